"""Launch topologies the loop cannot drive correctly are refused, naming the fix."""

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from llmtrain.config import ConfigError
from llmtrain.train import check_topology


@pytest.mark.parametrize("kind", [DistributedType.DEEPSPEED, DistributedType.FSDP])
def test_unsupported_topologies_are_refused(kind):
    with pytest.raises(ConfigError, match=f"launch: {kind.value} is not supported by recipes/finetune.py yet"):
        check_topology(SimpleNamespace(distributed_type=kind))


@pytest.mark.parametrize("kind", [DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU])
def test_ddp_and_single_process_run(kind):
    check_topology(SimpleNamespace(distributed_type=kind))

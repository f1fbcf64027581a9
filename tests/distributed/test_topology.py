"""The facts every module reads about the launch, from stand-in Accelerators of each
distributed type (real launches: tests/launch/test_deepspeed.py, test_fsdp.py)."""

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from llmtrain.distributed.topology import Topology


def fake(kind, precision="no", zero_stage=None):
    """An Accelerator as Topology.of reads it; without DeepSpeed its plugin is None, as
    Accelerate leaves it."""
    plugin = SimpleNamespace(zero_stage=zero_stage) if zero_stage is not None else None
    return SimpleNamespace(
        distributed_type=kind, mixed_precision=precision, state=SimpleNamespace(deepspeed_plugin=plugin)
    )


def facts(topology: Topology) -> dict:
    names = ("deepspeed", "zero_stage", "fsdp", "zero3", "sharded", "places_weights", "fp16", "half_engine")
    return {name: getattr(topology, name) for name in names}


PLAIN = dict(deepspeed=False, zero_stage=None, fsdp=False, zero3=False, sharded=False, places_weights=False)


@pytest.mark.parametrize("kind", [DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU])
@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_one_process_and_ddp_hold_whole_weights_they_place_themselves(kind, precision):
    assert facts(Topology.of(fake(kind, precision))) == {**PLAIN, "fp16": precision == "fp16", "half_engine": False}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_deepspeed_places_the_weights_shards_them_at_zero3_and_trains_half_copies_in_mixed_precision(stage, precision):
    assert facts(Topology.of(fake(DistributedType.DEEPSPEED, precision, stage))) == {
        "deepspeed": True,
        "zero_stage": stage,
        "fsdp": False,
        "zero3": stage == 3,
        "sharded": stage == 3,
        "places_weights": True,
        "fp16": precision == "fp16",
        "half_engine": precision != "no",
    }


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_fsdp2_shards_and_places_the_weights_in_their_own_precision(precision):
    """FSDP2's mixed precision casts for compute; the weights it trains stay as loaded."""
    assert facts(Topology.of(fake(DistributedType.FSDP, precision))) == {
        **PLAIN,
        "fsdp": True,
        "sharded": True,
        "places_weights": True,
        "fp16": precision == "fp16",
        "half_engine": False,
    }


def test_the_deepspeed_plugin_is_read_only_under_deepspeed():
    """A stale plugin left in Accelerate's shared state says nothing about a DDP run."""
    assert not Topology.of(fake(DistributedType.MULTI_GPU, zero_stage=3)).zero3


def test_a_topology_is_a_value():
    a, b = Topology.of(fake(DistributedType.FSDP)), Topology.of(fake(DistributedType.FSDP))
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.fsdp = False

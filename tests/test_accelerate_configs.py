from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from .conftest import ROOT, free_port, recipe_command  # noqa: F401

CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


def test_there_are_topology_configs():
    assert {p.name for p in CONFIGS} >= {"cpu_ddp.yaml", "single_gpu.yaml", "multi_gpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_accelerate_config_loads_with_accelerates_loader(path):
    cfg = load_config_from_file(str(path))
    assert cfg.num_processes >= 1
    first = Path(path).read_text().splitlines()[:4]
    assert any("accelerate launch --config_file accelerate_configs/" + path.name in line for line in first)

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from tests.support.accelerate_config import MULTI_CPU_CONFIG
from tests.support.runs import ROOT, recipe_args

CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


def test_there_are_topology_configs():
    assert {p.name for p in CONFIGS} >= {"cpu_ddp.yaml", "single_gpu.yaml", "multi_gpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_accelerate_config_loads_with_accelerates_loader(path):
    cfg = load_config_from_file(str(path))
    assert cfg.num_processes >= 1
    first = Path(path).read_text().splitlines()[:4]
    assert any("accelerate launch --config_file accelerate_configs/" + path.name in line for line in first)


def test_recipe_runs_with_the_config_accelerate_config_writes(base_config, tiny_model, chat_file, cache_env, tmp_path):
    """The README's path: `accelerate config` writes the default config file, then a plain
    `accelerate launch recipes/finetune.py` uses it."""
    import subprocess
    import sys

    env = dict(cache_env, HF_HOME=str(tmp_path / "hf_home"))
    accelerate = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]
    subprocess.run([*accelerate, "config", "default"], env=env, check=True, capture_output=True)
    assert (tmp_path / "hf_home" / "accelerate" / "default_config.yaml").is_file()
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            *accelerate,
            "launch",
            "recipes/finetune.py",
            *recipe_args(base_config, tiny_model, chat_file, out, "train.max_steps=2"),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "had defaults used instead" not in proc.stderr  # the file supplied every launch setting
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_multi_cpu_config_without_mpirun_stops_the_recipe_in_one_line(
    base_config, tiny_model, chat_file, cache_env, tmp_path
):
    """What `accelerate config` writes for "multi-CPU", 2 processes, no mpirun starts one
    process: the recipe stops before it loads anything, naming the launch that works,
    rather than training alone as if it were the run the config describes."""
    import subprocess
    import sys

    config = tmp_path / "multi_cpu.yaml"
    config.write_text(MULTI_CPU_CONFIG)
    out = tmp_path / "out"
    env = {k: v for k, v in cache_env.items() if k not in ("MASTER_ADDR", "WORLD_SIZE")}
    proc = subprocess.run(
        [
            *[sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)],
            "recipes/finetune.py",
            *recipe_args(base_config, tiny_model, chat_file, out, "train.max_steps=2"),
        ],
        env=env | {"HF_HOME": str(tmp_path / "hf_home")},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: launch: accelerate launch was asked for several processes but started only this one"
    ), proc.stderr[-3000:]
    assert not out.exists()

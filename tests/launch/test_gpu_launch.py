"""Every GPU topology config, one process per GPU, bf16: train with a checkpoint, resume from
it, export, and reload final/ with transformers. Skipped without a CUDA GPU (CI has none);
run with `python -m pytest -m gpu` on a GPU machine and record the result in README.md."""

import shutil
import subprocess
import sys

import pytest
import torch

from tests.support.runs import RECIPE, ROOT, free_port, train_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONFIGS = ["single_gpu", "multi_gpu", "ds_zero1", "ds_zero2", "ds_zero3", "ds_zero3_offload", "fsdp2"]


def launch(config: str, args: list[str], env: dict) -> subprocess.CompletedProcess:
    nproc = 1 if config == "single_gpu" else torch.cuda.device_count()
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / f"{config}.yaml"),
        "--num_processes",
        str(nproc),
        "--main_process_port",
        str(free_port()),
        str(RECIPE),
        *args,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.mark.parametrize("config", CONFIGS)
def test_gpu_topology_trains_resumes_and_exports(config, base_config, tiny_model, chat_file, cache_env, tmp_path):
    if config.startswith("ds_"):
        pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    args = [
        "--config",
        str(base_config),
        f"model.name_or_path={tiny_model}",
        f"data.train={chat_file}",
        "train.micro_batch_size=2",
        "train.grad_accum_steps=2",
        "train.max_steps=4",
        "checkpoint.every_steps=2",
        "data.packing=true",
    ]
    proc = launch(config, args + [f"output_dir={out}"], cache_env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    full = train_rows(out)
    assert [r["step"] for r in full] == [1, 2, 3, 4]

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    for p in (resumed / "checkpoints" / "step-4", resumed / "final"):
        shutil.rmtree(p)
    proc = launch(config, args + [f"output_dir={resumed}", "checkpoint.resume=auto"], cache_env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "resumed from" in proc.stdout
    # GPU kernels are not bit-deterministic; the resumed steps must still match closely.
    assert [r["loss"] for r in train_rows(resumed)] == pytest.approx([r["loss"] for r in full], rel=2e-3)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resumed / "final")
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()

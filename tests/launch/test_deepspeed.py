"""DeepSpeed ZeRO 1/2/3 (and 3 with CPU offload) through the shipped accelerate configs,
on CPU: DeepSpeed's CPU accelerator with two gloo processes. Each stage must give the
same losses, gradient norms and final weights as one process taking the whole global
batch, resume exactly, and export full weights that transformers loads."""

import json
from pathlib import Path

import pytest
import torch

from tests.support.runs import (
    final_weights,
    launch,
    llmtrain_eval,
    metrics,
    recipe_args,
    rewind,
    run_recipe,
    train_rows,
)

pytestmark = pytest.mark.slow

STAGES = ["zero1", "zero2", "zero3", "zero3_offload"]
# 18 rows, global batch 8: the last step has 2 rows, which fall on one process only, so the
# other runs an empty micro-batch (ZeRO-3's forward is a collective: a missing pass hangs).
# The cross-entropy runs in chunks of 7 tokens, recomputed in backward, where ZeRO-3 must
# gather the output layer again; the reference computes whole logits.
LAYOUT = [
    "train.micro_batch_size=2",
    "train.grad_accum_steps=2",
    "train.schedule=cosine",
    "train.warmup_steps=1",
    "train.loss_chunk_logits=2000",
    "checkpoint.every_steps=2",
    "eval.micro_batch_size=2",
    "eval.sample_prompts=['What is 2 + 3?']",
    "eval.sample_max_new_tokens=6",
]


@pytest.fixture(scope="module")
def run_args(base_config, tiny_model, tmp_path_factory):
    from llmtrain.demo import make_rows, write_jsonl

    data = tmp_path_factory.mktemp("ds_data")
    write_jsonl(make_rows(18, seed=11), data / "train.jsonl")
    write_jsonl(make_rows(5, seed=13), data / "eval.jsonl")

    def args(out: Path) -> list[str]:
        return recipe_args(
            base_config, tiny_model, data / "train.jsonl", out, f"data.eval={data / 'eval.jsonl'}", *LAYOUT
        )

    return args


@pytest.fixture(scope="module")
def reference_run(run_args, cache_env, tmp_path_factory) -> tuple[Path, str]:
    """One process, the whole global batch of 8 in one micro-batch: output dir and stdout."""
    out = tmp_path_factory.mktemp("ds_ref") / "run"
    proc = run_recipe(
        run_args(out) + ["train.micro_batch_size=8", "train.grad_accum_steps=1", "train.loss_chunk_logits=0"], cache_env
    )
    return out, proc.stdout


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    return reference_run[0]


def sample_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("sample> ")]


@pytest.fixture(scope="module")
def runs(run_args, cache_env, tmp_path_factory) -> dict:
    """Output directories of the DeepSpeed runs, made on first use."""
    done = {}

    def get(stage: str) -> Path:
        if stage not in done:
            out = tmp_path_factory.mktemp(f"ds_{stage}") / "run"
            # final/ in files of at most 100 KB (ZeRO-3 gathers it shard by shard).
            shards = ["export.max_shard_size=100KB"] if stage in ("zero2", "zero3") else []
            proc = launch(run_args(out) + shards, cache_env, f"ds_{stage}", check=False)
            assert proc.returncode == 0, f"{stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
            done[stage] = out, proc.stdout
        return done[stage][0]

    get.outputs = done
    return get


@pytest.mark.parametrize("stage", STAGES)
def test_zero_stage_trains_like_one_process(stage, runs, reference):
    out = runs(stage)
    got, ref = train_rows(out), train_rows(reference)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["lr"] == b["lr"]
    evals = [(r["step"], r["eval_loss"]) for r in metrics(out) if "eval_loss" in r]
    ref_evals = [(r["step"], r["eval_loss"]) for r in metrics(reference) if "eval_loss" in r]
    assert [s for s, _ in evals] == [0, 3]
    assert [v for _, v in evals] == pytest.approx([v for _, v in ref_evals], rel=1e-5)
    # final/ holds the full, gathered weights (ZeRO-3: from every process's shard).
    weights, ref_weights = final_weights(out / "final"), final_weights(reference / "final")
    assert (out / "final" / "model.safetensors.index.json").is_file() == (stage in ("zero2", "zero3"))
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_resume_continues_the_exact_run(stage, runs, run_args, cache_env, tmp_path):
    """What a run killed after step 2 leaves (step-2 complete, nothing later), resumed."""
    full = runs(stage)
    out = tmp_path / "run"
    rewind(out, 2, full)
    proc = launch(run_args(out) + ["checkpoint.resume=auto"], cache_env, f"ds_{stage}", check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "resumed from" in proc.stdout and "step-2" in proc.stdout
    keys = ("step", "loss", "grad_norm", "lr", "tokens")
    assert [[r[k] for k in keys] for r in train_rows(out)] == [[r[k] for k in keys] for r in train_rows(full)]
    assert (out / "checkpoints" / "step-3" / "train_state.json").is_file()


def test_zero3_export_loads_with_transformers(runs, reference):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(runs("zero3") / "final")
    ref = AutoModelForCausalLM.from_pretrained(reference / "final")
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-5)


def test_zero3_samples_from_the_trained_model(runs, reference_run):
    """Generation after a sharded run uses the gathered final/ weights on the main process
    (loaded as a whole model, not partitioned again), and answers like the reference."""
    runs("zero3")
    (_, stdout), (_, ref_stdout) = runs.outputs["zero3"], reference_run
    assert len(sample_lines(stdout)) == 1
    assert sample_lines(stdout) == sample_lines(ref_stdout)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_bf16_run_exports_the_float32_weights_it_trained(stage, run_args, cache_env, tmp_path):
    """Under bf16 DeepSpeed trains half-precision copies and keeps the float32 masters in its
    optimizer: final/ holds the masters (those of its last checkpoint, the same step), in
    float32 as one process, DDP and FSDP2 export, not their bf16 copies."""
    import json

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = tmp_path / "run"
    proc = launch(run_args(out) + ["train.max_steps=2"], cache_env, f"ds_{stage}", precision="bf16", check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "float32"
    weights = final_weights(out / "final")
    step = out / "checkpoints" / "step-2"
    engine = next(p for p in step.rglob("latest")).parent  # DeepSpeed's own folder in the checkpoint
    masters = get_fp32_state_dict_from_zero_checkpoint(str(engine))
    assert all(w.dtype == torch.float32 for w in weights.values())
    for key, value in weights.items():
        torch.testing.assert_close(value, masters[key].float(), rtol=0, atol=0, msg=key)


def test_llmtrain_eval_gathers_a_zero3_checkpoint(runs, run_args, cache_env, tmp_path):
    """A ZeRO-3 checkpoint holds each process's shard: llmtrain eval gathers DeepSpeed's
    float32 masters on its one process and measures what the run's last evaluation row did."""
    out = runs("zero3")
    step = out / "checkpoints" / "step-3"
    assert not (step / "model.safetensors").exists()
    results = tmp_path / "results.json"
    llmtrain_eval([str(step), *run_args(out), "--output", str(results)], cache_env)  # the run's own arguments
    got = json.loads(results.read_text())["models"][str(step)]["eval_loss"]
    last = [r["eval_loss"] for r in metrics(out) if "eval_loss" in r][-1]
    assert got == pytest.approx(last, rel=1e-5)

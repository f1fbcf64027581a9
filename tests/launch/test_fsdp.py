"""FSDP2 on CPU: PyTorch's fully_shard over gloo, through accelerate launch with the shipped
accelerate_configs/fsdp2.yaml and ACCELERATE_USE_CPU=1 (see distributed.launch.fsdp_on_cpu). Each
process holds its shard; the run gives the losses, gradient norms and weights of one
process taking the same global batch, checkpoints shard by shard and resumes exactly, and
exports a full final/."""

import json
from pathlib import Path

import pytest
import torch

from llmtrain.demo import make_rows, write_jsonl
from tests.support.runs import (
    final_weights,
    kill_run,
    launch,
    llmtrain_eval,
    metrics,
    recipe_args,
    rewind,
    run_recipe,
    start_run,
    train_rows,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_args(base_config, tiny_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("fsdp_data")
    write_jsonl(make_rows(18, seed=11), data / "train.jsonl")  # global batch 8: a last step of 2 rows
    write_jsonl(make_rows(5, seed=13), data / "eval.jsonl")

    def args(out: Path, *extra: str) -> list[str]:
        evals = f"data.eval={data / 'eval.jsonl'}"
        return recipe_args(base_config, tiny_model, data / "train.jsonl", out, evals, "eval.micro_batch_size=2", *extra)

    return args


def assert_same_run(got: Path, want: Path, exact: bool = False) -> None:
    rows, ref = train_rows(got), train_rows(want)
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref]
    if exact:
        assert [r["loss"] for r in rows] == [r["loss"] for r in ref]
    for a, b in zip(rows, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    evals = [(r["step"], r["eval_loss"]) for r in metrics(got) if "eval_loss" in r]
    ref_evals = [(r["step"], r["eval_loss"]) for r in metrics(want) if "eval_loss" in r]
    assert [s for s, _ in evals] == [s for s, _ in ref_evals]
    assert [v for _, v in evals] == pytest.approx([v for _, v in ref_evals], rel=1e-5)
    got_w, want_w = final_weights(got / "final"), final_weights(want / "final")
    assert got_w.keys() == want_w.keys()
    for key in want_w:
        tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(got_w[key], want_w[key], **tol, msg=key)


def test_fsdp2_on_cpu_trains_like_one_process(run_args, cache_env, tmp_path):
    """2 processes x 2 x 2 with the chunked loss, the last step's 2 rows on one process
    only (the other runs an empty batch through the sharded model), against 8 x 1. final/
    is gathered shard by shard into files of at most 100 KB."""
    one, fsdp = tmp_path / "one", tmp_path / "fsdp"
    run_recipe(run_args(one, "train.micro_batch_size=8", "train.loss_chunk_logits=0"), cache_env)
    launch(
        run_args(
            fsdp,
            "train.micro_batch_size=2",
            "train.grad_accum_steps=2",
            "train.loss_chunk_logits=2000",
            "export.max_shard_size=100KB",
        ),
        cache_env,
        "fsdp2",
    )
    assert json.loads((fsdp / "run.json").read_text())["distributed_type"] == "FSDP"
    assert len(list((fsdp / "final").glob("model-0000?-of-00005.safetensors"))) == 5
    assert json.loads((fsdp / "final" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert_same_run(fsdp, one)
    assert [r["tokens"] for r in train_rows(one)][-1] < [r["tokens"] for r in train_rows(one)][0]


def test_fsdp2_checkpoints_by_shard_and_resumes_exactly(run_args, cache_env, tmp_path):
    from llmtrain.output.checkpoint import complete_checkpoints

    run = ["train.micro_batch_size=2", "train.epochs=3", "checkpoint.every_steps=3", "checkpoint.resume=auto"]
    ref, out = tmp_path / "ref", tmp_path / "killed"
    launch(run_args(ref, *run), cache_env, "fsdp2")
    assert [r["step"] for r in train_rows(ref)] == list(range(1, 16))  # 5 steps of 4 rows an epoch
    assert (complete_checkpoints(ref)[-1][1] / "pytorch_model_fsdp_0").is_dir()  # sharded (DCP)
    # llmtrain eval merges the shards on its one process: the run's last evaluation row
    results = tmp_path / "results.json"
    last = complete_checkpoints(ref)[-1][1]
    llmtrain_eval([str(last), *run_args(ref, *run), "--output", str(results)], cache_env)
    got = json.loads(results.read_text())["models"][str(last)]["eval_loss"]
    assert got == pytest.approx([r["eval_loss"] for r in metrics(ref) if "eval_loss" in r][-1], rel=1e-5)
    proc = start_run(run_args(out, *run), cache_env, topology="fsdp2")
    assert wait_for(lambda: any(step >= 3 for step, _ in complete_checkpoints(out)), proc)
    kill_run(proc)
    step, path = complete_checkpoints(out)[-1]
    assert 3 <= step < 15 and not (out / "final").exists()
    done = launch(run_args(out, *run), cache_env, "fsdp2")
    assert f"resumed from {path} at step {step}" in done.stdout
    assert_same_run(out, ref, exact=True)


def test_lora_under_fsdp2_trains_like_one_process_and_exports_the_merged_model(run_args, cache_env, tmp_path):
    """LoRA adapters (no dropout, so both runs draw no random masks) with gradient
    checkpointing: FSDP2 shards the frozen base weights with the adapters; final/ gathers
    them, merged, and the adapter beside them."""
    lora = ["model.lora.enabled=true", "model.lora.r=4", "model.gradient_checkpointing=true"]  # dropout 0, the default
    lora += ["export.merge_lora=true", "train.lr=1e-2"]
    one, fsdp = tmp_path / "one", tmp_path / "fsdp"
    run_recipe(run_args(one, *lora, "train.micro_batch_size=8"), cache_env)
    launch(run_args(fsdp, *lora, "train.micro_batch_size=2", "train.grad_accum_steps=2"), cache_env, "fsdp2")
    assert_same_run(fsdp, one)
    assert (fsdp / "final" / "adapter" / "adapter_model.safetensors").is_file()


def test_an_fsdp2_checkpoint_resumes_on_another_process_count(run_args, cache_env, tmp_path):
    """Written by 2 processes (2 x 3), resumed on 3 (2 x 2), the same global batch of 12:
    the sharded (DCP) checkpoint reshards on load and the later steps read the rows and
    give the losses of the run that was not interrupted."""
    run = ["train.micro_batch_size=2", "train.epochs=3", "checkpoint.every_steps=2", "checkpoint.keep_last=5"]
    whole, out = tmp_path / "whole", tmp_path / "resharded"
    launch(run_args(whole, *run, "train.grad_accum_steps=3"), cache_env, "fsdp2")
    rewind(out, 2, whole)
    proc = launch(run_args(out, *run, "train.grad_accum_steps=2"), cache_env, "fsdp2", nproc=3)
    assert "as 3 process(es) x 2 x 2, the same global batch of 12" in proc.stdout
    rows, ref = train_rows(out), train_rows(whole)
    assert [r["step"] for r in rows] == [r["step"] for r in ref] and len(ref) > 3
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=1e-5)

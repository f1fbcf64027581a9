"""recipes/dpo.py launched as a user launches it, on a tiny model and the demo's kind of
pairs: the step is the mean over every pair of the global batch whatever its layout (one
process or two, micro-batches or accumulation, padded or packed, a partial last window),
under DDP, ZeRO-3 and LoRA; resume after a kill continues the exact run; outputs export."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmtrain.demo import make_pairs, write_jsonl
from tests.support.runs import (
    DPO_RECIPE,
    assert_same_weights,
    check_card,
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

REWARDS = ["rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen", "logps_rejected"]


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory) -> tuple[Path, Path]:
    """18 training pairs (a global batch of 8 leaves a last step of 2, which with 2
    processes x micro-batch 2 falls on one process only) and 5 eval pairs."""
    root = tmp_path_factory.mktemp("pairs")
    write_jsonl(make_pairs(18, seed=21), root / "train.jsonl")
    write_jsonl(make_pairs(5, seed=22), root / "eval.jsonl")
    return root / "train.jsonl", root / "eval.jsonl"


@pytest.fixture(scope="module")
def args(base_config, tiny_model, pair_files):
    def make(out: Path, *extra: str) -> list[str]:
        train, evals = pair_files
        return recipe_args(base_config, tiny_model, train, out, f"data.eval={evals}", "eval.micro_batch_size=2", *extra)

    return make


def dpo(args: list[str], env: dict, nproc: int = 1, **kw):
    return run_recipe(args, env, nproc=nproc, recipe=DPO_RECIPE, **kw)


def assert_same_steps(got: Path, want: Path, name: str, weights: bool = True) -> None:
    rows, ref = train_rows(got), train_rows(want)
    assert [r["step"] for r in rows] == [r["step"] for r in ref], name
    assert [r["pairs"] for r in rows] == [r["pairs"] for r in ref], name
    for a, b in zip(rows, ref):
        for key in ["loss", *REWARDS]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (name, a["step"], key)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3), (name, a["step"])
    evals = [(r["step"], r["eval_loss"], r["eval_rewards_accuracy"]) for r in metrics(got) if "eval_loss" in r]
    ref_evals = [(r["step"], r["eval_loss"], r["eval_rewards_accuracy"]) for r in metrics(want) if "eval_loss" in r]
    assert [e[0] for e in evals] == [e[0] for e in ref_evals], name
    for a, b in zip(evals, ref_evals):
        assert a[1:] == pytest.approx(b[1:], rel=1e-4, abs=1e-5), name
    if weights:
        assert_same_weights(got, want, name)


def test_a_global_batch_of_pairs_trains_alike_in_any_layout(args, cache_env, tmp_path):
    """8 x 1, 2 x 4, and 2 processes x 2 x 2 (chunked log-probs, the reference pass split
    between the processes): the same losses, rewards, pair counts and final weights."""
    layouts = {
        "8x1": (1, 8, 1, ["train.loss_chunk_logits=0"]),
        "2x4": (1, 2, 4, []),
        "2proc_2x2": (2, 2, 2, ["train.loss_chunk_logits=2000"]),
    }
    out = {}
    for name, (nproc, micro, accum, extra) in layouts.items():
        out[name] = tmp_path / name
        layout = [f"train.micro_batch_size={micro}", f"train.grad_accum_steps={accum}", *extra]
        proc = dpo(args(out[name], *layout), cache_env, nproc=nproc)
        assert proc.stdout.count("reference log-probs: 23 pairs in") == 1, proc.stdout
    assert [r["pairs"] for r in train_rows(out["8x1"])] == [8, 8, 2]
    assert train_rows(out["8x1"])[0]["loss"] == pytest.approx(0.6931, abs=1e-4)  # policy = reference at first
    for name in layouts:
        assert_same_steps(out[name], out["8x1"], name)


def test_packed_pairs_train_alike_on_one_process_and_two(args, cache_env, tmp_path):
    """Whole pairs packed into rows of 2 x data.max_seq_len: 4 rows a step, taken as 4 x 1
    on one process or 1 x 2 on each of two."""
    one, two = tmp_path / "one", tmp_path / "two"
    dpo(args(one, "data.packing=true", "train.micro_batch_size=4"), cache_env)
    dpo(args(two, "data.packing=true", "train.micro_batch_size=1", "train.grad_accum_steps=2"), cache_env, nproc=2)
    assert sum(r["pairs"] for r in train_rows(one)) == 18 and len(train_rows(one)) < 3
    assert_same_steps(two, one, "packed")


def test_lora_uses_the_model_with_adapters_off_as_reference(args, cache_env, tmp_path):
    """No reference pass, no second model; two processes with gradient checkpointing
    train like one; final/ holds the adapter."""
    one, two = tmp_path / "one", tmp_path / "two"
    lora = ["model.lora.enabled=true", "model.lora.r=4", "model.gradient_checkpointing=true"]  # dropout 0, the default
    proc = dpo(args(one, *lora, "train.micro_batch_size=8"), cache_env)
    assert "reference log-probs" not in proc.stdout
    dpo(args(two, *lora, "train.micro_batch_size=2", "train.grad_accum_steps=2"), cache_env, nproc=2)
    assert train_rows(one)[0]["loss"] == pytest.approx(0.6931, abs=1e-4)
    assert_same_steps(two, one, "lora", weights=False)
    assert (two / "final" / "adapter_config.json").exists()
    assert check_card(two / "final", ["dpo", "lora"], "AutoPeftModelForCausalLM")["library_name"] == "peft"


def test_orpo_trains_alike_on_one_process_and_two_and_resumes_exactly(args, cache_env, tmp_path):
    """ORPO (no reference, no reference pass): packed pairs as 4 x 1 on one process or
    1 x 2 on each of two; a run taken back to its first checkpoint continues to the same
    losses and weights, bit for bit."""
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    orpo = ["dpo.loss=orpo", "dpo.beta=0.2", "data.packing=true", "checkpoint.every_steps=1"]
    proc = dpo(args(one, *orpo, "train.micro_batch_size=4"), cache_env)
    assert "reference log-probs" not in proc.stdout
    dpo(args(two, *orpo, "train.micro_batch_size=1", "train.grad_accum_steps=2"), cache_env, nproc=2)
    assert_same_steps(two, one, "orpo")
    rows = train_rows(one)
    assert all(r["loss"] > 0 for r in rows)  # the chosen answers' NLL plus a positive odds-ratio term
    rewind(resumed, 1, source=one)
    done = dpo(args(resumed, *orpo, "train.micro_batch_size=4"), cache_env)
    assert "at step 1" in done.stdout
    assert [r["loss"] for r in train_rows(resumed)] == [r["loss"] for r in rows]
    for key, value in load_file(one / "final" / "model.safetensors").items():
        torch.testing.assert_close(load_file(resumed / "final" / "model.safetensors")[key], value, rtol=0, atol=0)


@pytest.fixture(scope="module")
def one_process(args, cache_env, tmp_path_factory) -> Path:
    """The whole global batch of 8 pairs in one micro-batch on one process."""
    out = tmp_path_factory.mktemp("dpo_one") / "run"
    dpo(args(out, "train.micro_batch_size=8", "train.loss_chunk_logits=0"), cache_env)
    return out


@pytest.mark.parametrize("stage", ["zero2", "zero3", "zero3-reference", "fsdp2"])
def test_sharded_runs_compute_the_reference_and_train_like_one_process(
    stage, args, one_process, tiny_model, cache_env, tmp_path
):
    """ZeRO-3 and FSDP2 shard the model, so every forward pass, the reference pass's
    included, is a collective: a process with no pair left runs an empty batch in step.
    ZeRO-2 shards the gradients and optimizer state. dpo.reference names a model of its own
    (here the policy's starting weights again, so the run must equal one process's): under
    ZeRO-3 it loads whole on each process, not partitioned as DeepSpeed loads the policy."""
    out = tmp_path / stage
    layout = ["train.micro_batch_size=2", "train.grad_accum_steps=2"]
    if stage == "zero3-reference":
        stage, layout = "zero3", [*layout, f"dpo.reference={tiny_model}"]
    if stage == "fsdp2":
        launch(args(out, *layout), cache_env, "fsdp2", recipe=DPO_RECIPE)
    else:
        proc = launch(args(out, *layout), cache_env, f"ds_{stage}", recipe=DPO_RECIPE, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert_same_steps(out, one_process, stage)


def test_a_killed_run_resumes_to_the_same_losses_and_reads_its_reference(args, cache_env, tmp_path):
    from llmtrain.output.checkpoint import complete_checkpoints

    run = ["train.micro_batch_size=2", "train.epochs=3", "checkpoint.every_steps=3", "checkpoint.resume=auto"]
    ref, out = tmp_path / "ref", tmp_path / "killed"
    dpo(args(ref, *run), cache_env, nproc=2)
    proc = start_run(args(out, *run), cache_env, recipe=DPO_RECIPE)
    assert wait_for(lambda: any(step >= 6 for step, _ in complete_checkpoints(out)), proc)
    kill_run(proc)
    step, path = complete_checkpoints(out)[-1]
    assert 6 <= step < 15 and not (out / "final").exists()
    done = dpo(args(out, *run), cache_env, nproc=2)
    assert f"resumed from {path} at step {step}" in done.stdout
    assert "reference log-probs: 23 pairs read from" in done.stdout
    assert [r["loss"] for r in train_rows(out)] == [r["loss"] for r in train_rows(ref)]  # exactly
    for key, value in load_file(ref / "final" / "model.safetensors").items():
        torch.testing.assert_close(load_file(out / "final" / "model.safetensors")[key], value, rtol=0, atol=0)


def test_simpo_and_another_reference_model(args, cache_env, tiny_model, tmp_path):
    """SimPO needs no reference; dpo.reference names another model, whose log-probs the
    first step's rewards measure the policy against (so they are not zero)."""
    simpo = tmp_path / "simpo"
    one_step = ["train.max_steps=1", "train.micro_batch_size=8"]
    proc = dpo(args(simpo, "dpo.loss=simpo", *one_step, "eval.every_steps=0", "data.eval=[]"), cache_env)
    assert "reference log-probs" not in proc.stdout
    assert "global batch 8 pairs" in proc.stdout and train_rows(simpo)[0]["pairs"] == 8
    other = tmp_path / "other"
    dpo(args(other, f"dpo.reference={simpo / 'final'}", *one_step), cache_env)
    first = train_rows(other)[0]
    assert first["loss"] != pytest.approx(0.6931, abs=1e-3) and first["rewards_margin"] != 0


def test_preference_errors_are_one_line(args, cache_env, tmp_path, chat_file):
    proc = dpo(args(tmp_path / "a", f"data.train={chat_file}"), cache_env, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "preference pairs need 'chosen' and 'rejected'" in proc.stderr
    proc = run_recipe(args(tmp_path / "b", "dpo.beta=0.2"), cache_env, check=False)  # finetune.py
    assert proc.returncode == 2 and "dpo: unknown key" in proc.stderr


def test_llmtrain_eval_measures_a_trained_model_against_its_base_as_the_run_did(args, cache_env, one_process, tmp_path):
    """`llmtrain eval` on the run's final/: the reference is the config's model (the run's
    start), so the rewards, margins and accuracy are the run's last evaluation row's."""
    results = tmp_path / "results.json"
    llmtrain_eval(
        [str(one_process / "final"), "--recipe", "dpo", "--output", str(results), *args(tmp_path / "u")], cache_env
    )
    got = json.loads(results.read_text())["models"][str(one_process / "final")]
    want = {k: v for k, v in [r for r in metrics(one_process) if "eval_loss" in r][-1].items() if k != "step"}
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (got, want)
    assert "eval_rewards_accuracy" in got


def test_llmtrain_eval_measures_a_checkpoint_against_the_runs_start(args, cache_env, tmp_path):
    out, results = tmp_path / "run", tmp_path / "results.json"
    dpo(
        args(out, "train.micro_batch_size=8", "train.max_steps=2", "eval.every_steps=1", "checkpoint.every_steps=1"),
        cache_env,
    )
    step = out / "checkpoints" / "step-1"
    llmtrain_eval([str(step), "--recipe", "dpo", "--output", str(results), *args(tmp_path / "u")], cache_env)
    got = json.loads(results.read_text())["models"][str(step)]
    want = {
        k: v for k, v in next(r for r in metrics(out) if "eval_loss" in r and r["step"] == 1).items() if k != "step"
    }
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (got, want)
    assert got["eval_rewards_margin"] != 0  # against the base: the checkpoint's own weights would give 0

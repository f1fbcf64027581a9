"""recipes/dpo.py with dpo.loss=kto launched as a user launches it, on a tiny model and the
demo's pairs taken apart into unpaired rows: the reference point z0 is taken over the whole
global batch, so one process and two (with a partial last window that falls on one process,
the other running empty batches) give the same losses, reference points, rewards and
weights; a run taken back to a checkpoint continues bit for bit.

The reference is another model (dpo.reference): the tiny model with its logits reversed
and tripled, under which the data is less likely (by about 2.5 nats a sequence), so that
z0 is well above 0 at every step (with the policy's own starting weights, a tiny model's
KL estimate stays below 0 for the first steps and is floored at 0, which would hide where
it is taken)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmtrain.demo import make_pairs, unpaired_rows, write_jsonl
from tests.support.runs import DPO_RECIPE, check_card, launch, metrics, recipe_args, rewind, run_recipe, train_rows

pytestmark = pytest.mark.slow

FIGURES = ["loss", "kl", "rewards_desirable", "rewards_undesirable", "desirable", "logps_desirable"]


@pytest.fixture(scope="module")
def reversed_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with its final norm's weights times -3: logits reversed and tripled."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("reversed") / "model"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(-3)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def row_files(tmp_path_factory) -> tuple[Path, Path]:
    """18 training rows (9 pairs: a global batch of 8 leaves a last step of 2, which with 2
    processes x micro-batch 2 falls on one process only) and 6 eval rows."""
    root = tmp_path_factory.mktemp("kto")
    write_jsonl(unpaired_rows(make_pairs(9, seed=31)), root / "train.jsonl")
    write_jsonl(unpaired_rows(make_pairs(3, seed=32)), root / "eval.jsonl")
    return root / "train.jsonl", root / "eval.jsonl"


def kto(out: Path, files, base_config, tiny_model, reference, env, *extra: str, nproc: int = 1):
    train, evals = files
    args = recipe_args(
        base_config,
        tiny_model,
        train,
        out,
        f"data.eval={evals}",
        "eval.micro_batch_size=2",
        "dpo.loss=kto",
        "dpo.beta=0.5",
        "dpo.desirable_weight=1.2",
        f"dpo.reference={reference}",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=3",
        *extra,
    )
    return run_recipe(args, env, nproc=nproc, recipe=DPO_RECIPE)


def test_kto_trains_alike_on_one_process_and_two_and_resumes_exactly(
    row_files, base_config, tiny_model, reversed_model, cache_env, tmp_path
):
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    common = (row_files, base_config, tiny_model, reversed_model, cache_env)
    proc = kto(one, *common, "train.micro_batch_size=8")
    assert "reference log-probs: 24 completions in" in proc.stdout  # 18 training rows, 6 eval rows
    assert "9 desirable and 9 undesirable completions; weighted 1.20 : 1" in proc.stdout
    two_layout = ["train.micro_batch_size=2", "train.grad_accum_steps=2", "train.loss_chunk_logits=2000"]
    kto(two, *common, *two_layout, nproc=2)

    rows, ref = train_rows(two), train_rows(one)
    assert [r["completions"] for r in ref] == [r["completions"] for r in rows] == [8, 8, 2]
    assert all(r["kl"] > 1 for r in ref)  # a reference point that matters
    for a, b in zip(rows, ref):
        for key in [*FIGURES, "undesirable", "rewards_undesirable", "logps_undesirable"]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3), a["step"]
    evals = [[r[k] for k in ("step", "eval_loss", "eval_kl")] for r in metrics(two) if "eval_loss" in r]
    ref_evals = [[r[k] for k in ("step", "eval_loss", "eval_kl")] for r in metrics(one) if "eval_loss" in r]
    assert len(evals) == len(ref_evals) == 2
    for a, b in zip(evals, ref_evals):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    want = load_file(one / "final" / "model.safetensors")
    for key, value in load_file(two / "final" / "model.safetensors").items():
        torch.testing.assert_close(value, want[key], rtol=1e-4, atol=1e-5, msg=key)

    rewind(resumed, 1, source=one)  # as if killed right after the checkpoint of step 1
    done = kto(resumed, *common, "train.micro_batch_size=8")
    assert "at step 1" in done.stdout and "reference log-probs: 24 completions read from" in done.stdout
    assert [[r[k] for k in FIGURES] for r in train_rows(resumed)] == [[r[k] for k in FIGURES] for r in ref]
    for key, value in load_file(resumed / "final" / "model.safetensors").items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)


def test_kto_with_lora_takes_the_reference_with_adapters_off_alike_on_one_process_and_two(
    row_files, base_config, tiny_model, cache_env, tmp_path
):
    """No reference pass: the reference point's KL sequences and the completions go through
    the model with its adapters off too, on empty batches as well (the second process's
    last window), with gradient checkpointing, under DDP."""
    one, two = tmp_path / "one", tmp_path / "two"
    train, _ = row_files
    lora = ["model.lora.enabled=true", "model.lora.r=4", "model.gradient_checkpointing=true"]  # dropout 0, the default
    args = recipe_args(base_config, tiny_model, train, one, "dpo.loss=kto", "data.eval=[]", *lora)
    proc = run_recipe([*args, "train.micro_batch_size=8"], cache_env, recipe=DPO_RECIPE)
    assert "reference log-probs" not in proc.stdout
    args = recipe_args(base_config, tiny_model, train, two, "dpo.loss=kto", "data.eval=[]", *lora)
    layout = ["train.micro_batch_size=2", "train.grad_accum_steps=2"]
    run_recipe([*args, *layout], cache_env, nproc=2, recipe=DPO_RECIPE)
    rows, ref = train_rows(two), train_rows(one)
    assert [r["completions"] for r in rows] == [8, 8, 2] and ref[0]["loss"] == pytest.approx(0.5)  # policy = reference
    for a, b in zip(rows, ref):
        for key in FIGURES:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)
    assert (two / "final" / "adapter_config.json").exists()
    check_card(two / "final", ["dpo", "kto", "lora"], "AutoPeftModelForCausalLM")


def test_kto_under_zero3_trains_like_one_process(row_files, base_config, tiny_model, cache_env, tmp_path):
    """ZeRO-3 shards the model, so every forward pass is a collective: the reference pass's,
    the reference point's (a process with no row left in the last window runs the KL
    sequences of an empty batch), the training's and the evaluation's two passes."""
    one, zero3 = tmp_path / "one", tmp_path / "zero3"
    train, evals = row_files
    extra = ["dpo.loss=kto", "dpo.beta=0.5", f"data.eval={evals}", "eval.micro_batch_size=2"]
    run_recipe(
        recipe_args(base_config, tiny_model, train, one, *extra, "train.micro_batch_size=8"),
        cache_env,
        recipe=DPO_RECIPE,
    )
    layout = ["train.micro_batch_size=2", "train.grad_accum_steps=2"]
    proc = launch(
        recipe_args(base_config, tiny_model, train, zero3, *extra, *layout),
        cache_env,
        "ds_zero3",
        recipe=DPO_RECIPE,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows, ref = train_rows(zero3), train_rows(one)
    assert [r["completions"] for r in rows] == [8, 8, 2]
    for a, b in zip(rows, ref):
        for key in FIGURES:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)
    evals = [r["eval_loss"] for r in metrics(zero3) if "eval_loss" in r]
    assert evals == pytest.approx([r["eval_loss"] for r in metrics(one) if "eval_loss" in r], rel=1e-4)
    want = load_file(one / "final" / "model.safetensors")
    # Adam divides by the gradient's running size, so a near-zero gradient summed in another
    # order (ZeRO-3 reduces by partitions) can move a weight by up to 2e-5 more or less after
    # three steps on some CPUs (1.8e-5 on an AMD EPYC); a wrong update moves it by the rate, 1e-3.
    for key, value in load_file(zero3 / "final" / "model.safetensors").items():
        torch.testing.assert_close(value, want[key], rtol=1e-4, atol=5e-5, msg=key)


def test_kto_data_errors_are_one_line(base_config, tiny_model, cache_env, tmp_path, row_files):
    """A row whose label is not a boolean, and pairs given to dpo.loss=kto: exit 2 with one
    line naming the file (and line), no traceback."""
    bad = tmp_path / "bad.jsonl"
    good = row_files[0].read_text().splitlines()[0]
    bad.write_text(good + '\n{"prompt": "hi", "completion": "yo", "label": "yes"}\n')
    pairs = tmp_path / "pairs.jsonl"
    write_jsonl(make_pairs(2, seed=1), pairs)
    for data, message in (
        (bad, f"data.train: {bad} line 2: 'label' must be true (a desirable completion) or false"),
        (pairs, f"data.train: {pairs}: dpo.loss=kto reads unpaired rows with 'prompt', 'completion' and 'label'"),
    ):
        args = recipe_args(base_config, tiny_model, data, tmp_path / data.stem, "dpo.loss=kto")
        proc = run_recipe(args, cache_env, recipe=DPO_RECIPE, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert message in proc.stderr

"""The spike guard in a real run: a spiking step is skipped without a trace, the run going
on as one that never had those rows, and too many skips in a row stop it (the guard itself:
tests/core/test_spike.py)."""

import copy
import json

import pytest
import torch

from llmtrain.demo import make_rows, write_jsonl
from tests.support.runs import metrics, recipe_args, run_recipe, train_rows

pytestmark = pytest.mark.slow


def test_a_spiking_step_is_skipped_without_a_trace(base_config, tiny_model, cache_env, tmp_path):
    """24 ordinary rows, then 4 whose answers are 40 characters never seen in training: the
    last two steps' losses jump. The guard skips both and the run goes on into the next
    epoch exactly as a run that never had those rows: same losses, same weights."""
    ordinary = make_rows(24, seed=5)
    spiky = []
    for row in make_rows(4, seed=6):
        row = copy.deepcopy(row)
        row["messages"][-1]["content"] = "~" * 40
        spiky.append(row)
    write_jsonl(ordinary, tmp_path / "ordinary.jsonl")
    write_jsonl(ordinary + spiky, tmp_path / "spiky.jsonl")

    def run(out, data, *extra, check=True):
        return run_recipe(
            recipe_args(
                base_config,
                tiny_model,
                tmp_path / data,
                tmp_path / out,
                "data.shuffle=false",
                "train.micro_batch_size=2",
                "train.lr=3e-3",
                "train.max_steps=14",
                *extra,
            ),
            cache_env,
            check=check,
        )

    guard = ["train.spike_factor=1.3", "train.spike_window=4"]
    run("unguarded", "spiky.jsonl")
    run("clean", "ordinary.jsonl")
    run("guarded", "spiky.jsonl", *guard, "checkpoint.every_steps=12")
    unguarded = train_rows(tmp_path / "unguarded")
    assert unguarded[12]["loss"] > 1.3 * max(r["loss"] for r in unguarded[8:12])  # the spike is real
    skips = [r for r in metrics(tmp_path / "guarded") if "skipped" in r]
    assert [r["step"] for r in skips] == [13, 13] and "spiked above train.spike_factor=1.3" in skips[0]["skipped"]
    keys = ("step", "epoch", "loss", "grad_norm", "lr")
    clean, guarded = train_rows(tmp_path / "clean"), train_rows(tmp_path / "guarded")
    assert [[r[k] for k in keys] for r in guarded] == [[r[k] for k in keys] for r in clean]
    from safetensors.torch import load_file

    want = load_file(tmp_path / "clean" / "final" / "model.safetensors")
    for name, tensor in load_file(tmp_path / "guarded" / "final" / "model.safetensors").items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0)
    state = json.loads((tmp_path / "guarded" / "checkpoints" / "step-12" / "train_state.json").read_text())
    assert state["recent_losses"] == [r["loss"] for r in clean[8:12]]  # a resume compares against the same window

    proc = run("bounded", "spiky.jsonl", *guard, "train.max_consecutive_skips=2", check=False)
    assert proc.returncode == 2
    assert "error: train: the loss" in proc.stderr and "spiked above" in proc.stderr
    assert "at step 13 (2 skipped step(s) in a row" in proc.stderr

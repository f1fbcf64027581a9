"""A run mixing sources by fraction, on two DDP processes, resumed in its second epoch: it
draws that epoch's subset again and continues exactly (the mixing itself:
tests/data/test_mixture.py)."""

import pytest
import torch

from tests.support.data import write_sources
from tests.support.runs import final_weights, recipe_args, rewind, run_recipe, train_rows

pytestmark = pytest.mark.slow


MIX_ARGS = [
    "train.micro_batch_size=2",
    "train.epochs=2",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=10",
    "checkpoint.resume=auto",
    "data.eval_fraction=0.1",
]


def test_a_mixed_run_resumed_in_its_second_epoch_continues_exactly(base_config, tiny_model, cache_env, tmp_path):
    """Two DDP processes; the second epoch draws another subset, which the resumed run
    must draw again (not the first epoch's, nor a fresh one)."""
    a, b = write_sources(tmp_path)
    train = f"[{{path: {a}, fraction: 0.5}}, {{path: {b}, fraction: 1.5}}]"
    ref = tmp_path / "ref"
    proc = run_recipe(recipe_args(base_config, tiny_model, train, ref, *MIX_ARGS), cache_env, nproc=2)
    # 18 x 0.5 + 9 x 1.5 = 9 + (9 + round(4.5) = 13) = 22 rows an epoch, 4 per step
    assert "training 12 steps (6 per epoch)" in proc.stdout, proc.stdout
    out = tmp_path / "resumed"
    rewind(out, 8, source=ref)  # killed after step 8: in the second epoch
    proc = run_recipe(recipe_args(base_config, tiny_model, train, out, *MIX_ARGS), cache_env, nproc=2)
    assert "at step 8 (epoch 1)" in proc.stdout + proc.stderr
    assert [r["loss"] for r in train_rows(out)] == [r["loss"] for r in train_rows(ref)]  # exactly
    for key, value in final_weights(ref / "final").items():
        torch.testing.assert_close(final_weights(out / "final")[key], value, rtol=0, atol=0)

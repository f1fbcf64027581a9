"""The router load-balancing loss in a real run: a packed Qwen3-MoE run gives the same
losses, router terms and weights however the global batch is split (the loss itself:
tests/core/test_router.py)."""

import pytest
import torch

from llmtrain.demo import make_rows, write_jsonl
from tests.support.runs import final_weights, recipe_args, run_recipe, train_rows

pytestmark = pytest.mark.slow


def test_moe_steps_do_not_depend_on_how_the_global_batch_is_split(zoo, base_config, cache_env, tmp_path):
    """A packed Qwen3-MoE run with the router loss on: 8 x 1, 2 x 4 and 2 processes x 2 x 2
    give the same losses, router terms and weights."""
    data = tmp_path / "rows.jsonl"
    write_jsonl(make_rows(40, seed=12), data)
    layouts = {"8x1": (1, 8, 1), "2x4": (1, 2, 4), "2proc_2x2": (2, 2, 2)}
    results = {}
    for layout, (nproc, micro, accum) in layouts.items():
        out = tmp_path / layout
        extra = [
            f"train.micro_batch_size={micro}",
            f"train.grad_accum_steps={accum}",
            "train.max_steps=3",
            "data.packing=true",
            "data.max_seq_len=128",
            "model.router_aux_loss=train",
        ]
        run_recipe(recipe_args(base_config, zoo("qwen3_moe"), data, out, *extra), cache_env, nproc=nproc)
        results[layout] = train_rows(out), final_weights(out / "final")
    ref_rows, ref_w = results["8x1"]
    assert [r["step"] for r in ref_rows] == [1, 2, 3] and all(r["router_aux"] > 0 for r in ref_rows)
    for layout, (rows, weights) in results.items():
        for a, b in zip(rows, ref_rows):
            assert a["tokens"] == b["tokens"], layout
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), layout
            assert a["router_aux"] == pytest.approx(b["router_aux"], rel=1e-5), layout
        # atol 1e-5, a hundredth of one step's update at lr 1e-3: an expert that saw few tokens
        # has weights with gradients near 0, where Adam's g/sqrt(v) turns summation-order noise
        # into updates of a few 1e-6 (one element of 4096 in transformers 5.24's experts).
        # A batch weighted by its layout moves whole tensors by 1e-4 and more.
        for key in ref_w:
            torch.testing.assert_close(weights[key], ref_w[key], rtol=1e-5, atol=1e-5, msg=f"{layout}: {key}")

"""The sampler correction (llmtrain/rl/correction.py): truncated and masked importance
weights, per token and per completion, as TRL 1.16's GRPOTrainer computes its
importance_sampling_ratio (written out plainly here, since TRL computes it inside its
generation step), and the mismatch metrics."""

import math

import pytest
import torch

from llmtrain.rl.correction import correction_weights, mismatch_metrics


def trl_ratio(trainer, sampler, lengths, mode, cap):
    """TRL's vllm_importance_sampling_mode on padded [rows, T] log-probs, back to flat."""
    rows, width = len(lengths), max(lengths)
    mask = torch.zeros(rows, width)
    old, samp = torch.zeros(rows, width, dtype=torch.float64), torch.zeros(rows, width, dtype=torch.float64)
    at = 0
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
        old[r, :n], samp[r, :n] = trainer[at : at + n], sampler[at : at + n]
        at += n
    diff = (old - samp) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    ratio = torch.clamp(ratio, max=cap) if mode.endswith("truncate") else ratio.masked_fill(ratio > cap, 0.0)
    return ratio.expand(rows, width)[mask.bool()]


@pytest.mark.parametrize("kind", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_weights_are_trls_importance_sampling_ratios(kind, level):
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 2]
    trainer = -torch.rand(sum(lengths), generator=g, dtype=torch.float64) * 3
    sampler = trainer + 0.4 * torch.randn(sum(lengths), generator=g, dtype=torch.float64)
    cap = 1.3
    weights, over = correction_weights(trainer, sampler, lengths, kind, level, cap)
    mode = f"{level}_{'truncate' if kind == 'tis' else 'mask'}"
    torch.testing.assert_close(weights.double(), trl_ratio(trainer, sampler, lengths, mode, cap), rtol=1e-6, atol=0)
    assert over.shape == ((sum(lengths),) if level == "token" else (len(lengths),))
    assert 0 < int(over.sum()) < len(over)  # the cap changed some units, not all
    if kind == "mis":
        assert (weights == 0).any()
    else:
        assert weights.max() == pytest.approx(cap) and (weights > 0).all()


def test_a_sampler_that_agrees_with_the_trainer_gets_weight_1():
    trainer = torch.tensor([-0.5, -2.0, -1.0])
    for level in ("token", "sequence"):
        weights, over = correction_weights(trainer, trainer.clone(), [2, 1], "mis", level, 2.0)
        assert weights.tolist() == [1.0, 1.0, 1.0] and not over.any()


def test_the_mismatch_metrics():
    """Two completions: one token 0.5 nats more likely to the trainer, the rest agreeing."""
    trainer = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    sampler = torch.tensor([-1.5, -1.0, -1.0], dtype=torch.float64)
    out = mismatch_metrics(trainer, sampler, [2, 1], "token", 1.5)
    assert out["sampler_kl"] == pytest.approx((math.exp(0.5) - 0.5 - 1) / 3)
    assert out["sampler_logp_gap_max"] == pytest.approx(0.5)
    assert out["sampler_ratio_max"] == pytest.approx(math.exp(0.5))
    assert out["sampler_ratio_p50"] == pytest.approx(1.0)
    assert out["sampler_corrected"] == pytest.approx(1 / 3)  # e^0.5 = 1.65 > 1.5
    per_completion = mismatch_metrics(trainer, sampler, [2, 1], "sequence", 1.5)
    assert per_completion["sampler_corrected"] == pytest.approx(1 / 2)
    assert mismatch_metrics(torch.zeros(0), torch.zeros(0), [], "token", 2.0) == {}

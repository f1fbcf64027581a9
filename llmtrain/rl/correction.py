"""The sampler correction (grpo.importance_correction): importance weights for the gap between
the log-probs a completion was sampled with and the trainer's log-probs of the same tokens.

A fast sampler (vLLM, another precision, kernels of its own) or an asynchronous run (weights
a step or more behind) samples from a distribution a little off the trainer's, so the policy
gradient is off-policy by that gap. For completion i's trained token t, with q_it the
sampler's log-prob (sampling.Completions.logps) and p_it the trainer's, as the policy stands
before the round's updates (the log-probs the loss's ratio starts from):

    token level     rho_it = exp(p_it - q_it)
    sequence level  rho_i  = exp(sum_t (p_it - q_it)), for each of its tokens
    tis             w = min(rho, cap)                  truncated importance sampling
    mis             w = rho if rho <= cap, else 0      masked importance sampling

w multiplies each token's policy loss (rl/loss.py), not its KL term, as TRL's
vllm_importance_sampling_correction does (its token_/sequence_ truncate and mask modes, its
cap vllm_importance_sampling_clip_max). The weights are computed once per generation round,
from whole completions, so they do not depend on the layout; a checkpoint within a round
keeps them (rollout.safetensors).

`mismatch_metrics` reports how far the two are apart over the global batch: the sampler's KL
to the trainer (k3, per token), the largest log-prob gap, quantiles of rho and the share of
units (tokens or completions) whose weight the cap changed.
"""

from __future__ import annotations

import torch

CORRECTIONS = ("none", "tis", "mis")
LEVELS = ("token", "sequence")


def log_ratios(trainer: torch.Tensor, sampler: torch.Tensor, lengths: list[int], level: str) -> torch.Tensor:
    """log rho per unit: per trained token (token level), or per completion (sequence level),
    from flat [tokens] log-probs of completions of `lengths` trained tokens each."""
    gap = (trainer - sampler).double()
    if level == "token":
        return gap
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    return torch.zeros(len(lengths), dtype=torch.float64).index_add(0, rows, gap)


def correction_weights(
    trainer: torch.Tensor, sampler: torch.Tensor, lengths: list[int], kind: str, level: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w per trained token, flat; which units' weight the cap changed): see the module
    docstring. `kind` is tis or mis."""
    rho = log_ratios(trainer, sampler, lengths, level).exp()
    over = rho > cap
    w = rho.clamp(max=cap) if kind == "tis" else rho.masked_fill(over, 0.0)
    if level == "sequence":
        w = torch.repeat_interleave(w, torch.tensor(lengths, dtype=torch.long))
    return w.float(), over


def mismatch_metrics(trainer: torch.Tensor, sampler: torch.Tensor, lengths: list[int], level: str, cap: float):
    """The metrics of the gap between sampler and trainer over a whole round (every process's
    completions): see the module docstring."""
    if trainer.numel() == 0:
        return {}
    gap = (trainer - sampler).double()
    rho = log_ratios(trainer, sampler, lengths, level).exp()
    q = torch.quantile(rho, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
    return {
        "sampler_kl": float((gap.exp() - gap - 1).mean()),  # KL(sampler || trainer), k3 at the sampled tokens
        "sampler_logp_gap_max": float(gap.abs().max()),
        "sampler_ratio_p05": q[0],
        "sampler_ratio_p50": q[1],
        "sampler_ratio_p95": q[2],
        "sampler_ratio_max": float(rho.max()),
        "sampler_corrected": float((rho > cap).double().mean()),
    }

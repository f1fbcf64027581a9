"""GRPO and its relatives: the clipped policy-gradient losses, as an objective of the shared
step (core/objective.py), so the step's loss is the same for any batch layout; it also names
the advantage estimator its completions are scored with (rl/advantages.py).

For completion i of a group and its trained token t, with A_i its advantage, w_it the
sampler correction (1 unless grpo.importance_correction: rollout.correction_weights) and
logp_old the log-probs the completion was sampled with (equal to logp on a generation
round's first step):

    r_it = exp(logp_it - logp_old_it)                              the token's ratio
    s_i  = exp(mean_t (logp_it - logp_old_it))                     the sequence's (GSPO)
    l_it = w_it f(...) + beta KL_it,  KL_it = exp(ref - logp) - (ref - logp) - 1   (k3)

with f, per loss type (docs/grpo.md):

    grpo, dr_grpo, dapo  -min(r A_i, clip(r, 1 - eps, 1 + eps_high) A_i)           PPO's clip
    gspo                 the same with s_i in place of r_it                        Zheng et al. 2025
    gspo_token           the same with sg(s_i) exp(logp_it - sg(logp_it))          (value s_i)
    cispo                -sg(min(r_it, 1 + cispo_eps_high)) A_i logp_it            MiniMax-M1

(sg: stop-gradient), and the step's loss over the global batch of N completions, |o_i|
trained tokens each:

    grpo, gspo, gspo_token   (1/N) sum_i (1/|o_i|) sum_t l_it       unit: completions
    dr_grpo                  (1/N) sum_i sum_t l_it / L             unit: completions (L = max_completion_length)
    dapo, cispo              sum_it l_it / sum_i |o_i|              unit: tokens

Each is a sum over units divided by the global count, which the step knows before any
forward pass: so 1 process and 8, or 8 x 1 and 2 x 4 micro-batches, give one loss.

The loss types are rows of LOSS_TYPES, not branches. A LossType is (unit, token_weights,
per_token, ratio, clipped): a micro-batch's loss is sum_t (w_t per_token(r_t, A_t, logp_t,
clip) + beta KL_t) x token_weight_t over its trained tokens (row-major order), with r_t =
ratio(logp, logp_old, mask, rows), and the metrics (clip_ratio: the tokens `clipped` counts,
kl) are given per unit (UNIT_WEIGHTS). To add a loss type: write what differs (its per-token
loss; its ratio; its token weights: functions of (mask, rows, dtype, L), the [rows, T] trained
mask, each trained token's row, the loss's dtype and max_completion_length) and add one
LossType row to LOSS_TYPES under its name: grpo.loss_type takes the table's names
(rl/config.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.logps import label_logps
from ..core.objective import Loss, loss_head, model_inputs
from ..data.rows import IGNORE
from .advantages import ESTIMATORS, estimate

Weights = Callable[[torch.Tensor, torch.Tensor, torch.dtype, int], torch.Tensor]


@dataclass(frozen=True)
class Clip:
    """The bounds a loss type clips its ratio to."""

    low: float  # 1 - grpo.epsilon
    high: float  # 1 + grpo.epsilon_high (or grpo.epsilon)
    cap: float  # CISPO's cap on its importance weight: 1 + grpo.cispo_epsilon_high


def each_token(mask: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype, max_len: int) -> torch.Tensor:
    """1 per token: a token is its own unit."""
    return torch.ones(rows.shape, dtype=dtype, device=rows.device)


def completion_mean(mask: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype, max_len: int) -> torch.Tensor:
    """1/|o_i|: each completion's tokens share its one unit."""
    return 1 / mask.sum(1).to(dtype)[rows]


def max_length(mask: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype, max_len: int) -> torch.Tensor:
    """1/L: a completion's tokens over the longest it may be (Dr. GRPO)."""
    return torch.full(rows.shape, 1 / max_len, dtype=dtype, device=rows.device)


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, logp: torch.Tensor, clip: Clip) -> torch.Tensor:
    """PPO's clipped objective, negated: -min(r A, clip(r, low, high) A)."""
    return -torch.min(ratio * adv, ratio.clamp(clip.low, clip.high) * adv)


def capped_weight_times_logp(ratio: torch.Tensor, adv: torch.Tensor, logp: torch.Tensor, clip: Clip) -> torch.Tensor:
    """CISPO's: the importance weight capped and kept out of the gradient, times A logp, so
    every token keeps a gradient (PPO's clip drops those outside its range)."""
    return -(ratio.clamp(max=clip.cap).detach() * adv * logp)


def token_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Each token's importance ratio, exp(logp - logp_old)."""
    return torch.exp(logp - old)


def sequence_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """GSPO's: each completion's exp(mean over its trained tokens of logp - logp_old), given
    to each of its tokens."""
    summed = torch.zeros(mask.shape[0], dtype=logp.dtype, device=logp.device).index_add(0, rows, logp - old)
    return torch.exp(summed / mask.sum(1).clamp(min=1).to(logp.dtype))[rows]


def sequence_ratio_per_token(
    logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """GSPO-token's: the sequence's ratio in value, with each token's own gradient,
    sg(s_i) exp(logp_t - sg(logp_t)), so that per-token advantages could weight them."""
    return sequence_ratio(logp, old, mask, rows).detach() * torch.exp(logp - logp.detach())


def clipped_against_advantage(ratio: torch.Tensor, adv: torch.Tensor, clip: Clip) -> torch.Tensor:
    """Whether the clip took the gradient away: below the range with a negative advantage, or
    above it with a positive one (the clip_ratio metric)."""
    return ((ratio < clip.low) & (adv < 0)) | ((ratio > clip.high) & (adv > 0))


def capped(ratio: torch.Tensor, adv: torch.Tensor, clip: Clip) -> torch.Tensor:
    """Whether CISPO's cap lowered the token's weight (its gradient is kept, smaller)."""
    return ratio > clip.cap


@dataclass(frozen=True)
class LossType:
    """One of grpo.loss_type: what it counts, and how a token's loss enters the sum."""

    unit: str  # "tokens" or "completions": what the step divides the summed loss by
    token_weights: Weights  # (mask, rows, dtype, max_completion_length) -> each token's share of its unit
    per_token: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Clip], torch.Tensor]  # (ratio, adv, logp, clip)
    # (logp, logp_old, mask, rows) -> each token's importance ratio: per token, or a
    # sequence's broadcast to its tokens (GSPO).
    ratio: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = token_ratio
    # (ratio, adv, clip) -> which tokens the clip_ratio metric counts as clipped.
    clipped: Callable[[torch.Tensor, torch.Tensor, Clip], torch.Tensor] = clipped_against_advantage


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType("completions", completion_mean, clipped_surrogate),
    "dr_grpo": LossType("completions", max_length, clipped_surrogate),
    "dapo": LossType("tokens", each_token, clipped_surrogate),
    "gspo": LossType("completions", completion_mean, clipped_surrogate, sequence_ratio),
    "gspo_token": LossType("completions", completion_mean, clipped_surrogate, sequence_ratio_per_token),
    "cispo": LossType("tokens", each_token, capped_weight_times_logp, clipped=capped),
}
UNIT_WEIGHTS: dict[str, Weights] = {"tokens": each_token, "completions": completion_mean}  # for metrics per unit


class GRPOLoss:
    """The objective of recipes/grpo.py. A micro-batch holds whole completions (prompt and
    completion tokens, labels on the completion), their `advantages`, and where needed
    `old_logps` and `ref_logps` aligned with the labels. `loss_type` names its row of
    LOSS_TYPES; `estimator` (grpo.scale_rewards) names the advantage estimator of
    advantages.ESTIMATORS that `advantages` applies to a round's rewards."""

    progress_metrics = {"clip_ratio": "clip"}

    def __init__(
        self,
        loss_type: str = "dapo",
        epsilon: float = 0.2,
        epsilon_high: float = 0.0,
        beta: float = 0.0,
        temperature: float = 1.0,
        max_completion_length: int = 1,
        chunk_tokens: int = 0,
        head=None,
        estimator: str = "group",
        cispo_epsilon_high: float = 4.0,
    ):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown GRPO loss type {loss_type!r}; one of {sorted(LOSS_TYPES)}")
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {estimator!r}; one of {sorted(ESTIMATORS)}")
        self.loss_type, self.beta, self.temperature = loss_type, beta, temperature
        self.variant = LOSS_TYPES[loss_type]
        self.estimator = estimator
        self.clip = Clip(1 - epsilon, 1 + (epsilon_high or epsilon), 1 + cispo_epsilon_high)
        self.max_completion_length = max_completion_length
        self.head, self.chunk = loss_head(head, chunk_tokens)
        self.unit = self.variant.unit
        self.metric_names = ("clip_ratio", "kl") if beta else ("clip_ratio",)

    def advantages(self, rewards: torch.Tensor, weights: torch.Tensor, group: int):
        """(advantage per completion, its weighted reward, whether its group's rewards have
        no spread) by this objective's estimator: advantages.estimate."""
        return estimate(rewards, weights, group, self.estimator)

    def count(self, batch: dict) -> int:
        trained = batch["labels"] != IGNORE
        return int(trained.sum()) if self.unit == "tokens" else int(trained.any(1).sum())

    def logps(self, model, batch: dict) -> torch.Tensor:
        """Each trained token's log-prob at grpo.temperature, flat in row-major order."""
        inputs = model_inputs(model, batch)
        return label_logps(model, inputs, batch["labels"], self.head, self.chunk, self.temperature)

    def __call__(self, model, batch: dict) -> Loss:
        logp = self.logps(model, batch)
        mask = batch["labels"] != IGNORE
        rows = mask.nonzero()[:, 0]
        adv = batch["advantages"].to(logp.dtype)[rows]
        old = batch["old_logps"][mask] if "old_logps" in batch else logp.detach()
        ratio = self.variant.ratio(logp, old, mask, rows)
        per_token = self.variant.per_token(ratio, adv, logp, self.clip)
        if "correction" in batch:  # the sampler correction's weights (grpo.importance_correction)
            per_token = per_token * batch["correction"][mask]
        clipped = self.variant.clipped(ratio, adv, self.clip)
        kl = None
        if self.beta:
            gap = batch["ref_logps"][mask] - logp
            kl = torch.exp(gap) - gap - 1
            per_token = per_token + self.beta * kl
        weight = self.variant.token_weights(mask, rows, logp.dtype, self.max_completion_length)
        per_unit = UNIT_WEIGHTS[self.unit](mask, rows, logp.dtype, self.max_completion_length)
        metrics = {"clip_ratio": (clipped.to(logp.dtype) * per_unit).sum().detach()}
        if kl is not None:
            metrics["kl"] = (kl * per_unit).sum().detach()
        return Loss((per_token * weight).sum(), metrics)

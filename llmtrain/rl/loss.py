"""GRPO: group-relative advantages and the clipped policy-gradient loss, as an objective of
the shared step (core/objective.py), so the step's loss is the same for any batch layout.

For completion i of a group and its token t, with r = exp(logp - logp_old) (logp_old: the
log-probs the completion was sampled with, equal to logp on a generation batch's first
step) and A_i its advantage:

    l_it = -min(r A_i, clip(r, 1 - epsilon, 1 + epsilon_high) A_i) + beta KL_it
    KL_it = exp(ref - logp) - (ref - logp) - 1          (k3, at the sampled token)

and the step's loss over the global batch of N completions, |o_i| tokens each (docs/grpo.md):

    grpo     (1/N) sum_i (1/|o_i|) sum_t l_it        unit: completions
    dr_grpo  (1/N) sum_i sum_t l_it / L              unit: completions (L = max_completion_length)
    dapo     sum_it l_it / sum_i |o_i|               unit: tokens

Each is a sum over units divided by the global count, which the step knows before any
forward pass: so 1 process and 8, or 8 x 1 and 2 x 4 micro-batches, give one loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.objective import Loss, loss_head, model_inputs, trained_head
from ..data.rows import IGNORE
from ..errors import RewardError


def advantages(rewards: torch.Tensor, weights: torch.Tensor, group: int, scale: str):
    """(advantage per completion, its weighted reward, whether its group's rewards have no
    spread) from [completions, functions] rewards (NaN: unscored) of a whole global batch,
    groups of `group` consecutive completions. A completion no function scored gets
    advantage 0 and stays out of its group's mean and spread."""
    unscored = rewards.isnan().all(1)
    total = (rewards * weights).nansum(1)
    total[unscored] = float("nan")
    grouped = total.view(-1, group)
    mean = grouped.nanmean(1, keepdim=True)
    spread = nanstd(grouped, 1, keepdim=True)
    adv = (grouped - mean).view(-1)
    std = spread.expand_as(grouped).reshape(-1) if scale != "batch" else nanstd(total).expand_as(total)
    if total.isinf().any() or spread.isinf().any() or std.isinf().any():  # advantages and metrics NaN or inf
        largest = float(rewards.nan_to_num(0).abs().max())
        raise RewardError(
            f"grpo.rewards: rewards as large as {largest:.3g} (times grpo.reward_weights) overflow the float32 "
            "arithmetic of the advantages (weighted sums and spreads); return rewards of a smaller scale, such as 0 "
            "to 1"
        )
    if scale != "none":
        adv = adv / (std + 1e-4)
    flat = spread.view(-1)
    zero_spread = torch.isclose(flat, torch.zeros_like(flat)) | flat.isnan()
    return torch.nan_to_num(adv, nan=0.0), total, zero_spread


def nanstd(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """The sample standard deviation (n - 1) ignoring NaN; NaN for fewer than two values."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = x.nanmean(dim, keepdim=True)
    n = (~x.isnan()).sum(dim, keepdim=True)
    var = ((x - mean) ** 2).nansum(dim, keepdim=True) / (n - 1).clamp(min=1)
    var = torch.where(n > 1, var, torch.full_like(var, float("nan")))
    return (var.sqrt() if keepdim else var.sqrt().squeeze(dim)).to(x.dtype)


def _chunk_logps(temperature: float):
    def per_chunk(hidden, weight, bias, labels):
        logits = F.linear(hidden, weight, bias).float() / temperature
        return -F.cross_entropy(logits, labels, reduction="none")

    return per_chunk


def token_logps(model, batch: dict, temperature: float, head=None, chunk: int = 0) -> torch.Tensor:
    """Log-probs (of the tempered distribution) of the trained tokens (labels not IGNORE),
    flat in row-major order. With a `head` the output layer computes them `chunk` positions
    at a time, so [tokens, vocabulary] logits never exist whole."""
    labels = batch["labels"]
    kwargs = model_inputs(model, batch)
    if head is not None:
        with trained_head(head, labels, chunk, _chunk_logps(temperature), lambda parts: torch.cat(parts)):
            return model(**kwargs).logits
    mask = labels != IGNORE
    logits = model(**kwargs).logits[mask].float() / temperature
    return logits.log_softmax(-1).gather(1, labels[mask][:, None]).squeeze(1)


class GRPOLoss:
    """The objective of recipes/grpo.py. A micro-batch holds whole completions (prompt and
    completion tokens, labels on the completion), their `advantages`, and where needed
    `old_logps` and `ref_logps` aligned with the labels."""

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
    ):
        self.loss_type, self.beta, self.temperature = loss_type, beta, temperature
        self.low, self.high = 1 - epsilon, 1 + (epsilon_high or epsilon)
        self.max_completion_length = max_completion_length
        self.head, self.chunk = loss_head(head, chunk_tokens)
        self.unit = "tokens" if loss_type == "dapo" else "completions"
        self.metric_names = ("clip_ratio", "kl") if beta else ("clip_ratio",)

    def count(self, batch: dict) -> int:
        trained = batch["labels"] != IGNORE
        return int(trained.sum()) if self.unit == "tokens" else int(trained.any(1).sum())

    def logps(self, model, batch: dict) -> torch.Tensor:
        return token_logps(model, batch, self.temperature, self.head, self.chunk)

    def __call__(self, model, batch: dict) -> Loss:
        logp = self.logps(model, batch)
        mask = batch["labels"] != IGNORE
        rows = mask.nonzero()[:, 0]
        adv = batch["advantages"].to(logp.dtype)[rows]
        old = batch["old_logps"][mask] if "old_logps" in batch else logp.detach()
        ratio = torch.exp(logp - old)
        per_token = -torch.min(ratio * adv, ratio.clamp(self.low, self.high) * adv)
        clipped = ((ratio < self.low) & (adv < 0)) | ((ratio > self.high) & (adv > 0))
        kl = None
        if self.beta:
            gap = batch["ref_logps"][mask] - logp
            kl = torch.exp(gap) - gap - 1
            per_token = per_token + self.beta * kl
        weight = self.token_weights(mask, rows, logp.dtype)
        metrics = {"clip_ratio": (clipped.to(logp.dtype) * self.unit_weights(mask, rows, logp.dtype)).sum().detach()}
        if kl is not None:
            metrics["kl"] = (kl * self.unit_weights(mask, rows, logp.dtype)).sum().detach()
        return Loss((per_token * weight).sum(), metrics)

    def token_weights(self, mask, rows, dtype) -> torch.Tensor:
        """Each token's share of its units: 1 (dapo), 1/|o_i| (grpo), 1/L (dr_grpo)."""
        if self.loss_type == "dapo":
            return torch.ones(rows.shape, dtype=dtype, device=rows.device)
        if self.loss_type == "dr_grpo":
            return torch.full(rows.shape, 1 / self.max_completion_length, dtype=dtype, device=rows.device)
        return self.unit_weights(mask, rows, dtype)

    def unit_weights(self, mask, rows, dtype) -> torch.Tensor:
        """For metrics given per unit: 1 per token, or each completion's token mean."""
        if self.unit == "tokens":
            return torch.ones(rows.shape, dtype=dtype, device=rows.device)
        return 1 / mask.sum(1).to(dtype)[rows]

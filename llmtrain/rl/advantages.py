"""Advantage estimators: how a global batch's rewards become each completion's advantage.

The batch holds groups of `group` consecutive completions of one prompt each, whole on
every process (rl/rollout.py). `estimate` does what every estimator shares:

    total_i = sum_f w_f r_if               (NaN terms left out; NaN when no function scored i)
    A_i = (total_i - baseline_i) / scale_i        (NaN, that is unscored: A_i = 0)

A completion no function scored stays out of its group's mean and spread. Rewards whose
weighted sums or spreads overflow float32 are one error (`RewardError`), not a step of NaN
or zero advantages. An estimator (`ESTIMATORS`, named by grpo.scale_rewards) supplies the
centred rewards (each total less its baseline; the group's mean for each here) and their
scale_i, the divisor, or None to leave them as they are:

    group   baseline: its group's mean; scale: the group's spread (sample standard deviation) + 1e-4   (GRPO)
    batch   baseline: its group's mean; scale: the whole global batch's spread + 1e-4
    none    baseline: its group's mean; no scaling                                (Dr. GRPO)
    rloo    baseline: the mean of the rest of its group; no scaling               (RLOO, TRL's RLOOTrainer)

RLOO's A_i = total_i - mean_{j != i} total_j is n/(n - 1) times the group-centred total,
for n scored completions in the group (a group with one scored completion: 0).

To add one: write `estimator(grouped, spread) -> ([completions] centred rewards, [completions]
divisors or None)` from the [groups, group] weighted totals (NaN: unscored) and each group's
spread ([groups, 1]), and add it to ESTIMATORS under its name: grpo.scale_rewards takes the
table's names (rl/config.py). The objective (loss.GRPOLoss) holds the estimator's name, and
the rollouts ask it for the advantages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import RewardError

EPS = 1e-4  # keeps a group whose rewards barely differ from dividing by almost 0

Estimator = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def group_centred(grouped: torch.Tensor) -> torch.Tensor:
    """Each total less its group's mean (unscored ones left out of it), flat."""
    return (grouped - grouped.nanmean(1, keepdim=True)).view(-1)


def _group(grouped: torch.Tensor, spread: torch.Tensor):
    return group_centred(grouped), spread.expand_as(grouped).reshape(-1) + EPS


def _batch(grouped: torch.Tensor, spread: torch.Tensor):
    total = grouped.view(-1)
    return group_centred(grouped), nanstd(total).expand_as(total) + EPS


def _none(grouped: torch.Tensor, spread: torch.Tensor):
    return group_centred(grouped), None


def _leave_one_out(grouped: torch.Tensor, spread: torch.Tensor):
    scored = (~grouped.isnan()).sum(1, keepdim=True)
    others = (grouped.nansum(1, keepdim=True) - grouped) / (scored - 1)  # NaN (0/0) with one scored: advantage 0
    return (grouped - others).view(-1), None


ESTIMATORS: dict[str, Estimator] = {"group": _group, "batch": _batch, "none": _none, "rloo": _leave_one_out}


def estimate(rewards: torch.Tensor, weights: torch.Tensor, group: int, estimator: str):
    """(advantage per completion, its weighted reward, whether its group's rewards have no
    spread) from [completions, functions] rewards (NaN: unscored) of a whole global batch,
    groups of `group` consecutive completions, by the estimator named `estimator`."""
    unscored = rewards.isnan().all(1)
    total = (rewards * weights).nansum(1)
    total[unscored] = float("nan")
    grouped = total.view(-1, group)
    spread = nanstd(grouped, 1, keepdim=True)
    adv, divisor = ESTIMATORS[estimator](grouped, spread)
    # Advantages and metrics NaN or inf otherwise.
    if total.isinf().any() or spread.isinf().any() or (divisor is not None and divisor.isinf().any()):
        largest = float(rewards.nan_to_num(0).abs().max())
        raise RewardError(
            f"grpo.rewards: rewards as large as {largest:.3g} (times grpo.reward_weights) overflow the float32 "
            "arithmetic of the advantages (weighted sums and spreads); return rewards of a smaller scale, such as 0 "
            "to 1"
        )
    if divisor is not None:
        adv = adv / divisor
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

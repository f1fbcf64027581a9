"""Evaluation: the objective's mean loss and metrics over a whole held-out set, on every
process."""

from __future__ import annotations

import torch

from .window import Outcome, draw_window


@torch.no_grad()
def evaluate(model, loader, objective, accelerator, empty: dict, beat=None) -> tuple[float, dict[str, float]]:
    """The objective's loss and metrics summed over every batch of `loader` on every
    process, divided by the count of all of them. Batches go one at a time through the
    window agreement, which also sums their counts over the processes, so a process that
    has run out runs `empty` while the others finish (a sharded model's forward is a
    collective)."""
    model.eval()
    names = objective.metric_names
    sums = torch.zeros(1 + len(names), device=accelerator.device, dtype=torch.float64)  # the loss, then metrics
    count = 0
    batches = iter(loader)
    while (window := draw_window(batches, 1, accelerator, objective.count, beat=beat)).outcome is Outcome.STEP:
        out = objective(model, window.micro_batches(empty)[0])
        sums[0] += out.total.double()
        for key, value in out.metrics.items():
            sums[1 + names.index(key)] += value.double()
        count += window.count
    model.train()
    totals = (accelerator.reduce(sums, reduction="sum") / count).tolist()
    return totals[0], dict(zip(names, totals[1:]))

"""Evaluation: the objective's mean loss over a whole held-out set, on every process."""

from __future__ import annotations

import torch

from .window import Outcome, draw_window


@torch.no_grad()
def evaluate(model, loader, objective, accelerator, empty: dict, beat=None) -> float:
    """The objective's loss summed over every batch of `loader` on every process, divided
    by the count of all of them. Batches go one at a time through the window agreement,
    which also sums their counts over the processes, so a process that has run out runs
    `empty` while the others finish (a sharded model's forward is a collective)."""
    model.eval()
    loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    count = 0
    batches = iter(loader)
    while (window := draw_window(batches, 1, accelerator, objective.count, beat=beat)).outcome is Outcome.STEP:
        loss_sum += objective(model, window.micro_batches(empty)[0]).total.double()
        count += window.count
    model.train()
    return float(accelerator.reduce(loss_sum, reduction="sum")) / count

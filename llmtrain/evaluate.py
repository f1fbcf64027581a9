"""Evaluation: the objective's mean loss over a whole held-out set, on every process."""

from __future__ import annotations

import torch

from .window import Outcome, draw_window


@torch.no_grad()
def evaluate(model, loader, objective, accelerator, empty: dict, beat=None) -> float:
    """The objective's loss summed over every batch of `loader` on every process, divided
    by the count of all of them. Batches go one at a time through the window agreement,
    so a process that has run out runs `empty` while the others finish (a sharded
    model's forward is a collective)."""
    model.eval()
    sums = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    batches = iter(loader)
    while (window := draw_window(batches, 1, accelerator, objective.count, beat=beat)).outcome is Outcome.STEP:
        out = objective(model, window.micro_batches(empty)[0])
        sums += torch.stack([out.total.double(), out.count.double()])
    model.train()
    sums = accelerator.reduce(sums, reduction="sum")
    return float(sums[0] / sums[1])

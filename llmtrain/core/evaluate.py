"""Evaluation: the objective's mean loss and metrics over a whole held-out set, on every
process. An objective with a `before_window` (KTO's reference point) has it run once over
the whole set first, in a pass of its own."""

from __future__ import annotations

from functools import partial

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
    if (before := getattr(objective, "before_window", None)) is not None:  # once, over the whole set
        before(
            model,
            _every_batch(loader, accelerator, objective, empty, beat),
            partial(accelerator.reduce, reduction="sum"),
        )
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


def _every_batch(loader, accelerator, objective, empty: dict, beat):
    """Every batch of `loader` on this process, then `empty` ones while other processes
    still have batches: the same number of batches on every process."""
    batches = iter(loader)
    while (window := draw_window(batches, 1, accelerator, objective.count, beat=beat)).outcome is Outcome.STEP:
        yield window.micro_batches(empty)[0]

"""The optional loss-spike guard (train.spike_factor): a step whose loss is far above the
recent ones is skipped like a non-finite one, before the optimizer step. The step loss is
the same on every process, so every process decides alike."""

from __future__ import annotations

import statistics


class SpikeGuard:
    def __init__(self, factor: float, window: int, recent: list[float] | None = None):
        self.factor, self.window = factor, window
        self.recent = list(recent or [])[-window:]  # losses of the last accepted steps

    def is_spike(self, loss: float) -> bool:
        """Above factor x the median of a full window of recent losses (off when factor is 0)."""
        return (
            bool(self.factor)
            and len(self.recent) == self.window
            and loss > self.factor * statistics.median(self.recent)
        )

    def accept(self, loss: float) -> None:
        self.recent = (self.recent + [loss])[-self.window :]

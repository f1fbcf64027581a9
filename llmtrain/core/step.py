"""One optimizer step: forward and backward over a window of micro-batches, then one
decision, the same on every process, to step or to skip.

The step's loss is the objective's summed loss over every micro-batch of the window on
every process, divided by the global count the window agreement established before any
forward pass (see `objective` and `backend.Backend.loss_scale`). The loss and gradient
norm are then the same on every process (the loss is reduced, the gradients were
all-reduced), so every process reaches the same decision without another collective.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from .state import Skip, StepResult, TrainState

if TYPE_CHECKING:
    from ..distributed.backend import Backend
    from .objective import Objective
    from .window import Window


def train_step(
    model,
    optimizer: torch.optim.Optimizer,
    window: Window,
    objective: Objective,
    backend: Backend,
    state: TrainState,
    *,
    lr: float,
    max_grad_norm: float,
    empty: dict,
    beat=None,
) -> StepResult:
    """Run the window's micro-batches (this process's, then `empty` ones up to the count
    every process runs), after the objective's `before_window` where it has one, then
    step, or skip when the loss or gradient norm is not finite or the loss spikes
    (state.spikes), leaving weights and optimizer as they were; then check that the update
    left no more non-finite weights than the run started with. Reads `state` (the step
    number, the spike window); the caller records the result in it."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    scale = backend.loss_scale(window.count)
    micro = window.micro_batches(empty)
    if (before := getattr(objective, "before_window", None)) is not None:  # e.g. KTO's reference point
        if beat is not None:
            beat(f"step {state.step + 1}, the objective's pass before the window")
        before(model, micro, backend.sum_over_processes)
    loss_sum = torch.zeros((), device=backend.accelerator.device)
    metric_sums = torch.zeros(len(objective.metric_names), device=loss_sum.device)
    for i, batch in enumerate(micro):
        if beat is not None:
            beat(f"step {state.step + 1}, micro-batch {i + 1} of {len(micro)}")
        with backend.micro_batch(model, last=i == len(micro) - 1):
            out = objective(model, batch)
            backend.backward(out.total * scale)
        loss_sum += out.total.detach()
        for key, value in out.metrics.items():  # a name not in metric_names is a bug in the objective
            metric_sums[objective.metric_names.index(key)] += value.detach().float()
    grad_norm = backend.clip_grad_norm(model, max_grad_norm)
    # One reduce of the same length on every process: the loss, then the metrics by name.
    sums = backend.sum_over_processes(torch.cat([loss_sum[None], metric_sums]))
    loss = float(sums[0]) / window.count
    metrics = {key: float(s) / window.count for key, s in zip(objective.metric_names, sums[1:])}

    def result(skip: Skip | None = None, reason: str = "") -> StepResult:
        seconds = time.perf_counter() - window.started
        return StepResult(loss, grad_norm, window.count, lr, seconds, window.data_wait, skip, reason, metrics)

    nonfinite = (
        not math.isfinite(loss)
        or (backend.grad_norm_is_ours() and not math.isfinite(grad_norm))
        or backend.engine_skipped()
    )
    if nonfinite:
        backend.skip_update(optimizer)
        return result(Skip.NONFINITE, f"the loss or gradient norm was not finite (loss {loss}, grad_norm {grad_norm})")
    if state.spikes.is_spike(loss):
        backend.skip_update(optimizer)
        spikes = state.spikes
        return result(
            Skip.SPIKE,
            f"the loss {loss:.4g} spiked above train.spike_factor={spikes.factor:g} x "
            f"the median of the last {spikes.window} steps",
        )
    backend.optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    if backend.scaler_skipped():
        return result(Skip.OVERFLOW, "fp16 gradient overflow; loss scale lowered")
    # The loss and gradients were finite, yet an update can still make weights non-finite
    # (an infinite rate, an optimizer fault). It cannot be undone: the loop stops the run
    # before anything is saved.
    if (count := backend.nonfinite_weights(model)) > state.nonfinite_weights:
        return result(Skip.POISONED, f"the update made {count - state.nonfinite_weights} weight values non-finite")
    return result()

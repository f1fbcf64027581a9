"""Where a run stands: one object that the loop updates after every optimizer step and
that checkpoints save and load whole (as train_state.json), so a resumed run continues
exactly where the saved one was; and what a step's outcome is (StepResult, and Skip: why
no update was taken), which the step returns and the state, the loop and the log read."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .spike import SpikeGuard


class Skip(Enum):
    NONFINITE = "the loss or gradient norm was not finite"
    SPIKE = "the loss spiked (train.spike_factor)"
    OVERFLOW = "fp16 gradient overflow"
    POISONED = "the update made weights non-finite"


@dataclass
class StepResult:
    loss: float  # the global batch's summed loss / its count
    grad_norm: float  # before clipping; nan where the backend gives none
    count: int  # the objective's units in the global batch (trained tokens for SFT)
    lr: float
    seconds: float  # from the start of drawing the window to the end of the step
    data_wait: float  # of which this process waited for its batches
    skip: Skip | None = None  # why no update was taken; None if it was
    reason: str = ""  # the skip, in words for the log
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's own, means over the count


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps taken. Skipped windows take no step number; the learning rate is
    a function of it."""
    epoch: int = 0
    """The pass over the training data."""
    batches_in_epoch: int = 0
    """Micro-batches drawn in the pass by the process that drew the most, those of
    skipped windows included: where a resumed run starts reading. The same on every
    process (a process that ran out earlier skips past its end, which reads nothing)."""
    skips_in_a_row: int = 0
    """Windows skipped (non-finite or spiking) since the last step taken; the run stops
    at train.max_consecutive_skips."""
    spikes: SpikeGuard = field(default_factory=lambda: SpikeGuard(0.0, 1))
    """The spike guard and its window of recent losses."""
    nonfinite_weights: int = 0
    """Non-finite values the trainable weights started with (a model may carry some, say
    in an embedding row no data uses). An update that adds any stops the run, so no
    checkpoint ever holds more; a resume checks the weights it loads against it."""
    trained: int = 0
    """The objective's units (trained tokens for SFT: `Objective.unit`) of every step taken,
    over all processes."""
    seconds: float = 0.0
    """Seconds spent in steps (skipped ones too), from drawing their batches to the update;
    evaluations and checkpoints not included. With `trained`, what the model card reports."""
    identity: dict = field(default_factory=dict)
    """What the run is (`rundir.identity`: its recipe, its training files' content and the
    other files it reads), set by the recipe before training and saved with the state (as
    "run"), so a rerun can tell that the output_dir holds its own run, and what changed."""

    # What train_state.json must hold to say where a run stands.
    POSITION = ("step", "epoch", "batches_in_epoch")

    def record(self, result: StepResult) -> None:
        """Take a step's outcome into the state. A step taken advances the step and joins
        the spike window. A window skipped as non-finite or spiking counts toward
        train.max_consecutive_skips. An fp16 overflow is the loss scaler's own business:
        the loss and gradients passed our checks, so it ends a run of skips, and the
        window is retried under the same step number."""
        self.seconds += result.seconds
        if result.skip is None:
            self.step += 1
            self.trained += result.count
            self.spikes.accept(result.loss)
        if result.skip in (Skip.NONFINITE, Skip.SPIKE):
            self.skips_in_a_row += 1
        else:
            self.skips_in_a_row = 0

    def next_epoch(self) -> None:
        self.epoch, self.batches_in_epoch = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "skips_in_a_row": self.skips_in_a_row,
            "recent_losses": self.spikes.recent,
            "nonfinite_weights": self.nonfinite_weights,
            "trained": self.trained,
            "seconds": self.seconds,
            **({"run": self.identity} if self.identity else {}),
        }

    def load_state_dict(self, saved: dict) -> None:
        """From train_state.json; fields added since a checkpoint was written count from 0."""
        self.step, self.epoch, self.batches_in_epoch = (saved[k] for k in self.POSITION)
        self.skips_in_a_row = saved.get("skips_in_a_row", 0)
        self.nonfinite_weights = saved.get("nonfinite_weights", 0)
        self.trained, self.seconds = saved.get("trained", 0), saved.get("seconds", 0.0)
        self.spikes = SpikeGuard(self.spikes.factor, self.spikes.window, saved.get("recent_losses"))

"""The per-step agreement: before every optimizer step, each process draws its window of
micro-batches and all processes exchange one small report in a single collective. From
it every process learns the same facts (the global count the loss is averaged over, how
many micro-batches to run, whether any process was signalled or met bad data) and so
takes the same decision without another collective.

A process may draw fewer micro-batches than the others, or none, at the end of the data;
it then runs empty batches up to the most any process has (`Window.micro_batches`), so
that sharded models (ZeRO-3, FSDP), whose forward passes are collectives, see the same
number of passes on every process. When no process drew anything, the pass is over.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from enum import Enum
from itertools import islice

import torch

from ..errors import DataError
from ..observe.throughput import document_sizes


class Outcome(Enum):
    """How drawing a window (or a whole run) ended."""

    STEP = "a window to train on"
    EXHAUSTED = "every process has run out of data: the pass is over"
    STOPPED = "a process was signalled to stop: all stop before the step"
    DATA_FAULT = "a process met bad data drawing its batches: all stop before the step"
    FINISHED = "every step of the run was trained"


@dataclass
class Report:
    """What one process tells the others before a step. All fields travel in one tensor
    through one all-gather; the agreement reads their sums and maxima."""

    batches: int = 0  # micro-batches this process drew
    count: int = 0  # the objective's loss units in them (trained tokens for SFT)
    input_tokens: int = 0  # non-padding tokens
    squared_lengths: int = 0  # sum of squared document lengths (attention FLOPs)
    signal: int = 0  # the stop signal this process received, 0 for none
    fault: int = 0  # 1 if drawing the batches met bad data
    due: int = 0  # 1 if this process's clock says a checkpoint is due (checkpoint.every_minutes)

    def exchange(self, accelerator) -> tuple[Report, Report]:
        """(sum, max) of every field over all processes."""
        local = torch.tensor(dataclasses.astuple(self), device=accelerator.device)
        every = accelerator.gather(local[None]).view(-1, len(local))  # one row per process
        total, most = every.sum(0).tolist(), every.max(0).values.tolist()
        return Report(*total), Report(*most)


@dataclass
class Window:
    """One optimizer step's micro-batches on this process, with what all processes agreed."""

    outcome: Outcome
    batches: list = field(default_factory=list)  # this process's micro-batches
    micro_steps: int = 0  # the most micro-batches any process has; every process runs this many
    count: int = 0  # loss units in the global batch (all micro-batches, all processes)
    input_tokens: int = 0  # all processes
    squared_lengths: int = 0  # all processes
    started: float = 0.0  # time.perf_counter() when drawing began
    data_wait: float = 0.0  # seconds this process waited for its batches
    signal: int = 0  # with STOPPED: the signal agreed on
    fault: str = ""  # with DATA_FAULT: this process's error, if it met the bad data
    checkpoint_due: bool = False  # some process's clock says a checkpoint is due after this step

    def micro_batches(self, empty: dict) -> list[dict]:
        """This process's micro-batches, then `empty` up to micro_steps."""
        return self.batches + [empty] * (self.micro_steps - len(self.batches))


def fault_message(e: DataError) -> str:
    """The DataError's own line; from a DataLoader worker it arrives wrapped in a traceback."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    last = lines[-1] if lines else type(e).__name__
    return last.split("DataError: ", 1)[1] if "Original Traceback" in str(e) and "DataError: " in last else last


def draw_window(batches, size: int, accelerator, count, stop=None, beat=None, due: bool = False) -> Window:
    """Draw up to `size` micro-batches from the iterator `batches` and agree with the
    other processes on what happens next (the Window's outcome).

    `count(batch)` gives a micro-batch's loss units (the objective's count). With `stop`
    (a StopRequest), a signal to any process, or bad data met while drawing (a
    DataError, which is otherwise raised), ends the iteration on every process alike.
    `beat(where)` marks progress for the watchdog. `due`: this process's clock says a
    checkpoint is due; if any process's does, every Window says so (checkpoint_due)."""
    if beat is not None:
        beat("fetching batches and agreeing on the next step with the other processes")
    started = time.perf_counter()
    fault = ""
    try:
        drawn = list(islice(batches, size))
    except DataError as e:  # a bad streamed row or an unreadable file
        if stop is None:
            raise
        fault, drawn = fault_message(e), []
    wait = time.perf_counter() - started
    sizes = [document_sizes(b) for b in drawn]
    report = Report(
        batches=len(drawn),
        count=sum(count(b) for b in drawn),
        input_tokens=sum(s for s, _ in sizes),
        squared_lengths=sum(q for _, q in sizes),
        signal=stop.signum if stop is not None else 0,
        fault=int(bool(fault)),
        due=int(due),
    )
    total, most = report.exchange(accelerator)
    window = Window(Outcome.STEP, started=started, data_wait=wait, checkpoint_due=bool(most.due))
    if most.fault:
        window.outcome, window.fault = Outcome.DATA_FAULT, fault
    elif most.signal:
        window.outcome, window.signal = Outcome.STOPPED, most.signal
    elif total.batches == 0:
        window.outcome = Outcome.EXHAUSTED
    else:
        window.batches, window.micro_steps, window.count = drawn, most.batches, total.count
        window.input_tokens, window.squared_lengths = total.input_tokens, total.squared_lengths
    return window

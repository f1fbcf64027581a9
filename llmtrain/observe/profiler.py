"""train.profile_steps: a torch.profiler trace of a few optimizer steps on every process.

Written to output_dir/profile/steps-A-B/:
- rankN.<ns>.pt.trace.json, one per process, from PyTorch's `tensorboard_trace_handler`:
  a Chrome trace that opens in Perfetto (ui.perfetto.dev) or chrome://tracing, and that
  TensorBoard's profiler plugin (torch-tb-profiler) reads with `tensorboard --logdir
  output_dir/profile`;
- rankN-top-ops.txt, the operators that took the most time, which the main process also
  prints;
- on CUDA, rankN-memory.pickle, a snapshot of every allocation during the steps (with
  stacks), for pytorch.org/memory_viz.

Recording starts before the window of the first step is drawn (data loading shows) and
stops after the last step is taken; a step retried after an fp16 overflow is recorded
under its number, and an evaluation or checkpoint due inside the range is recorded too.
Profiling slows what it records, and only that. A run that fails inside the range writes
no trace (its error is what matters); one that stops or ends there writes what it has.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from .. import safefs

TOP_OPS = 20


class StepProfiler:
    def __init__(self, steps: tuple[int, int] | None, output_dir: str, accelerator, beat=None):
        self.steps, self.accelerator, self.beat = steps, accelerator, beat
        self.cuda = accelerator.device.type == "cuda"
        self.dir = Path(output_dir) / "profile" / (f"steps-{steps[0]}-{steps[1]}" if steps else "")
        self.profile: torch.profiler.profile | None = None

    def before(self, step: int) -> None:
        """Called before drawing the window of optimizer step `step` (counted from 1)."""
        if self.steps is None or self.profile is not None or not self.steps[0] <= step <= self.steps[1]:
            return
        # Every process writes its trace here: a link in place of either directory is refused.
        safefs.make_dir(self.dir.parent)
        safefs.make_dir(self.dir)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            # Private but documented ("Understanding CUDA Memory Usage"): the allocator's
            # history, with stacks, for the memory snapshot.
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.profile = torch.profiler.profile(
            activities=activities,
            record_shapes=True,
            profile_memory=True,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(self.dir), worker_name=f"rank{self.accelerator.process_index}"
            ),
        )
        self.profile.start()

    def after(self, steps_taken: int) -> None:
        """Called after each step (taken or skipped) with the number of steps taken."""
        if self.profile is not None and steps_taken >= self.steps[1]:
            self.close()

    def close(self) -> None:
        """Stop and write what was recorded (also when the run ends inside the range)."""
        if self.profile is None:
            return
        profile, self.profile = self.profile, None
        if self.beat is not None:
            self.beat(f"writing the profile of steps {self.steps[0]}-{self.steps[1]}")
        profile.stop()  # writes the trace through on_trace_ready
        rank = self.accelerator.process_index
        if self.cuda:
            # torch opens the name it is given and follows a link there: it writes a new
            # temporary file, renamed over the name (a rename replaces a link).
            tmp = safefs.new_temp(self.dir, f".tmp-rank{rank}-memory-")
            torch.cuda.memory._dump_snapshot(str(tmp))
            os.replace(tmp, self.dir / f"rank{rank}-memory.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = profile.key_averages().table(sort_by=sort, row_limit=TOP_OPS)
        safefs.write_text(self.dir / f"rank{rank}-top-ops.txt", table + "\n")
        self.accelerator.print(
            f"profile of steps {self.steps[0]}-{self.steps[1]} written to {self.dir}; "
            f"top operators on this process:\n{table}"
        )

    def abandon(self) -> None:
        """Stop recording without writing anything: the run is failing, and its error,
        not a trace, is what the user must see."""
        if self.profile is None:
            return
        profile, self.profile = self.profile, None
        profile.on_trace_ready = None
        with contextlib.suppress(Exception):
            profile.stop()
            if self.cuda:
                torch.cuda.memory._record_memory_history(enabled=None)

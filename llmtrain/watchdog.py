"""A bounded wait for the other processes.

When one rank dies or hangs, the others block in their next collective, by default for
as long as the backend's timeout (30 minutes for gloo, and some code paths never time
out). The watchdog is a thread that ends its process with an error naming the rank once
training has made no progress for `train.hang_timeout_s`; the launcher then stops the
remaining processes, so the whole job exits non-zero within the bound. The training loop
marks progress at every micro-batch, evaluation batch and checkpoint.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_HUNG = 3


class Watchdog:
    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s, self.rank = timeout_s, rank
        self.where = "starting"
        self.last = time.monotonic()
        self._done = threading.Event()

    def start(self) -> Watchdog:
        if self.timeout_s > 0:
            threading.Thread(target=self._watch, name="llmtrain-watchdog", daemon=True).start()
        return self

    def beat(self, where: str) -> None:
        """Progress: `where` says what the process is about to do (shown if it never returns)."""
        self.where, self.last = where, time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(5.0, self.timeout_s / 4)):
            if time.monotonic() - self.last > self.timeout_s:
                print(f"error: rank {self.rank}: no progress for {self.timeout_s:g} s, stuck at {self.where}; "
                      "another process has probably died or hung (its log names it). The newest complete "
                      "checkpoint is intact: resume with checkpoint.resume=auto. If a step, evaluation or "
                      "checkpoint write really takes this long, raise train.hang_timeout_s.",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_HUNG)

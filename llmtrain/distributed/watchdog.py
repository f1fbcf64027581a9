"""A bounded wait for the other processes.

When one rank dies or hangs, the others block in their next collective, by default for
as long as the backend's timeout (30 minutes for gloo, and some code paths never time
out). The watchdog is a thread that ends its process with an error once training has made
no progress for `train.hang_timeout_s`; the launcher then stops the remaining processes,
so the whole job exits non-zero within the bound. The training loop marks progress at
every micro-batch, evaluation batch and checkpoint.

So that the error can name the rank at fault, not only the one that gave up waiting, each
watchdog posts its rank's state (where it is, since when) to the process group's key-value
store every few seconds. A rank that died or froze stops posting; one stuck in its own
work keeps posting but makes no progress. Both are named in the error.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

EXIT_HUNG = 3


def default_store():
    """The process group's key-value store (hosted by the launcher under torchrun, so it
    outlives a dead rank), or None outside a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError):
        return None


class Watchdog:
    def __init__(self, timeout_s: float, rank: int, world: int = 1, store=None):
        self.timeout_s, self.rank, self.world, self.store = timeout_s, rank, world, store
        self.where = "starting"
        self.last = time.monotonic()
        self.poll_s = min(2.0, timeout_s / 8)  # how often it checks, and posts its state
        self.silent_s = max(3 * self.poll_s, min(timeout_s / 2, 30.0))  # no post for this long: dead or frozen
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        if self.timeout_s > 0:
            if self.store is None and self.world > 1:
                self.store = default_store()
            self._post(0.0)
            self._thread = threading.Thread(target=self._watch, name="llmtrain-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self, where: str) -> None:
        """Progress: `where` says what the process is about to do (shown if it never returns)."""
        self.where, self.last = where, time.monotonic()

    def stop(self) -> None:
        """End the thread and wait for it. It must not be inside a store call when the
        process group is torn down or the interpreter exits: the C++ store client then
        aborts the process (SIGABRT, "terminate called without an active exception"),
        which the launcher reports as a failed run."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 10)  # a store call blocked on a dead launcher: go on
            self._thread = None
        self.store = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            idle = time.monotonic() - self.last
            self._post(idle)
            if idle > self.timeout_s:
                others = self._others(idle)
                if self.world == 1:  # nothing else to wait for: the work itself (a reward function, a read) hangs
                    blame = "the only process, so what runs there did not return"
                elif others:
                    blame = "; ".join(others)
                else:
                    blame = "another process has probably died or hung (its log names it)"
                print(
                    f"error: rank {self.rank}: no progress for {self.timeout_s:g} s, stuck at {self.where}; "
                    f"{blame}. The newest complete checkpoint is intact: run the same command again to resume from it. "
                    "If a step, evaluation or checkpoint write really takes this long, raise train.hang_timeout_s.",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_HUNG)

    def _post(self, idle: float) -> None:
        if self.store is None:
            return
        try:
            self.store.set(
                f"llmtrain/watchdog/{self.rank}",
                json.dumps({"where": self.where, "idle_s": idle, "posted": time.time()}),
            )
        except Exception:  # the store is gone (the launcher is tearing down): stop posting
            self.store = None

    def _others(self, idle: float) -> list[str]:
        """What the other ranks last posted, for those that stopped posting (dead or
        frozen) or that have made no progress for longer than this rank, somewhere else
        (ranks that wait where this one waits are fellow victims, and are not named)."""
        if self.store is None:
            return []
        found, now = [], time.time()
        try:
            for rank in range(self.world):
                key = f"llmtrain/watchdog/{rank}"
                if rank == self.rank or not self.store.check([key]):
                    continue
                state = json.loads(self.store.get(key))
                silent = now - state["posted"]
                if silent > self.silent_s:
                    found.append(
                        f"rank {rank} stopped reporting {silent:.0f} s ago (dead or frozen), last at {state['where']}"
                    )
                elif state["idle_s"] + silent > idle and state["where"] != self.where:
                    found.append(
                        f"rank {rank} is alive but has made no progress for "
                        f"{state['idle_s'] + silent:.0f} s, at {state['where']}"
                    )
        except Exception:  # the store is gone: say what was found
            return found
        return found

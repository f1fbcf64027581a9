"""Stopping on request. While a run trains (`StopRequest.deferred`), a signal only sets a
flag; at the next step boundary every process learns whether any of them was asked (the
flag rides on the per-step agreement, `window.draw_window`), so all stop at the same
step, write one complete checkpoint, and exit. Outside it (loading, tokenizing, the
samples after the export) there is nothing to save, and a signal stops the process at
once with the same exit code; one that comes while final/ is written takes effect when it
is complete.

SIGUSR1 is the preemption warning (Slurm's `--signal=USR1@<seconds>`): exit 0, so a
launcher with --max_restarts does not restart the workers, and the batch script
requeues the job. SIGTERM, SIGINT and SIGHUP (a closed terminal or SSH session, which the
launcher passes on) exit 128+signal; a second Ctrl-C while training interrupts at once. A
SIGHUP the process started with ignored (nohup) stays ignored.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager

GRACEFUL = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def exit_code(signum: int) -> int:
    return 0 if signum == signal.SIGUSR1 else 128 + signum


class StopRequest:
    def __init__(self):
        self.signum = 0  # the signal this process received (0: none)
        self.agreed = 0  # the signal all processes agreed to stop on (0: keep going)
        self.deferring = False

    def install(self) -> StopRequest:
        for sig in GRACEFUL:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: the user asked for the run to outlive the terminal
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if not self.deferring:
            self._exit(signum, "")
        self.signum = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    @contextmanager
    def deferred(self, after: str = "final/ is saved"):
        """Signals only set the flag inside; one that came is acted on when it ends (the
        loop ends at the agreed step itself, before this)."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.signum and not self.agreed:
            self._exit(self.signum, after)

    def _exit(self, signum: int, after: str) -> None:
        name = signal.Signals(signum).name
        print(f"stopped on {name}{'; ' + after if after else ''}", file=sys.stderr, flush=True)
        raise SystemExit(exit_code(signum))

    @property
    def name(self) -> str:
        return signal.Signals(self.agreed).name if self.agreed else ""

    def exit_code(self) -> int:
        return exit_code(self.agreed)

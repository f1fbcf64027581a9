"""Stopping on request. A signal only sets a flag; at the next step boundary every process
learns whether any of them was asked (the flag rides on the per-step agreement,
`window.draw_window`), so all stop at the same step, write one complete checkpoint, and
exit.

SIGUSR1 is the preemption warning (Slurm's `--signal=USR1@<seconds>`): exit 0, so a
launcher with --max_restarts does not restart the workers, and the batch script
requeues the job. SIGTERM and SIGINT exit 128+signal after the checkpoint; a second
Ctrl-C interrupts at once.
"""

from __future__ import annotations

import signal

GRACEFUL = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self):
        self.signum = 0  # the signal this process received (0: none)
        self.agreed = 0  # the signal all processes agreed to stop on (0: keep going)

    def install(self) -> StopRequest:
        for sig in GRACEFUL:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    @property
    def name(self) -> str:
        return signal.Signals(self.agreed).name if self.agreed else ""

    def exit_code(self) -> int:
        return 0 if self.agreed == signal.SIGUSR1 else 128 + self.agreed

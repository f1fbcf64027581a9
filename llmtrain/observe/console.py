"""stdout and stderr that a closed reader cannot break.

A run's output often goes through a pipe (`... 2>&1 | tee log`) or to a terminal that can
go away (a closed SSH session). Ctrl-C reaches `tee` too, which exits; Python ignores
SIGPIPE, so the run's next write to the pipe raises BrokenPipeError (a write to a terminal
that hung up raises EIO), from wherever it happens: a progress bar, an eval line, the stop
message, a library's warning. Before this guard, that write ended the run on its way to
the checkpoint of its stop.

`survive_closed_streams` (every recipe and `llmtrain plan`, before anything else) puts a
`Survivor` in place of sys.stdout and sys.stderr, and in every logging handler that already
held one of them. When a write or flush through it fails because its reader is gone, it
points the file descriptor at /dev/null (os.dup2): from then on every writer of that
descriptor succeeds and writes nothing, those that kept the original stream object (its
buffer is flushed to /dev/null at exit), C code and child processes alike. The run goes
on and saves as it would have; what it writes to the other stream, if that one still has
a reader, says once that output was lost. metrics.jsonl keeps the numbers either way.

Only a reader that is gone is forgiven (EPIPE, EIO); any other failed write (a full disk
under a redirected log) still raises.

The training progress bar (`progress`) is a tqdm bar on a terminal; elsewhere (a log file,
a pipe, a Slurm job's output), where every redraw would be a frame in the log, it is a line
every PROGRESS_LINE_S seconds and one at the last step.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import time

GONE = (errno.EPIPE, errno.EIO)  # the pipe's reader exited; the terminal hung up


class Survivor:
    """A text stream (sys.stdout or sys.stderr) whose writes and flushes stop raising
    once its reader is gone; every other attribute is the wrapped stream's."""

    def __init__(self, stream, name: str):
        self._stream = stream
        self._name = name
        self.lost = False  # the reader went away: writes go nowhere

    def write(self, text: str) -> int:
        if not self.lost:
            self._guarded(self._stream.write, text)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.lost:
            self._guarded(self._stream.flush)

    def _guarded(self, call, *args) -> None:
        try:
            call(*args)
        except OSError as e:
            if e.errno not in GONE:
                raise
            self._lose(e)

    def _lose(self, e: OSError) -> None:
        self.lost = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            fd = self._stream.fileno()
            sink = os.open(os.devnull, os.O_WRONLY)
            os.dup2(sink, fd)
            os.close(sink)
        other = sys.stderr if self._name == "stdout" else sys.stdout
        if isinstance(other, Survivor) and not other.lost:
            why = "a pipe whose reader exited" if e.errno == errno.EPIPE else "a terminal that hung up"
            other.write(
                f"note: {self._name} is gone ({why}); the run goes on and saves as it would, printing no more to "
                f"{self._name} (metrics.jsonl has the numbers)\n"
            )
            other.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_closed_streams() -> None:
    """Put a Survivor in place of sys.stdout and sys.stderr (once), and in the logging
    handlers that already write to either (a library's handler made at import)."""
    swapped = {}
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, Survivor):
            continue
        survivor = Survivor(stream, name)
        setattr(sys, name, survivor)
        swapped[id(stream)] = survivor
    if not swapped:
        return
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):  # a PlaceHolder has none
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in swapped:
                survivor = handler.stream = swapped[id(handler.stream)]
                if getattr(vars(handler).get("flush"), "__self__", None) is survivor._stream:
                    handler.flush = survivor.flush  # transformers' handler flushes sys.stderr itself


PROGRESS_LINE_S = 30  # how often a progress line is written where stderr is no terminal


def progress(total: int, initial: int, desc: str):
    """The training progress display: update(n), set_postfix(dict), close(), as tqdm's."""
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)
    return ProgressLines(total, initial, desc)


class ProgressLines:
    """A progress bar's figures as a line on stderr every `every_s` seconds and at the last
    step: 'train: step 120/600 (20%), 0.42 s/step, 3:21 left; loss 1.2345, lr 3.00e-03, ...'."""

    def __init__(self, total: int, initial: int, desc: str, every_s: float = PROGRESS_LINE_S):
        self.total, self.n, self.desc, self.every_s = total, initial, desc, every_s
        self.first, self.start = initial, time.monotonic()
        self.last = self.start
        self.postfix: dict = {}

    def set_postfix(self, values: dict, refresh: bool = True) -> None:
        self.postfix = dict(values)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every_s or self.n >= self.total:
            self.last = now
            print(self.line(now), file=sys.stderr, flush=True)

    def line(self, now: float) -> str:
        per_step = (now - self.start) / max(1, self.n - self.first)
        left = int(per_step * max(0, self.total - self.n))
        figures = ", ".join(f"{k} {v}" for k, v in self.postfix.items())
        return (
            f"{self.desc}: step {self.n}/{self.total} ({self.n / max(1, self.total):.0%}), {per_step:.2f} s/step, "
            f"{left // 60}:{left % 60:02d} left" + (f"; {figures}" if figures else "")
        )

    def close(self) -> None:
        pass

"""Locks a process holds until it lets go or ends: an flock on a file that says who holds it.

Used for output_dir (one run per directory, output/rundir.py) and for the demo's cache (one
builder at a time, demo.py). The kernel releases an flock however its process ends (a
crash, SIGKILL), so a lock is never stale on one machine: a lock file a dead process left
is taken as if it were free. On a shared filesystem that supports locks (NFSv4, Lustre
mounted with flock) it also holds across nodes, and the server releases the lock of a
crashed node when its lease runs out. The file is opened with O_NOFOLLOW: a link planted
in its place is refused, never followed. The lock belongs to the open file: a second `take`
of the same file by the same process waits for the first like any other process would.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from . import safefs


class Busy(Exception):
    """Another process holds the lock; `holder` is what its file says ('pid N on host, started ...')."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


class NoLocks(Exception):
    """The filesystem does not support locks; `reason` says why (the error's text)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def take(path: Path, wait: Callable[[str], None] | None = None, what: str = "output_dir") -> IO:
    """Hold the lock at `path` (created if absent) and return its open file: the lock lasts
    until that file is closed, at most until the process ends. Held by another process:
    without `wait`, raise Busy; with it, call wait(holder) once and block until it is free
    (a signal's handler can still end the wait). A filesystem without locks raises NoLocks;
    a file that cannot be opened, the OSError (a planted link: safefs.link_error, naming
    `what`, the setting that chose the place)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError:
        if path.is_symlink():
            raise safefs.link_error(path, what) from None
        raise
    handle = os.fdopen(fd, "r+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(handle)
            if wait is None:
                raise Busy(holder) from None
            wait(holder)
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as e:
            raise NoLocks(e.strerror or str(e)) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
    except BaseException:
        handle.close()
        raise
    return handle


def read_holder(handle: IO) -> str:
    """What a held lock file says of its holder; a holder that has just taken it writes
    that a moment later, so an empty file is read again for up to half a second."""
    for _ in range(10):
        handle.seek(0)
        if holder := handle.read().strip():
            return holder
        time.sleep(0.05)
    return "its holder"

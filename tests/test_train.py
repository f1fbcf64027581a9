"""train.keep_writing: a checkpoint or final/ that cannot be written (a full disk) is
tried again while the trained steps are still in memory, not given up at the first fault."""

import errno
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmtrain import train
from llmtrain.core.state import TrainState
from llmtrain.distributed.stop import StopRequest
from llmtrain.output.checkpoint import WriteFailed, complete_checkpoints, save


@pytest.fixture
def run():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    stop = StopRequest().install()
    printed = []
    fake = SimpleNamespace(
        cfg=SimpleNamespace(checkpoint=SimpleNamespace(write_retry_s=1800)),
        stop=stop,
        watchdog=SimpleNamespace(beat=lambda where: None),
        accelerator=SimpleNamespace(print=lambda line, **kw: printed.append(line)),
        printed=printed,
    )
    with stop.deferred():
        yield fake
        stop.agreed = stop.signum  # as the loop does once it acted on one
    for sig, handler in saved.items():
        signal.signal(sig, handler)


class Clock:
    """train.time for keep_writing: sleeping moves the clock, and takes no time."""

    def __init__(self, on_sleep=None):
        self.now, self.slept, self.on_sleep = 0.0, [], on_sleep

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.now += s
        self.slept.append(s)
        if self.on_sleep is not None:
            self.on_sleep(len(self.slept))


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(train, "time", fake)
    return fake


def full_disk(times: int, result="written"):
    calls = []

    def write():
        calls.append(1)
        if len(calls) <= times:
            raise WriteFailed("export: writing .tmp-final failed", "No space left on device", Path("/out"))
        return result

    return write, calls


def test_a_write_that_fails_is_tried_again_once_a_minute_until_it_succeeds(run, clock):
    write, calls = full_disk(2)
    assert train.keep_writing(run, "final/", write) == "written"
    assert len(calls) == 3 and sum(clock.slept) == 120
    assert run.printed[0] == (
        "final/: writing it failed (No space left on device); the steps trained since the last complete checkpoint "
        "are in memory only. Free space in /out (or fix its permissions): trying again in 60 s (see "
        "checkpoint.write_retry_s); a stop signal (Ctrl-C) gives up"
    )


@pytest.mark.parametrize(("limit", "tries", "waited"), [(0, 1, 0), (90, 3, 90)])
def test_after_write_retry_s_the_write_failure_is_the_error(run, clock, limit, tries, waited):
    run.cfg.checkpoint.write_retry_s = limit
    write, calls = full_disk(10)
    with pytest.raises(WriteFailed, match="export: writing .tmp-final failed"):
        train.keep_writing(run, "final/", write)
    assert len(calls) == tries and sum(clock.slept) == waited


def test_the_time_writes_take_counts_against_write_retry_s(run, clock):
    """A checkpoint that takes 5 minutes to fail is not tried 30 times over 3 hours."""
    write, calls = full_disk(100)

    def slow():
        clock.now += 300
        return write()

    run.cfg.checkpoint.write_retry_s = 1800
    with pytest.raises(WriteFailed):
        train.keep_writing(run, "the checkpoint of step 9", slow)
    assert len(calls) == 6 and clock.now <= 1800 + 300


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_while_waiting_gives_up(run, clock, capfd, sig):
    clock.on_sleep = lambda n: n == 5 and os.kill(os.getpid(), sig)
    write, calls = full_disk(10)
    with pytest.raises(WriteFailed):
        train.keep_writing(run, "final/", write)
    assert len(calls) == 1 and len(clock.slept) == 5
    assert capfd.readouterr().err == f"{sig.name}: giving up on final/\n"


def test_a_stop_signal_that_came_before_the_write_does_not_give_it_up(run, clock):
    """The stop checkpoint of a Ctrl-C: the disk is full, so it waits for space as any write."""
    os.kill(os.getpid(), signal.SIGINT)
    write, calls = full_disk(1)
    assert train.keep_writing(run, "the checkpoint of step 4", write) == "written" and len(calls) == 2


def test_ctrl_c_while_writing_neither_interrupts_nor_gives_up(run, clock):
    """Ctrl-C reaches a one-process launcher too, whose exit sends SIGTERM mid-write."""
    calls = []

    def write():
        calls.append(1)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C would raise KeyboardInterrupt outside
        if len(calls) == 1:
            raise WriteFailed("checkpoint failed", "No space left on device", Path("/out"))
        return "written"

    assert train.keep_writing(run, "final/", write) == "written" and len(calls) == 2


class FullOnce:
    """One process whose first save_state finds the disk full, half way through."""

    is_main_process = True
    num_processes = 1

    def __init__(self):
        self.tries = 0

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        self.tries += 1
        (Path(path) / "model.safetensors").write_bytes(b"weights" if self.tries > 1 else b"half")
        if self.tries == 1:
            raise OSError(errno.ENOSPC, "No space left on device")


def test_a_checkpoint_whose_first_write_filled_the_disk_is_written_whole_on_the_next(run, clock, tmp_path):
    accelerator = FullOnce()

    def write():
        return save(accelerator, str(tmp_path), TrainState(step=4), {}, "", keep_last=2)

    path = train.keep_writing(run, "the checkpoint of step 4", write)
    assert complete_checkpoints(str(tmp_path)) == [(4, path)] and accelerator.tries == 2
    assert (path / "model.safetensors").read_bytes() == b"weights"
    assert f"Free space in {tmp_path}/checkpoints" in run.printed[0]

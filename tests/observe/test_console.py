"""stdout and stderr survive a reader that is gone (llmtrain.observe.console): writes and
flushes stop raising, the descriptor then writes to /dev/null for every writer, the other
stream says so once, and a logging handler made before the guard writes through it too.
Off a terminal the training progress is a line now and then, not a bar's frames."""

import io
import logging
import os
import stat
import sys

import pytest

from llmtrain.observe import console
from llmtrain.observe.console import ProgressLines, Survivor, survive_closed_streams


def closed_pipe() -> io.TextIOWrapper:
    """A text stream over a pipe whose reader has exited (as `| tee` after Ctrl-C)."""
    read, write = os.pipe()
    os.close(read)
    return io.TextIOWrapper(os.fdopen(write, "wb"), line_buffering=True)


def test_a_write_to_a_closed_pipe_is_dropped_and_the_descriptor_sinks_to_devnull(monkeypatch):
    stream = closed_pipe()
    said = io.StringIO()
    monkeypatch.setattr(sys, "stderr", Survivor(said, "stderr"))
    survivor = Survivor(stream, "stdout")
    monkeypatch.setattr(sys, "stdout", survivor)
    with pytest.raises(BrokenPipeError):  # what every print met before
        stream.write("step 5: eval_loss 1.0\n")
    print("step 5: eval_loss 1.0", flush=True)
    print("stopped on SIGINT after step 5", flush=True)
    assert survivor.lost
    assert stat.S_ISCHR(os.fstat(stream.fileno()).st_mode)  # /dev/null now: the stream's own flush succeeds
    stream.write("more\n")
    stream.flush()
    assert said.getvalue().count("note: stdout is gone (a pipe whose reader exited)") == 1
    stream.close()


def test_other_write_errors_still_raise():
    class Full(io.StringIO):
        def write(self, text):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        Survivor(Full(), "stdout").write("x")


def test_a_logging_handler_made_before_the_guard_writes_through_it(monkeypatch):
    stream = closed_pipe()
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", stream)
    handler = logging.StreamHandler()  # as a library makes one at import: it holds sys.stderr
    handler.flush = stream.flush  # and transformers' flushes that stream itself
    logger = logging.getLogger("llmtrain-test-console")
    logger.addHandler(handler)
    try:
        survive_closed_streams()
        assert handler.stream is sys.stderr and isinstance(sys.stderr, Survivor)

        def fail(record):
            raise AssertionError("the handler met the closed pipe")

        monkeypatch.setattr(handler, "handleError", fail)
        logger.warning("a library's warning")
        logger.warning("and another")
        assert sys.stderr.lost
    finally:
        logger.removeHandler(handler)
        stream.close()


def test_off_a_terminal_progress_is_a_line_every_so_often_and_at_the_end(monkeypatch, capsys):
    clock = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    bar = ProgressLines(total=10, initial=2, desc="train", every_s=30)
    for _ in range(8):
        clock[0] += 5  # 5 s a step: a line after 30 s (step 8), then the last step's
        bar.set_postfix({"loss": "1.2345"})
        bar.update(1)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "train: step 8/10 (80%), 5.00 s/step, 0:10 left; loss 1.2345",
        "train: step 10/10 (100%), 5.00 s/step, 0:00 left; loss 1.2345",
    ]

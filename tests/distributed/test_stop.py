"""Signals: while a run trains they only set a flag (the loop stops at an agreed step);
outside, where there is nothing to save, they stop the process at once with the
documented exit code; one that comes while final/ is written waits for it."""

import os
import signal

import pytest

from llmtrain.distributed.stop import StopRequest


@pytest.fixture
def stop():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield StopRequest().install()
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGUSR1, 0), (signal.SIGHUP, 129)]
)
def test_outside_training_a_signal_stops_at_once(stop, capsys, sig, code):
    with pytest.raises(SystemExit) as exited:
        os.kill(os.getpid(), sig)
    assert exited.value.code == code
    assert capsys.readouterr().err == f"stopped on {signal.Signals(sig).name}\n"


def test_while_training_a_signal_only_sets_the_flag(stop):
    with stop.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM  # still running: the loop decides where to stop
        stop.agreed = stop.signum  # the loop stopped at an agreed step and checkpointed
    assert stop.exit_code() == 143


def test_a_signal_the_loop_did_not_act_on_stops_the_process_once_final_is_written(stop, capsys):
    written = []
    with pytest.raises(SystemExit) as exited, stop.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        written.append("final/")  # the export goes on to the end
    assert written == ["final/"] and exited.value.code == 143
    assert capsys.readouterr().err == "stopped on SIGTERM; final/ is saved\n"


def test_a_second_ctrl_c_while_training_interrupts_at_once(stop):
    with pytest.raises(KeyboardInterrupt), stop.deferred():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)


def test_a_hangup_ignored_at_start_stays_ignored():
    """nohup starts the process with SIGHUP ignored, so that the run outlives the terminal."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        StopRequest().install()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) != saved[signal.SIGTERM]
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)

"""Signals: while a run trains they only set a flag (the loop stops at an agreed step);
outside, where there is nothing to save, they stop the process at once with the
documented exit code; one that comes while final/ is written waits for it."""

import os
import signal

import pytest

from llmtrain.distributed.stop import StopRequest, launched_by_launcher


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


def test_the_first_request_names_the_stop(stop):
    """Ctrl-C reaches accelerate's one-process launcher too, whose exit then sends SIGTERM."""
    with stop.deferred():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGINT
        stop.agreed = stop.signum


def test_a_second_ctrl_c_while_training_interrupts_at_once(stop):
    with pytest.raises(KeyboardInterrupt), stop.deferred():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)


def test_while_a_checkpoint_is_written_a_second_ctrl_c_waits_for_it(stop, capfd):
    """Cut there, the steps since the last complete checkpoint would be lost (with
    checkpoint.every_steps=0, the whole run). Once it is written, Ctrl-C interrupts again."""
    written = []
    with pytest.raises(KeyboardInterrupt), stop.deferred():
        os.kill(os.getpid(), signal.SIGINT)  # the loop stops at an agreed step and checkpoints it
        with stop.saving("the checkpoint of step 3"):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            written.append("step-3")
        told = "SIGINT: writing the checkpoint of step 3 first\nSIGTERM: writing the checkpoint of step 3 first\n"
        assert capfd.readouterr().err == told
        os.kill(os.getpid(), signal.SIGINT)
    assert written == ["step-3"] and stop.signum == signal.SIGINT


def test_a_ctrl_c_that_comes_while_final_is_written_arms_the_next_one(stop):
    with pytest.raises(KeyboardInterrupt), stop.deferred():
        with stop.saving("final/"):
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT
        os.kill(os.getpid(), signal.SIGINT)


def test_a_signal_left_pending_by_a_pass_before_training_stops_every_process(stop, capsys):
    """deferred(after=None) leaves a signal to an agreement; `agree` is that agreement for a
    pass before training (one process here: its own signal)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    with stop.deferred(after=None):
        stop.agree(accelerator, " before training; nothing was trained yet")  # nothing came: goes on
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(SystemExit) as exited:
            stop.agree(accelerator, " before training; nothing was trained yet")
    assert exited.value.code == 0 and stop.agreed == signal.SIGUSR1
    assert capsys.readouterr().out == "stopped on SIGUSR1 before training; nothing was trained yet\n"


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


@pytest.mark.parametrize(
    ("argv", "launcher"),
    [
        (["/venv/bin/python3", "/venv/bin/accelerate", "launch", "--num_processes", "1", "train.py"], True),
        (["python", "-m", "accelerate.commands.launch", "train.py"], True),
        (["/venv/bin/python3", "/venv/bin/accelerate-launch", "train.py"], True),  # its own command
        (["python", "-m", "accelerate.commands.accelerate_cli", "launch", "train.py"], True),
        (["/venv/bin/python3", "/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"], True),
        (["python", "-u", "-m", "torch.distributed.run", "train.py"], True),
        (["python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "train.py"], True),
        (["-bash"], False),
        (["nohup", "python", "train.py"], False),
        (["/venv/bin/python3", "/venv/bin/accelerate", "env"], False),
        (["python", "train.py", "launch"], False),
        (["/usr/sbin/slurmstepd"], False),
        (["python", "sweep.py", "--via", "torchrun"], False),  # an argument, not the program
        (["python3.11", "-W", "ignore", "-m", "torch.distributed.run", "train.py"], True),  # -W takes a value
    ],
)
def test_launchers_are_told_by_their_command_line(argv, launcher):
    assert launched_by_launcher(argv) is launcher


# A stand-in parent: started as `python <dir>/<name> [launch]`, it starts the child below,
# records its pid and waits, as a launcher waits for its workers.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.stdin.read()], stderr=open("err", "w"))
open("pid", "w").write(str(child.pid))
time.sleep(600)
"""
CHILD = """
import time
from llmtrain.distributed.stop import StopRequest, launched_by_launcher
StopRequest().install()
open("ready", "w").close()
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("name", "env", "stops"),
    [
        ("accelerate launch", {}, True),  # accelerate's one-process launcher, told by its command line
        ("agent", {"TORCHELASTIC_RUN_ID": "none"}, True),  # torchrun's agent, told by the worker's environment
        ("shell", {}, False),  # `nohup python train.py &` outlives the shell that started it
    ],
)
def test_a_process_stops_when_the_launcher_that_started_it_dies(tmp_path, name, env, stops):
    import subprocess
    import sys
    import time

    import psutil

    script, *args = name.split()
    (tmp_path / script).write_text(PARENT)
    parent = subprocess.Popen(
        [sys.executable, script, *args], cwd=tmp_path, stdin=subprocess.PIPE, env={**os.environ, **env}, text=True
    )
    parent.stdin.write(CHILD)
    parent.stdin.close()
    deadline = time.time() + 60
    while not (tmp_path / "ready").exists() and time.time() < deadline:
        time.sleep(0.05)
    child = psutil.Process(int((tmp_path / "pid").read_text()))
    parent.kill()  # SIGKILL: it can pass nothing on
    parent.wait()
    try:
        gone, _ = psutil.wait_procs([child], timeout=10 if stops else 2)
        assert bool(gone) is stops
        if stops:
            assert (tmp_path / "err").read_text() == "stopped on SIGTERM\n"
    finally:
        if child.is_running():
            child.kill()


SLEEPER = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
STARTER = f"""
import signal, sys
from llmtrain.distributed.stop import run_child
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as a run's stop handler: an exception in the wait
run_child([sys.executable, "-c", {SLEEPER!r}], {{}})
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_child_does_not_outlive_its_parent(sig):
    """run_child's child (the demo's SFT build) ends with the process that started it:
    killed (the kernel sends it SIGTERM), or stopped by a signal that ends its wait in an
    exception (it is stopped and waited for before the exception goes on)."""
    import subprocess
    import sys

    import psutil

    parent = subprocess.Popen(
        [sys.executable, "-c", STARTER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        parent.send_signal(sig)
        parent.wait(timeout=30)
        assert not psutil.wait_procs([child], timeout=10)[1]  # gone
    finally:
        parent.kill()
    if sig == signal.SIGTERM:
        assert parent.returncode == 143 and "Traceback" not in parent.stderr.read()

"""User errors are reported once per job: by the main process, and by another process
only when the error was its alone; no process exits before the main one has reported."""

from types import SimpleNamespace

import pytest

from llmtrain import cli
from llmtrain.errors import DataError
from tests.support.runs import ROOT, free_port


class Store:
    def __init__(self):
        self.keys = {}

    def set(self, key, value):
        self.keys[key] = value

    def check(self, keys):
        return all(k in self.keys for k in keys)


@pytest.fixture
def store(monkeypatch):
    s = Store()
    monkeypatch.setattr(cli, "default_store", lambda: s)
    monkeypatch.setattr(cli, "REPORT_WAIT_S", 0.2)
    return s


def state(rank: int, world: int = 2):
    return SimpleNamespace(num_processes=world, is_main_process=rank == 0)


def test_the_main_process_reports_and_says_so(store, capsys):
    cli.report_once(DataError("data.train: a.jsonl line 3: bad\nsecond problem"), state(0))
    assert capsys.readouterr().err == "error: data.train: a.jsonl line 3: bad\nerror: second problem\n"
    assert store.check(["llmtrain/error-reported/0"])


def test_another_process_stays_silent_once_the_main_one_has_reported(store, capsys):
    store.set("llmtrain/error-reported/0", "1")
    cli.report_once(DataError("data.train: bad"), state(1))
    assert capsys.readouterr().err == ""


def test_an_error_of_another_process_alone_is_reported_by_it(store, capsys):
    cli.report_once(DataError("data.train: bad"), state(1))  # the main process never reports
    assert capsys.readouterr().err == "error: data.train: bad\n"


def test_one_process_reports_without_a_store(capsys):
    with pytest.raises(SystemExit) as exited, cli.user_errors(state(0, world=1)):
        raise DataError("data.train: bad")
    assert exited.value.code == 2 and capsys.readouterr().err == "error: data.train: bad\n"


ENDING = """
import atexit, sys
from pathlib import Path
from llmtrain.cli import run_cli

out = Path(sys.argv[1])


class Finalized:  # its __del__ runs only if the interpreter tears itself down
    def __init__(self, path):
        self.path, self.open = path, open  # builtins are gone by then

    def __del__(self):
        self.open(self.path, "w").close()


def main(argv):
    global rank, keep
    import torch.distributed as dist

    rank = dist.get_rank()
    keep = Finalized(str(out / f"finalized-{rank}"))
    atexit.register(lambda: (out / f"atexit-{rank}").write_text(""))
    print(f"rank {rank} done", end="")  # unflushed
    if argv[0] != "0":
        sys.exit(int(argv[0]))


run_cli(main, sys.argv[2:])
"""


@pytest.mark.parametrize("code", [0, 3])
def test_a_multi_process_run_ends_with_its_code_without_interpreter_teardown(tmp_path, code):
    """After the run, a gloo worker thread may still free a collective's Python tensors;
    during interpreter teardown that aborts the process (see cli.exit_now). So a
    multi-process run exits right after its atexit handlers, with its own code."""
    import subprocess
    import sys

    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    env = {k: v for k, v in __import__("os").environ.items() if k != "ACCELERATE_USE_CPU"}
    env["ACCELERATE_USE_CPU"] = "1"
    proc = subprocess.run(
        [*cmd, str(script), str(tmp_path), str(code)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert (proc.returncode == 0) == (code == 0), proc.stderr[-3000:]
    if code:
        assert f"exitcode  : {code}" in proc.stderr
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout
    made = sorted(p.name for p in tmp_path.iterdir() if p.name != "ending.py")
    assert made == ["atexit-0", "atexit-1"]


LEAVING = """
import os, sys, time
from llmtrain.cli import run_cli


def main(argv):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(0.5)
        print("rank 1 ends", flush=True)
        os._exit(5)  # as a crash or a kill would end it
    dist.broadcast_object_list([None], src=1)


run_cli(main, sys.argv[1:])
"""


def test_a_process_whose_peer_left_says_so_in_one_line(tmp_path):
    """Rank 0 waits in a collective on rank 1, which dies: gloo's error is no fault of rank
    0's, and its traceback would bury what rank 1 printed. One line points there."""
    import os
    import subprocess
    import sys

    script = tmp_path / "leaving.py"
    script.write_text(LEAVING)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    env = dict(os.environ, ACCELERATE_USE_CPU="1")
    proc = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode != 0 and "rank 1 ends" in proc.stdout
    assert "error: rank 0: another process left the job (gloo: Connection closed by peer); its own output says why" in (
        proc.stderr
    ), proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr


def test_processes_that_formed_no_group_report_on_rank_0_alone(monkeypatch, capsys):
    """Launched as 2 processes without a process group, each is a world of one: rank 0
    reports; rank 1 waits, silent, for the launcher to stop it."""
    import signal

    from llmtrain.distributed.stop import GRACEFUL

    monkeypatch.setattr(cli, "REPORT_WAIT_S", 0.2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    saved = {sig: signal.getsignal(sig) for sig in GRACEFUL}  # rank 1 hands them back to the default action
    try:
        for rank, printed in (("0", "error: launch: no group\n"), ("1", "")):
            monkeypatch.setenv("RANK", rank)
            with pytest.raises(SystemExit) as exited, cli.user_errors(state(0, world=1)):
                raise DataError("launch: no group")
            assert exited.value.code == 2 and capsys.readouterr().err == printed
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_signal_while_a_finished_one_process_run_exits_is_ignored(tmp_path):
    """A second Ctrl-C just after final/ was saved interrupted the atexit handlers
    ('Exception ignored in atexit callback ... KeyboardInterrupt'), exit 130."""
    import subprocess
    import sys

    script = (
        "import atexit, os, signal\n"
        "from llmtrain.cli import run_cli\n"
        "from llmtrain.distributed.stop import StopRequest\n"
        "def main(argv):\n"
        "    StopRequest().install()\n"
        "    atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), print('flushed', flush=True)))\n"
        "run_cli(main, [])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "flushed\n", proc.stderr
    assert "Exception ignored" not in proc.stderr and "stopped on" not in proc.stderr


@pytest.mark.parametrize("code", [0, 2])
def test_a_one_process_run_exits_though_a_thread_it_started_never_ends(code):
    """A thread that is no daemon (a reward function's) kept the process alive after final/,
    with the stop signals ignored: only SIGKILL ended it. Python waits THREAD_WAIT_S for it,
    then the run exits with its own code, naming the thread, after its atexit handlers."""
    import subprocess
    import sys

    script = (
        "import atexit, sys, threading, time\n"
        "from llmtrain import cli\n"
        "from llmtrain.errors import DataError\n"
        "cli.THREAD_WAIT_S = 0.5\n"
        "def main(argv):\n"
        "    threading.Thread(target=time.sleep, args=(600,), name='poller').start()\n"
        "    atexit.register(lambda: print('atexit ran', flush=True))\n"
        f"    if {code}:\n"
        "        raise DataError('data.train: bad')\n"
        "cli.run_cli(main, [])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == code and proc.stdout == "atexit ran\n", proc.stderr
    assert "warning: thread(s) 'poller' still running 0.5 s after the run was over" in proc.stderr

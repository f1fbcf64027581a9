"""The fork server (tests/support/forkserver.py) runs a command as `python` would: the same output,
exit code, working directory, environment, signal handlers and exit handlers."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.support.runs import FORKS, ROOT, free_port

SCRIPT = """\
import atexit, json, os, signal, sys
# Each line is one write: two workers share the launcher's pipe, and print's separate write
# of the newline lets their lines interleave.
atexit.register(lambda: sys.stdout.write("atexit ran\\n"))
sys.stdout.write(json.dumps({
    "name": __name__,
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "marker": os.environ.get("FORK_TEST_MARKER"),
    "handlers": {s: str(signal.getsignal(getattr(signal, s))) for s in ("SIGINT", "SIGTERM", "SIGPIPE", "SIGUSR1")},
}) + "\\n")
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "code":
    sys.exit(3)
if how == "message":
    sys.exit("a message")
if how == "raise":
    raise ValueError("boom")
if how == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("fork") / "script.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("how", ["ok", "code", "message", "raise", "signal"])
def test_a_forked_command_is_what_python_gives(script, cache_env, how):
    env = dict(cache_env, FORK_TEST_MARKER="x")  # read at run time, so the server may serve it
    forked = FORKS.run([str(script), how], env, script.parent, 60)
    real = subprocess.run(
        [sys.executable, str(script), how], env=env, cwd=script.parent, capture_output=True, text=True, timeout=60
    )
    assert (
        forked.returncode == real.returncode == {"ok": 0, "code": 3, "message": 1, "raise": 1}.get(how, -signal.SIGTERM)
    )
    assert forked.stdout == real.stdout
    first = json.loads(real.stdout.splitlines()[0])
    assert first["marker"] == "x" and first["name"] == "__main__" and first["cwd"] == str(script.parent)
    if how in ("ok", "code", "message", "raise"):
        assert real.stdout.endswith("atexit ran\n")
    # The traceback's first frames differ (runpy's, the server's); its last line may not.
    assert forked.stderr.splitlines()[0] == real.stderr.splitlines()[0] == "to stderr"
    assert forked.stderr.splitlines()[-1] == real.stderr.splitlines()[-1]


def test_a_command_is_forked_only_in_the_servers_environment(cache_env):
    assert FORKS.serves(cache_env) == (os.environ.get("LLMTRAIN_TEST_NO_FORK") != "1")
    assert FORKS.serves(dict(cache_env, ACCELERATE_USE_CPU="1")) == FORKS.serves(cache_env)  # read at run time
    assert not FORKS.serves(dict(cache_env, HF_HOME="/elsewhere"))
    assert not FORKS.serves({k: v for k, v in cache_env.items() if k != "HF_DATASETS_CACHE"})


def test_a_launchs_forked_workers_are_what_torchrun_starts(script, cache_env):
    """Workers are forked from the launcher, which has torchrun's signal handlers and exit
    handlers: each must start as a fresh `python -u script` would."""
    env = dict(cache_env, ACCELERATE_USE_CPU="1", FORK_TEST_MARKER="x")
    launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    forked = FORKS.run([*launch, str(script), "ok"], env, script.parent, 120)
    launch[-1] = str(free_port())
    real = subprocess.run(
        [sys.executable, *launch, str(script), "ok"],
        env=env,
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert forked.returncode == real.returncode == 0, forked.stderr + real.stderr
    assert sorted(forked.stdout.splitlines()) == sorted(real.stdout.splitlines())
    assert forked.stdout.count("atexit ran") == 2


def test_a_child_starts_with_the_handlers_exec_would_leave_it(tmp_path):
    """fresh_handlers, in a process started with SIGINT ignored (a job in the background) that
    then handles SIGINT and SIGTERM itself (as torchrun's agent does) and ignores SIGHUP: a
    handled signal goes back to Python's start-up handler, an ignored one stays ignored."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import signal, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests' / 'support')!r})\n"
        "from forkserver import fresh_handlers\n"
        "ignored_at_start = signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
        "for sig in (signal.SIGINT, signal.SIGTERM):\n"
        "    signal.signal(sig, lambda *_: None)\n"
        "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "fresh_handlers()\n"
        "handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]\n"
        "print(ignored_at_start, *handlers, sep='|')\n"
    )
    out = subprocess.run(
        [sys.executable, str(probe)],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    ignored_at_start, sigint, sigterm, sighup = out.stdout.strip().split("|")
    assert ignored_at_start == "True"
    assert (sigint, sigterm, sighup) == (
        str(signal.default_int_handler),
        str(signal.SIG_DFL),
        str(signal.SIG_IGN),
    )

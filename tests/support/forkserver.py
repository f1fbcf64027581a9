"""A fork server for the suite's commands: `python recipes/finetune.py ...` and
`python -m accelerate.commands.launch ... recipes/<recipe>.py ...`.

Most of a tiny test run is Python importing torch, transformers, datasets and accelerate
(about 8 of its 10 seconds on 2 cores, paid again by every process of a launch). This
server imports them once, then forks a fresh child for each command, which runs the script
or module as its `__main__` exactly as `python` would: its own process and session,
arguments, environment, working directory, stdout and stderr files, signal handlers, exit
code, atexit handlers. A launch runs accelerate's launcher and torchrun's agent for real
(rendezvous, worker environments, failure handling, exit codes); only the agent's
`Popen([python, "-u", script, ...])` of each worker becomes a fork of the launcher running
the script the same way (`_popen` below).

What a child cannot change is what was read at import time, so tests.support.runs sends a
command here only when its environment is the one the server started with, less the
variables that are read at run time (`ForkServer.serves`); anything else is a real
subprocess.

Protocol (one JSON object a line): the client sends {"argv", "env", "cwd", "out", "err"};
the server answers {"pid": child} when the child starts and {"rc": exit code, or minus the
signal that ended it} when it ends.
"""

import atexit
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback

# What the commands import (and the model class the suite's tiny models use, which
# transformers imports lazily); nothing here may start a thread or touch a device.
PRELOAD = (
    "torch",
    "accelerate",
    "datasets",
    "peft",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "llmtrain.cli",
    "llmtrain.preference.pairs",
    "llmtrain.plan",
    "llmtrain.recipe",
    "llmtrain.train",
)


def preload() -> list:
    """Import PRELOAD; returns what the imports registered with atexit, so a worker forked
    from a launcher, which registered its own, runs at exit what a fresh worker would:
    these and what it registers itself."""
    registered, register = [], atexit.register

    def recording(func, *args, **kwargs):
        registered.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    atexit.register = recording
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    finally:
        atexit.register = register
    return registered


IMPORTED_EXITS = preload()

# What Python sets at start-up where the signal is not ignored already (SIGINT raises
# KeyboardInterrupt; SIGPIPE and SIGXFSZ are ignored); every other signal keeps what exec left.
STARTUP = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN, signal.SIGXFSZ: signal.SIG_IGN}


def fresh_handlers() -> None:
    """Give this (forked) process the handlers `python` would start with if this process
    exec'd it: exec keeps an ignored signal ignored and resets a handled one to its default
    (torchrun's agent handles SIGINT, so its workers start with KeyboardInterrupt even where
    the launch itself ignores SIGINT, as a job started in the background does), then Python
    sets STARTUP."""
    for sig in signal.valid_signals():
        current = signal.getsignal(sig)
        if current is None:  # not set from Python: left as it is
            continue
        fresh = signal.SIG_IGN if current is signal.SIG_IGN else STARTUP.get(sig, signal.SIG_DFL)
        if current is not fresh:
            signal.signal(sig, fresh)


class Forked:
    """What torchrun's agent uses of the Popen of a worker, for a forked one."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _popen(handler, args: tuple, env: dict):
    """SubprocessHandler._popen for a worker `python -u script ...` (or `-u -m module`):
    fork this launcher, which has the stack imported, and run the script there."""
    argv = list(args[1:])
    if argv[:1] != ["-u"]:
        raise RuntimeError(f"forkserver: unexpected worker command {args}")
    pid = os.fork()
    if pid == 0:
        os.setsid()  # as Popen(start_new_session=True)
        atexit._clear()
        for func, fargs, kwargs in IMPORTED_EXITS:
            atexit.register(func, *fargs, **kwargs)
        files = (handler._stdout, handler._stderr)
        for fd, f in zip((1, 2), files):
            if f is not None:
                os.dup2(f.fileno(), fd)
        become(argv[1:], env, os.getcwd(), unbuffered=True)
    return Forked(pid)


def become(argv: list[str], env: dict, cwd: str, unbuffered: bool = False) -> None:
    """Run `python *argv` in this process and exit with its code: never returns."""
    code = 1
    try:
        fresh_handlers()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env:  # read by torch when it was imported here
            sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
        if unbuffered or env.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        if argv[0] == "-m":
            if argv[1] in ("accelerate.commands.launch", "torch.distributed.run"):
                from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

                subprocess_handler.SubprocessHandler._popen = _popen
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], cwd
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # What the interpreter does on its way out: wait for threads, run atexit, flush.
        try:
            import threading

            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def child(request: dict) -> None:
    """Become the requested command in its own session, with stdin from /dev/null and
    stdout and stderr to the requested files: never returns."""
    os.setsid()  # as the suite's subprocesses, so a kill takes its workers too
    write = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    for fd, name, mode in ((0, os.devnull, os.O_RDONLY), (1, request["out"], write), (2, request["err"], write)):
        target = os.open(name, mode, 0o600)
        os.dup2(target, fd)
        os.close(target)
    become(request["argv"], request["env"], request["cwd"])


def main() -> None:
    out = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        print(json.dumps({"pid": pid}), file=out, flush=True)
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        print(json.dumps({"rc": rc}), file=out, flush=True)


if __name__ == "__main__":
    main()

"""Stopping on request. While a run trains (`StopRequest.deferred`), a signal only sets a
flag; at the next step boundary every process learns whether any of them was asked (the
flag rides on the per-step agreement, `window.draw_window`), so all stop at the same
step, write one complete checkpoint, and exit. Outside it (loading, tokenizing, the
samples after the export) there is nothing to save, and a signal stops the process at
once with the same exit code; one that comes while final/ is written takes effect when it
is complete.

SIGUSR1 is the preemption warning (Slurm's `--signal=USR1@<seconds>`): exit 0, so a
launcher with --max_restarts does not restart the workers, and the batch script
requeues the job. SIGTERM, SIGINT and SIGHUP (a closed terminal or SSH session, which the
launcher passes on) exit 128+signal; a second Ctrl-C while training interrupts at once, but
not while a checkpoint or final/ is written (`StopRequest.saving`): cut there, the steps
since the last complete checkpoint would be lost. A SIGHUP the process started with
ignored (nohup) stays ignored.

A process started by a launcher (`accelerate launch`, torchrun, DeepSpeed's) also stops,
as on SIGTERM, when that launcher dies (`stop_with_launcher`): otherwise a launcher that
is killed, or that exits on a signal it does not pass on (accelerate's one-process
launcher passes on none; torchrun not SIGUSR1), leaves its workers training on with no one
waiting for them, holding the output directory and the devices.

No process llmtrain starts outlives it (`run_child`: the demo's SFT build): the kernel
stops the child when its parent dies, however it dies, and a parent that stops on a signal
or an error stops the child first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from contextlib import contextmanager

GRACEFUL = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def exit_code(signum: int) -> int:
    return 0 if signum == signal.SIGUSR1 else 128 + signum


class StopRequest:
    def __init__(self):
        self.signum = 0  # the signal this process received (0: none)
        self.agreed = 0  # the signal all processes agreed to stop on (0: keep going)
        self.deferring = False
        self.note = ""  # inside StopRequest.saving: what a signal is told (a checkpoint is written first)
        self.requests = 0  # signals received so far

    def install(self) -> StopRequest:
        for sig in GRACEFUL:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: the user asked for the run to outlive the terminal
            signal.signal(sig, self._handle)
        stop_with_launcher()
        return self

    def _handle(self, signum, frame) -> None:
        if not self.deferring:
            self._exit(signum, "")
        # The first request names the stop: Ctrl-C reaches the one-process launcher too,
        # whose exit then sends SIGTERM (stop_with_launcher) while this one is saving.
        self.signum = self.signum or signum
        self.requests += 1
        if self.note:  # os.write: print's buffered stream may be mid-write in this thread
            with contextlib.suppress(OSError):  # stderr gone (`| tee` exited on the same Ctrl-C): still save
                os.write(2, f"{signal.Signals(signum).name}: {self.note}\n".encode())
        elif signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    @contextmanager
    def saving(self, what: str):
        """While `what` (a checkpoint, final/) is written, every signal only sets the flag,
        a second Ctrl-C too: the write holds the steps since the last complete checkpoint,
        and before the first checkpoint the whole run."""
        if signal.getsignal(signal.SIGINT) == signal.default_int_handler and self.signum == signal.SIGINT:
            signal.signal(signal.SIGINT, self._handle)  # a first Ctrl-C re-armed the default: ours again
        self.note = f"writing {what} first"
        try:
            yield
        finally:
            self.note = ""
            if self.signum == signal.SIGINT and signal.getsignal(signal.SIGINT) == self._handle:
                signal.signal(signal.SIGINT, signal.default_int_handler)  # a further Ctrl-C interrupts again

    @contextmanager
    def deferred(self, after: str | None = "final/ is saved"):
        """Signals only set the flag inside; one that came is acted on when it ends (the
        loop ends at the agreed step itself, before this). With after=None it is left to
        the training loop's first agreement (a pass before training: the reference
        log-probs)."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if after is not None and self.signum and not self.agreed:
            self._exit(self.signum, after)

    def agree(self, accelerator, tail: str) -> None:
        """A collective: if any process was signalled, every process stops alike (on the
        first signalled one's signal), printing 'stopped on SIG...' + `tail`. Where no
        training step agrees on it: before training, once final/ is saved."""
        from accelerate.utils import gather_object

        signals = [s for s in gather_object([self.signum]) if s]
        if signals:
            self.stop_all(signals[0], accelerator, tail)

    def stop_all(self, signum: int, accelerator, tail: str) -> None:
        """Every process agreed to stop on `signum` where there is nothing to save: exit."""
        self.agreed = signum
        accelerator.print(f"stopped on {self.name}{tail}")
        raise SystemExit(self.exit_code())

    def _exit(self, signum: int, after: str) -> None:
        name = signal.Signals(signum).name
        print(f"stopped on {name}{'; ' + after if after else ''}", file=sys.stderr, flush=True)
        raise SystemExit(exit_code(signum))

    @property
    def name(self) -> str:
        return signal.Signals(self.agreed).name if self.agreed else ""

    def exit_code(self) -> int:
        return exit_code(self.agreed)


# The launchers' names on their command lines: torchrun and its modules, `python -m
# accelerate.commands.launch` and its `accelerate-launch` command, DeepSpeed's per-node
# launcher; and `accelerate` (the command or its module) when followed by `launch`.
LAUNCHERS = {"torchrun", "torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch"}
LAUNCHERS |= {"accelerate-launch", "deepspeed.launcher.launch"}
ACCELERATE = ("accelerate", "accelerate.commands.accelerate_cli")


def launched_by_launcher(parent_argv: list[str]) -> bool:
    """Whether a parent process with this command line is a launcher that started this
    process as one of its workers. Only the program is read (the command, or under a Python
    interpreter its script or `-m` module), never its arguments: `python sweep.py --via
    torchrun` is no launcher."""
    words = [os.path.basename(a) for a in parent_argv]
    at = 0
    if words and words[0].startswith("python"):  # the interpreter's options, then -m module or a script
        at = 1
        while at < len(words) and words[at].startswith("-") and words[at] != "-m":
            at += 2 if words[at] in ("-W", "-X") else 1  # these two take the next word as their value
        at += at < len(words) and words[at] == "-m"
    if at >= len(words):
        return False
    program, rest = words[at], words[at + 1 :]
    return program in LAUNCHERS or (program in ACCELERATE and rest[:1] == ["launch"])


def launcher_parent() -> int | None:
    """The process id of the launcher that started this process, or None when the parent is
    no launcher (a shell, `nohup`) or cannot be read. torchrun's agent says it started the
    process (TORCHELASTIC_RUN_ID in its environment); accelerate's one-process launcher says
    nothing, so its command line is read (Linux)."""
    parent = os.getppid()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return parent
    argv = proc_strings(parent, "cmdline")
    return parent if argv is not None and launched_by_launcher(argv) else None


def launcher_strings() -> tuple[list[str], list[str]] | None:
    """The command line and environment of this process's parent when it is a launcher and
    both can be read (Linux); None otherwise. What a worker reads to tell the launcher's own
    choices (its OMP_NUM_THREADS, its MASTER_ADDR) from the user's, passed on."""
    parent = os.getppid()
    argv, environ = proc_strings(parent, "cmdline"), proc_strings(parent, "environ")
    if argv is None or environ is None or not launched_by_launcher(argv):
        return None
    return argv, environ


# Bytes read of /proc/<pid>/<name>: a command line's program comes first, so its start is
# enough; an environment is read whole (Linux caps arguments and environment together at a
# quarter of the stack limit, 6 MiB at most) or not at all.
PROC_LIMITS = {"cmdline": 1 << 16, "environ": 6 << 20}


def proc_strings(pid: int, name: str) -> list[str] | None:
    """/proc/<pid>/<name> (cmdline: its start; environ: whole) as NUL-separated strings, or
    None where it cannot be read (another system, a process gone, an environment longer than
    its limit)."""
    limit = PROC_LIMITS[name]
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return None
    if len(data) > limit:
        if name == "environ":
            return None
        data = data[:limit]
    return data.decode(errors="replace").split("\0")


def stop_with_launcher() -> None:
    """Ask the kernel for SIGTERM when the launcher that started this process dies
    (Linux's PR_SET_PDEATHSIG). Written by hand because neither Accelerate's launchers nor
    torchrun ask for it. Only under a launcher: a process run as `nohup python ...` must
    outlive the shell that started it (`launcher_parent`)."""
    if not sys.platform.startswith("linux"):
        return
    parent = launcher_parent()
    if parent is None or not signal_on_parent_death(signal.SIGTERM):
        return
    if os.getppid() != parent:  # the launcher died before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)


def signal_on_parent_death(signum: int) -> bool:
    """Ask the kernel to send this process `signum` when its parent dies (Linux's
    PR_SET_PDEATHSIG; strictly, when the parent's thread that started it ends). Whether
    the request took hold."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    return prctl(pr_set_pdeathsig, signum, 0, 0, 0) == 0


# The interpreter run_child's children start in (this one's, as it was when llmtrain loaded),
# and what it runs: ask for SIGTERM on the parent's death, make sure the parent is still the
# one that asked (it may have died first), then become the command.
INTERPRETER = sys.executable
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(128 + signal.SIGTERM)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


# How long a child told to stop (SIGTERM) may take to end before it is killed: a recipe
# finishes its step and writes a checkpoint first.
CHILD_STOP_S = 60


def run_child(argv: list[str], env: dict) -> int:
    """Run `argv` to its end and return its exit code, as subprocess.run does, in a process
    that does not outlive this one: on Linux the kernel sends it SIGTERM when this process
    dies, SIGKILL included (asked for before `argv` starts, so no moment is left uncovered);
    and when the wait here ends in an exception (a stop signal's SystemExit, Ctrl-C's
    KeyboardInterrupt, anything), the child is sent SIGTERM, given CHILD_STOP_S to end,
    then killed, before the exception goes on."""
    import subprocess

    if sys.platform.startswith("linux"):
        # The request is made by a small interpreter that then becomes `argv` (the request
        # survives exec), not by a preexec_fn between fork and exec: Python code there can
        # deadlock in a process with threads (a lock another thread held at the fork).
        argv = [INTERPRETER, "-c", DIE_WITH_PARENT, str(os.getpid()), *argv]
    child = subprocess.Popen(argv, env=env)
    try:
        return child.wait()
    except BaseException:
        child.terminate()
        try:
            child.wait(timeout=CHILD_STOP_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        raise

"""Command-line plumbing shared by the recipes: arguments and one-line errors."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from .config import Config, load_config
from .config.validate import DEMO_NAMES
from .distributed.launch import process_group_backend
from .distributed.stop import GRACEFUL
from .distributed.watchdog import default_store
from .errors import UserError
from .observe.console import survive_closed_streams
from .observe.quiet import quiet_bars_off_terminal


def parse_args(
    argv: list[str] | None,
    default_config: Path | None,
    description: str = "",
    schema: type = Config,
    sections: dict[str, str] | None = None,
):
    """Returns (config, parsed arguments); the config is a `schema` (a method's tree), and
    `sections` names the other methods' sections (config.load_config)."""
    parser = argparse.ArgumentParser(
        description=description, epilog="Overrides: dotted key=value pairs, e.g. train.lr=2e-5 data.packing=true"
    )
    parser.add_argument("--config", type=Path, default=default_config, help=f"YAML config (default: {default_config})")
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="tokenize the data into the cache and exit (run once before a multi-node job)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = parser.parse_intermixed_args(argv)  # options may come after overrides
    cfg = load_config(args.config, args.overrides, schema, sections)
    own = [cfg.model.name_or_path, *cfg.data.names()]
    if args.config == default_config and any(name not in DEMO_NAMES for name in own):
        from accelerate import PartialState

        PartialState().print(
            f"note: no --config given, so the demo's settings from {default_config} apply "
            f"(train.lr={cfg.train.lr}, train.epochs={cfg.train.epochs}, ...), which suit its tiny "
            "model; pass --config with your own YAML (see recipes/configs/) for a real run"
        )
    return cfg, args


@contextmanager
def user_errors(state=None):
    """Turn a user error (errors.UserError) into one 'error: ...' line per problem on
    stderr, printed once per job (see `report_once`), and exit 2. Anything else is a bug
    and keeps its traceback. The recipes and `llmtrain plan` both report through here."""
    try:
        yield
    except UserError as e:
        report_once(e, state)
        sys.exit(2)


# How long another process waits for the main process to report an error it met too.
REPORT_WAIT_S = 5.0


def report_once(e: UserError, state=None) -> None:
    """Print the error's lines once for the whole job. Most user errors happen on every
    process alike; the main process prints them. Another process must not exit first (the
    launcher would then stop the main process before it printed), so it waits until the
    main process says, through the process group's store, that it has reported; if that
    does not come (the error was this process's alone), it prints the error itself."""
    lines = "".join(f"error: {line}\n" for line in str(e).splitlines())
    tell_launcher(lines)  # every process that met it: the launcher's report shows it for each
    multi = state is not None and state.num_processes > 1
    if not multi and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and os.environ.get("RANK", "0") != "0":
        # Started as one of several processes that formed no group (no GPU and no
        # ACCELERATE_USE_CPU=1): there is no store, and each met the same error, which
        # rank 0 prints. Wait for the launcher to stop this one once rank 0 has exited, and
        # let its signal end this process without a word.
        stop_signals(signal.SIG_DFL)
        time.sleep(REPORT_WAIT_S)
        return
    store = default_store() if multi else None
    key = f"llmtrain/error-reported/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if not multi or state.is_main_process or store is None:
        if not multi or state.is_main_process:
            sys.stderr.write(lines)
            sys.stderr.flush()
        if store is not None:
            with contextlib.suppress(Exception):  # the store is gone: nothing waits on it then
                store.set(key, "1")
        return
    deadline = time.monotonic() + REPORT_WAIT_S
    with contextlib.suppress(Exception):
        while time.monotonic() < deadline:
            if store.check([key]):
                return
            time.sleep(0.05)
    sys.stderr.write(lines)
    sys.stderr.flush()


def tell_launcher(lines: str) -> None:
    """Write a user error where torchrun's failure report reads a failed process's own
    account (the file TORCHELASTIC_ERROR_FILE names; torchrun sets it for each process), so
    that the report's "Root Cause" shows the error instead of a link to torch's docs. The
    report itself cannot be left out: torchrun (torch.distributed.launcher.api.launch_agent)
    raises ChildFailedError whenever a process exits with a code other than 0, and
    `accelerate launch` lets it end in a traceback; exit 0, the one quiet path, would tell
    the shell, Slurm and CI that a refused run succeeded."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(json.dumps({"message": lines.rstrip(), "timestamp": int(time.time())}))


def run_cli(main, argv: list[str] | None = None) -> None:
    """Run main(argv), reporting user errors once (see `user_errors`); a closed stdout or
    stderr (`| tee` gone, a terminal hung up) ends no run (`survive_closed_streams`)."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    survive_closed_streams()
    quiet_bars_off_terminal()

    # Set up the process group first, so only one process reports. It must honour
    # ACCELERATE_USE_CPU exactly as Accelerator() will, or CPU runs launched with
    # --num_processes 2 would silently become two unrelated single-process runs.
    backend = process_group_backend()
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"), **({"backend": backend} if backend else {}))
    if state.num_processes == 1:
        try:
            with user_errors(state):
                main(argv)
        finally:  # the run is over: a stop signal now would only interrupt the exit (atexit handlers)
            stop_signals(signal.SIG_IGN)
        return
    try:
        with user_errors(state):
            main(argv)
    except SystemExit as e:  # a user error (2) or a stop signal (128 + signal)
        exit_now(e.code)
    except RuntimeError as e:
        said = [words for words in PEER_LEFT if words in str(e)]
        if not said:
            raise
        # Another process ended (a crash, a signal, the OOM killer) while this one waited on
        # it in a collective: its own output says why, which this process's traceback of the
        # collective would bury.
        sys.stderr.write(
            f"error: rank {state.process_index}: another process left the job (gloo: {said[0]}); its own output "
            "says why\n"
        )
        exit_now(1)
    exit_now(0)


# gloo's words when the process at the other end of a collective has exited.
PEER_LEFT = ("Connection closed by peer", "Connection reset by peer")


def exit_now(code) -> None:
    """End a multi-process run without the interpreter's own shutdown.

    Written by hand because neither torch nor Accelerate guards against it: a gloo worker
    thread can free a finished collective a moment after the collective returns, and that
    frees tensors Python created, which takes the GIL. If the main thread is shutting the
    interpreter down by then, Python 3.11 ends the thread inside a C++ destructor and the
    process aborts ("terminate called without an active exception", exit -6) after the
    run has finished and written everything. So, once the run is over: the atexit handlers
    run as usual (weakref finalizers, logging), the output is flushed, and the process
    exits with its code, leaving the interpreter's teardown out. A stop signal that comes
    meanwhile (the launcher stops the other processes once one has exited) is ignored: the
    run is over and this code is its outcome, where the stop handler would report a stop
    from inside an atexit handler."""
    import atexit

    stop_signals(signal.SIG_IGN)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message") prints it and exits 1
        sys.stderr.write(f"{code}\n")
        sys.stderr.flush()
        code = 1
    os._exit(code)


def stop_signals(action) -> None:
    """Give SIGUSR1/SIGTERM/SIGINT/SIGHUP (stop.GRACEFUL) `action`: SIG_IGN once a run is
    over and exits, SIG_DFL for a process that waits to be stopped."""
    for sig in GRACEFUL:
        signal.signal(sig, action)

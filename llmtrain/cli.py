"""Command-line plumbing shared by the recipes and `llmtrain plan`: arguments, where a run's
settings come from (`run_config`: a demo's only for a run of the demo), one-line errors."""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import json
import math
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

from .config import Config, load_config
from .config.foreign import FOREIGN
from .config.load import key_for, key_type, overridden, read_config, set_values
from .config.validate import named
from .distributed.launch import process_group_backend
from .distributed.stop import GRACEFUL
from .distributed.watchdog import default_store
from .errors import ConfigError, UserError
from .observe.console import survive_closed_streams
from .observe.quiet import quiet_bars_off_terminal


def parse_args(argv: list[str] | None, method, demo: Path | None, sections: dict[str, str] | None = None):
    """Returns (config, parsed arguments) for a run of `method` (a core/method.Method): its
    tree from --config and the overrides, or from its `demo` YAML, as `run_config` decides;
    `sections` names the other methods' sections (config.load_config)."""
    parser = argparse.ArgumentParser(
        description=method.description,
        epilog="Overrides: dotted key=value pairs, e.g. train.lr=2e-5 data.packing=true",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"YAML config (default: the demo's, {demo}, when no model or data of your own is named)",
    )
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="tokenize the data into the cache and exit (run once before a multi-node job)",
    )
    parser.add_argument(
        "--restartable",
        action="store_true",
        help="each start may be a restart of the same job (recipes/slurm/job.sh passes it): checkpoint.resume=none "
        "is refused, since a restart must continue from the job's own checkpoints",
    )
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args, unknown = parser.parse_known_intermixed_args(argv)  # options may come after overrides
    refuse_options(unknown, sys.argv[1:] if argv is None else argv, parser, method.schema)

    def say(line: str) -> None:  # once per job, from the main process
        from accelerate import PartialState

        PartialState().print(line)

    cfg = run_config(args.config, args.overrides, method, demo, sections, say)
    if args.restartable:
        check_restartable(cfg, "recipes/slurm/job.sh: a requeue or a worker restart")
    elif restarts := int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0):  # torchrun gives every worker it
        check_restartable(cfg, f"accelerate launch --max_restarts {restarts}: a worker restart")
    return cfg, args


# The keys that name what a run trains and evaluates: a command line that names a model or
# data set of its own in any of them (anything but a `demo:` name) runs without the demo.
OWN_KEYS = ("model.name_or_path", "data.train", "data.eval")
# The keys that make a run the user's once resolved: the model it trains and its data.
TRAINED_KEYS = ("model.name_or_path", "data.train")


def run_config(
    config: Path | None,
    overrides: list[str],
    method,
    demo: Path | None,
    sections: dict[str, str] | None = None,
    say=print,
) -> Config:
    """The config a run of `method` trains with; the recipes and `llmtrain plan` both read
    their settings through here. A run whose model or data is the user's never takes a
    demo's data or output_dir, nor its tuned settings without a note (docs/config.md, "Where a
    run's settings come from"):
    - no --config: the method's `demo` YAML is the base only while the command line names no
      model or data of its own (OWN_KEYS); once it names one, the base is the schema's
      defaults (output_dir runs/<method>), as if given an empty YAML, and a note says so;
    - a demo config (one that trains a `demo:` model or data) given with --config to a run
      of the user's model or data: each `demo:` name it brings, and its output_dir, are
      refused; a note lists the settings it brings. Names and keys given on the command
      line are the user's and kept.
    Notes go to `say`, one line each."""
    given = overridden(overrides, method.schema)
    # The recipe's config for your own model and data, beside its demo's, which the notes name.
    template = demo.with_name(method.template) if demo is not None and method.template else None
    template = template if template is not None and template.is_file() else None
    if config is None:
        own = [key for key in OWN_KEYS if any(not is_demo(n) for n in names(given.get(key)))]
        if own and demo is not None and demo.is_file():
            say(_no_demo_note(own, given, method, demo, template))
        if own:
            base = [] if "output_dir" in given else [f"output_dir=runs/{method.name}"]
            return load_config(None, [*base, *overrides], method.schema, sections)
        if demo is None or not demo.is_file():
            where = f"the demo's {demo} is not here" if demo else f"{method.name} has no demo"
            raise ConfigError([f"--config: required; {where}, so give your YAML"])
        config = demo
    cfg = load_config(config, overrides, method.schema, sections)
    _demo_in_own_run(cfg, config, given, template, say)
    return cfg


def is_demo(name) -> bool:
    """Whether a model or data name is one of the demo's (`demo:...`; a typo of one is
    validate's to report)."""
    return isinstance(name, str) and name.startswith("demo:")


def names(value) -> list[str]:
    """The model or data names in a value as written: a name, a list of names and
    {path: ..., fraction: ...} entries (data.train), or nothing."""
    items = value if isinstance(value, list) else [value]
    found = [item.get("path") if isinstance(item, dict) else item for item in items]
    return [name for name in found if isinstance(name, str) and name]


def _no_demo_note(own: list[str], given: dict, method, demo: Path, template: Path | None) -> str:
    writes = "" if "output_dir" in given else f", writing to runs/{method.name}"
    instead = f"--config {shown_path(template)} starts from a config for your own model, " if template else ""
    return (
        f"note: the command line names a model or data of your own ({', '.join(own)}) and no --config, so the "
        f"demo's settings do not apply: the run starts from the defaults (docs/config.md){writes}; "
        f"{instead}--config {shown_path(demo)} from the demo's settings"
    )


def _demo_in_own_run(cfg: Config, path: Path, given: dict, template: Path | None, say) -> None:
    """Refuse what a demo config brings to a run of the user's own model or data: its
    `demo:` names and its output_dir; note the settings it brings (see `run_config`)."""
    written = set_values(read_config(path))
    if not any(is_demo(n) for key in TRAINED_KEYS for n in names(written.get(key))):
        return  # not a demo config
    if all(is_demo(name) for key, name in named(cfg) if key in TRAINED_KEYS):
        return  # the demo's own run, perhaps varied
    where = shown_path(path)
    demo_names: dict[str, list[str]] = {}
    for key, name in named(cfg):
        if is_demo(name) and key not in given:
            demo_names.setdefault(key, []).append(name)
    problems = []
    for key, found in demo_names.items():
        value = found[0] if len(found) == 1 else f"[{', '.join(found)}]"
        data = key.startswith("data.")
        fix = f"{key}=<your {'file' if data else 'model'}>"
        empty = [] if data else ""
        if key not in TRAINED_KEYS and may_be_empty(cfg, key, empty):  # data.eval, a reference (the starting weights)
            fix += f" or {key}={'[]' if data else repr('')}"
            if key == "data.eval" and cfg.eval.every_steps and "eval.every_steps" not in given:
                fix += " eval.every_steps=0"
        problems.append(f"{key}: {value} is the demo's, from {where}, in a run of your own model or data; set {fix}")
    if "output_dir" not in given:
        problems.append(
            f"output_dir: {cfg.output_dir} is the demo's, from {where}, in a run of your own model or data; name "
            "your own: output_dir=runs/<name>"
        )
    kept = (*OWN_KEYS, "output_dir", *given)
    tuned = [f"{key}={brief(value)}" for key, value in written.items() if key not in kept]
    if tuned:
        start = f", or start from {shown_path(template)}" if template else ""
        say(
            f"note: {where} is a demo config, tuned for the demo's tiny model; this run of your own model or data "
            f"takes these settings from it: {', '.join(tuned)}; override those that do not suit yours{start}"
        )
    if problems:
        raise ConfigError(problems)


def may_be_empty(cfg: Config, key: str, empty) -> bool:
    """Whether the config's own checks accept `key` (a section.field) left empty: data.eval or
    a reference model may be, a teacher may not."""
    section, field = key.split(".", 1)
    trial = copy.deepcopy(cfg)
    setattr(getattr(trial, section), field, empty)
    return not any(q.startswith(f"{key}:") for q in trial.problems())


def brief(value) -> str:
    """A setting's value as an override would write it, cut to a few dozen characters."""
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf).strip().removesuffix("...").strip()
    return text if len(text) <= 40 else text[:37] + "..."


def shown_path(path: Path) -> str:
    """A path as typed from the working directory: relative to it when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def refuse_options(unknown: list[str], argv: list[str], parser: argparse.ArgumentParser, schema: type) -> None:
    """Options the parser does not know (`unknown`, as parse_known_args leaves them), each one
    line naming what to write instead, where argparse would print its usage and
    'unrecognized arguments': a setting is a dotted override, so --learning_rate 1e-5, as
    Transformers' scripts take it, is train.lr=1e-5 (config.foreign), --seed 3 is
    train.seed=3, --bf16 a flag of accelerate launch; any other, the closest option."""
    options = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    problems = []
    for i, arg in enumerate(unknown):
        value = not arg.startswith("-") or NUMBER.fullmatch(arg)
        if value and i and unknown[i - 1].startswith("--") and "=" not in unknown[i - 1]:
            continue  # --a 1 --b 2: argparse leaves the 2 here; it is --b's value, named with it
        problems.append(option_problem(arg, argv, options, schema))
    if problems:
        raise ConfigError(problems)


def option_problem(arg: str, argv: list[str], options: list[str], schema: type) -> str:
    """The line for unknown option `arg` of the command line `argv`, whose known options are
    `options` (see `refuse_options`)."""
    if not arg.startswith("--") or arg == "--":
        return f"{arg}: neither an option nor an override; settings are dotted overrides, e.g. train.lr=2e-5"
    name, given, value = arg[2:].partition("=")
    if not given and arg in argv:  # --learning_rate 1e-5: its value is the next argument (which parsed as an override)
        after = argv[argv.index(arg) + 1 : argv.index(arg) + 2]
        if after and "=" not in after[0] and (not after[0].startswith("-") or NUMBER.fullmatch(after[0])):
            given, value = "=", after[0]
    not_ours = f"--{name}: not an option;"
    ours = FOREIGN.get(name.replace("-", "_"))
    note = f" ({ours.note})" if ours is not None and ours.note else ""
    if ours is not None and ours.flag:  # --bf16: --mixed_precision bf16; --mixed_precision fp16 as it is
        flag = f"{ours.flag} {value}" if given and " " not in ours.flag else ours.flag
        return f"{not_ours} it is set at launch: accelerate launch {flag} ...{note}"
    key = ours.key if ours is not None else key_for(name.replace("-", "_"), schema)
    if key is None:
        close = difflib.get_close_matches(f"--{name}", options, n=1)
        hint = f"did you mean {close[0]}?" if close else f"its options are {', '.join(options)}."
        return f"{not_ours} {hint} Settings are dotted overrides, key.sub=value (python -m llmtrain.config lists them)"
    if ours is not None and ours.value:  # --warmup_ratio 0.03 is no number of steps
        value = ours.value
    elif not given:  # a flag, as --gradient_checkpointing
        value = "true" if key_type(schema, key) is bool else "<value>"
    return f"{not_ours} settings are dotted overrides: {key}={value}{note}"


# A value such as -1 or -1e-5 after an option, which is not an option itself.
NUMBER = re.compile(r"-?\d+(\.\d*)?([eE][-+]?\d+)?")


def check_restartable(cfg: Config, how: str) -> None:
    """A job that restarts itself (`how`: a Slurm requeue with --restartable, workers
    restarted by `accelerate launch --max_restarts`) runs the same command at each start,
    and each must continue from the newest checkpoint the job wrote. checkpoint.resume=auto
    (the default) does; a checkpoint path does too (its run continues from its own newest
    checkpoint, output/rundir.find_start); none would refuse the job's own checkpoints at
    the first restart, as if another run had written them, so it is refused here, at the
    first start."""
    if cfg.checkpoint.resume == "none":
        raise ConfigError(
            [
                f"checkpoint.resume: none cannot hold in a job that restarts itself ({how} must continue from the "
                "job's own checkpoints); leave it at auto, and give a new output_dir to be sure of a fresh start"
            ]
        )


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
        code = 1  # a bug's traceback, or Ctrl-C's KeyboardInterrupt
        try:
            with user_errors(state):
                main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
            raise
        finally:  # the run is over: a stop signal now would only interrupt the exit (atexit handlers)
            stop_signals(signal.SIG_IGN)
            exit_past_threads(code)
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
    stop_signals(signal.SIG_IGN)
    leave(code)


def leave(code) -> None:
    """Run the atexit handlers, flush the output and end the process with `code` (an int,
    None for 0, or a message for 1, as sys.exit takes them), leaving the interpreter's own
    teardown out. Callable from any thread."""
    import atexit

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


# How long a one-process run that is over lets Python wait for threads still running
# before it exits without them (`exit_past_threads`).
THREAD_WAIT_S = 5.0


def exit_past_threads(code) -> None:
    """A one-process run is over, with exit code `code`. On its way out Python waits for
    every thread that is no daemon, with the stop signals ignored: a thread that never ends
    (one started by a reward function) would keep the process alive after final/, and only
    SIGKILL would end it (a Slurm job would hold its node to its time limit). Where such
    threads run, a daemon thread watches the exit: if they still run THREAD_WAIT_S after
    Python began to wait for them, it names them in a warning and ends the process with the
    run's code, after the atexit handlers (`leave`), as a multi-process run always ends
    (`exit_now`). Python's own exit is left alone otherwise: it shuts down thread pools
    (whose idle threads end then) and runs the handlers itself; a process that goes on after
    run_cli (tests run several commands in one) is never ended."""
    if not running_threads():
        return

    def watch():
        threading.main_thread().join()  # returns once Python's exit has begun (threading._shutdown)
        time.sleep(THREAD_WAIT_S)
        left = running_threads()
        if not left:
            return  # they ended: Python's exit goes on by itself
        names = ", ".join(repr(t.name) for t in left)
        with contextlib.suppress(Exception):  # a closed stderr: exit all the same
            sys.stderr.write(
                f"warning: thread(s) {names} still running {THREAD_WAIT_S:g} s after the run was over (started by "
                "a reward function or other code of yours?); exiting without waiting for them\n"
            )
        leave(code)

    threading.Thread(target=watch, name="llmtrain-exit-watch", daemon=True).start()


def running_threads() -> list[threading.Thread]:
    """The threads Python waits for at exit (no daemons), besides the main thread."""
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]


def stop_signals(action) -> None:
    """Give SIGUSR1/SIGTERM/SIGINT/SIGHUP (stop.GRACEFUL) `action`: SIG_IGN once a run is
    over and exits, SIG_DFL for a process that waits to be stopped."""
    for sig in GRACEFUL:
        signal.signal(sig, action)

"""User code run inside the trainer (reward functions now; tools and environments next):
`contained` runs a block of it, so that what the code does to the process stays its own or
is named. Invariants, for any block run inside it:

- Whatever it raises, BaseException included (SystemExit from exit() or sys.exit(), an
  asyncio CancelledError), leaves the block as the caller's UserError: one line naming the
  code, the line of its file the exception came from, and what it did. Two pass through
  unchanged, because they are a stop the user asked for: KeyboardInterrupt (a second Ctrl-C
  while training) and the SystemExit that the stop-signal handler raises while the block
  runs (distributed/stop.StopRequest, outside training).
- The process state the run depends on is what it was before the block: the working
  directory (a run's paths are absolute too, config.load.absolute_paths, for threads the
  code leaves running), torch's grad mode, default dtype and device, deterministic and
  anomaly flags, thread count and matmul precision (cuDNN and TF32 flags too), the warnings
  filters, the umask, sys.stdout and sys.stderr, and the stop signals' handlers (`SETTINGS`).
  Each one the code changed is put back, with a warning naming the code and the setting,
  once per code and setting. Inference mode left on cannot be left from outside the
  `with` block that entered it: that is an error.
- A thread it started that is not a daemon and still runs is named in a warning, once; the
  process does not wait for such threads when the run is over (cli.run_cli).

Left to the caller: what the code receives (pass copies: rl/rewards.Reward deep-copies its
arguments, so no edit reaches the trained tokens or another function). Left alone by choice:
the random number generators. The code shares the run's seeded generators, which checkpoints
save, so code that draws random numbers is reproduced on resume; put back after every call,
they would hand the code the same numbers each time (GRPO's loop draws none between calls).

`load_function` loads such code by the name a config gives it ('path/to/file.py:function',
'module:function'), and `code_files` names the files it consists of, read and never run: what a run records of
it in its identity (output/rundir.inputs), so that an edit to any of them is a change of the run.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .distributed.stop import GRACEFUL, StopRequest
from .errors import UserError, describe, warn

PACKAGE = str(Path(__file__).resolve().parent)
EXIT_FIX = (
    "code that llmtrain runs must return, not exit: a module's script part (sys.exit(main())) goes under "
    "`if __name__ == '__main__':`, and exec()ed code that may call exit() needs try/except SystemExit"
)


@dataclass(frozen=True)
class Setting:
    """A piece of process state that user code could change for the whole run: read before
    and after a block, and put back when it differs."""

    name: str  # what a warning calls it
    get: Callable[[], object]
    put: Callable[[object], None]
    hint: str = ""  # how the code should do it instead


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the code removed the directory it moved to
        return None


def _umask() -> int:
    """The umask, read from /proc where it can be (setting it to read it would, for a
    moment, give other threads' new files another mode)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o077)
        os.umask(mask)
        return mask


def _default_device(device) -> None:
    torch.set_default_device(None if device.type == "cpu" else device)  # no device context where none was


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _put_deterministic(mode: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])


def _chdir(directory: str | None) -> None:
    if directory is not None:
        os.chdir(directory)


def _warning_filters(filters: list) -> None:
    warnings.resetwarnings()  # tells the warnings machinery that its filters changed
    warnings.filters.extend(filters)


def _stop_handlers() -> dict:
    return {sig: signal.getsignal(sig) for sig in GRACEFUL}


def _put_stop_handlers(handlers: dict) -> None:
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)


def _flag(owner, prefix: str, name: str) -> Setting:
    """A flag set by assignment, such as torch.backends.cudnn.benchmark."""
    return Setting(f"{prefix}.{name}", lambda: getattr(owner, name), lambda value: setattr(owner, name, value))


SETTINGS = [
    Setting("the working directory", _cwd, _chdir, "use absolute paths"),
    Setting(
        "torch's grad mode",
        torch.is_grad_enabled,
        torch.set_grad_enabled,
        "use `with torch.no_grad():` around the code that needs it",
    ),
    Setting("torch's default dtype", torch.get_default_dtype, torch.set_default_dtype, "give tensors their dtype"),
    Setting("torch's default device", torch.get_default_device, _default_device, "give tensors their device"),
    Setting("torch.use_deterministic_algorithms", _deterministic, _put_deterministic),
    Setting("torch's anomaly detection", torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    Setting("torch's thread count", torch.get_num_threads, torch.set_num_threads),
    Setting("torch's float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    *(
        _flag(torch.backends.cudnn, "torch.backends.cudnn", f)
        for f in ("enabled", "benchmark", "deterministic", "allow_tf32")
    ),
    *(
        _flag(torch.backends.cuda.matmul, "torch.backends.cuda.matmul", f)
        for f in ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")
    ),
    Setting(
        "the warnings filters",
        lambda: list(warnings.filters),
        _warning_filters,
        "use `with warnings.catch_warnings():`",
    ),
    Setting("the umask", _umask, os.umask),
    Setting("sys.stdout", lambda: sys.stdout, lambda f: setattr(sys, "stdout", f), "use contextlib.redirect_stdout"),
    Setting("sys.stderr", lambda: sys.stderr, lambda f: setattr(sys, "stderr", f), "use contextlib.redirect_stderr"),
]
STOP_HANDLERS = Setting("the stop signals' handlers", _stop_handlers, _put_stop_handlers)

_warned: set[tuple[str, str]] = set()  # (code, what it changed): each warned about once


def warn_once(what: str, changed: str, did: str) -> None:
    if (what, changed) not in _warned:
        _warned.add((what, changed))
        warn(f"{what} {did}")


def llmtrains_own(handler) -> bool:
    """Whether a signal handler is one the stop protocol itself sets (distributed/stop: its
    handler, or Python's KeyboardInterrupt after a first Ctrl-C while training)."""
    return handler is signal.default_int_handler or getattr(handler, "__module__", "").startswith("llmtrain.")


def changed_handlers(before: dict, after: dict) -> bool:
    return any(after[sig] != before[sig] and not llmtrains_own(after[sig]) for sig in before)


@contextmanager
def contained(what: str, error: type[UserError], fix: str, file: str | None = None, current=lambda: True):
    """Run the block (user code) as the module docstring says. `what` names the code in its
    messages ('grpo.rewards: rewards.py:short'); `error` is the UserError an exception
    becomes, '<what> raised <exception> (<file>:<line>); <fix>'; `file` is the code's own
    file, whose line is the one named (else the innermost line outside llmtrain). `current()`
    says, when the block ends, whether its caller still waits for it: a call its caller gave
    up on (a tool that timed out, in a thread of its own) puts no process state back, since
    the state it saw at its start is stale by then (the run, or another test, has moved on)."""
    main = threading.current_thread() is threading.main_thread()  # signal handlers are the main thread's
    before = [s.get() for s in SETTINGS]
    handlers = STOP_HANDLERS.get() if main else None
    threads = set(threading.enumerate())
    inference = torch.is_inference_mode_enabled()
    failure = None
    try:
        yield
    except KeyboardInterrupt:
        raise
    except SystemExit as e:
        if any(tb.tb_frame.f_code is StopRequest._exit.__code__ for tb in frames(e)):
            raise  # a stop signal that came while the code ran: the run stops as it would anywhere
        code = "" if e.code is None else repr(e.code)
        failure = f"{what} exited (SystemExit({code}), from exit() or sys.exit()){where(e, file)}; {EXIT_FIX}"
    except BaseException as e:
        failure = f"{what} raised {describe(e)}{where(e, file)}; {fix}"
    finally:
        for setting, was in zip(SETTINGS, before if current() else ()):
            if (now := setting.get()) != was:
                setting.put(was)
                to = f" (to {now!r})" if isinstance(now, (bool, int, str, tuple, torch.dtype, torch.device)) else ""
                hint = f"; {setting.hint}" if setting.hint else ""
                warn_once(what, setting.name, f"changed {setting.name}{to}; llmtrain put it back{hint}")
        if handlers is not None and current() and changed_handlers(handlers, after := STOP_HANDLERS.get()):
            STOP_HANDLERS.put({sig: h if llmtrains_own(h) else handlers[sig] for sig, h in after.items()})
            warn_once(
                what,
                STOP_HANDLERS.name,
                "replaced the handler of a stop signal (SIGINT, SIGTERM, SIGUSR1 or SIGHUP); llmtrain put its own "
                "back, which stops the run after a checkpoint",
            )
        left = [t.name for t in threading.enumerate() if t not in threads and t.is_alive() and not t.daemon]
        if left:
            warn_once(
                what,
                "threads",
                f"started thread(s) {', '.join(repr(n) for n in left)} that still run; the process will not wait for "
                "them once the run is over (make them daemon threads, or join them before returning)",
            )
    if failure is None and torch.is_inference_mode_enabled() and not inference:
        failure = (
            f"{what} left torch's inference mode on, which cannot be undone from outside; {fix} (enter it only as "
            "`with torch.inference_mode():`)"
        )
    if failure is not None:
        raise error(failure) from None


def frames(e: BaseException):
    """The traceback entries of `e`, outermost first."""
    tb = e.__traceback__
    while tb is not None:
        yield tb
        tb = tb.tb_next


def where(e: BaseException, file: str | None) -> str:
    """' (<file>:<line>)': the innermost line of `file` in e's traceback, else the innermost
    one outside llmtrain; '' when there is none."""
    entries = [tb for tb in frames(e) if not tb.tb_frame.f_code.co_filename.startswith(PACKAGE)]
    if file is not None:
        own = [tb for tb in entries if tb.tb_frame.f_code.co_filename == file]
        entries = own or entries
    if not entries:
        return ""
    tb = entries[-1]
    return f" ({Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno})"


IMPORT_FIX = "fix the module"


def load_function(spec: str, key: str, error: type[UserError], builtins: str = "") -> tuple[Callable, str | None]:
    """The function of 'path/to/file.py:function', or of 'module:function' (config key `key`,
    whose other names are `builtins`; a problem is `error`, one line naming them): a module of the
    working directory (module.py, or a package directory module/ and dotted names in it),
    else an installed one. Returns it with its file. A file of the user's is loaded by its
    path under a name of its own (`load_file`), never looked up by its bare name on
    sys.path, where the recipe's directory (reward.py, dpo.py) or the standard library
    (code.py) would give another file of the same name. Its top-level code runs once per
    process, contained (usercode.contained), with its own directory and the working
    directory on sys.path meanwhile (`importable`), so that it can import helper modules
    beside it."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        kinds = f"neither {builtins} nor" if builtins else "not"
        raise error(f"{key}: {spec!r} is {kinds} 'module:function' or 'path/to/file.py:function'")
    if names_file(where):
        path = Path(where).expanduser()
        if not path.is_file():
            raise error(f"{key}: {spec}: no file {path}; give the path of a .py file")
        with importable(path.parent, Path.cwd()):
            module = load_file(path, spec, key, error)
    else:
        with importable(Path.cwd()):
            module = load_module(where, spec, key, error)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise error(f"{key}: {where} has no function {name!r}")
    return fn, getattr(module, "__file__", None)


def load_module(name: str, spec: str, key: str, error: type[UserError]):
    """Module `name` of 'module:function': the working directory's (a package directory, or
    a file, dotted names within them), loaded by path (`load_file`), else an installed one."""
    parts = name.split(".")
    cwd = Path.cwd()
    local = local_module(parts, cwd)
    # The package already imported from this very directory (llmtrain's own, say, run from its
    # checkout: llmtrain.calculator:add) is the same code: imported as it was.
    paths = getattr(sys.modules.get(parts[0]), "__path__", None) or []
    if local is not None and local[1] and any(Path(p).resolve() == local[0].resolve() for p in paths):
        local = None
    if local is not None and local[1]:  # a package: its own modules import relatively
        package = load_file(local[0], spec, key, error, package=True)
        if len(parts) == 1:
            return package
        with contained(f"{key}: {spec}: its import", error, IMPORT_FIX):
            return importlib.import_module(".".join([package.__name__, *parts[1:]]))
    if local is not None:
        return load_file(local[0], spec, key, error)
    try:
        found = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise error(
            f"{key}: {spec}: no module {parts[0]!r} in the working directory ({cwd}) nor installed; run from "
            "the directory that holds it, or name its file: path/to/file.py:function"
        )
    with contained(f"{key}: {spec}: its import", error, IMPORT_FIX):
        return importlib.import_module(name)


def names_file(where: str) -> bool:
    """Whether the part of a name before its function ('path/to/file.py', 'module.sub')
    names a file by its path rather than a module."""
    return where.endswith(".py") or "/" in where


def local_module(parts: list[str], cwd: Path) -> tuple[Path, bool] | None:
    """Where 'module:function' finds the dotted module `parts` in the working directory:
    (its package's directory, True) or (its file, False); None for none there."""
    if (cwd / parts[0] / "__init__.py").is_file():
        return cwd / parts[0], True
    file = cwd.joinpath(*parts[:-1], f"{parts[-1]}.py")
    return (file, False) if file.is_file() else None


def load_file(path: Path, spec: str, key: str, error: type[UserError], package: bool = False):
    """The module of a file of the user's (or the package of a directory), imported once
    per process under a name of its own made from its resolved path. It is in sys.modules
    while its code runs, as an import puts it (dataclasses and pickling look it up there),
    and taken out again if that code fails, so the next load reports the failure again."""
    resolved = path.resolve()
    module_name = f"llmtrain_user_{hashlib.sha256(str(resolved).encode()).hexdigest()[:16]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    origin = resolved / "__init__.py" if package else resolved
    search = [str(resolved)] if package else None
    found = importlib.util.spec_from_file_location(module_name, origin, submodule_search_locations=search)
    module = importlib.util.module_from_spec(found)
    sys.modules[module_name] = module
    try:
        with contained(f"{key}: {spec}: its import", error, IMPORT_FIX, str(origin)):
            found.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


@contextmanager
def importable(*directories: Path):
    """`directories` on sys.path while a module of the user's loads, so that it can import the
    helper modules beside it (the recipe's own directory is what Python puts there, not the
    module's nor the working directory). They go last, and only for the load, so their other
    files never stand in for an installed package (a json.py there; a matplotlib.py,
    imported later by the loss plot)."""
    added = [str(d) for d in dict.fromkeys(d.resolve() for d in directories)]
    added = [d for d in added if d not in sys.path and not (d == str(Path.cwd().resolve()) and "" in sys.path)]
    sys.path.extend(added)
    try:
        yield
    finally:
        for d in added:
            sys.path.remove(d)


# Bounds on what `code_files` reads: files followed, and the size of a file it parses.
MAX_CODE_FILES = 200
MAX_SOURCE_BYTES = 4 << 20


def code_files(spec: str) -> list[Path]:
    """The files of the user's that loading `spec` runs, with its function named after the
    last ':' (`load_function`: 'path/to/file.py:function', or 'module:function' for
    a module or package of the working directory): that file, then every module of the
    user's it imports, directly or through another (`local_imports`). Empty for a name that
    loads no file of the user's (a built-in, an installed module)."""
    where, colon, _ = spec.rpartition(":")
    if not colon or not where:
        return []
    cwd = Path.cwd()
    if names_file(where):
        file = Path(where).expanduser()
        return local_imports([file], [file.parent, cwd]) if file.is_file() else []
    parts = where.split(".")
    local = local_module(parts, cwd)
    if local is None:
        return []
    found = _module_files(parts, cwd) if local[1] else [local[0]]  # a package: its __init__, the module in it
    return local_imports(found, [cwd])


def local_imports(files: list[Path], roots: list[Path]) -> list[Path]:
    """`files` and the modules of `roots` (the directories the loader puts on sys.path) that
    they import, followed through each imported file, up to MAX_CODE_FILES. Read from each
    file's import statements (ast), so an import made by name at run time (importlib) is
    missed. A name Python finds elsewhere first (the standard library, an installed package,
    sys.path before the roots) is not the user's, as it is not when the code runs."""
    roots = [r.resolve() for r in roots]
    others = [p for p in sys.path if Path(p or ".").resolve() not in roots]
    seen: dict[Path, None] = {}
    queue = [f.resolve() for f in files]
    while queue and len(seen) < MAX_CODE_FILES:
        file = queue.pop(0)
        if file in seen:
            continue
        seen[file] = None
        for parts, base in _imports(file):
            if base is None:  # absolute: the user's only where nothing before the roots has it
                if parts[0] in sys.builtin_module_names or _found_elsewhere(parts[0], others):
                    continue
                queue += [f for root in roots for f in _module_files(parts, root)]
            else:
                queue += _module_files(parts, base)
    return list(seen)


def _imports(file: Path) -> list[tuple[list[str], Path | None]]:
    """(dotted name as parts, the directory a relative import starts from, None for an
    absolute one) of each module `file` imports; `from m import n` gives m and m.n (n may be
    a submodule). A file that cannot be read or parsed gives none (loading it reports why)."""
    try:
        if file.stat().st_size > MAX_SOURCE_BYTES:
            return []
        tree = ast.parse(file.read_bytes(), str(file))
    except (OSError, SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name.split("."), None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = None
            if node.level:
                base = file.parent
                for _ in range(node.level - 1):
                    base = base.parent
            module = node.module.split(".") if node.module else []
            if module:
                found.append((module, base))
            found += [([*module, alias.name], base) for alias in node.names if alias.name != "*"]
    return found


def _found_elsewhere(name: str, path: list[str]) -> bool:
    try:
        return importlib.machinery.PathFinder.find_spec(name, path) is not None
    except (ImportError, ValueError, OSError):
        return False


def _module_files(parts: list[str], root: Path) -> list[Path]:
    """The files importing the dotted module `parts` from directory `root` runs: each
    package's __init__.py on the way, and the module's own file."""
    files, directory = [], root
    for part in parts:
        if not part.isidentifier():
            break
        package = directory / part / "__init__.py"
        if package.is_file():
            files.append(package)
            directory = directory / part
        elif (module := directory / f"{part}.py").is_file():
            files.append(module)
            break
        else:
            break
    return files

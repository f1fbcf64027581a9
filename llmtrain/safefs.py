"""Writing under output_dir without following links llmtrain did not make.

An output directory may be shared or group-writable, so another user can plant a
symbolic link where llmtrain writes (metrics.jsonl -> ~victim/.bashrc, checkpoints ->
/elsewhere). llmtrain never writes through such a link:

- `check_output_dir` refuses, at start-up and in one line, a link in place of any name
  llmtrain writes under output_dir (files and the directories it writes into). output_dir
  itself may be a link: that is the user's own choice.
- `open_write` opens a file for writing with O_NOFOLLOW, so a link planted after the
  check is refused rather than followed; `write_text` uses it.
- `new_temp` creates a temporary file exclusively (O_EXCL), never an existing one, for
  writes that are then renamed into place (a rename replaces a link, never follows it).

Every file and directory a run leaves has the mode the user's umask gives (a group shares an
output_dir under umask 002): files are created 0666 and directories 0777 less the umask;
the directories libraries write into are private (0700) only until complete, when `opened`
gives them and all they hold the umask's modes (a library may write its files 0600).
- `rmtree` removes a link in place of a directory instead of the tree it points to, and
  `make_dir` refuses a directory path whose existing part is a link.

Writes by libraries (accelerate's save_state, save_pretrained, torch.save) go into
directories llmtrain has just created itself with `fresh_dir` (checkpoints, the export),
or that `make_dir` made sure are no links (the profiler's, which every process shares).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from .errors import CacheError, LinkError

# What llmtrain writes, creates or removes directly under output_dir.
OUTPUT_NAMES = (
    ".llmtrain.lock",
    "config.yaml",
    "run.json",
    "metrics.jsonl",
    "loss.png",
    "checkpoints",
    "final",
    ".tmp-final",
    ".old-final",
    ".deleting-final",
    "profile",
    "logs",
    "evals",
    "reference_logps.pt",
    ".tmp-reference_logps.pt",
)


def link_error(path: Path, what: str = "output_dir") -> LinkError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return LinkError(
        f"{what}: {path} is a symbolic link (to {target}); llmtrain does not write through links it did not "
        f"make; remove it or choose another {what}"
    )


# Of OUTPUT_NAMES, the directories; the others are files.
OUTPUT_DIRS = {"checkpoints", "final", ".tmp-final", ".old-final", ".deleting-final", "profile", "logs", "evals"}


def check_output_dir(output_dir: str | Path, names: tuple[str, ...] = OUTPUT_NAMES) -> None:
    """Refuse, in one line, a symbolic link in place of anything llmtrain writes under
    output_dir (the files and directories in `names`, the entries of checkpoints/ it
    creates, replaces and deletes, the trackers' directories under logs/ and the
    profiler's), and anything else than a file where it writes a file or a directory where
    it writes into one (a FIFO at metrics.jsonl would hang the run)."""
    out = Path(output_dir)
    for name in names:
        check_entry(out / name, directory=name in OUTPUT_DIRS)
    for sub in ("checkpoints", "profile", "logs", "evals"):
        if (out / sub).is_dir():
            for p in (out / sub).iterdir():
                if p.is_symlink():
                    raise link_error(p)


def check_entry(path: Path, directory: bool) -> None:
    """A link at `path` is a LinkError; so is something other than a directory (or, with
    directory=False, a regular file) there. Nothing there is fine."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise link_error(path)
    if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        raise LinkError(
            f"output_dir: {path} is {kind(mode)}, where llmtrain writes {'a directory' if directory else 'a file'}; "
            "remove it or choose another output_dir"
        )


def kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "a device or other special file"


def open_write(path: str | Path, append: bool = False, what: str = "output_dir", binary: bool = False):
    """Open `path` for writing (truncating, or appending), creating it if absent, without
    following a symbolic link at its last component: a link there is a LinkError."""
    # O_NONBLOCK: a named pipe planted after the start-up check fails to open (no reader)
    # instead of blocking; anything but a regular file is refused. Both are OSErrors, as a
    # full disk is: the writers that go on without a file (metrics.jsonl) go on.
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if Path(path).is_symlink():
            raise link_error(Path(path), what) from None
        raise e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{kind(mode)}, not a regular file", str(path))
    os.set_blocking(fd, True)
    mode = ("a" if append else "w") + ("b" if binary else "")
    return os.fdopen(fd, mode) if binary else os.fdopen(fd, mode, encoding="utf-8")


def write_text(path: str | Path, text: str, what: str = "output_dir") -> None:
    with open_write(path, what=what) as f:
        f.write(text)


def new_temp(directory: str | Path, prefix: str) -> Path:
    """A new, empty file in `directory`, created exclusively (never an existing file or
    link), for a write that is renamed over its destination when complete. Its mode is what
    the umask gives any new file, as for every file a run writes: the rename carries it to
    the destination (tempfile.mkstemp's 0600 would make metrics.jsonl private in a
    directory shared with a group)."""
    for _ in range(100):
        path = Path(directory) / f"{prefix}{secrets.token_hex(6)}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        except FileExistsError:  # taken (or a link planted there): another name
            continue
        os.close(fd)
        return path
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(Path(directory) / prefix))


def replace_text(path: str | Path, text: str) -> None:
    """Write `path` whole: into a new temporary file beside it, renamed over it. A link at
    `path` is replaced, not followed."""
    path = Path(path)
    tmp = new_temp(path.parent, f".tmp-{path.name}-")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def rmtree(path: str | Path) -> None:
    """Remove a directory tree, or only the link when `path` is a symbolic link (never the
    tree it points to). Missing paths and errors are ignored, as for a leftover."""
    path = Path(path)
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def make_dir(path: str | Path, what: str = "output_dir") -> None:
    """mkdir -p, refusing when `path` itself is a symbolic link."""
    path = Path(path)
    if path.is_symlink():
        raise link_error(path, what)
    path.mkdir(parents=True, exist_ok=True)


def fresh_dir(path: str | Path) -> None:
    """`path` as a new, empty directory this process has just made: whatever was there (a
    leftover, or a planted link) is removed first, and mkdir fails rather than reuse one
    that reappears. It is made private (0700) while libraries write into it: under a
    group-writable umask (002, usual where output directories are shared) others could
    otherwise plant links inside it before a library opens its files. `opened` gives it
    the umask's mode once it is complete."""
    rmtree(path)
    Path(path).mkdir(mode=0o700)


def opened(path: str | Path) -> None:
    """A directory made by `fresh_dir`, now complete, and everything in it given the modes
    the user's umask gives new directories and files. The files too: a library may write
    its own private (safetensors 0.8 writes each file 0600, through a temporary file), and
    what a run leaves follows the umask whoever wrote it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):  # nothing of ours is a link: never followed
                os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o666 & ~umask)


def _unusable(path: Path) -> str | None:
    """Why a cache directory at `path` cannot be used (made if missing, then written), or
    None. Tried for real: a directory is made and removed in `path`, or where it is missing
    in its nearest existing ancestor. A permission check (os.access) says yes to root where
    nothing can be made (/proc, /sys, a read-only mount), and the library's first write
    would then fail with a traceback. Nothing is left behind."""
    probe = path
    try:
        if path.exists() and not path.is_dir():
            return "is not a directory"
        while not probe.exists():
            if probe.is_symlink():
                return f"has a dangling link at {probe}"
            probe = probe.parent
        if not probe.is_dir():
            return f"cannot be made ({probe} is not a directory)"
    except OSError as e:  # a parent directory it may not search
        return f"cannot be looked up ({e.strerror})"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".llmtrain-probe-", dir=probe))
    except OSError:
        return "is not writable" if probe == path else f"cannot be made ({probe} is not writable)"
    return None


def _source(var: str, default: list[tuple[str, str]]) -> tuple[str, Path]:
    """The variable a cache path comes from, and the path: `var` when set, else the first
    set of the fallbacks (variable, path below it)."""
    if os.environ.get(var):
        return var, Path(os.environ[var]).expanduser()
    for name, below in default:
        if name == "HOME" or os.environ.get(name):
            base = os.environ.get(name) or os.path.expanduser("~")
            return name, Path(base).expanduser() / below
    raise AssertionError("HOME is the last fallback")


def check_caches(uses_demo: bool) -> None:
    """Stop at start-up, with one line naming the variable, when a cache llmtrain or the
    libraries will write cannot be used: the datasets cache (HF_DATASETS_CACHE, else
    HF_HOME/datasets, else ~/.cache/huggingface/datasets), HF_HOME when it is a file (a
    read-only hub cache is fine: the hub reads it), and with demo:* names the demo cache
    (LLMTRAIN_CACHE, else ~/.cache/llmtrain). Without this check the first write, deep in
    a library, fails with a traceback."""
    checks = [
        (
            "HF_DATASETS_CACHE",
            _source(
                "HF_DATASETS_CACHE",
                [
                    ("HF_HOME", "datasets"),
                    ("XDG_CACHE_HOME", "huggingface/datasets"),
                    ("HOME", ".cache/huggingface/datasets"),
                ],
            ),
        )
    ]
    if os.environ.get("HF_HOME"):
        home = Path(os.environ["HF_HOME"]).expanduser()
        if home.exists() and not home.is_dir():
            raise CacheError(f"HF_HOME: {home} is not a directory; set HF_HOME to a directory (or unset it)")
    if uses_demo:
        checks.append(("LLMTRAIN_CACHE", _source("LLMTRAIN_CACHE", [("HOME", ".cache/llmtrain")])))
    for cache, (var, path) in checks:
        why = _unusable(path)
        if why is None:
            continue
        if var == cache:
            raise CacheError(f"{var}: {path} {why}; set {var} to a directory you can write to")
        raise CacheError(
            f"{var}: {path} {why}; it is where {var} puts the {cache} cache: set {cache} (or {var}) to a "
            "directory you can write to"
        )

"""What makes a config valid beyond its types: the bounds of numbers, the keys that hold
paths (`PathKey`), the chat template, the demo's asset names, installed trackers. Each
section of the schema checks itself with these in its `problems()`; nothing here reads the
schema (the annotations of whatever tree it is given say which keys are what), so schema.py
and the method wings' trees import this module and not the other way round.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import importlib.util
import math
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from ..errors import describe, shown
from ..files import no_such_file
from ..template import MAX_TEMPLATE_CHARS, install


@dataclass(frozen=True)
class Bounds:
    """The valid range of a number field. Every number is checked at start-up
    (`Config.problems`): finite, and within its Bounds, which are "not negative" unless the
    field's annotation gives others."""

    low: float = 0
    high: float = math.inf
    low_open: bool = False  # low itself is not allowed
    high_open: bool = False  # high itself is not allowed

    def problem(self, value) -> str | None:
        if isinstance(value, int) and abs(value) >= 2**63:  # beyond what torch or the OS take
            return f"must be below 2**63, got a number of {len(str(abs(value)))} digits"
        if not math.isfinite(value):
            return f"must be a finite number, got {value}"
        too_low = value <= self.low if self.low_open else value < self.low
        too_high = value >= self.high if self.high_open else value > self.high
        return f"must be {self.describe()}, got {value}" if too_low or too_high else None

    def describe(self) -> str:
        low, high = (str(int(x)) if float(x).is_integer() else f"{x:g}" for x in (self.low, self.high))
        if self.high == math.inf:
            if self.low == 0:
                return "positive" if self.low_open else "zero or more"
            return f"above {low}" if self.low_open else f"at least {low}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


AT_LEAST_1 = Bounds(1)
POSITIVE = Bounds(0, low_open=True)
FRACTION = Bounds(0, 1)
BELOW_1 = Bounds(0, 1, high_open=True)


@dataclass(frozen=True)
class PathKey:
    """Marks a key whose value is a path (`Annotated[str, PATH]`): every such key, in any
    section of any recipe's tree, gets `~` and $VARS expanded (load.expand_paths) and must be
    a name a filesystem can look up (`path_problems`), by this one rule. `asset`: a model or
    data set, which may also be a hub name or one of the demo's assets (`DEMO_NAMES`);
    `text`: the value may be Jinja template text instead (it holds a `{`), left as it is;
    `parts`: a name whose `:`-separated parts may be paths (grpo.rewards' reward_model:DIR
    and path/to/file.py:function), each expanded as a path; `code`: a name that loads code
    of the user's, whose files (usercode.code_files) are part of the run's identity.
    On a list, every entry is a path (a DataSource entry: its own PathKey fields)."""

    asset: bool = False
    text: bool = False
    parts: bool = False
    code: bool = False


PATH = PathKey()
ASSET = PathKey(asset=True)  # model.name_or_path, data.train, data.eval, a method's reference model
PATH_OR_TEXT = PathKey(text=True)  # data.chat_template
PATHS_IN_NAME = PathKey(parts=True, code=True)  # grpo.rewards

# The demo's reserved names, each a file or directory in its cache (llmtrain/demo.py builds
# them): a config may name them wherever it names a model or data set.
DEMO_NAMES = {
    "demo:tiny-llama": "tiny-llama",
    "demo:train": "train.jsonl",
    "demo:eval": "eval.jsonl",
    "demo:tiny-llama-sft": "tiny-llama-sft",
    "demo:pairs-train": "pairs-train.jsonl",
    "demo:pairs-eval": "pairs-eval.jsonl",
    "demo:kto-train": "kto-train.jsonl",
    "demo:kto-eval": "kto-eval.jsonl",
    "demo:prompts-train": "rl-words-train.jsonl",
    "demo:prompts-eval": "rl-words-eval.jsonl",
    "demo:tiny-llama-tools": "tiny-llama-tools",
    "demo:calc-traces": "calc-traces.jsonl",
    "demo:calc-traces-eval": "calc-traces-eval.jsonl",
    "demo:tiny-llama-calc": "tiny-llama-calc",
    "demo:calc-train": "calc-train.jsonl",
    "demo:calc-eval": "calc-eval.jsonl",
    "demo:tiny-llama-teacher": "tiny-llama-teacher",
    "demo:tiny-llama-small": "tiny-llama-small",
    "demo:tiny-vlm": "tiny-vlm",
    "demo:shapes-count": "shapes/count.jsonl",
    "demo:shapes-train": "shapes/train.jsonl",
    "demo:shapes-eval": "shapes/eval.jsonl",
}


def path_kind(annotation) -> PathKey | None:
    """The PathKey an annotation carries, or None."""
    extras = typing.get_args(annotation)[1:] if typing.get_origin(annotation) is Annotated else ()
    return next((e for e in extras if isinstance(e, PathKey)), None)


def map_paths(node, fn, prefix: str = "") -> None:
    """Replace, in place, the value of every path key of the tree `node` with
    fn(key, value, PathKey): a string key's value; each entry of a list; the path fields of a
    dataclass entry (a data.train {path, fraction} entry, named by its list's key, as its
    errors are). Keys without a PathKey, and values that are not strings, are left alone."""
    hints = typing.get_type_hints(type(node), include_extras=True)
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            map_paths(value, fn, f"{key}.")
        elif (kind := path_kind(hints[f.name])) is not None:
            setattr(node, f.name, _mapped(value, key, kind, fn))
        elif isinstance(value, list) and any(dataclasses.is_dataclass(v) for v in value):  # eval.tasks
            setattr(node, f.name, [_entry(v, f"{key}[{i}].", fn) for i, v in enumerate(value)])


def _mapped(value, key: str, kind: PathKey, fn):
    if isinstance(value, list):
        return [_mapped(v, key, kind, fn) for v in value]
    if dataclasses.is_dataclass(value):
        entry = dataclasses.replace(value)  # never change an entry another tree may share
        hints = typing.get_type_hints(type(entry), include_extras=True)
        for f in dataclasses.fields(entry):
            if (own := path_kind(hints[f.name])) is not None:
                setattr(entry, f.name, _mapped(getattr(entry, f.name), key, own, fn))
        return entry
    return fn(key, value, kind) if isinstance(value, str) else value


def _entry(value, prefix: str, fn):
    """A list's mapping entry (an eval.tasks entry), its path keys mapped and named by
    their place (eval.tasks[0].prompts); a copy, never changing one another tree shares."""
    if not dataclasses.is_dataclass(value):
        return value
    entry = dataclasses.replace(value)
    map_paths(entry, fn, prefix)
    return entry


def iter_paths(node, prefix: str = ""):
    """(key, value, PathKey) of every path in the tree, in field order, as `map_paths` would
    see them, leaving the tree as it is."""
    hints = typing.get_type_hints(type(node), include_extras=True)
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from iter_paths(value, f"{key}.")
        elif (kind := path_kind(hints[f.name])) is not None:
            yield from _entries(value, key, kind)
        elif isinstance(value, list):  # a list of mappings (eval.tasks): each entry's, by its place
            for i, v in enumerate(value):
                if dataclasses.is_dataclass(v):
                    yield from iter_paths(v, f"{key}[{i}].")


def _entries(value, key: str, kind: PathKey):
    if isinstance(value, list):
        for v in value:
            yield from _entries(v, key, kind)
    elif dataclasses.is_dataclass(value):
        hints = typing.get_type_hints(type(value), include_extras=True)
        for f in dataclasses.fields(value):
            if (own := path_kind(hints[f.name])) is not None:
                yield from _entries(getattr(value, f.name), key, own)
    elif isinstance(value, str):
        yield key, value, kind


def path_values(cfg, asset: bool | None = None) -> list[tuple[str, str, PathKey]]:
    """(key, value, PathKey) of every path in the tree (the assets alone with asset=True)."""
    return [(key, value, kind) for key, value, kind in iter_paths(cfg) if asset is None or kind.asset == asset]


def named(cfg) -> list[tuple[str, str]]:
    """(config key, name) of every model and data set a config names (its asset keys)."""
    return [(key, value) for key, value, _ in path_values(cfg, asset=True)]


def closest(key: str, names: list[str]) -> str | None:
    """The valid name a typo most likely meant: a close spelling, else a shared prefix."""
    close = difflib.get_close_matches(key, names, n=1)
    if close:
        return close[0]
    related = [n for n in names if key.startswith(n) or n.startswith(key)]
    return max(related, key=len) if related else None


def number_problems(node, prefix: str = "") -> list[str]:
    """Every int and float field of the tree against its Bounds (see `Bounds`)."""
    problems = []
    hints = typing.get_type_hints(type(node), include_extras=True)
    for f in dataclasses.fields(node):
        tp, value = hints[f.name], getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            problems += number_problems(value, f"{prefix}{f.name}.")
            continue
        if isinstance(value, list):  # entries written as mappings (eval.tasks): each one's numbers
            for i, entry in enumerate(value):
                if dataclasses.is_dataclass(entry):
                    problems += number_problems(entry, f"{prefix}{f.name}[{i}].")
            continue
        base, *extras = typing.get_args(tp) if typing.get_origin(tp) is Annotated else (tp,)
        if base in (int, float):
            bounds = next((e for e in extras if isinstance(e, Bounds)), Bounds())
            if (why := bounds.problem(value)) is not None:
                problems.append(f"{prefix}{f.name}: {why}")
    return problems


def path_problems(cfg) -> list[str]:
    """Path keys of the tree whose value, given as a path (or hub name), no filesystem can
    look up: too long (a part over 255 bytes, or the whole over 4096, on Linux) or holding a
    null character. Every later look-up (exists, is_file) would raise on it. Template text
    (a `text` key's value with a `{`) is not a path."""
    problems = []
    for key, name, kind in path_values(cfg):
        if not name or (kind.text and "{" in name):
            continue
        try:
            os.stat(os.path.expanduser(name))
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                problems.append(
                    f"{key}: a name of {len(name)} characters ({shown(name)}), longer than a path may be; "
                    "give a shorter path or name"
                )
        except ValueError:  # a null character
            problems.append(f"{key}: {shown(name)} holds a null character, which no path may; remove it")
    return problems


def resolve_chat_template(t: str) -> str | None:
    """data.chat_template: the text of a template file, the template text itself (it has
    `{`), or None for the tokenizer's own. Checked at start-up by `chat_template_problem`."""
    if t and "{" not in t:
        return _read_template(Path(t).expanduser())
    return t or None


def _read_template(path: Path) -> str:
    """A template file's text, read with a limit (one more character than a template may
    have, for `chat_template_problem` to refuse)."""
    with open(path, encoding="utf-8") as f:
        return f.read(MAX_TEMPLATE_CHARS + 1)


def chat_template_problem(t: str) -> str | None:
    """Why data.chat_template `t` cannot be used, or None: a path (no `{` in it) that is not a
    readable UTF-8 file, or a template with a Jinja syntax error (with its line)."""
    if not t:
        return None
    where = "the template"
    if "{" not in t:
        path = Path(t).expanduser()
        if not path.is_file():
            what = f"{t} is not a file" if path.exists() else no_such_file(t)
            return f"data.chat_template: {what}; give a Jinja template file, or the template text itself"
        where = t
        try:
            t = _read_template(path)
        except (OSError, UnicodeDecodeError) as e:
            return f"data.chat_template: cannot read {where} ({describe(e)}); give a UTF-8 Jinja template file"
    if len(t) > MAX_TEMPLATE_CHARS:
        return (
            f"data.chat_template: {where} is longer than {MAX_TEMPLATE_CHARS} characters; no chat template needs that"
        )
    import jinja2

    install()  # the bounded sandbox (llmtrain.template), which also folds no huge constant while compiling
    try:
        # The environment transformers renders chat templates in (its own `generation`
        # tag included); private, but a public check would accept templates it rejects.
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(t)
    except jinja2.TemplateSyntaxError as e:
        return f"data.chat_template: {where} line {e.lineno}: Jinja syntax error ({e.message}); fix the template"
    except (RecursionError, MemoryError):  # Jinja's lexer and parser recurse with the nesting
        return f"data.chat_template: {where} is nested too deeply for Jinja to compile; simplify the template"
    return None


def demo_name_problems(cfg) -> list[str]:
    """A `demo:` name that is none of the demo's assets (a typo would otherwise be looked
    up on the hub), with the closest one."""
    problems = []
    for key, name in named(cfg):
        if isinstance(name, str) and name.startswith("demo:") and name not in DEMO_NAMES:
            close = closest(name, list(DEMO_NAMES))
            hint = f"did you mean {close}? " if close else ""
            problems.append(f"{key}: {name} is not one of the demo's assets; {hint}they are {', '.join(DEMO_NAMES)}")
    return problems


# What Accelerate imports for each log.tracker: without it, it logs nothing and only warns.
TRACKER_MODULES = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "trackio": ("trackio",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
}


def tracker_problem(tracker: str) -> str | None:
    if tracker in TRACKER_MODULES and not any(importlib.util.find_spec(m) for m in TRACKER_MODULES[tracker]):
        return f"log.tracker: {tracker} is not installed; pip install {tracker}, or set log.tracker=none"
    return None

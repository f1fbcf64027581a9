"""What makes a config valid beyond its types: the bounds of numbers, names that must be
paths, the chat template, the demo's asset names, installed trackers. Each section of the
schema checks itself with these in its `problems()`; nothing here reads the schema, so
schema.py imports this module and not the other way round.
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

from ..demo import DEMO_NAMES, named
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
        base, *extras = typing.get_args(tp) if typing.get_origin(tp) is Annotated else (tp,)
        if base in (int, float):
            bounds = next((e for e in extras if isinstance(e, Bounds)), Bounds())
            if (why := bounds.problem(value)) is not None:
                problems.append(f"{prefix}{f.name}: {why}")
    return problems


def path_problems(names: list[tuple[str, str]]) -> list[str]:
    """(key, name) pairs whose name, given as a path (or hub name), no filesystem can look
    up: too long (a part over 255 bytes, or the whole over 4096, on Linux) or holding a
    null character. Every later look-up (exists, is_file) would raise on it."""
    problems = []
    for key, name in names:
        if not isinstance(name, str) or not name:
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
TRACKER_MODULES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",)}


def tracker_problem(tracker: str) -> str | None:
    if tracker in TRACKER_MODULES and not any(importlib.util.find_spec(m) for m in TRACKER_MODULES[tracker]):
        return f"log.tracker: {tracker} is not installed; pip install {tracker}, or set log.tracker=none"
    return None

"""Bounds on rendering a chat template, in size and in time.

A chat template is code that comes with the data or the model: data.chat_template, or
the template of the model directory (tokenizer_config.json or chat_template.jinja).
transformers renders it in Jinja's ImmutableSandboxedEnvironment, which keeps it from
Python's internals but not from building a huge string or looping for hours:
`{{ 'x' * 10**10 }}` asks for 10 GB in one step (at compile time even, where Jinja folds
constants), and loops over `range` (each capped at 100000 items) nest. Rendering runs
inside datasets.map and the stream's reader, once per row and turn, so the bounds act on
each render, in whatever process renders:

- size: Jinja's sandbox is made to be extended by a subclass that intercepts operators
  (`intercepted_binops`, `call_binop`), calls, and attribute and item reads.
  `sandbox_class` refuses, before computing it, a repetition (`*`), concatenation (`+`),
  power or %-format whose result would pass MAX_RENDERED characters (or an integer past
  MAX_INT_BITS), a call or filter given a number past MAX_RENDERED (a width such as
  `ljust(10**10)`), and checks the text each block of the template and each `~` join.
  transformers builds its environment from the name ImmutableSandboxedEnvironment in
  its chat_template_utils module and takes no environment from its caller, so `install`
  points that name at the bounded class.
- time: each render runs under an interval timer (SIGALRM) of MAX_RENDER_SECONDS, which
  interrupts a long loop between two of its steps. A signal reaches only the main thread,
  which is where datasets.map (without num_proc) and DataLoader workers render; elsewhere
  the size bounds still hold.

A template past a bound stops the run (`TemplateLimit`, whatever data.bad_rows says: the
template is at fault, not the row), naming the template's source and the row. The
sandbox is not a memory jail: the bounds catch the ways a template builds much from
little in one step (Jinja's own operators and filters, the methods of str), and the timer
the ways it does so in many.
"""

from __future__ import annotations

import functools
import re
import signal
import threading
from contextlib import contextmanager

from .errors import DataError

MAX_RENDERED = 128 << 20  # characters of one rendered conversation: a row (files.MAX_ROW_BYTES) and the template's text
MAX_RENDER_SECONDS = 10.0  # one render of one conversation; a real template takes milliseconds
MAX_INT_BITS = 1 << 16  # an integer a template computes; a chat template needs small counts
MAX_TEMPLATE_CHARS = 1 << 20  # the template's own text; real ones have a few KiB


class TemplateLimit(DataError):
    """A chat template went past a bound while rendering; the message says which, and the
    caller puts the row and the template's source before it."""


def _too_long(how: str) -> TemplateLimit:
    return TemplateLimit(f"builds a text of more than {MAX_RENDERED} characters ({how})")


def _length(x) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else 0


def _check_numbers(args, kwargs=None) -> None:
    for value in [*args, *(kwargs or {}).values()]:
        if isinstance(value, int) and abs(value) > MAX_RENDERED:
            raise TemplateLimit(
                f"passes the number {value if value.bit_length() < 200 else 'of many digits'}, more "
                f"than the {MAX_RENDERED} characters a rendering may have"
            )


PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d*)(?:\.(\d*))?")
FORMAT_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")


def _check_format(text: str, spec: re.Pattern) -> None:
    """A width or precision in a format string past MAX_RENDERED ('%99999999999s')."""
    for match in spec.finditer(text):
        for number in re.findall(r"\d+", "".join(g or "" for g in match.groups())):
            if len(number) > 12 or int(number) > MAX_RENDERED:
                raise _too_long("a format field that wide")


@functools.cache
def sandbox_class() -> type:
    """ImmutableSandboxedEnvironment with the size bounds (see the module docstring)."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCode(CodeGenerator):
        def visit_Concat(self, node, frame):
            """`a ~ b` joined by the environment's checked concat, not an unchecked join."""
            if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
                return super().visit_Concat(node, frame)
            self.write("environment.concat(map(str, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write(")))")

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        code_generator_class = BoundedCode

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.filters = _BoundedFilters(self.filters)

        def call_binop(self, context, operator, left, right):
            ints = isinstance(left, int) and isinstance(right, int)
            if operator == "*":
                if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise TemplateLimit(f"multiplies numbers past {MAX_INT_BITS} bits")
                for seq, n in ((left, right), (right, left)):
                    if isinstance(n, int) and _length(seq) * n > MAX_RENDERED:
                        raise _too_long("repeating a text or list")
            elif operator == "**":
                if ints and abs(left) > 1 and right * left.bit_length() > MAX_INT_BITS:
                    raise TemplateLimit(f"raises a number to a power past {MAX_INT_BITS} bits")
            elif operator == "+":
                if _length(left) + _length(right) > MAX_RENDERED:
                    raise _too_long("joining two")
            elif operator == "%" and isinstance(left, str):
                _check_format(left, PERCENT_SPEC)
                _check_numbers(right if isinstance(right, tuple) else (right,))
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
            target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner = getattr(target, "__self__", None)
            if isinstance(owner, (str, list, tuple)):  # a width to a method of a text: 'x'.ljust(10**10)
                _check_numbers(args, kwargs)  # (a macro may well be given a large number from the data)
                name = getattr(target, "__name__", "")
                if name in ("format", "format_map") and isinstance(owner, str):
                    _check_format(owner, FORMAT_SPEC)
                if isinstance(owner, str) and _grows_past(name, owner, args):
                    raise _too_long(f"calling {name}")
            result = super().call(__context, __obj, *args, **kwargs)
            if _length(result) > MAX_RENDERED:
                raise _too_long("calling a function")
            return result

        def getattr(self, obj, attribute):
            return _checked(super().getattr(obj, attribute))

        def getitem(self, obj, argument):
            return _checked(super().getitem(obj, argument))

        @staticmethod
        def concat(parts):
            """The text of a block or of `a ~ b`, checked as it grows (Jinja joins with "".join)."""
            out, size = [], 0
            for part in parts:
                size += len(part)
                if size > MAX_RENDERED:
                    raise _too_long("joining texts")
                out.append(part)
            return "".join(out)

    return Bounded


def _grows_past(name: str, text: str, args: tuple) -> bool:
    """Whether str.join or str.replace on `text` would build more than MAX_RENDERED
    characters, known before building it (the result is checked after the call, when it
    has taken its memory already: [s] * 30 joined, s of 100 M, took 3 GB)."""
    if name == "join" and args and isinstance(args[0], (list, tuple)):
        return _joined_length(args[0], text) > MAX_RENDERED
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        count = text.count(old) if old else len(text) + 1
        return len(text) + count * (len(new) - len(old)) > MAX_RENDERED
    return False


def _joined_length(items, sep: str) -> int:
    return sum(len(x) if isinstance(x, str) else 0 for x in items) + len(sep) * max(len(items) - 1, 0)


def _checked(value):
    if _length(value) > MAX_RENDERED:
        raise _too_long("reading one")
    return value


class _BoundedFilters(dict):
    """The environment's filters, each refusing numbers past MAX_RENDERED (center(10**10),
    indent(10**10)) and a result past it; `format` also checks its %-format."""

    def __init__(self, filters: dict):
        super().__init__({name: self._bound(name, f) for name, f in filters.items()})

    def __setitem__(self, name, f):  # transformers adds its tojson after the environment is made
        super().__setitem__(name, self._bound(name, f))

    @staticmethod
    def _bound(name: str, f):
        at = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # where the filtered value is

        @functools.wraps(f)  # keeps Jinja's pass_context/pass_eval_context marks
        def bounded(*args, **kwargs):
            _check_numbers(args[at + 1 :], kwargs)
            if name == "join" and len(args) > at and isinstance(args[at], (list, tuple)):
                sep = args[at + 1] if len(args) > at + 1 and isinstance(args[at + 1], str) else kwargs.get("d", "")
                if _joined_length(args[at], sep if isinstance(sep, str) else "") > MAX_RENDERED:
                    raise _too_long("joining a list")  # before joining, not after
            if name == "format" and len(args) > at and isinstance(args[at], str):
                _check_format(args[at], PERCENT_SPEC)
            result = f(*args, **kwargs)
            if _length(result) > MAX_RENDERED:
                raise _too_long(f"the {name} filter")
            return result

        return bounded


def install() -> None:
    """Make transformers render chat templates in the bounded sandbox (idempotent; each
    process that renders calls it)."""
    from transformers.utils import chat_template_utils as ctu

    bounded = sandbox_class()
    if ctu.ImmutableSandboxedEnvironment is not bounded:
        ctu.ImmutableSandboxedEnvironment = bounded
        ctu._compile_jinja_template.cache_clear()  # templates compiled before were compiled unbounded


@contextmanager
def time_limit(seconds: float | None = None):
    """Raise TemplateLimit in the block after `seconds` (MAX_RENDER_SECONDS), from the main
    thread (elsewhere a signal cannot reach, and the block runs unbounded in time). A timer
    running before is set going again after."""
    seconds = MAX_RENDER_SECONDS if seconds is None else seconds
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def alarm(signum, frame):
        raise TemplateLimit(f"ran longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    previous = signal.SIG_DFL if previous is None else previous  # None: a handler set outside Python
    before, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if before:
            signal.setitimer(signal.ITIMER_REAL, before)


def template_source(chat_template: str, tokenizer) -> str:
    """Where the chat template that renders the rows comes from, for an error line."""
    if chat_template:
        return "data.chat_template" + ("" if "{" in chat_template else f" ({chat_template})")
    return f"the chat template of {tokenizer.name_or_path} (its tokenizer_config.json or chat_template.jinja)"

"""Tools for multi-turn GRPO: plain Python functions the policy may call, taken as TRL's
`tools=` takes them, so a function written for TRL works unchanged:

    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: The first number.
            b: The second number.
        \"\"\"
        return a + b

A tool is named 'path/to/file.py:function' or 'module:function' and loaded by path
(usercode.load_function). Its schema is what transformers' `get_json_schema` reads from the
type hints and the Google-style docstring, the form a chat template's `tools` takes, so a
model tuned for tool calling sees the tools as it was trained to; a function it cannot read
is one line at start naming it.

A call never stops the run: what goes wrong in it is a result the model sees, as TRL does,
and is counted (`Call.error`). Invariants of `ToolBox.call`:
- Whatever the function raises (an exit included) is an error result, '{"error": "<Type>:
  <message>"}'; the process state it changes is put back (usercode.contained). So is a call
  of an unknown tool, or with arguments that are not a mapping.
- It gets copies of the arguments, and runs in a thread of its own for at most
  `timeout_s`; a call still running then is an error result ("timed out") and is left to
  finish on its own (a Python thread cannot be stopped). `MAX_HUNG` calls still running at
  once stop the run, naming the tool, rather than let threads pile up.
- Its result becomes text (a string as it is, anything else as JSON, else its str()), cut
  to `max_chars` characters with a note saying how many more there were: a tool that returns
  megabytes costs neither the memory nor the tokenizer's time.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ToolError, describe
from ..usercode import contained, load_function

# Calls that timed out and still run, at once, at which a run stops: each holds a thread.
MAX_HUNG = 8


@dataclass(frozen=True)
class Tool:
    name: str  # what the model calls it: the function's name
    fn: Callable
    schema: dict  # {"type": "function", "function": {...}}, for the chat template's `tools`
    spec: str  # as the config names it
    file: str | None  # the function's file, for the line an error names


@dataclass(frozen=True)
class Call:
    """The outcome of one tool call, as the model sees it and as the metrics count it."""

    name: str
    content: str  # the tool message's content
    error: bool  # raised, timed out, unknown tool or bad arguments
    timed_out: bool = False
    cut: bool = False  # the result was longer than max_chars

    def message(self) -> dict:
        """The tool message a chat template renders."""
        return {"role": "tool", "name": self.name, "content": self.content}


def schema_of(fn: Callable, spec: str, key: str) -> dict:
    """transformers' JSON schema of `fn`, or one line naming the key, the tool and the fix."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # its parsing exceptions, a TypeError for a builtin: all the function's form
        raise ToolError(
            f"{key}: {spec}: transformers cannot read its schema ({describe(e)}); give every argument a type hint "
            "and a Google-style docstring with a description and an 'Args:' line per argument"
        ) from None


def load_tools(specs: list[str], key: str = "grpo.tools") -> list[Tool]:
    """The tools `specs` name, each loaded and its schema read; two of one name are refused
    (the model calls a tool by its name)."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        fn, file = load_function(spec, key, ToolError)
        schema = schema_of(fn, spec, key)
        name = schema["function"]["name"]
        if name in tools:
            raise ToolError(
                f"{key}: {tools[name].spec} and {spec} are both named {name!r}; the model calls a tool by its name"
            )
        tools[name] = Tool(name, fn, schema, spec, file)
    return list(tools.values())


def as_text(result) -> str:
    """A tool's result as the tool message's content: a string as it is, else JSON (what a
    model tuned on tool calls usually reads), else str()."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


def cut(text: str, max_chars: int) -> tuple[str, bool]:
    if len(text) <= max_chars:
        return text, False
    return f"{text[:max_chars]}... [{len(text) - max_chars} more characters cut]", True


class ToolBox:
    """The tools of a run, called by name with the arguments the model wrote."""

    def __init__(
        self,
        tools: list[Tool],
        timeout_s: float,
        max_chars: int,
        key: str = "grpo.tools",
        hung: list[tuple[str, threading.Thread]] | None = None,
    ):
        self.tools = {t.name: t for t in tools}
        self.timeout_s, self.max_chars, self.key = timeout_s, max_chars, key
        # Calls that timed out and may still run: a run's episodes share one list (`hung`),
        # so MAX_HUNG counts the run's threads, not one episode's.
        self.hung = [] if hung is None else hung

    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def call(self, name: str, arguments) -> Call:
        """Call tool `name` with `arguments` (the mapping the model wrote), as the module
        docstring says."""
        tool = self.tools.get(name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return self.failed(name, f"unknown tool {name!r} (the tools: {known})")
        if not isinstance(arguments, dict):
            return self.failed(name, f"the arguments must be an object of named values, not {as_text(arguments)!r}")
        self.check_hung()
        box: dict = {}
        abandoned = threading.Event()  # set when the call times out: its end then puts nothing back

        def run() -> None:
            try:
                spec = f"{self.key}: {tool.spec}"
                with contained(spec, ToolError, "fix the tool", tool.file, lambda: not abandoned.is_set()):
                    try:
                        box["result"] = tool.fn(**copy.deepcopy(arguments))
                    except BaseException as e:  # what the model is told; contained names it for the log
                        box["error"] = describe(e)
                        raise
            except ToolError as e:  # state the tool changed (put back) or inference mode left on
                box.setdefault("error", str(e))

        thread = threading.Thread(target=run, name=f"tool {name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            abandoned.set()
            self.hung.append((tool.spec, thread))
            return self.failed(name, f"timed out after {self.timeout_s:g} s", timed_out=True)
        if "error" in box:
            return self.failed(name, box["error"])
        content, was_cut = cut(as_text(box.get("result")), self.max_chars)
        return Call(name, content, error=False, cut=was_cut)

    def failed(self, name: str, why: str, timed_out: bool = False) -> Call:
        content, was_cut = cut(json.dumps({"error": why}, ensure_ascii=False), self.max_chars)
        return Call(name, content, error=True, timed_out=timed_out, cut=was_cut)

    def check_hung(self) -> None:
        self.hung[:] = [(spec, t) for spec, t in self.hung if t.is_alive()]
        if len(self.hung) >= MAX_HUNG:
            specs = sorted({spec for spec, _ in self.hung})
            raise ToolError(
                f"{self.key}: {len(self.hung)} calls of {', '.join(specs)} timed out and still run, each holding a "
                f"thread; fix the tool so that a call returns (it was given {self.timeout_s:g} s)"
            )

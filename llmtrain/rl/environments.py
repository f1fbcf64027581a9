"""Environments for multi-turn GRPO, as TRL's `environment_factory` takes them, so a class
written for TRL works unchanged:

    class GuessingGame:
        def reset(self, **row) -> str | None: ...      # optional: text added to the prompt's last user message
        def guess(self, n: int) -> str: ...            # every public method is a tool (rl/tools.py)
        def get_reward(self) -> float: ...             # optional: scores the finished episode

A factory (a class, or a function returning an instance) is named 'path/to/file.py:Name' or
'module:Name' and loaded by path (usercode.load_function). `load_environments` probes one
instance of each at start, so a method transformers cannot describe is one line before
anything trains. Several environments are named by a mapping, and each row's `environment`
column picks one, as TRL does.

Invariants of an `Episode`:
- One instance per episode, made by the factory: episodes never share state.
- `reset` gets copies of the row's columns (without `environment`); it may return text or
  None, anything else is an error naming the environment. An environment without `reset`
  starts as the factory made it.
- Its methods are called as any tool is (tools.ToolBox: contained, copied arguments, a
  timeout, bounded output): what goes wrong in a call is a result the model sees.
- What goes wrong in the factory, `reset` or `get_reward` is the environment's fault, not the
  model's: one line naming it (ToolError), which stops the run after a checkpoint.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ToolError, shown
from ..usercode import contained, load_function
from .tools import Tool, ToolBox, schema_of

HOOKS = ("reset", "get_reward")  # methods an environment may define that are not tools
COLUMN = "environment"  # the row column that names a row's environment among several
FIX = "fix the environment"


@dataclass(frozen=True)
class Environment:
    """An environment kind: its factory and what a probe instance showed of it."""

    name: str | None  # its key in a mapping of several (the `environment` column's value); None for one
    factory: Callable
    spec: str
    file: str | None
    schemas: dict[str, dict]  # tool name -> schema, for the chat template's `tools`
    resets: bool
    rewards: bool


def methods_of(instance) -> list[str]:
    """The public methods of an instance's class, hooks left out. Read from the class, not the
    instance, so a property is never evaluated."""
    return [
        name
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if not name.startswith("_") and name not in HOOKS
    ]


def make(factory: Callable, spec: str, file: str | None, key: str):
    with contained(f"{key}: {spec}", ToolError, FIX, file):
        return factory()


def load_environments(specs: str | dict[str, str], key: str = "grpo.environment") -> dict[str | None, Environment]:
    """The environment kinds `specs` names (one spec, or {name: spec} for several), each
    loaded and probed with one instance."""
    named = {None: specs} if isinstance(specs, str) else dict(specs)
    kinds = {}
    for name, spec in named.items():
        where = key if name is None else f"{key}.{name}"
        factory, file = load_function(spec, where, ToolError)
        probe = make(factory, spec, file, where)
        schemas = {}
        for method in methods_of(probe):
            schemas[method] = schema_of(getattr(probe, method), f"{spec}.{method}", where)
        resets = callable(getattr(probe, "reset", None))
        rewards = callable(getattr(probe, "get_reward", None))
        if not schemas and not rewards:
            raise ToolError(
                f"{where}: {spec} has no public method to call as a tool and no get_reward; an environment's "
                "methods are the tools the model calls"
            )
        kinds[name] = Environment(name, factory, spec, file, schemas, resets, rewards)
    return kinds


def pick(kinds: dict[str | None, Environment], row: dict, key: str = "grpo.environment") -> Environment:
    """The row's environment: the only one, or the one its `environment` column names."""
    if None in kinds:
        return kinds[None]
    name = row.get(COLUMN)
    if name not in kinds:
        raise ToolError(
            f"{key}: a row's {COLUMN!r} column is {shown(name)}, not one of the environments {sorted(kinds)}; give "
            f"every row an {COLUMN!r} column naming one"
        )
    return kinds[name]


class Episode:
    """One episode's environment (see the module docstring): `observation` is what `reset`
    returned, `tools` calls its methods (and the run's tools given as `also`), `reward()`
    asks `get_reward`."""

    def __init__(
        self,
        kind: Environment,
        row: dict,
        timeout_s: float,
        max_chars: int,
        key: str = "grpo.environment",
        also: tuple[Tool, ...] = (),
        hung: list | None = None,
    ):
        self.kind, self.key = kind, key if kind.name is None else f"{key}.{kind.name}"
        self.instance = make(kind.factory, kind.spec, kind.file, self.key)
        self.observation = None
        if kind.resets:
            columns = {k: copy.deepcopy(v) for k, v in row.items() if k != COLUMN}
            with contained(f"{self.key}: {kind.spec}.reset", ToolError, FIX, kind.file):
                observation = self.instance.reset(**columns)
            if observation is not None and not isinstance(observation, str):
                raise ToolError(
                    f"{self.key}: {kind.spec}.reset returned {shown(observation)}; return the text to add to the "
                    "prompt, or None"
                )
            self.observation = observation
        tools = [
            Tool(name, getattr(self.instance, name), schema, f"{kind.spec}.{name}", kind.file)
            for name, schema in kind.schemas.items()
        ]
        # `also`: the run's own tools (grpo.tools), beside the environment's; `hung`: the run's
        # list of timed-out calls (tools.ToolBox).
        self.tools = ToolBox([*also, *tools], timeout_s, max_chars, self.key, hung)

    def outcome(self) -> float | None:
        """get_reward()'s score of the finished episode (None: unscored, or no get_reward)."""
        if not self.kind.rewards:
            return None
        with contained(f"{self.key}: {self.kind.spec}.get_reward", ToolError, FIX, self.kind.file):
            value = self.instance.get_reward()
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise ToolError(
                f"{self.key}: {self.kind.spec}.get_reward returned {shown(value)}; return a finite number, or None"
            )
        return float(value)

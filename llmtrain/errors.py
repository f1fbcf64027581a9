"""User errors: what a user's config, data, model or environment got wrong.

Every problem a user can fix is raised as one of the `UserError` subclasses defined here.
Its message has one line per problem, each naming the config key, and the file and line
or row where there is one, then what is wrong and how to fix it; `cli.user_errors`
prints each as `error: <line>` and exits 2.
A library's exception caused by the user's input is caught where that input is used and
raised again as a UserError (`describe` gives its gist in one line). Any other exception
is a bug and keeps its traceback.
"""

from __future__ import annotations

import reprlib
from itertools import islice


class UserError(ValueError):
    """A problem in the user's input; one line per problem."""


class ConfigError(UserError):
    """Bad configuration. `problems` holds one line per problem, each naming its key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class DataError(UserError):
    """Bad data: the message names the config key, the file and the line or row."""


class ModelError(UserError):
    """A model, tokenizer or reference that cannot be loaded or used as configured."""


class AttentionError(UserError):
    """An attention backend the model, the device or packed rows cannot use."""


class CheckpointError(UserError):
    """A checkpoint or output directory that cannot be written, read or resumed from."""


class TrainingError(UserError):
    """Training cannot go on; the message says what happened and what to try."""


class RewardError(DataError):
    """A reward function (grpo.rewards) that cannot be loaded, does not fit the data, or
    fails or returns something other than a number per completion: named in the message.
    A DataError, so one met during training stops every process after a checkpoint."""


class ToolError(DataError):
    """A tool (grpo.tools) that cannot be loaded or described, or whose calls keep hanging:
    named in the message. What goes wrong within a call is the model's to see, not an error
    (rl/tools.py). A DataError, so one met during training stops every process after a
    checkpoint."""


class LinkError(UserError):
    """A link where llmtrain writes, which it will not write through."""


class CacheError(UserError):
    """A cache directory that cannot be used; names the variable that chose it."""


def describe(e: BaseException) -> str:
    """'<Type>: <first non-empty line of the message>' (with the lines after it if it ends
    in ':'), or the type alone: the gist of a library exception for a one-line error (some
    have empty or many-line messages), cut to 300 characters (some quote a value whole)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    gist = lines[0]
    if gist.endswith(":"):  # it says nothing without what follows
        gist = " ".join(lines)
    gist = gist if len(gist) <= 300 else gist[:297] + "..."
    return f"{type(e).__name__}: {gist}"


def shown(value) -> str:
    """A user's value as an error message quotes it: its repr, cut to a few hundred
    characters. reprlib builds the cut text without the whole repr, so a long row or an
    alias-expanded YAML value never becomes a long (or huge) message."""
    text = _Short().repr(value)
    return text if len(text) <= 300 else text[:297] + "..."


class _Short(reprlib.Repr):
    """reprlib's bounds, with a mapping's keys in their own order (reprlib sorts them)."""

    def __init__(self):
        super().__init__()
        self.maxstring = self.maxother = 120  # at most 8**4 such pieces before the cut to 300
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict, self.maxset = 4, 8, 8, 8, 8

    def repr_dict(self, x, level):
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in islice(x.items(), self.maxdict)]
        return "{" + ", ".join(pieces + ["..."] * (len(x) > self.maxdict)) + "}"


def warn(message: str) -> None:
    """'warning: <message>' on stderr, from the main process only: something the user
    should know that does not stop the run."""
    import sys

    from accelerate import PartialState

    if PartialState().is_main_process:
        print(f"warning: {message}", file=sys.stderr, flush=True)

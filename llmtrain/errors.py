"""User errors: what a user's config, data, model or environment got wrong.

Every problem a user can fix is raised as a `UserError` (ConfigError, DataError,
ModelError, CheckpointError, TrainingError). Its message has one line per problem, each
naming the config key, and the file and line or row where there is one, then what is
wrong and how to fix it; `cli.user_errors` prints each as `error: <line>` and exits 2.
A library's exception caused by the user's input is caught where that input is used and
raised again as a UserError (`describe` gives its gist in one line). Any other exception
is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem in the user's input; one line per problem."""


class DataError(UserError):
    """Bad data: the message names the config key, the file and the line or row."""


def describe(e: BaseException) -> str:
    """'<Type>: <first non-empty line of the message>' (with the lines after it if it ends
    in ':'), or the type alone: the gist of a library exception for a one-line error (some
    have empty or many-line messages)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    gist = lines[0]
    if gist.endswith(":"):  # it says nothing without what follows
        gist = " ".join(lines)
        gist = gist if len(gist) <= 300 else gist[:297] + "..."
    return f"{type(e).__name__}: {gist}"


def warn(message: str) -> None:
    """'warning: <message>' on stderr, from the main process only: something the user
    should know that does not stop the run."""
    import sys

    from accelerate import PartialState

    if PartialState().is_main_process:
        print(f"warning: {message}", file=sys.stderr, flush=True)

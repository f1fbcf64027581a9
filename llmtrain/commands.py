"""The `llmtrain` command: `llmtrain plan` (plan.py) and `llmtrain eval` (evaluation.py), each
with one error line for a user's mistake and an exit that no thread left running holds up."""

from __future__ import annotations

import sys

from . import evaluation, plan, verify
from .cli import exit_past_threads, user_errors
from .observe.console import survive_closed_streams
from .observe.quiet import quiet_bars_off_terminal

COMMANDS = {"plan": plan.plan, "eval": evaluation.main, "verify": verify.main}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    survive_closed_streams()  # `llmtrain plan | head` ends in no traceback
    quiet_bars_off_terminal()
    if argv[:1] in (["-h"], ["--help"]) or argv[:2] in (["plan", "-h"], ["plan", "--help"]):
        print(plan.usage())
        return
    command = COMMANDS.get(argv[0]) if argv else None
    if command is None:
        said = f"unknown command {argv[0]!r}; " if argv else ""
        print(
            f"error: {said}the commands are `llmtrain plan`, `llmtrain eval` and `llmtrain verify`; "
            "`llmtrain --help` lists what there is",
            file=sys.stderr,
        )
        sys.exit(2)
    code = 1
    try:
        with user_errors():
            command(argv[1:])
        code = 0
    except SystemExit as e:
        code = e.code
        raise
    finally:  # a reward module the command imported may have left a thread running: it still exits
        exit_past_threads(code)


if __name__ == "__main__":
    main()

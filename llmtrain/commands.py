"""The `llmtrain` command: `llmtrain plan` (plan.py) and `llmtrain eval` (evaluation.py)."""

from __future__ import annotations

import sys

from . import evaluation, plan
from .observe.console import survive_closed_streams
from .observe.quiet import quiet_bars_off_terminal


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:
        survive_closed_streams()  # `llmtrain eval ... | head` ends in no traceback
        quiet_bars_off_terminal()
        evaluation.run(argv[1:])
        return
    plan.main(argv)


if __name__ == "__main__":
    main()

"""Runs command lines as the CLI does, one after another in this one process, so the
end-to-end error cases (tests/test_errors.py) start Python and import torch once rather
than once a case. A case is [command, argv] or [command, argv, cwd]: recipes/finetune.py's
or recipes/dpo.py's arguments, through cli.run_cli as their `__main__` runs them, or
`llmtrain plan`'s, through commands.main as the entry point runs it. Prints {name: {"code":
exit code, "stderr": what it wrote, "traceback": an exception that escaped, or ""}} as
JSON on its last line."""

import contextlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

import dpo  # noqa: E402
import finetune  # noqa: E402

from llmtrain import commands
from llmtrain.cli import run_cli


def run(command: str, argv: list[str], cwd: str | None = None) -> dict:
    err, code, escaped, start = io.StringIO(), None, "", os.getcwd()
    os.chdir(cwd or start)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            if command == "plan":
                commands.main(["plan", *argv])
            else:
                run_cli({"finetune": finetune.main, "dpo": dpo.main}[command], argv)
            code = 0
        except SystemExit as e:
            code = e.code
        except BaseException:
            escaped = traceback.format_exc()[-3000:]
    os.chdir(start)
    return {"code": code, "stderr": err.getvalue(), "traceback": escaped}


def main(spec: str) -> None:
    cases = json.loads(Path(spec).read_text())
    print(json.dumps({name: run(*case) for name, case in cases.items()}))


if __name__ == "__main__":
    main(sys.argv[1])

"""The code is formatted and lint-clean, with the settings in pyproject.toml."""

import subprocess
import sys

import pytest

from tests.support.runs import ROOT


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    proc = subprocess.run([sys.executable, "-m", "ruff", *command, "."], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, (
        f"ruff {' '.join(command)} . found problems (fix with: ruff check --fix . && "
        f"ruff format .):\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    )

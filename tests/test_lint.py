"""The project's code is formatted and lint-clean, with the settings in pyproject.toml.

Only the project's own files are checked: the ones git tracks (a user's reward function or
script in the clone is theirs, not the suite's to fail on); without git (an unpacked
archive), the project's folders."""

import shutil
import subprocess
import sys

import pytest

from tests.support.runs import ROOT

FOLDERS = ["llmtrain", "recipes", "tests", "benchmarks"]


def project_files() -> list[str]:
    if (ROOT / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(["git", "ls-files", "-z", "*.py"], capture_output=True, text=True, cwd=ROOT)
        if listed.returncode == 0:
            return [name for name in listed.stdout.split("\0") if name and (ROOT / name).is_file()]
    return FOLDERS


def test_a_file_of_the_users_own_is_not_checked(tmp_path):
    untracked = ROOT / "tests" / "_not_tracked_by_git.py"
    untracked.write_text("import os,sys\n")  # unsorted, unused, unformatted
    try:
        files = project_files()
    finally:
        untracked.unlink()
    if files is FOLDERS:
        pytest.skip("not a git checkout: the project's folders are checked")
    assert "tests/_not_tracked_by_git.py" not in files
    assert "llmtrain/recipe.py" in files and "tests/test_lint.py" in files


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *project_files()], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, (
        f"ruff {' '.join(command)} found problems (fix with: ruff check --fix . && "
        f"ruff format .):\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    )

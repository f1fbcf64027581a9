"""The README stays true: its reference lists every config key, and CI runs its test command."""

import re

from llmtrain.config import field_docs

from .conftest import ROOT

README = (ROOT / "README.md").read_text()


def test_config_reference_lists_every_key_with_its_default():
    for key, default, doc in field_docs():
        assert f"| `{key}` | `{default}` |" in README, key
        assert doc, f"{key} has no docstring in llmtrain/config.py"


def test_config_reference_is_what_the_schema_prints():
    import subprocess
    import sys

    table = subprocess.run(
        [sys.executable, "-m", "llmtrain.config"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert table.strip() in README, "regenerate the README table: python -m llmtrain.config"


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    test_command = next(b for b in blocks if "pytest" in b)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_readme_names_only_shipped_files():
    for path in set(
        re.findall(r"(?:recipes/configs|accelerate_configs|recipes/slurm)/[\w.]+\.(?:yaml|sbatch|sh)", README)
    ):
        assert (ROOT / path).is_file(), path

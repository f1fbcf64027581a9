"""Importing llmtrain shortens OpenMP's spin before idle threads sleep (GOMP_SPINCOUNT) before
torch loads OpenMP, unless the user chose a wait policy or spin count."""

import ast
import os
import subprocess
import sys

import pytest

from tests.support.runs import ROOT

PROBE = (
    "import os, sys, llmtrain; print('torch' in sys.modules, os.getenv('OMP_WAIT_POLICY'), os.getenv('GOMP_SPINCOUNT'))"
)


@pytest.mark.parametrize(
    ("env", "printed"),
    [
        ({}, "False None 3000"),  # set, and torch not yet loaded, so OpenMP reads it
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "False PASSIVE None"),  # the user's choice of policy
        ({"GOMP_SPINCOUNT": "300000"}, "False None 300000"),  # or of spin
    ],
)
def test_idle_openmp_threads_spin_briefly_unless_the_user_chose(env, printed):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-c", PROBE], env=base | env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == printed.split()


def test_every_recipe_imports_llmtrain_before_torch():
    """A recipe imports only the standard library before llmtrain, so the spin count is in
    the environment when torch loads OpenMP."""
    for script in sorted((ROOT / "recipes").glob("*.py")):
        imports = [n for n in ast.parse(script.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [(n.module if isinstance(n, ast.ImportFrom) else n.names[0].name).split(".")[0] for n in imports]
        first = names.index("llmtrain")
        assert all(name in sys.stdlib_module_names for name in names[:first]), script.name

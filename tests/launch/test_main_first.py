"""A user error that the main process meets first, while the others wait for its data (the
main-first step of distributed/launch.py), ends every process of a two-process run quietly,
printed once (the launch checks themselves: tests/distributed/test_launch.py)."""

import pytest

from tests.support.runs import run_recipe

pytestmark = pytest.mark.slow


def test_a_user_error_the_main_process_meets_first_ends_every_process_quietly(
    base_config, tiny_model, cache_env, tmp_path
):
    """The main process tokenizes first while the others wait: its data error reaches them,
    so it is printed once and no process dies in a collective the main one left."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": 5}\n')
    args = ["--config", str(base_config), f"model.name_or_path={tiny_model}", f"data.train={bad}"]
    proc = run_recipe([*args, f"output_dir={tmp_path / 'run'}"], cache_env, nproc=2, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: data.train: {bad} line 2: 'text' must be a string; data.bad_rows=skip would drop malformed "
        "rows instead"
    ]
    assert "exitcode  : 2" in proc.stderr  # the launcher's report: the process that exited first, with 2
    ours = [line for line in proc.stderr.splitlines() if "llmtrain/" in line or 'recipes/finetune.py", line' in line]
    assert not ours and "gloo" not in proc.stderr and "[rank" not in proc.stderr

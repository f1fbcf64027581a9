"""A recipe refuses, in one line and before it writes anything, a symbolic link planted where
it writes and an unusable datasets cache (the checks themselves: tests/test_safefs.py)."""

import pytest

from tests.support.links import untouched
from tests.support.runs import recipe_args, run_recipe


@pytest.mark.slow
def test_a_recipe_refuses_a_planted_metrics_link_in_one_line(base_config, tiny_model, chat_file, cache_env, victim):
    (victim.out / "metrics.jsonl").symlink_to(victim.file)
    proc = run_recipe(recipe_args(base_config, tiny_model, chat_file, victim.out), cache_env, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: output_dir: {victim.out / 'metrics.jsonl'} is a symbolic link (to {victim.file}); llmtrain does "
        "not write through links it did not make; remove it or choose another output_dir"
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    untouched(victim)


@pytest.mark.slow
def test_a_recipe_with_an_unusable_datasets_cache_stops_in_one_line(
    base_config, tiny_model, chat_file, cache_env, tmp_path
):
    (tmp_path / "a_file").write_text("")
    env = dict(cache_env, HF_DATASETS_CACHE=str(tmp_path / "a_file"))
    proc = run_recipe(recipe_args(base_config, tiny_model, chat_file, tmp_path / "run"), env, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: HF_DATASETS_CACHE: {tmp_path / 'a_file'} is not a directory; set HF_DATASETS_CACHE to a directory "
        "you can write to"
    ], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # stopped before anything was written

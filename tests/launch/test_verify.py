"""`llmtrain verify` (llmtrain/verify.py) as a user runs it: it passes on a model and data
that keep the guarantees, and fails, naming the check and why, where they cannot hold."""

import json
import sys

import pytest

from tests.support.runs import LLMTRAIN, run_python

pytestmark = pytest.mark.slow


def verify(args: list[str], env: dict):
    return run_python([sys.executable, str(LLMTRAIN), "verify", *args], env, 900)


def test_verify_passes_where_the_guarantees_hold(base_config, tiny_model, chat_file, cache_env, tmp_path):
    report = tmp_path / "report.json"
    given = ["--config", str(base_config), f"model.name_or_path={tiny_model}", f"data.train={chat_file}"]
    proc = verify([*given, "--output", str(report)], cache_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(report.read_text())["checks"]
    names = [c["name"] for c in checks]
    assert names == [
        "accumulation vs one micro-batch",
        "2 processes vs one micro-batch",
        "resume vs uninterrupted",
        "resume on 2 processes vs uninterrupted",
    ]
    assert all(c["passed"] for c in checks)
    assert next(c for c in checks if c["name"] == "resume vs uninterrupted")["worst"] == 0.0  # exact
    assert "4 of 4 checks passed" in proc.stdout
    for name in names:
        assert any(line.startswith(name) and "pass" in line for line in proc.stdout.splitlines()), name


def test_verify_fails_with_dropout_left_on_and_says_so(base_config, tiny_model, chat_file, cache_env, tmp_path):
    """A model whose config keeps dropout on (model.dropout=model, the default, keeps it):
    each layout draws other masks, so the layout checks fail, saying why and what to set."""
    from transformers import AutoConfig, AutoTokenizer

    dropped = tmp_path / "dropout-model"
    config = AutoConfig.from_pretrained(tiny_model)
    config.attention_dropout = 0.2
    config.save_pretrained(dropped)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(dropped)
    given = ["--config", str(base_config), f"model.name_or_path={dropped}", f"data.train={chat_file}"]
    proc = verify(given, cache_env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = "dropout is on (config.attention_dropout=0.2): each layout draws other masks; set model.dropout=none"
    assert f"accumulation vs one micro-batch: {said}" in proc.stdout
    assert f"2 processes vs one micro-batch: {said}" in proc.stdout

"""`llmtrain eval`'s table, JSON report and one-line errors (its runs: tests/launch/
test_evaluation.py, and the GRPO and DPO launch tests)."""

import pytest

from llmtrain.errors import ConfigError
from llmtrain.evaluation import column, main, report, table


def test_the_table_puts_each_model_in_a_column_and_the_last_minus_the_first_after_them(tmp_path):
    (tmp_path / "run" / "final").mkdir(parents=True)
    final = str(tmp_path / "run" / "final")
    results = {"org/base": {"eval_loss": 2.5, "eval_reward": 0.25}, final: {"eval_loss": 1.25}}
    assert table(results).splitlines() == [
        "             org/base  run/final  difference",
        "eval_loss      2.5000     1.2500     -1.2500",
        "eval_reward    0.2500          -           -",
    ]
    assert report(results) == {"models": results, "difference": {"eval_loss": -1.25}}
    assert "difference" not in table({"org/base": {"eval_loss": 2.5}}) and "difference" not in report(
        {"org/base": {"eval_loss": 2.5}}
    )
    assert column(str(tmp_path / "run")) == "run" and column("org/base") == "org/base"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--config", "c.yaml"], "llmtrain eval: name the model(s) to measure"),
        (["m", "model.name_or_path=m", "data.train=d.jsonl"], "data.eval: llmtrain eval measures on held-out data"),
    ],
)
def test_a_missing_model_or_held_out_set_is_one_line_naming_the_fix(argv, said, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("model: {name_or_path: m}\ndata: {train: d.jsonl}\n")
    with pytest.raises(ConfigError) as e:
        main(argv)
    assert str(e.value).startswith(said) and len(str(e.value).splitlines()) == 1, str(e.value)

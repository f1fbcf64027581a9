"""eval.tasks (llmtrain/rl/tasks.py) on one process: prompts read through the row pipeline,
answered by the model (greedy, or sampled from seeds of their own), scored by each
function; figures with pass@k from the scores; bad functions as one line naming the key.
That the figures are the same on two processes, in `llmtrain eval` and with evaluation
on or off is tests/launch/test_evaluation.py's."""

from math import comb

import pytest
import torch
from accelerate import Accelerator

from llmtrain.config import Config
from llmtrain.config.load import load_config
from llmtrain.demo import make_prompts, write_jsonl
from llmtrain.errors import ConfigError, RewardError
from llmtrain.rl.tasks import Tasks

SCORES = []  # what the `spread` function gave, in call order (in the copy of this file it is loaded from)


def spread(completion_ids, **kwargs):
    """A score a random model's answers spread over: the share of even token ids."""
    out = [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
    SCORES.append(out)
    return out


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


@pytest.fixture
def accelerator():
    yield Accelerator(cpu=True)


def config(tmp_path, tiny_model, task: str, rows=None) -> Config:
    write_jsonl(rows if rows is not None else make_prompts(5, seed=2), tmp_path / "task.jsonl")
    path = tmp_path / "c.yaml"
    path.write_text(
        f"model: {{name_or_path: {tiny_model}}}\ndata: {{train: x.jsonl, max_seq_len: 128}}\n"
        f"train: {{micro_batch_size: 2, seed: 3}}\neval:\n  tasks:\n"
        f"    - {{prompts: {tmp_path / 'task.jsonl'}, {task}}}\n"
    )
    return load_config(path, [], Config)


def tasks(cfg, accelerator, tokenizer, model) -> Tasks:
    loaded = Tasks.load(cfg, accelerator, tokenizer)
    loaded.bind(model, False, lambda what: None)
    return loaded


def test_sampled_answers_give_the_mean_score_and_pass_at_k_the_same_at_every_evaluation(
    tmp_path, tiny_model, tokenizer, model, accelerator
):
    task = f"name: even, rewards: ['{__file__}:spread'], samples: 4, temperature: 2.0, pass_threshold: 0.5, "
    task += "max_new_tokens: 5"
    evaluator = tasks(config(tmp_path, tiny_model, task), accelerator, tokenizer, model)
    given = evaluator.tasks[0].rewards[0].fn.__globals__["SCORES"]
    model.train()
    out = evaluator.evaluate(step=2)
    scores = [s for call in given for s in call]  # 5 prompts x 4 answers, prompts in order on one process
    assert len(scores) == 20
    rows = [scores[i * 4 : (i + 1) * 4] for i in range(5)]
    passed = [sum(s >= 0.5 for s in row) for row in rows]
    assert 0 < sum(passed) < 20  # a spread: pass@k differs from pass@1
    want = {"eval_even/reward": sum(scores) / 20}
    for k in (1, 2, 4):
        want[f"eval_even/pass@{k}"] = sum(1 - comb(4 - c, k) / comb(4, k) for c in passed) / 5
    assert out == pytest.approx(want)  # one function: no figures of its own beside the task's
    assert evaluator.evaluate(step=3) == out  # the same draws at every evaluation
    assert model.training  # generation put the model back as it found it


def test_greedy_answers_are_scored_by_each_function(tmp_path, tiny_model, tokenizer, model, accelerator):
    task = f"name: g, rewards: [accuracy, '{__file__}:spread'], max_new_tokens: 3"
    out = tasks(config(tmp_path, tiny_model, task), accelerator, tokenizer, model).evaluate(step=0)
    assert set(out) == {
        "eval_g/reward",
        "eval_g/reward_accuracy",
        "eval_g/reward_spread",
        "eval_g/pass@1",
        "eval_g/pass@1_accuracy",
        "eval_g/pass@1_spread",
    }
    assert out["eval_g/reward"] == pytest.approx(out["eval_g/reward_accuracy"] + out["eval_g/reward_spread"])


def test_a_function_the_prompts_cannot_feed_or_that_fails_is_one_line_naming_the_task(
    tmp_path, tiny_model, tokenizer, model, accelerator
):
    no_answers = [{"prompt": "Say hi"}] * 3
    cfg = config(tmp_path, tiny_model, "name: a, rewards: [accuracy]", no_answers)
    with pytest.raises(
        RewardError, match=r"^eval\.tasks\[0\]\.rewards: accuracy compares completions with an 'answer'"
    ):
        Tasks.load(cfg, accelerator, tokenizer)
    broken = tmp_path / "broken.py"
    broken.write_text("def r(completions, **kwargs):\n    return [1 / 0 for c in completions]\n")
    cfg = config(tmp_path, tiny_model, f"name: b, rewards: ['{broken}:r'], max_new_tokens: 2")
    with pytest.raises(RewardError, match=r"^eval\.tasks\[0\]\.rewards: .*r.*ZeroDivisionError.*\(task b\)"):
        tasks(cfg, accelerator, tokenizer, model).evaluate(step=0)


@pytest.mark.parametrize(
    "task, said",
    [
        ("name: 'a b'", "eval.tasks[0].name: give a name of letters, digits, _ and -"),
        ("name: a, samples: 0", "eval.tasks[0].samples: must be at least 1, got 0"),
        ("name: a, sample: 2", "eval.tasks[0].sample: unknown key; did you mean 'eval.tasks[0].samples'?"),
    ],
)
def test_a_tasks_bad_setting_is_one_line_naming_its_key(tmp_path, tiny_model, task, said):
    from llmtrain.config.load import check

    with pytest.raises(ConfigError) as e:
        check(config(tmp_path, tiny_model, task))
    assert any(line.startswith(said) for line in str(e.value).splitlines())


def test_a_tasks_paths_expand_and_are_named_by_its_place(monkeypatch, tmp_path):
    """An entry's prompts and reward files are path keys like any other: ~ and $VARS
    expanded, an unset variable one problem naming eval.tasks[i].<key>."""
    monkeypatch.setenv("HOME", str(tmp_path))
    given = ["model.name_or_path=m", "data.train=d.jsonl"]
    cfg = load_config(None, [*given, "eval.tasks=[{name: a, prompts: ~/p.jsonl, rewards: [accuracy, ~/r.py:f]}]"])
    assert cfg.eval.tasks[0].prompts == f"{tmp_path}/p.jsonl"
    assert cfg.eval.tasks[0].rewards == ["accuracy", f"{tmp_path}/r.py:f"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*given, "eval.tasks=[{name: a}, {name: b, prompts: $LLMTRAIN_NOT_SET_ANYWHERE/p.jsonl}]"])
    assert any(p.startswith("eval.tasks[1].prompts: ") for p in e.value.problems), e.value.problems

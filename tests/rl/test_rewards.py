"""Reward functions (llmtrain/rl/rewards.py): the built-ins, loading the user's own by
name with TRL's signature, and one line naming the function for everything that can go
wrong with one."""

import math
import os
import sys

import pytest
import torch

from llmtrain.errors import RewardError
from llmtrain.rl.rewards import accuracy, format_reward, load_rewards, score, trainer_state
from tests.support.runs import ROOT


def test_accuracy_compares_numbers_as_numbers_and_words_exactly():
    completions = ["1,000", "The answer is 1000.0", "\\boxed{1000} since 999 + 1", "999", "STAR", "star", "STAR.", "x"]
    answers = ["1000", "1000", "1000", "1000", "STAR", "STAR", "STAR", None]
    assert accuracy(None, completions, answers) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, None]
    chat = [[{"role": "assistant", "content": "12"}]]
    assert accuracy(None, chat, [12]) == [1.0]
    # Nothing to compare with: unscored, not wrong (nor right, for an empty completion).
    assert accuracy(None, ["4", "", "[4]"], [["4"], " ", {"a": 4}]) == [None, None, None]


def test_format_matches_the_whole_completion():
    f = format_reward(r"<answer>\d+</answer>")
    assert f(["<answer>12</answer>", " <answer>12</answer>\n", "<answer>12</answer> and more"]) == [1.0, 1.0, 0.0]


def write(tmp_path, text: str):
    path = tmp_path / "my_rewards.py"
    path.write_text(text)
    return path


def test_user_functions_load_from_a_file_or_a_module_with_trls_signature(tmp_path, monkeypatch):
    path = write(
        tmp_path,
        "def trl_style(prompts, completions, completion_ids, **kwargs):\n"
        "    return [float(len(ids)) + (kwargs['bonus'][i] or 0) for i, ids in enumerate(completion_ids)]\n"
        "def narrow(completions, bonus):\n"
        "    return [None if b is None else 1.0 for b in bonus]\n"
        "def staged(completions, trainer_state):\n"
        "    return [float(trainer_state.global_step)] * len(completions)\n",
    )
    rewards = load_rewards([f"{path}:trl_style", f"{path}:narrow", f"{path}:staged"], {"bonus"})
    monkeypatch.chdir(tmp_path)
    rewards += load_rewards(["my_rewards:narrow"], {"bonus"})
    table = score(
        rewards, ["p", "q"], ["a", "bb"], [[1], [2, 3]], [{"bonus": 0.5}, {"bonus": None}], trainer_state(4, 9, 0)
    )
    assert table[0].tolist() == [1.5, 1.0, 4.0, 1.0]
    assert table[1, 0] == 2.0 and math.isnan(table[1, 1]) and table[1, 2] == 4.0


def test_a_module_reward_leaves_the_working_directorys_other_files_unimportable(tmp_path, monkeypatch):
    """'shadow_rewards:fn' finds shadow_rewards.py in the working directory, but a json.py or an
    uninstalled name there never shadows or joins what Python imports later."""
    import sys

    module = "import json\ndef fn(completions):\n    return [1.0] * len(completions)\n"
    (tmp_path / "shadow_rewards.py").write_text(module)
    (tmp_path / "json.py").write_text("raise SystemExit('planted json ran')\n")
    (tmp_path / "planted_helper.py").write_text("raise SystemExit('planted helper ran')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "json")  # imported afresh by my_rewards: the installed one must win
    rewards = load_rewards(["shadow_rewards:fn"], set())
    assert rewards and sys.modules["json"].__file__ != str(tmp_path / "json.py")
    assert str(tmp_path) not in sys.path and "" not in sys.path[:1]
    with pytest.raises(ModuleNotFoundError):
        __import__("planted_helper")


def test_a_column_some_rows_lack_is_passed_as_none_whichever_rows_are_drawn_together():
    """The data's columns (any row's) reach every call, None where a row lacks one: a batch
    whose rows all lack `answer` leaves accuracy's completions unscored, not failing."""
    (reward,) = load_rewards(["accuracy"], {"answer"})
    table = score([reward], ["p", "q"], ["7", "8"], [[1], [2]], [{}, {}], trainer_state(1, 9, 0), {"answer"})
    assert table.isnan().all()
    table = score([reward], ["p", "q"], ["7", "8"], [[1], [2]], [{"answer": "7"}, {}], None, {"answer"})
    assert table[0, 0] == 1.0 and math.isnan(table[1, 0])


@pytest.mark.parametrize(
    ("source", "spec", "message"),
    [
        (None, "nowhere.py:f", "no file"),
        ("x = 1\n", "{path}:f", "has no function 'f'"),
        ("raise ImportError('no numpy here')\n", "{path}:f", "{path}:f: its import raised ImportError: no numpy here"),
        ("def f(completions, solution): return [1.0]\n", "{path}:f", "needs column(s) ['solution']"),
        ("def f(completions, /): return [1.0]\n", "{path}:f", "by position only"),
        (None, "accuracy_typo", "neither a built-in"),
        (None, "accuracy", "'answer' column"),
    ],
)
def test_a_function_that_cannot_load_or_fit_the_data_is_one_line(tmp_path, source, spec, message):
    path = write(tmp_path, source) if source else tmp_path / "missing.py"
    with pytest.raises(RewardError) as e:
        load_rewards([spec.format(path=path)], {"question"})
    assert message.format(path=path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("return 1 / 0", "f raised ZeroDivisionError: division by zero"),
        ("return [1.0]", "returned 1 values for 2 completions"),
        ("return 'ok'", "returned 'ok' for 2 completions"),
        ("return [1.0, 'high']", "returned 'high' for completion 1"),
        ("return [1.0, float('inf')]", "returned inf for completion 1"),
        ("return [1.0, 1e39]", "returned 1e+39 for completion 1; return a finite number (within float32's range)"),
        ("return completions[7]", "f raised IndexError"),
    ],
)
def test_a_function_that_fails_or_returns_no_numbers_is_one_line(tmp_path, body, message):
    path = write(tmp_path, f"def f(completions, **kwargs):\n    {body}\n")
    (reward,) = load_rewards([f"{path}:f"], set())
    with pytest.raises(RewardError) as e:
        score([reward], ["p", "q"], ["a", "b"], [[1], [2]], [{}, {}], None)
    assert f"grpo.rewards: {path}:f" in str(e.value) and message in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model, tmp_path_factory):
    """A one-label sequence classifier on the tiny model, saved as recipes/reward.py saves one."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model.config.pad_token_id = tokenizer.pad_token_id
    path = tmp_path_factory.mktemp("reward_model") / "final"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_reward_model_scores_completions_as_transformers_scores_the_rendered_pair(reward_model_dir):
    """reward_model:DIR gives each completion the score plain transformers gives its
    prompt and completion rendered as recipes/reward.py renders a pair's answer (string and
    message prompts, batched with padding); an empty completion is left unscored."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from llmtrain.config import DataConfig
    from llmtrain.preference.pairs import PAIRS

    (reward,) = load_rewards([f"reward_model:{reward_model_dir}"], {"answer"})
    prompts = ["What is 2 + 2?", [{"role": "user", "content": "Uppercase: cat"}], "What is 3 + 1?", "Say hi"]
    completions = ["4", [{"role": "assistant", "content": "CAT"}], "the answer is four, I think", ""]
    got = reward(prompts, completions, [[1]] * 4, {"answer": ["4", "CAT", "4", "hi"]}, None)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    for i in range(3):
        other = "x" if completions[i] != "x" else "y"
        row = PAIRS.process(
            {"prompt": prompts[i], "chosen": completions[i], "rejected": other}, tokenizer, DataConfig()
        )
        with torch.no_grad():
            want = float(model(input_ids=torch.tensor([row["chosen_input_ids"]])).logits[0, 0])
        assert got[i] == pytest.approx(want, rel=1e-4, abs=1e-6), i
    assert math.isnan(got[3])


def test_a_reward_model_that_is_not_one_is_one_line(tiny_model, reward_model_dir, tmp_path):
    """A causal LM, a missing directory, a run's output_dir and LoRA adapters alone: one line
    each, naming the setting and what to give instead."""
    import shutil

    with pytest.raises(RewardError, match=r"grpo.rewards: reward_model:.* is not a reward model; give a one-label"):
        load_rewards([f"reward_model:{tiny_model}"], None)
    missing = tmp_path / "missing"
    with pytest.raises(RewardError, match=rf"^grpo.rewards: reward_model:{missing}: no such directory: {missing};"):
        load_rewards([f"reward_model:{missing}"], None)
    run = tmp_path / "run"
    shutil.copytree(reward_model_dir, run / "final")
    with pytest.raises(RewardError, match=r"has no config.json; it is a run's output_dir: give its model, "
                       rf"grpo.rewards=\[reward_model:{run / 'final'}\]$"):  # fmt: skip
        load_rewards([f"reward_model:{run}"], None)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "base"}')
    with pytest.raises(RewardError, match=r"holds LoRA adapters only \(adapter_config.json\), not a model; give a"):
        load_rewards([f"reward_model:{adapter}"], None)


def test_a_reward_model_without_a_chat_template_is_refused_for_conversation_prompts(reward_model_dir, tmp_path):
    """Checked when the data is read (grpo_prompts), not at the first scoring after a round
    of generation; text prompts need no template."""
    import shutil

    from transformers import AutoTokenizer

    plain = tmp_path / "plain"
    shutil.copytree(reward_model_dir, plain)
    tokenizer = AutoTokenizer.from_pretrained(plain)
    tokenizer.chat_template = None
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer.save_pretrained(plain)
    assert not AutoTokenizer.from_pretrained(plain).chat_template
    with pytest.raises(RewardError, match=rf"^grpo.rewards: reward_model:{plain}: its tokenizer has no chat template"):
        load_rewards([f"reward_model:{plain}"], {"answer"}, conversations=True)
    (reward,) = load_rewards([f"reward_model:{plain}"], {"answer"})
    assert math.isfinite(reward(["What is 2 + 2?"], ["4"], [[1]], {"answer": ["4"]}, None)[0])
    load_rewards([f"reward_model:{reward_model_dir}"], {"answer"}, conversations=True)


def test_each_reward_gets_a_metric_name_of_its_own():
    from llmtrain.rl.rollout import reward_labels

    names = ["accuracy", "a.py:short", "b.py:short", "reward_model:runs/rm/final", "my_rewards:length"]
    assert reward_labels(names) == ["accuracy", "short_2", "short_3", "reward_model", "length"]
    for names in (["a.py:short", "b.py:short", "c.py:short_2"], ["m:len", "m:len_std", "m:std", "m:x", "n:x"]):
        labels = reward_labels(names)
        keys = [k for label in labels for k in (f"reward_{label}", f"reward_{label}_std")]
        assert len(set(keys)) == len(keys) and "reward_std" not in keys, labels


def test_arrays_and_tensors_are_taken_as_lists(tmp_path):
    path = write(tmp_path, "import numpy, torch\ndef a(completions, **kw): return numpy.array([1.0, 0.5])\n"
                 "def t(completions, **kw): return torch.tensor([0.0, 2.0])\n")  # fmt: skip
    rewards = load_rewards([f"{path}:a", f"{path}:t"], set())
    assert score(rewards, ["p", "q"], ["a", "b"], [[1], [2]], [{}, {}], None).tolist() == [[1.0, 0.0], [0.5, 2.0]]


def test_a_module_that_exits_is_one_line_at_import_and_at_every_load(tmp_path):
    """A script's `sys.exit(main())` at the end of a reward file would end the run with exit
    status 0 and nothing saved; the failed import is not kept, so every load reports it."""
    path = write(
        tmp_path, "def f(completions, **kw):\n    return [1.0] * len(completions)\n\nimport sys\nsys.exit(0)\n"
    )
    for _ in range(2):
        with pytest.raises(RewardError) as e:
            load_rewards([f"{path}:f"], set())
        assert str(e.value).startswith(
            f"grpo.rewards: {path}:f: its import exited (SystemExit(0), from exit() or sys.exit()) (my_rewards.py:5); "
            "code that llmtrain runs must return, not exit"
        )


def test_a_function_that_exits_is_one_line_naming_it(tmp_path):
    path = write(tmp_path, "def f(completions, **kw):\n    exec('exit()')\n")
    (reward,) = load_rewards([f"{path}:f"], set())
    with pytest.raises(RewardError, match=r"^grpo.rewards: .*my_rewards.py:f exited \(SystemExit\(\), from exit\(\) or "
                       r"sys.exit\(\)\) \(my_rewards.py:2\); code that llmtrain runs must return"):  # fmt: skip
        score([reward], ["p"], ["a"], [[1]], [{}], None)


def test_a_module_or_function_that_turns_gradients_off_leaves_training_its_own(tmp_path, capsys):
    """torch.set_grad_enabled(False) at a module's top, or in a call, would end the run in a
    bare traceback at the next backward: it is put back, and said once."""
    path = write(
        tmp_path,
        "import os, torch\ntorch.set_grad_enabled(False)\n"
        "def f(completions, **kw):\n    torch.set_grad_enabled(False)\n    os.chdir(os.path.dirname(__file__))\n"
        "    return [1.0] * len(completions)\n",
    )
    cwd = os.getcwd()
    try:
        (reward,) = load_rewards([f"{path}:f"], set())
        assert torch.is_grad_enabled()
        for _ in range(2):
            score([reward], ["p"], ["a"], [[1]], [{}], None)
            assert torch.is_grad_enabled() and os.getcwd() == cwd
    finally:
        torch.set_grad_enabled(True)
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert err.count(f"warning: grpo.rewards: {path}:f: its import changed torch's grad mode (to False)") == 1
    assert err.count(f"warning: grpo.rewards: {path}:f changed torch's grad mode (to False)") == 1
    assert err.count(f"warning: grpo.rewards: {path}:f changed the working directory (to '{tmp_path}')") == 1


def test_a_function_edits_only_its_own_copies(tmp_path):
    """A function that edits what it receives in place changes neither the tokens that are
    trained (the caller's lists) nor what the next function receives."""
    path = write(
        tmp_path,
        "def edits(prompts, completions, completion_ids, answer, trainer_state, **kw):\n"
        "    for ids in completion_ids:\n        ids[:] = [0]\n"
        "    answer[0] = 'changed'; prompts.clear(); completions[0] = ''; trainer_state.global_step = -1\n"
        "    return [0.0] * len(completion_ids)\n"
        "def reads(prompts, completions, completion_ids, answer, trainer_state, **kw):\n"
        "    return [float(len(i) + len(p) + len(c) + (a == '7') + trainer_state.global_step)\n"
        "            for i, p, c, a in zip(completion_ids, prompts, completions, answer)]\n",
    )
    rewards = load_rewards([f"{path}:edits", f"{path}:reads"], {"answer"})
    ids, prompts, completions, rows = [[5, 6, 7]], ["pq"], ["abcd"], [{"answer": "7"}]
    state = trainer_state(10, 20, 0)
    table = score(rewards, prompts, completions, ids, rows, state)
    assert table[0].tolist() == [0.0, 3 + 2 + 4 + 1 + 10]
    assert ids == [[5, 6, 7]] and prompts == ["pq"] and completions == ["abcd"] and rows == [{"answer": "7"}]
    assert state.global_step == 10


def test_a_module_name_finds_the_working_directorys_file_before_a_recipe_or_the_standard_library(tmp_path, monkeypatch):
    """'reward:fn' and 'code:fn' name the user's reward.py and code.py in the working
    directory, though recipes/reward.py comes first on sys.path (the recipe's directory)
    and `code` is the standard library's."""
    import code  # noqa: F401 (imported already, as a library may have done)

    body = "def fn(completions, **kw):\n    return [2.0] * len(completions)\n"
    for name in ("reward", "dpo", "code"):
        (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    rewards = load_rewards(["reward:fn", "dpo:fn", "code:fn", "reward.py:fn"], set())
    assert score(rewards, ["p"], ["a"], [[1]], [{}], None).tolist() == [[2.0] * 4]
    assert all(r.file == str(tmp_path / f"{n}.py") for r, n in zip(rewards, ("reward", "dpo", "code", "reward")))


def test_a_reward_module_imports_helpers_beside_it_and_its_package_relative_ones(tmp_path, monkeypatch):
    """A file imports a helper module beside it while it loads; a package of the working
    directory ('pkg.rewards:fn') imports its own modules relatively; a dataclass in a file
    works (its module is in sys.modules while it runs)."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "scoring_helper.py").write_text("BONUS = 3.0\n")
    (tmp_path / "lib" / "scored.py").write_text(
        "from dataclasses import dataclass\nimport scoring_helper\n@dataclass\nclass Box:\n    value: float\n"
        "def fn(completions, **kw):\n    return [Box(scoring_helper.BONUS).value] * len(completions)\n"
    )
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "util.py").write_text("WEIGHT = 4.0\n")
    (tmp_path / "pkg" / "rewards.py").write_text(
        "from .util import WEIGHT\ndef fn(completions, **kw):\n    return [WEIGHT] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    rewards = load_rewards([f"{tmp_path / 'lib' / 'scored.py'}:fn", "pkg.rewards:fn"], set())
    assert score(rewards, ["p"], ["a"], [[1]], [{}], None).tolist() == [[3.0, 4.0]]
    assert str(tmp_path / "lib") not in sys.path and str(tmp_path) not in sys.path  # only while they loaded


def test_a_module_found_nowhere_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match=r"^grpo.rewards: nowhere_rewards:fn: no module 'nowhere_rewards' in the "
                       rf"working directory \({tmp_path}\) nor installed; run from the directory"):  # fmt: skip
        load_rewards(["nowhere_rewards:fn"], set())

"""Reward functions (llmtrain/rl/rewards.py): the built-ins, loading the user's own by
name with TRL's signature, and one line naming the function for everything that can go
wrong with one."""

import math

import pytest
import torch

from llmtrain.errors import RewardError
from llmtrain.rl.rewards import accuracy, format_reward, load_rewards, score, trainer_state


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
        ("raise ImportError('no numpy here')\n", "{path}:f", "loading {path}:f failed: ImportError: no numpy here"),
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

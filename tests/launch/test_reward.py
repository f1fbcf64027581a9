"""recipes/reward.py launched as a user launches it, on a tiny model and the demo's kind of
pairs: the step is the mean over every pair of the global batch on one process or two,
packed or padded; a resumed run continues the exact run; final/ scores text in plain
transformers as training scored it, full or LoRA."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmtrain.demo import make_pairs, write_jsonl
from tests.support.runs import REWARD_RECIPE, check_card, metrics, recipe_args, rewind, run_recipe, train_rows

pytestmark = pytest.mark.slow

METRICS = ["loss", "accuracy", "rewards_chosen", "rewards_rejected", "rewards_margin"]


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory) -> tuple[Path, Path]:
    """18 training pairs with margins (a last step of 2) and 6 eval pairs."""
    root = tmp_path_factory.mktemp("reward_pairs")
    train = make_pairs(18, seed=31)
    for i, row in enumerate(train):
        row["margin"] = (i % 3) * 0.5
    write_jsonl(train, root / "train.jsonl")
    write_jsonl(make_pairs(6, seed=32), root / "eval.jsonl")
    return root / "train.jsonl", root / "eval.jsonl"


@pytest.fixture(scope="module")
def args(base_config, tiny_model, pair_files):
    def make(out: Path, *extra: str) -> list[str]:
        train, evals = pair_files
        return recipe_args(
            base_config,
            tiny_model,
            train,
            out,
            f"data.eval={evals}",
            "eval.micro_batch_size=2",
            "eval.sample_prompts=[]",
            "train.lr=1e-3",
            "reward.center_coefficient=0.01",
            *extra,
        )

    return make


def reward(args: list[str], env: dict, nproc: int = 1):
    return run_recipe(args, env, nproc=nproc, recipe=REWARD_RECIPE)


def plain_scores(final: Path, eval_file: Path) -> tuple[list[float], list[float]]:
    """Each eval pair's chosen and rejected scores from final/ in plain transformers: the
    sequences as the recipe renders them (its tokenizer and chat template), one at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from llmtrain.config import DataConfig
    from llmtrain.preference.pairs import PAIRS

    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    chosen, rejected = [], []
    with torch.no_grad():
        for line in eval_file.read_text().splitlines():
            row = PAIRS.process(json.loads(line), tokenizer, DataConfig())
            if row["status"] != "ok":
                continue
            chosen.append(float(model(input_ids=torch.tensor([row["chosen_input_ids"]])).logits[0, 0]))
            rejected.append(float(model(input_ids=torch.tensor([row["rejected_input_ids"]])).logits[0, 0]))
    return chosen, rejected


def test_pairs_train_alike_on_one_process_and_two_resume_exactly_and_final_scores_in_transformers(
    args, pair_files, cache_env, tmp_path
):
    """Packed sequences of pairs as 4 x 1 on one process and 1 x 2 on each of two: the same losses,
    accuracies and weights; a run taken back to its first checkpoint continues bit for
    bit; final/ loads with AutoModelForSequenceClassification, and the eval accuracy and
    mean scores at the end are what plain transformers gives on the eval pairs."""
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    common = ["data.packing=true", "checkpoint.every_steps=1"]
    reward(args(one, *common, "train.micro_batch_size=4"), cache_env)
    reward(args(two, *common, "train.micro_batch_size=1", "train.grad_accum_steps=2"), cache_env, nproc=2)
    rows, ref = train_rows(two), train_rows(one)
    assert [r["pairs"] for r in rows] == [r["pairs"] for r in ref] and len(ref) >= 2
    for a, b in zip(rows, ref):
        for key in METRICS:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)
    w1, w2 = load_file(one / "final" / "model.safetensors"), load_file(two / "final" / "model.safetensors")
    assert "score.weight" in w1
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=1e-4, atol=1e-5, msg=key)

    rewind(resumed, 1, source=one)
    reward(args(resumed, *common, "train.micro_batch_size=4"), cache_env)
    assert [r["loss"] for r in train_rows(resumed)] == [r["loss"] for r in ref]
    for key, value in load_file(resumed / "final" / "model.safetensors").items():
        torch.testing.assert_close(value, w1[key], rtol=0, atol=0)

    chosen, rejected = plain_scores(one / "final", pair_files[1])
    check_card(one / "final", ["reward-model"], "AutoModelForSequenceClassification")
    last = [r for r in metrics(one) if "eval_loss" in r][-1]
    assert last["eval_accuracy"] == pytest.approx(sum(c > r for c, r in zip(chosen, rejected)) / len(chosen))
    assert last["eval_rewards_chosen"] == pytest.approx(sum(chosen) / len(chosen), rel=1e-4, abs=1e-5)
    assert last["eval_rewards_rejected"] == pytest.approx(sum(rejected) / len(rejected), rel=1e-4, abs=1e-5)


def test_lora_trains_the_adapters_and_the_whole_score_head_and_exports_merged(args, pair_files, cache_env, tmp_path):
    out = tmp_path / "lora"
    reward(args(out, "model.lora.enabled=true", "train.micro_batch_size=4"), cache_env)  # merged by default
    assert (out / "final" / "adapter" / "adapter_config.json").exists()
    adapter = load_file(out / "final" / "adapter" / "adapter_model.safetensors")
    assert any("score" in k for k in adapter)  # saved whole (modules_to_save), not adapted
    assert not any("score" in k and "lora_" in k for k in adapter)
    chosen, rejected = plain_scores(out / "final", pair_files[1])
    last = [r for r in metrics(out) if "eval_loss" in r][-1]
    assert last["eval_rewards_chosen"] == pytest.approx(sum(chosen) / len(chosen), rel=1e-4, abs=1e-5)

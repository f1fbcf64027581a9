import pytest
import yaml

from llmtrain.config import load_config
from llmtrain.output.card import (
    CardFacts,
    base_license,
    check_public,
    eval_figures,
    is_hub_name,
    public_name,
    render,
    settings,
)
from llmtrain.rl.config import GRPOConfig


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def facts(**kw) -> CardFacts:
    base = dict(
        name="qwen-chat",
        recipe="finetune",
        base="Qwen/Qwen2.5-0.5B",
        hub_base=True,
        settings={"train": {"lr": 1e-5}},
        data=[{"name": "train.jsonl", "sha256": "ab" * 32, "fraction": 1.0}],
        eval_data=[{"name": "eval.jsonl", "sha256": "cd" * 32}],
        hub_datasets=["org/chat"],
        steps=120,
        epochs=1,
        trained=54_180,
        unit="tokens",
        seconds=3723.0,
        hardware="8 x NVIDIA H200",
        precision="weights bfloat16",
        layout="FSDP2",
        loading="causal-lm",
        license="apache-2.0",
        tags=["llmtrain", "sft"],
    )
    return CardFacts(**(base | kw))


def test_the_card_has_the_hubs_front_matter_and_says_what_was_trained():
    text = render(facts(evals={"eval_loss": (2.5, 0, 1.25, 120)}, final={"loss": 1.3}, curve=True))
    assert front_matter(text) == {
        "base_model": "Qwen/Qwen2.5-0.5B",
        "library_name": "transformers",
        "license": "apache-2.0",
        "pipeline_tag": "text-generation",
        "tags": ["llmtrain", "sft"],
        "datasets": ["org/chat"],
    }
    for line in [
        "| steps | 120 (epochs begun: 2) |",
        "| trained tokens | 54,180 |",
        "| time in training steps | 1 h 2 min |",
        "| hardware | 8 x NVIDIA H200 |",
        "# qwen-chat",
        f"- `train.jsonl`, sha256 `{'ab' * 32}`",
        f"- `eval.jsonl` (evaluation), sha256 `{'cd' * 32}`",
        'path = "path/to/this/directory"  # or its name on the Hub',
        "| eval_loss | 2.5 (step 0) | 1.25 (step 120) |",
        "| loss | 1.3 |",
        "![loss curve](loss.png)",
        "model = AutoModelForCausalLM.from_pretrained(path)",
    ]:
        assert line in text.splitlines(), line


def test_an_adapter_a_local_base_and_a_reward_model_are_described_as_they_load():
    text = render(facts(loading="adapter", hub_base=False, base="my-base", license="", hub_datasets=[]))
    meta = front_matter(text)
    assert meta["library_name"] == "peft" and "base_model" not in meta and "license" not in meta
    assert "datasets" not in meta and "AutoPeftModelForCausalLM.from_pretrained(path)" in text
    text = render(facts(loading="classifier"))
    assert "pipeline_tag" not in front_matter(text) and "AutoModelForSequenceClassification" in text
    assert "AutoModelForImageTextToText" in render(facts(loading="vision"))
    text = render(facts(loading="adapter-vision"))
    assert front_matter(text)["library_name"] == "peft" and "PeftModel.from_pretrained(base, path)" in text


def test_local_paths_are_named_by_their_file_name_and_demo_assets_by_their_demo_name(tmp_path):
    local = tmp_path / "models" / "base"
    local.mkdir(parents=True)
    assert public_name(str(local)) == "base"
    assert public_name("/data/corpus/train.jsonl") == "train.jsonl"
    assert public_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert public_name(str(local), lambda p: "demo:tiny-llama" if p == str(local) else None) == "demo:tiny-llama"
    assert is_hub_name("Qwen/Qwen2.5-0.5B") and not is_hub_name(str(local)) and not is_hub_name("demo:train")
    with pytest.raises(ValueError, match="would name the local path /home/me"):
        check_public("base: /home/me/model", ["/home/me"])
    check_public("[llmtrain](https://github.com/llmtrain/llmtrain), /home/meg", ["/llmtrain", "/home/me"])


def test_the_settings_name_every_path_publicly(tmp_path):
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tmp_path}/m",
            f"output_dir={tmp_path}/out",
            f"data.train={tmp_path}/d.jsonl",
            f"grpo.rewards=[{tmp_path}/rewards.py:exact, accuracy]",
            f"grpo.tools=[{tmp_path}/tools.py:add]",
            "model.lora.enabled=true",
        ],
        GRPOConfig,
    )
    shown = settings(cfg, "grpo")
    assert shown["grpo"]["rewards"] == ["rewards.py:exact", "accuracy"] and shown["grpo"]["tools"] == ["tools.py:add"]
    assert shown["model"]["lora"]["r"] == 16 and shown["train"]["lr"] == cfg.train.lr
    assert str(tmp_path) not in yaml.safe_dump(shown)


def test_the_base_models_license_is_read_from_its_cards_front_matter(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: mit\ntags: [x]\n---\n# a model\n")
    assert base_license(str(tmp_path)) == "mit"
    (tmp_path / "README.md").write_text("# no front matter\nlicense: mit\n")
    assert base_license(str(tmp_path)) == ""
    (tmp_path / "README.md").write_text("---\nlicense: [not, a, name]\n---\n")
    assert base_license(str(tmp_path)) == ""
    assert base_license(str(tmp_path / "missing")) == ""


def test_the_results_compare_the_first_and_last_evaluation_and_leave_out_speed():
    rows = [
        {"step": 0, "eval_loss": 3.0},
        {"step": 1, "loss": 2.9, "lr": 1e-4, "step_s": 0.3, "tokens": 40},
        {"step": 2, "loss": 2.0, "lr": 1e-4, "step_s": 0.2, "tokens": 42, "reward": 0.5},
        {"step": 2, "eval_loss": 1.9, "eval_reward": 0.7},
        {"step": 2, "lm_eval/sums/acc": 0.4},  # lm-eval on checkpoints, joined as each finished
        {"step": 1, "lm_eval/sums/acc": 0.3},
    ]
    final, evals = eval_figures(rows)
    assert final == {"loss": 2.0, "reward": 0.5}
    assert evals == {
        "eval_loss": (3.0, 0, 1.9, 2),
        "eval_reward": (0.7, 2, 0.7, 2),
        "lm_eval/sums/acc": (0.3, 1, 0.4, 2),
    }


def test_a_finished_runs_card_counts_what_it_trained(finished_run, chat_file, tiny_model):
    """The card of a real run: its steps, the trained tokens of every step, its training
    file by name and content hash, its base model by name, its last loss."""
    import json

    from llmtrain.files import content_hash
    from llmtrain.observe.metrics import read_metrics
    from tests.support.runs import check_card

    out, _ = finished_run
    meta = check_card(out / "final", ["sft"], "AutoModelForCausalLM")
    assert meta["library_name"] == "transformers" and "base_model" not in meta  # a local base is no hub name
    text = (out / "final" / "README.md").read_text()
    rows = read_metrics(out / "metrics.jsonl")
    trained = sum(r["tokens"] for r in rows if "loss" in r)
    state = json.loads((out / "final" / "train_state.json").read_text())
    assert state["trained"] == trained and state["seconds"] > 0
    last = [r for r in rows if "loss" in r][-1]
    for line in [
        f"# {out.name}",
        f"Trained from `{tiny_model.name}` with llmtrain's `finetune` recipe (`recipes/finetune.py`).",
        "| steps | 4 (epochs begun: 1) |",
        f"| trained tokens | {trained:,} |",
        f"- `{chat_file.name}`, sha256 `{content_hash(chat_file)}`",
        f"| loss | {last['loss']:.4g} |",
    ]:
        assert line in text.splitlines(), line

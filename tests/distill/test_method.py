"""Distillation as a method (llmtrain/distill/method.py, config.py): the checks of the distill
section, each one line naming its key; the rows numbered only where the student answers some;
the teacher's tokenizer checked with the teacher's own words; what `llmtrain plan` says."""

import pytest

from llmtrain.config.load import load_config
from llmtrain.distill.config import DistillConfig
from llmtrain.distill.method import DISTILL, describe_distill
from llmtrain.errors import ConfigError


def config(*overrides: str) -> DistillConfig:
    return load_config(None, ["model.name_or_path=m", "data.train=x.jsonl", *overrides], DistillConfig)


def problems(*overrides: str) -> list[str]:
    try:
        config(*overrides)
    except ConfigError as e:
        return e.problems
    return []


@pytest.mark.parametrize(
    "overrides, says",
    [
        ((), "distill.teacher: required; the teacher model"),
        (("distill.teacher=t", "distill.loss=reverse_kl"), "distill.loss: reverse_kl scores the student's own"),
        (("distill.teacher=t", "distill.top_k=5", "distill.beta=1"), "distill.top_k: the reverse KL"),
        (("distill.teacher=t", "distill.forward_top_k=5"), "distill.forward_top_k: used only with"),
        (("distill.teacher=t", "data.packing=true"), "data.packing: the student's own answers"),
        (("distill.teacher=t", "data.streaming=true"), "data.streaming: the student's own answers"),
        (("distill.teacher=t", "distill.max_completion_length=2048"), "distill.max_completion_length: 2048 leaves"),
    ],
)
def test_each_bad_setting_is_one_line_naming_its_key(overrides, says):
    found = [p for p in problems(*overrides) if p.startswith(says)]
    assert len(found) == 1, problems(*overrides)


def test_offline_distillation_packs_and_streams_and_numbers_nothing():
    from llmtrain.data.build import ROWS

    assert problems("distill.teacher=t", "distill.on_policy_fraction=0", "data.packing=true") == []
    assert problems("distill.teacher=t", "distill.loss=reverse_kl", "distill.on_policy_fraction=1") == []
    offline = config("distill.teacher=t", "distill.on_policy_fraction=0")
    assert DISTILL.kind(offline) is ROWS
    online = config("distill.teacher=t")
    assert DISTILL.kind(online).index == "index"


def test_a_teacher_with_another_tokenizer_is_one_error_in_the_teachers_words(tiny_model, tokenizer, tmp_path):
    from transformers import AutoConfig

    from llmtrain.distill.method import check_distill
    from llmtrain.errors import ModelError

    small = tmp_path / "small"
    config = AutoConfig.from_pretrained(tiny_model)
    config.vocab_size = 40
    config.save_pretrained(small)
    cfg = load_config(
        None,
        [f"model.name_or_path={tiny_model}", "data.train=x.jsonl", f"distill.teacher={small}"],
        DistillConfig,
    )
    with pytest.raises(ModelError, match=r"^distill.teacher: '.*small' embeds 40 tokens, .* the teacher must be a "):
        check_distill(cfg, tokenizer)


def test_the_plan_lines_say_what_is_compared_and_where_the_answers_come_from(tokenizer):
    cfg = load_config(
        None,
        [
            "model.name_or_path=m",
            "data.train=x.jsonl",
            "distill.teacher=big",
            "distill.on_policy_fraction=0.25",
            "distill.beta=0",
        ],
        DistillConfig,
    )
    first = {"input_ids": tokenizer("hi there")["input_ids"], "labels": [-100, -100, 5, 5, 5, 5, 5, -100]}
    lines = "\n".join(describe_distill(cfg, first, tokenizer))
    assert "distillation from big (frozen, whole on each process)" in lines
    assert "forward KL(teacher || student) over the vocabulary" in lines
    assert "25% of steps answered by the student" in lines

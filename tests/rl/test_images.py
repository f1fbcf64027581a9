"""GRPO prompts of vision-language models (llmtrain/rl/prompts.py, sampling.py and rollout.py
with llmtrain/vision.py): a prompt's images become its image tokens and travel with it, a
completion sampled from a prompt with images is the same whatever shares its generation
batch, and a multi-turn run's prompts stay text. The runs: tests/launch/test_vision.py."""

import pytest
import torch

from llmtrain.config import Config, DataConfig
from llmtrain.data.rows import FileRow
from llmtrain.model import load_model
from llmtrain.processor import processor_of
from llmtrain.rl.prompts import prompt_kind
from llmtrain.rl.sampling import HFGenerator
from llmtrain.vision import IMAGE_COLUMNS, rows_kind
from tests.support.vision_models import build_all, loaded, pictures

FAMILIES = ("qwen2_5_vl", "gemma3", "idefics3", "llava")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return build_all(tmp_path_factory.mktemp("vlms"), FAMILIES)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return pictures(tmp_path_factory.mktemp("images"))


def prompt_row(image: str | None, root, text: str = "what colour?") -> FileRow:
    part = [{"type": "image", "image": image}] if image else []
    row = FileRow({"prompt": [{"role": "user", "content": [*part, {"type": "text", "text": text}]}], "answer": "x"})
    row.root = root
    return row


KIND = prompt_kind(8).images  # a vision-language model's single-turn prompts


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompts_images_become_its_image_tokens_and_travel_with_it(family, models, images):
    _, tokenizer = loaded(models[family])
    example = KIND.process(prompt_row("red.png", images), tokenizer, DataConfig())
    assert example["status"] == "ok", example["status"]
    assert example["prompt_ids"].count(tokenizer.image_token_id) > 0
    assert example["images"] == [(images / "red.png").read_bytes()]
    assert all(len(example[k]) == len(example["prompt_ids"]) for k in IMAGE_COLUMNS if k != "images")
    text = KIND.process(prompt_row(None, images), tokenizer, DataConfig())
    assert text["status"] == "ok" and text["images"] == [] and tokenizer.image_token_id not in text["prompt_ids"]
    # A prompt too long for its completion's room is cut from the left only where its image stays whole.
    long = prompt_row("red.png", images, "word " * 60)
    whole = KIND.process(long, tokenizer, DataConfig(max_seq_len=2048))["prompt_ids"]
    kept = KIND.process(long, tokenizer, DataConfig(max_seq_len=len(whole) + 8 - 1))  # its first token cut
    assert kept["status"] == "truncated" and kept["prompt_ids"] == whole[1:]
    assert kept["images"] and len(kept[IMAGE_COLUMNS[1]]) == len(kept["prompt_ids"])
    into = whole.index(tokenizer.image_token_id) + 1  # a cut that takes an image token
    cut = KIND.process(long, tokenizer, DataConfig(max_seq_len=len(whole) + 8 - into))
    assert cut["status"].startswith("too long (") and "image tokens that a cut" in cut["status"]


def test_the_kinds_a_vision_model_gets_and_a_multi_turn_runs_text_prompts(models):
    _, tokenizer = loaded(models["qwen2_5_vl"])
    cfg = Config()
    kind = prompt_kind(8)
    assert rows_kind(kind, tokenizer, cfg) is kind.images and kind.images.version.endswith("-images-v1")
    assert prompt_kind(8, agent=_NoTools()).images is None  # episodes: images are malformed rows


class _NoTools:
    def described(self):
        return []

    def schemas(self, row):
        return []


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "llava"])
def test_a_completion_with_images_is_the_same_whatever_shares_its_batch(family, models, images):
    """Seeded sampling (one generator per completion) from prompts padded on the left with
    their images: the completion of a prompt alone is the one it gets beside a text prompt
    and another image's prompt, and its log-probs are those the sampler reports."""
    cfg, tokenizer = loaded(models[family])
    model = load_model(cfg).eval()
    rows = [prompt_row("red.png", images), prompt_row(None, images, "no picture here, what colour?")]
    rows.append(prompt_row("green.png", images, "and this one?"))
    examples = [KIND.process(r, tokenizer, DataConfig()) for r in rows]
    prompts = [e["prompt_ids"] for e in examples]
    shown = [{k: e[k] for k in IMAGE_COLUMNS} for e in examples]
    generator = HFGenerator(tokenizer, 6, temperature=1.0)
    together = generator.generate(model, prompts, [11, 12, 13], shown=shown)
    for i in (0, 2):
        alone = generator.generate(model, [prompts[i]], [11 + i], shown=[shown[i]])
        assert alone.ids[0] == together.ids[i]
        torch.testing.assert_close(torch.tensor(alone.logps[0]), torch.tensor(together.logps[i]), atol=1e-4, rtol=0)
    assert processor_of(tokenizer) is not None

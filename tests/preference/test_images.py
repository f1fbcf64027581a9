"""Preference pairs and KTO rows of vision-language models (llmtrain/preference/pairs.py,
unpaired.py with llmtrain/vision.py): the prompt's images shown to every answer, only the
answers trained, the same log-probs packed as padded, KL sequences that show their own
prompt's images, and a careless user's rows each one line. The text pairs' own tests:
test_pairs.py, test_unpaired.py."""

import datasets
import pytest
import torch

from llmtrain.config import Config, DataConfig
from llmtrain.data.rows import IGNORE, FileRow, row_problem
from llmtrain.errors import DataError
from llmtrain.model import load_model
from llmtrain.preference.kto import KTOLoss
from llmtrain.preference.loss import PreferenceLoss
from llmtrain.preference.pairs import IMAGE_PAIRS, PAIRS, PackedPairs, PairCollator
from llmtrain.preference.reward_model import REWARD_PAIRS
from llmtrain.preference.unpaired import IMAGE_UNPAIRED, UNPAIRED, KLCompletions, UnpairedCollator
from llmtrain.processor import processor_of
from llmtrain.vision import rows_kind
from tests.support.vision_models import build_all, loaded, pictures, png

FAMILIES = ("qwen2_5_vl", "gemma3", "idefics3", "llava")
PIXELS = DataConfig().max_image_pixels


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return build_all(tmp_path_factory.mktemp("vlms"), FAMILIES)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return pictures(tmp_path_factory.mktemp("images"))


def in_file(row: dict, root) -> FileRow:
    row = FileRow(row)
    row.root = root
    return row


def question(image: str | None, text: str = "colour?") -> list[dict]:
    part = {"type": "image", "image": image} if image else {"type": "image"}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def pair(colour: str, other: str, root) -> FileRow:
    return in_file({"prompt": question(f"{colour}.png"), "chosen": colour, "rejected": other}, root)


def trained(labels: list[int], tokenizer) -> list[str]:
    return tokenizer.decode([t for t in labels if t != IGNORE], skip_special_tokens=True).split()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pairs_prompt_images_are_shown_to_both_answers_and_only_the_answers_train(family, models, images):
    _, tokenizer = loaded(models[family])
    example = IMAGE_PAIRS.process(pair("red", "blue", images), tokenizer, DataConfig())
    assert example["status"] == "ok", example["status"]
    assert trained(example["chosen_labels"], tokenizer) == ["red"]
    assert trained(example["rejected_labels"], tokenizer) == ["blue"]
    image_id = tokenizer.image_token_id
    shown = [example[f"{side}_input_ids"].count(image_id) for side in ("chosen", "rejected")]
    assert shown[0] == shown[1] > 0
    assert all(image_id not in example[f"{side}_labels"] for side in ("chosen", "rejected"))
    assert example["images"] == [(images / "red.png").read_bytes()]  # once, for both answers
    # TRL's layout, the images in their own column, makes the same example
    trl = in_file({"prompt": question(None), "images": ["red.png"], "chosen": "red", "rejected": "blue"}, images)
    assert IMAGE_PAIRS.process(trl, tokenizer, DataConfig()) == example
    # and so do whole conversations that share the prompt
    whole = {
        "chosen": question("red.png") + [{"role": "assistant", "content": "red"}],
        "rejected": question("red.png") + [{"role": "assistant", "content": "blue"}],
    }
    assert IMAGE_PAIRS.process(in_file(whole, images), tokenizer, DataConfig()) == example


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3", "llava"])
def test_packed_pairs_give_each_answer_its_padded_log_probs_and_a_step_trains_the_language_model(
    family, models, images
):
    """Two pairs with images and one without, packed into one sequence: each answer's
    summed log-prob is the one it has padded, its own prompt's image features on its own
    image tokens; the DPO loss trains the language model, the vision tower stays frozen."""
    cfg, tokenizer = loaded(models[family])
    text = {"prompt": "no picture", "chosen": "none", "rejected": "red"}
    rows = [pair("red", "blue", images), text, pair("green", "red", images)]
    examples = [IMAGE_PAIRS.process(r, tokenizer, DataConfig()) | {"pair_index": i} for i, r in enumerate(rows)]
    assert all(e.pop("status") == "ok" for e in examples)
    processor = processor_of(tokenizer)
    padded = PairCollator(tokenizer.pad_token_id, 0, False, processor, PIXELS)
    examples = [{k: e[k] for k in padded.columns} | {"length": e["length"]} for e in examples]
    width = sum(e["length"] for e in examples)
    packed_set = PackedPairs(datasets.Dataset.from_list(examples), width)
    assert len(packed_set) == 1
    packed = PairCollator(tokenizer.pad_token_id, width, False, processor, PIXELS)
    model = load_model(cfg)
    objective = PreferenceLoss("sigmoid", 0.1)
    with torch.no_grad():
        sums, tokens = objective.logps(model.eval(), packed([packed_set[0]]))
        order = packed_set[0]["pair_index"]
        for slot, i in enumerate(order):
            alone, n = objective.logps(model, padded([{k: v for k, v in examples[i].items() if k != "length"}]))
            k = len(order)
            torch.testing.assert_close(sums[[slot, slot + k]], alone, rtol=1e-4, atol=1e-4)
            assert tokens[[slot, slot + k]].tolist() == n.tolist()
    batch = padded([{k: v for k, v in e.items() if k != "length"} for e in examples])
    assert batch["pixel_values"].shape[0] > 0
    objective.reference = torch.zeros(3, 2)
    objective(model.train(), batch).total.backward()
    vision = ("vision", "visual", "projector", "connector", "image_newline")
    assert all(p.grad is None for n, p in model.named_parameters() if any(v in n for v in vision))
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "layers" in n)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_kto_rows_show_their_images_and_each_kl_sequence_its_own_prompts(family, models, images):
    """A KL sequence is its row's prompt (its images included) followed by the next row's
    completion: its log-prob is that of such a row made directly."""
    cfg, tokenizer = loaded(models[family])

    def row(colour, answer, label=True):
        return in_file({"prompt": question(f"{colour}.png"), "completion": answer, "label": label}, images)

    rows = [row("red", "red"), row("green", "blue", False), row("blue", "blue")]
    examples = [IMAGE_UNPAIRED.process(r, tokenizer, DataConfig()) for r in rows]
    assert [e.pop("status") for e in examples] == ["ok"] * 3
    assert trained(examples[1]["labels"], tokenizer) == ["blue"]
    assert examples[1]["images"] == [(images / "green.png").read_bytes()]
    view = KLCompletions(datasets.Dataset.from_list([e | {"row_index": i} for i, e in enumerate(examples)]), 256)
    collate = UnpairedCollator(tokenizer.pad_token_id, processor_of(tokenizer), PIXELS)
    batch = collate([view[i] for i in range(3)])
    torch.testing.assert_close(batch["kl_pixel_values"], batch["pixel_values"])
    direct = IMAGE_UNPAIRED.process(row("red", "blue", False), tokenizer, DataConfig())  # row 0's prompt, 1's answer
    assert view[0]["kl_input_ids"] == direct["input_ids"] and view[0]["kl_labels"] == direct["labels"]
    model = load_model(cfg).eval()
    objective = KTOLoss(0.1, 1.0, 1.0)
    with torch.no_grad():
        kl, _ = objective.sequence_logps(model, batch, kl=True)
        alone, _ = objective.sequence_logps(model, collate([view[0]]), kl=True)
        made = collate([view[0] | {k: direct[k] for k in ("input_ids", "labels")}])
        want, _ = objective.sequence_logps(model, made)
    torch.testing.assert_close(kl[0], alone[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kl[0], want[0], rtol=1e-4, atol=1e-4)


def test_careless_rows_are_one_line_each(models, images, tmp_path):
    _, tokenizer = loaded(models["llava"])

    def error(row: dict, kind=IMAGE_PAIRS, **settings) -> str:
        out = kind.process(in_file(row, images), tokenizer, DataConfig(**settings))
        assert out["status"].startswith("error: ") and "\n" not in out["status"], out["status"]
        return out["status"]

    drawn = [{"role": "assistant", "content": [{"type": "image", "image": "red.png"}]}]
    assert "'chosen' holds an image; images go in the prompt" in error(
        {"prompt": question("red.png"), "chosen": drawn, "rejected": "blue"}
    )
    assert "'completion' holds an image; images go in the prompt" in error(
        {"prompt": "draw", "completion": drawn, "label": True}, IMAGE_UNPAIRED
    )
    assert "show different images in the messages they share" in error(
        {
            "chosen": question("red.png") + [{"role": "assistant", "content": "red"}],
            "rejected": question("blue.png") + [{"role": "assistant", "content": "blue"}],
        }
    )
    assert "image 'gone.png': no such file" in error({"prompt": question("gone.png"), "chosen": "a", "rejected": "b"})
    assert "'images' column has 2 image(s)" in error(
        {"prompt": question(None), "images": ["red.png", "blue.png"], "chosen": "a", "rejected": "b"}
    )
    png(tmp_path / "huge.png", size=(300, 300))
    assert "over data.max_image_pixels=1000" in error(
        {"prompt": question(str(tmp_path / "huge.png")), "chosen": "a", "rejected": "b"}, max_image_pixels=1000
    )
    # A prompt cut from the left would lose its image's tokens: dropped as too long, never split.
    long = {"prompt": question("red.png", "word " * 80), "chosen": "red " * 30, "rejected": "blue"}
    whole = IMAGE_PAIRS.process(in_file(long, images), tokenizer, DataConfig(max_seq_len=1024))
    width = len(whole["chosen_input_ids"]) - 10
    cut = IMAGE_PAIRS.process(in_file(long, images), tokenizer, DataConfig(max_seq_len=width))
    assert cut["status"].startswith("too long (") and "image tokens that a cut" in cut["status"]
    refused = DataConfig(max_seq_len=width, overlong="error")
    strict = IMAGE_PAIRS.process(in_file(long, images), tokenizer, refused)
    assert "above data.max_seq_len" in row_problem(strict["status"], refused)


def test_a_vision_models_kinds_and_what_they_refuse(models):
    _, tokenizer = loaded(models["qwen2_5_vl"])
    cfg = Config()
    assert rows_kind(PAIRS, tokenizer, cfg) is IMAGE_PAIRS
    assert rows_kind(UNPAIRED, tokenizer, cfg) is IMAGE_UNPAIRED
    assert rows_kind(REWARD_PAIRS, tokenizer, cfg) is REWARD_PAIRS  # reward models are text models
    cfg.data.streaming = True
    with pytest.raises(DataError, match="^data.streaming: rows with images are not streamed yet"):
        rows_kind(PAIRS, tokenizer, cfg)
    _, gemma = loaded(models["gemma3"])
    cfg = Config()
    cfg.data.packing = True
    assert rows_kind(PAIRS, gemma, cfg) is IMAGE_PAIRS  # its images' blocks join the packed mask

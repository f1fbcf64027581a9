"""Images in chat rows (llmtrain/vision.py), without a model: content parts read into
placeholders and names, images read and bounded as a careless user's files would test them
(missing, a URL, too large, too many pixels, corrupt, truncated, not an image), the `images`
column filling placeholders, and labels carried onto the processor's tokens. The tiny
vision-language models' rows and runs: tests/launch/test_vision.py."""

import json

import pytest
import torch
from PIL import Image

from llmtrain.config import Config, DataConfig, ModelConfig
from llmtrain.core.objective import TokenLoss, model_inputs
from llmtrain.data.build import ROWS
from llmtrain.data.rows import IGNORE, FileRow, RowError, message, row_problem
from llmtrain.errors import DataError, ModelError
from llmtrain.model import check_model, load_model
from llmtrain.processor import processor_of, vision_in_every_forward
from llmtrain.vision import (
    IMAGE_ROWS,
    ImageCollator,
    PackedImageRows,
    carry_labels,
    read_image,
    row_images,
    rows_kind,
)
from tests.support.vision_models import FAMILIES, build_all, loaded, pictures, png


def test_image_parts_become_placeholders_and_their_names_are_kept_in_order():
    names: list = []
    m = message(
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "a.png"},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": "b.png"}},
                {"type": "image"},
            ],
        },
        0,
        images=names,
    )
    assert m["content"] == [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "image"}]
    assert names == ["a.png", "b.png", None]
    # text parts alone stay text, as for a text model
    assert message({"role": "user", "content": [{"type": "text", "text": "hi"}]}, 0, images=[])["content"] == "hi"


def test_an_image_for_a_text_model_or_another_recipe_is_one_line():
    only = r"messages\[1\]: holds an image; only recipes/finetune.py, .*recipes/distill.py take images"
    with pytest.raises(RowError, match=only):
        message({"role": "user", "content": [{"type": "image", "image": "a.png"}]}, 1)


def test_images_are_read_relative_to_the_data_file_and_bounded(tmp_path):
    cfg = DataConfig()
    data = png(tmp_path / "red.png")
    read, picture = read_image("red.png", tmp_path, cfg)
    assert read == data and picture.size == (16, 16) and picture.getpixel((3, 3)) == (255, 0, 0)
    assert read_image(str(tmp_path / "red.png"), None, cfg)[0] == data
    assert read_image({"bytes": data, "path": None}, None, cfg)[0] == data  # a hub data set's undecoded image

    def error(ref, root=tmp_path, **kw) -> str:
        with pytest.raises(RowError) as e:
            read_image(ref, root, DataConfig(**kw))
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "no such file (paths are relative to the data file's folder)" in error("missing.png")
    assert "is a URL; llmtrain reads local image files only" in error("https://example.com/cat.png")
    assert "is a relative path, which only rows of a local data file can give" in error("red.png", root=None)
    assert "over data.max_image_bytes=10" in error("red.png", max_image_bytes=10)
    big = png(tmp_path / "big.png", size=(40, 30))
    assert "40x30 pixels is over data.max_image_pixels=1000" in error("big.png", max_image_pixels=1000)
    (tmp_path / "cut.png").write_bytes(big[: len(big) // 2])
    assert "cannot be decoded" in error("cut.png")
    (tmp_path / "notes.png").write_text("not an image")
    assert "cannot be decoded" in error("notes.png")
    (tmp_path / "folder.png").mkdir()
    assert "is not a file" in error("folder.png")
    assert "give a file path" in error(7)


def test_placeholders_take_the_images_column_in_order_and_must_match_it():
    assert row_images(["a.png", None, None], {"images": ["b.png", "c.png"]}) == ["a.png", "b.png", "c.png"]
    assert row_images(["a.png"], {}) == ["a.png"]
    with pytest.raises(RowError, match=r"2 image placeholder\(s\) .* 'images' column has 1 image"):
        row_images([None, None], {"images": ["b.png"]})


def test_labels_follow_the_text_onto_the_processors_tokens_and_image_tokens_never_train():
    # plain: <s> U <img> q A a </s>, trained "a </s>"; the processor puts 3 image tokens (9)
    # in place of the placeholder (5) and a start (8) before it.
    plain = [1, 4, 5, 6, 7, 3, 2]
    labels = [IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, 3, 2]
    full = [1, 4, 8, 9, 9, 9, 6, 7, 3, 2]
    carried, images = carry_labels(plain, labels, full)
    assert carried == [IGNORE] * 8 + [3, 2]
    assert images == [2, 3, 4, 5]
    # Qwen's placeholder is one of the image's own tokens: the one the rendering held counts too
    carried, images = carry_labels([1, 4, 9, 7, 3, 2], [IGNORE] * 4 + [3, 2], [1, 4, 9, 9, 9, 7, 3, 2])
    assert carried == [IGNORE] * 6 + [3, 2] and images == [2, 3, 4]
    with pytest.raises(RowError, match="changed trained tokens"):
        carry_labels(plain, labels, [1, 4, 8, 9, 6, 7, 9, 2])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return build_all(tmp_path_factory.mktemp("vlms"), FAMILIES)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return pictures(tmp_path_factory.mktemp("images"))


def colour_row(colour: str, root, system: bool = False) -> FileRow:
    messages = [{"role": "system", "content": "Answer in one word."}] if system else []
    messages += [
        {"role": "user", "content": [{"type": "image", "image": f"{colour}.png"}, {"type": "text", "text": "colour?"}]},
        {"role": "assistant", "content": colour},
        {"role": "user", "content": [{"type": "text", "text": "and this?"}, {"type": "image"}]},
        {"role": "assistant", "content": "blue"},
    ]
    row = FileRow({"messages": json.loads(json.dumps(messages)), "images": ["blue.png"]})
    row.root = root
    return row


@pytest.mark.parametrize("family", FAMILIES)
def test_only_answers_train_and_every_image_gets_its_tokens(family, models, images):
    """The trained positions decode to the two answers (and their end of turn); the
    processor's image tokens, as many as it makes for each image, carry no loss."""
    cfg, tokenizer = loaded(models[family])
    example = IMAGE_ROWS.process(colour_row("red", images, system=family != "gemma3"), tokenizer, DataConfig())
    assert example["status"] == "ok", example["status"]
    trained = [t for t in example["labels"] if t != IGNORE]
    assert tokenizer.decode(trained, skip_special_tokens=True).split() == ["red", "blue"]
    image_id, ids = tokenizer.image_token_id, example["input_ids"]
    assert image_id not in trained
    # what the processor makes of one such image alone (the count depends on the size for some)
    alone = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    picture = Image.open(images / "red.png").convert("RGB")
    per_image = processor_of(tokenizer)(text=[alone], images=[[picture]])["input_ids"][0].count(image_id)
    assert ids.count(image_id) == 2 * per_image > 0
    assert example["images"] == [(images / "red.png").read_bytes(), (images / "blue.png").read_bytes()]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_trains_the_language_model_and_leaves_the_vision_tower_frozen(family, models, images):
    cfg, tokenizer = loaded(models[family])
    examples = [IMAGE_ROWS.process(colour_row(c, images), tokenizer, DataConfig()) for c in ("red", "green")]
    examples.append(
        IMAGE_ROWS.process(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}]},
            tokenizer,
            DataConfig(),
        )
    )
    collate = ImageCollator(tokenizer.pad_token_id, processor_of(tokenizer), DataConfig().max_image_pixels)
    batch = collate([{k: e[k] for k in collate.columns if k in e} for e in examples])
    model = load_model(cfg)
    loss = TokenLoss.for_model(model, 0)(model, batch)
    assert torch.isfinite(loss.total)
    loss.total.backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(
        p.grad is not None for n, p in model.named_parameters() if p.requires_grad and "embed" not in n
    )
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    vision = ("vision", "visual", "projector", "connector", "image_newline")
    assert frozen and all(any(v in n for v in vision) for n in frozen), frozen


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3", "smolvlm", "llava", "llava_next"])
def test_packed_rows_give_each_row_the_logits_it_has_alone(family, models, images):
    """Rows with images (and one without) packed into one sequence: each row's logits are
    those of the row run alone, its own image features on its own image tokens."""
    import datasets

    cfg, tokenizer = loaded(models[family])
    text_row = {"messages": [{"role": "user", "content": "no picture"}, {"role": "assistant", "content": "none"}]}
    rows = [colour_row("red", images), text_row, colour_row("green", images)]
    examples = [IMAGE_ROWS.process(r, tokenizer, DataConfig()) for r in rows]
    collate = ImageCollator(tokenizer.pad_token_id, processor_of(tokenizer), DataConfig().max_image_pixels)
    width = sum(e["length"] for e in examples)
    packed = PackedImageRows(datasets.Dataset.from_list(examples), width)
    assert len(packed) == 1
    model = load_model(cfg).eval()
    with torch.no_grad():
        together = model(**model_inputs(model, collate([packed[0]]))).logits[0]
        start = 0
        for i in packed.bins[0]:
            e = examples[i]
            alone = model(**model_inputs(model, collate([e]))).logits[0]
            n = e["length"]
            torch.testing.assert_close(together[start : start + n], alone[:n], rtol=1e-4, atol=1e-5)
            start += n


def test_gemma3_packs_unless_an_images_tokens_outrun_its_sliding_window(models):
    """Gemma 3's image tokens attend to each other both ways: packed (the blocks join the
    packed mask; logits: test_packed_rows_give_each_row_the_logits_it_has_alone), but not
    where an image's tokens outnumber the sliding window, refused in one line."""
    import copy

    cfg, tokenizer = loaded(models["gemma3"])
    mcfg = check_model(cfg, 256)
    run = Config()
    run.data.packing = True
    assert rows_kind(ROWS, tokenizer, run, mcfg) is IMAGE_ROWS
    narrow = copy.deepcopy(mcfg)
    narrow.text_config.sliding_window = 3  # an image is 4 tokens here
    with pytest.raises(DataError, match=r"^data.packing: the model attends both ways among an image's 4 tokens, more"):
        rows_kind(ROWS, tokenizer, run, narrow)


def test_an_over_long_row_is_cut_after_its_images_or_follows_data_overlong(models, images):
    """data.overlong=truncate cuts a row after its last image token; a row whose image tokens
    run past data.max_seq_len is dropped as too long (an error under overlong=error), never
    cut through an image. (Idefics3 renders parts in order; LLaVA's template puts images
    first in a turn.)"""
    _, tokenizer = loaded(models["idefics3"])
    image_id = tokenizer.image_token_id

    def row(words_before: int, words_after: int) -> FileRow:
        content = [
            {"type": "text", "text": "word " * words_before},
            {"type": "image", "image": "red.png"},
            {"type": "text", "text": "colour?"},
        ]
        answer = {"role": "assistant", "content": "red " * words_after}
        r = FileRow({"messages": [{"role": "user", "content": content}, answer]})
        r.root = images
        return r

    whole = IMAGE_ROWS.process(row(0, 40), tokenizer, DataConfig(max_seq_len=512))
    n_image = whole["input_ids"].count(image_id)
    last = len(whole["input_ids"]) - whole["input_ids"][::-1].index(image_id)
    width = last + 40  # the image, the question and some of the answer
    cut = IMAGE_ROWS.process(row(0, 40), tokenizer, DataConfig(max_seq_len=width))
    assert cut["status"] == "truncated" and cut["input_ids"] == whole["input_ids"][:width]
    assert cut["input_ids"].count(image_id) == n_image > 0 and len(cut["images"]) == 1
    late = IMAGE_ROWS.process(row(60, 1), tokenizer, DataConfig(max_seq_len=width))
    assert late["status"].startswith("too long (") and "image tokens past data.max_seq_len" in late["status"]
    strict = DataConfig(max_seq_len=width, overlong="error")
    refused = IMAGE_ROWS.process(row(60, 1), tokenizer, strict)
    assert f"tokens, above data.max_seq_len={width}" in row_problem(refused["status"], strict)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_qlora_quantizes_the_language_model_alone_and_trains_adapters_there(family, models, images):
    """model.quantization=nf4 with LoRA: the language model's linear layers load in 4 bits,
    the vision tower, projector and output layer stay whole; a step trains the adapters only."""
    pytest.importorskip("bitsandbytes")
    cfg, tokenizer = loaded(models[family], quantization="nf4")
    cfg.lora.enabled = True
    model = load_model(cfg)
    inside = "language_model"
    quantized = {n for n, m in model.named_modules() if type(m).__module__.startswith("bitsandbytes")}
    assert quantized and all(inside in n for n in quantized), sorted(quantized)[:5]
    examples = [IMAGE_ROWS.process(colour_row(c, images), tokenizer, DataConfig()) for c in ("red", "green")]
    collate = ImageCollator(tokenizer.pad_token_id, processor_of(tokenizer), DataConfig().max_image_pixels)
    loss = TokenLoss.for_model(model, 0)(model, collate([{k: e[k] for k in collate.columns} for e in examples]))
    loss.total.backward()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n and inside in n for n in trained)
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_forward_runs_the_vision_tower_where_a_batch_with_images_does(family, models, images):
    """processor.vision_in_every_forward (runs of several processes): a batch without
    images runs the vision tower on a blank image, in the order a batch with images runs
    its layers (what ZeRO-3 and FSDP2 gather by), with the same logits as without it; a
    trained vision tower gets (zero) gradients, as DDP needs of every process."""
    cfg, tokenizer = loaded(models[family], freeze_vision=False)
    model = load_model(cfg)
    collate = ImageCollator(tokenizer.pad_token_id, processor_of(tokenizer), DataConfig().max_image_pixels)
    text = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}]}
    plain = collate([{k: v for k, v in IMAGE_ROWS.process(text, tokenizer, DataConfig()).items() if k != "status"}])
    shown = IMAGE_ROWS.process(colour_row("red", images), tokenizer, DataConfig())
    pictured = collate([{k: v for k, v in shown.items() if k != "status"}])
    order: list[str] = []
    vision = ("vision", "visual", "projector", "connector")
    for name, module in model.named_modules():
        if name and (name.endswith(".layers.0") or name.endswith("layers.1")) and not any(v in name for v in vision):
            module.register_forward_pre_hook(lambda m, a, name=name: order.append("language"))
        elif any(v in name for v in vision) and any(p.numel() for p in module.parameters(recurse=False)):
            module.register_forward_pre_hook(lambda m, a, name=name: order.append("vision"))

    def run(batch):
        order.clear()
        return model(**model_inputs(model, batch)).logits, [
            k for i, k in enumerate(order) if i == 0 or k != order[i - 1]
        ]

    tower = {n: p for n, p in model.named_parameters() if any(v in n for v in vision)}
    logits, with_images = run(pictured)
    logits.sum().backward()
    used = {n for n, p in tower.items() if p.grad is not None}  # LLaVA reads an inner layer: not all
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        before, without = run(plain)
    assert with_images == ["vision", "language"] and without == ["language"] and used
    vision_in_every_forward(model, processor_of(tokenizer))
    logits, hooked = run(plain)
    assert hooked == with_images
    assert torch.equal(logits, before)
    logits.sum().backward()
    reached = {n for n, p in tower.items() if p.grad is not None}
    assert reached >= used and not any(tower[n].grad.any() for n in reached)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "idefics3", "llava"])
def test_lora_on_the_projector_adapts_it_beside_the_language_model_and_not_the_vision_tower(family, models, images):
    """model.lora.projector: adapters on every linear layer of the projector (LLaVA's,
    Idefics3's connector, Qwen-VL's mergers) and the language model's; a step trains both,
    nothing else; without the option the projector has none."""
    cfg, tokenizer = loaded(models[family])
    cfg.lora.enabled = True

    def adapted(model) -> set[str]:
        return {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}

    plain = adapted(load_model(cfg))
    cfg.lora.projector = True
    model = load_model(cfg)
    with_projector = adapted(model)
    extra = with_projector - plain
    assert extra and plain < with_projector
    projectors = {"multi_modal_projector", "connector", "merger", "deepstack_merger_list"}
    assert all(set(n.split(".")) & projectors for n in extra)
    inside = "text_model" if family == "idefics3" else "language_model"
    assert all(inside in n for n in plain)
    examples = [IMAGE_ROWS.process(colour_row(c, images), tokenizer, DataConfig()) for c in ("red", "green")]
    collate = ImageCollator(tokenizer.pad_token_id, processor_of(tokenizer), DataConfig().max_image_pixels)
    batch = collate([{k: e[k] for k in collate.columns} for e in examples])
    TokenLoss.for_model(model, 0)(model, batch).total.backward()
    grads = {n.split(".lora_")[0] for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
    assert extra & grads and grads <= with_projector


def test_lora_on_a_projector_that_is_no_linear_layer_or_of_a_text_model_is_one_line(models, tiny_model):
    cfg, _ = loaded(models["gemma3"])  # Gemma 3 projects with a weight of its own, no linear layer
    cfg.lora.enabled = cfg.lora.projector = True
    with pytest.raises(ModelError, match=r"^model.lora.projector: Gemma3ForConditionalGeneration has no projector"):
        load_model(cfg)
    text = ModelConfig(name_or_path=str(tiny_model), attn_implementation="sdpa")
    text.lora.enabled = text.lora.projector = True
    with pytest.raises(ModelError, match=r"^model.lora.projector: .* is a text model, with no projector"):
        load_model(text)


def test_a_reference_or_teacher_of_another_family_is_refused_in_one_line(models, tiny_model):
    """A vision-language policy's reference (DPO, GRPO) or teacher (distillation) reads the
    rows' images as the policy does: a text model, or another family's, is refused before
    any weights load; one of the family passes. Its SFT rows collate with their images."""
    from llmtrain.core.finetune import rows_collator
    from llmtrain.model import check_reference
    from llmtrain.vision import ImageCollator

    cfg, tokenizer = loaded(models["qwen2_5_vl"])
    with pytest.raises(
        ModelError, match=r"^distill.teacher: '.*' is a llama model, but the policy is a vision-language"
    ):
        check_reference(str(tiny_model), "distill.teacher", cfg, tokenizer, role="teacher")
    with pytest.raises(ModelError, match=r"^dpo.reference: '.*' is a gemma3 model, .* must be a qwen2_5_vl model too"):
        check_reference(str(models["gemma3"]), "dpo.reference", cfg, tokenizer)
    check_reference(str(models["qwen2_5_vl"]), "dpo.reference", cfg, tokenizer)
    assert isinstance(rows_collator(Config(), tokenizer), ImageCollator)

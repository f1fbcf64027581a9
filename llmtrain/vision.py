"""Images in chat rows, for vision-language models. Such a model (llmtrain.processor:
`is_vision`) loads as AutoModelForImageTextToText with its AutoProcessor, whose tokenizer
carries the processor (`processor_of`, set by model.load_tokenizer): the row pipeline and the
recipes pass the tokenizer as for text, and what meets an image reads the processor there.

Rows. A chat row's images are its messages' content parts `{"type": "image", "image":
"cat.png"}` (also `path` or `url` for the name, and OpenAI's `image_url` parts), or
`{"type": "image"}` placeholders filled in order from the row's `images` column (TRL's
layout; a hub data set's decoded images come this way). A path is relative to the data
file's folder, or absolute; a URL is refused (nothing is fetched: download it first).
Each image is bounded as it is read: its file's size (data.max_image_bytes), its pixels
before it is decoded (data.max_image_pixels), the images of a row (data.max_images); a
missing, corrupt or truncated image makes its row malformed, reported with its file and
line like any other (data.bad_rows).

An example keeps each image as its file's bytes, checked by decoding them once: the
collator decodes the same bytes, so training sees what was checked whatever happens to the
file afterwards, and the datasets cache holds compressed images, not pixel arrays.

Tokens. The chat template renders one placeholder per image; the processor replaces each
with the image's tokens (how many depends on the model and the image's size). The trained
positions are found on the rendered text as for a text row (rows.labelled_chat: assistant
turns by character span) and carried onto the processor's tokens by aligning the two
sequences (`carry_labels`): tokens the processor inserted are image tokens and never
trained, and a trained token the processor changed is an error rather than a guess. The
processor's own per-token outputs that the model reads (Gemma 3's token_type_ids,
SEQUENCE_INPUTS) are kept with the example.

An over-long row is cut (data.overlong=truncate) only after its last image token, since
half an image's tokens match none of its features; otherwise it is dropped as too long
(or refused under data.overlong=error).

Batches (`ImageCollator`): the text as batches.Collator pads it, the extra per-token
columns padded with 0, and the images of the batch through the processor's image processor
into the tensors the model's forward takes (MODEL_INPUTS), which objective.model_inputs
passes on.

Packing (`PackedImageRows`) joins rows as text rows are joined, with their images in order:
a model puts each image's features at its tokens in order, so each row's features stay on
its tokens, and the packed mask keeps rows apart. Gemma 3, whose image tokens attend to each
other both ways, gets those blocks in the packed mask (processor.image_blocks); Qwen-VL,
which positions image tokens in three dimensions, gets each sample's own positions
(processor.packed_positions); both from objective.model_inputs. A model whose per-token
inputs the packed batch cannot keep exact is refused in one line (`unpackable`).
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import re
from pathlib import Path

from .attention import text_config
from .config import DataConfig
from .data.answers import answer_ids, empty_answer
from .data.batches import Collator
from .data.build import ROWS
from .data.kind import DataKind
from .data.packing import PackedDataset, join_rows
from .data.prepare import check_source
from .data.rows import (
    IGNORE,
    IMAGE_KEYS,
    IMAGE_PARTS,
    RowError,
    check_line,
    labelled_chat,
    length_status,
    row_format,
    row_tools,
    sft_example,
    to_messages,
    tokenize_row,
)
from .errors import DataError, describe, shown
from .processor import MODEL_INPUTS, SEQUENCE_INPUTS, processor_of

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # http:, https:, data:, s3:, file: ...


# --- reading images -------------------------------------------------------------------


def read_image(ref, root: Path | None, cfg: DataConfig):
    """(the bytes of image `ref`, the image they decode to): `ref` a path, or a hub data
    set's image as {bytes, path} or a PIL image; read within data.max_image_bytes and
    decoded within data.max_image_pixels; a RowError saying what is wrong otherwise."""
    if isinstance(ref, dict) and isinstance(ref.get("bytes"), bytes):
        data = ref["bytes"]
    elif isinstance(ref, dict) and isinstance(ref.get("path"), str):
        return read_image(ref["path"], root, cfg)
    elif hasattr(ref, "save") and hasattr(ref, "size"):  # a PIL image, as a hub data set decodes it
        out = io.BytesIO()
        ref.save(out, format="PNG")
        data = out.getvalue()
    elif isinstance(ref, str) and ref:
        data = _read_file(ref, root, cfg)
    else:
        raise RowError(f"image {shown(ref)}: give a file path (relative to the data file's folder)")
    if len(data) > cfg.max_image_bytes:
        raise RowError(f"an image of {len(data)} bytes is over data.max_image_bytes={cfg.max_image_bytes}")
    return data, decode(data, cfg.max_image_pixels)


def _read_file(name: str, root: Path | None, cfg: DataConfig) -> bytes:
    if URL.match(name) and not re.match(r"^[A-Za-z]:[\\/]", name):  # not a Windows drive
        raise RowError(f"image {name!r} is a URL; llmtrain reads local image files only: download it and give its path")
    path = Path(name)
    if not path.is_absolute():
        if root is None:
            raise RowError(f"image {name!r} is a relative path, which only rows of a local data file can give")
        path = root / path
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise RowError(f"image {name!r} is not a file")
        if size > cfg.max_image_bytes:
            raise RowError(
                f"image {name!r} has {size} bytes, over data.max_image_bytes={cfg.max_image_bytes}; shrink it or "
                "raise the setting"
            )
        with open(path, "rb") as f:
            return f.read(cfg.max_image_bytes + 1)  # bounded, should it grow after the check
    except FileNotFoundError:
        where = "" if Path(name).is_absolute() else " (paths are relative to the data file's folder)"
        raise RowError(f"image {name!r}: no such file{where}") from None
    except OSError as e:
        raise RowError(f"image {name!r} cannot be read ({describe(e)})") from None


def decode(data: bytes, max_pixels: int):
    """The image `data` holds, as RGB, refused past `max_pixels` before its pixels are
    decoded (the header gives its size); a RowError for data that is no whole image."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise RowError(
                    f"an image of {width}x{height} pixels is over data.max_image_pixels={max_pixels}; shrink it or "
                    "raise the setting"
                )
            image.load()  # a truncated or corrupt file fails here
            return image.convert("RGB")
    except RowError:
        raise
    except Exception as e:  # PIL's errors for unreadable data are of many types
        raise RowError(f"an image cannot be decoded ({describe(e)}): a corrupt or truncated file, or none") from None


def row_images(refs: list, row: dict) -> list:
    """The row's images in order: each part's own name, and its placeholders ({type:
    image} alone) filled from the row's `images` column, which must match them in number."""
    column = row.get("images")
    if column is None:
        column = []
    elif not isinstance(column, list):
        column = [column]
    placeholders = sum(r is None for r in refs)
    if placeholders != len(column):
        raise RowError(
            f"the messages hold {placeholders} image placeholder(s) ({{type: image}} without a name) but the "
            f"'images' column has {len(column)} image(s); give each placeholder one image, in order"
        )
    given = iter(column)
    return [next(given) if r is None else r for r in refs]


# --- rows to examples -------------------------------------------------------------------


def carry_labels(plain: list[int], labels: list[int], full: list[int]) -> tuple[list[int], list[int]]:
    """`labels` (of the tokenized rendering `plain`) carried onto `full`, the processor's
    tokens for the same text with each image's tokens inserted; returns (the labels of
    `full`, the positions of `full` that are not `plain`'s: the images' tokens). A trained
    token of `plain` that `full` does not hold unchanged is a RowError."""
    out = [IGNORE] * len(full)
    matched = [False] * len(full)
    kept = 0
    for block in difflib.SequenceMatcher(None, plain, full, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            out[block.b + k] = labels[block.a + k]
            matched[block.b + k] = True
        kept += sum(lab != IGNORE for lab in labels[block.a : block.a + block.size])
    if kept != sum(lab != IGNORE for lab in labels):
        raise RowError(
            "the processor changed trained tokens while inserting image tokens (an image inside an assistant "
            "turn?); keep images in user messages"
        )
    # The image tokens: those inserted, and any token of the same ids that the alignment
    # paired with the rendering's placeholder (Qwen's <|image_pad|> is both).
    inserted = {full[i] for i, m in enumerate(matched) if not m}
    return out, [i for i, m in enumerate(matched) if not m or full[i] in inserted]


def read_images(refs: list, row: dict, cfg: DataConfig) -> tuple[list[bytes], list]:
    """(their bytes, the images they decode to) of a row's image parts `refs` (as
    rows.message collects them), placeholders filled from its `images` column, at most
    data.max_images, relative paths from the folder of the row's data file (`row.root`,
    a rows.FileRow's)."""
    refs = row_images(refs, row)
    if len(refs) > cfg.max_images:
        raise RowError(f"the row has {len(refs)} images, over data.max_images={cfg.max_images}")
    if not refs:
        return [], []
    root = getattr(row, "root", None)
    images, pictures = zip(*(read_image(r, root, cfg) for r in refs), strict=True)
    return list(images), list(pictures)


def with_images(processor, text: str, plain: list[int], labels: list[int], pictures: list):
    """(input_ids, labels, the processor's per-token inputs, the image tokens' positions)
    of `text` with its images' tokens inserted by the processor, the labels of `plain`
    (the text tokenized alone) carried onto them (`carry_labels`)."""
    try:
        out = processor(text=[text], images=[pictures], add_special_tokens=False, return_tensors="pt")
    except Exception as e:  # the processor refuses the text and images together
        raise RowError(f"the processor cannot take this row's text and images ({describe(e)})") from None
    ids = out["input_ids"][0].tolist()
    labels, image_positions = carry_labels(plain, labels, ids)
    extras = {k: out[k][0].tolist() if k in out else [0] * len(ids) for k in SEQUENCE_INPUTS}
    return ids, labels, extras, image_positions


def no_inputs(n: int) -> dict:
    """The per-token inputs of `n` tokens of text."""
    return {k: [0] * n for k in SEQUENCE_INPUTS}


def answer_tokens(prompt, answer, tokenizer, tools, pictures: list):
    """answers.answer_ids (input_ids, labels before shifting, where the answer starts) of
    an answer after a prompt whose messages show `pictures`, with the per-token inputs and
    the image tokens' positions: a preference pair's or a KTO row's sequence."""
    if not pictures:
        ids, labels, first = answer_ids(prompt, answer, tokenizer, tools)
        return ids, labels, first, no_inputs(len(ids)), []
    if empty_answer(answer):
        return [], [], 0, {}, []
    text, plain, plain_labels = labelled_chat(prompt + answer, tokenizer, "assistant", len(prompt), tools)
    ids, labels, extras, positions = with_images(processor_of(tokenizer), text, plain, plain_labels, pictures)
    return ids, labels, next(i for i, t in enumerate(labels) if t != IGNORE), extras, positions


def kept_whole(positions: list[int], cut: int, width: int) -> bool:
    """Whether cutting `cut` tokens from the left and then keeping `width` keeps every
    image token (half an image's tokens match none of its features)."""
    return not positions or (positions[0] >= cut and positions[-1] < cut + width)


def image_example(row: dict, tokenizer, cfg: DataConfig) -> dict | str:
    """An SFT row of a vision-language model as its example: input_ids with the images'
    tokens, labels (shifted), its images as bytes and the processor's per-token inputs;
    or why it is dropped (rows.processed's contract). Rows of other formats than chat
    carry no images and are tokenized as text rows."""
    check_line(row)
    fmt = row_format(row) if cfg.format == "auto" else cfg.format
    images, pictures = [], []
    if fmt == "chat":
        refs: list = []
        tools = row_tools(row)
        messages = to_messages(row, "chat", cfg.system_prompt, images=refs)
        images, pictures = read_images(refs, row, cfg)
        text, plain, plain_labels = labelled_chat(messages, tokenizer, cfg.loss_on, tools=tools)
    else:
        plain, plain_labels = tokenize_row(row, fmt, tokenizer, cfg)
    if images:
        ids, labels, extras, image_positions = with_images(processor_of(tokenizer), text, plain, plain_labels, pictures)
    else:
        ids, labels, extras, image_positions = plain, plain_labels, no_inputs(len(plain)), []
    width = cfg.max_seq_len
    status = length_status(len(ids), width, cfg)
    if status == "truncated" and not kept_whole(image_positions, 0, width):
        status = f"too long ({len(ids)} tokens, image tokens past data.max_seq_len, which a cut would split)"
    example = sft_example(ids, labels, status, width)
    if isinstance(example, str):
        return example
    return example | {"images": images, **{k: v[:width] for k, v in extras.items()}}


def empty_example() -> dict:
    """What a dropped row holds besides its status, in image_example's columns."""
    empty = {"input_ids": [], "labels": [], "length": 0, "n_trained": 0, "images": []}
    return empty | {k: [] for k in SEQUENCE_INPUTS}


# --- batches --------------------------------------------------------------------------


# The columns of an example that hold its images and the processor's per-token inputs.
IMAGE_COLUMNS = ("images", *SEQUENCE_INPUTS)


def extended(shown: dict, n: int) -> dict:
    """A prompt's IMAGE_COLUMNS with its per-token inputs extended over `n` tokens of text
    after it (a completion: 0)."""
    return {k: v + [0] * n if k in SEQUENCE_INPUTS else v for k, v in shown.items()}


class PackedImageRows(PackedDataset):
    """Image rows packed as text rows are (packing.PackedDataset), each sequence with its
    rows' images in order: a model puts an image's features at its tokens in order, so the
    features of each packed row land on that row's tokens."""

    def documents(self, j: int) -> list[dict]:
        rows = self.rows[self.bins[j]]
        columns = ("input_ids", "labels", *(k for k in IMAGE_COLUMNS if k in rows))
        return [{k: rows[k][i] for k in columns} for i in range(len(rows["input_ids"]))]

    def __getitem__(self, j: int) -> dict:
        docs = self.documents(j)
        return join_rows(docs) | joined_images(docs)


def joined_images(docs: list[dict]) -> dict:
    """The IMAGE_COLUMNS of packed documents `docs` (in order) as one packed sequence's."""
    out = {"images": [image for d in docs for image in d["images"]]}
    return out | {k: [t for d in docs for t in d[k]] for k in SEQUENCE_INPUTS if all(k in d for d in docs)}


class ImageCollator(Collator):
    """batches.Collator's padded batch of a vision-language model's examples, with what
    the model reads of their images (`image_inputs`)."""

    columns = ("input_ids", "labels", *IMAGE_COLUMNS)

    def __init__(self, pad_id: int, processor, max_pixels: int, pack_width: int = 0):
        super().__init__(pad_id, pack_width)
        self.processor, self.max_pixels = processor, max_pixels

    def __call__(self, examples: list[dict]) -> dict:
        batch = super().__call__(examples)
        return batch | image_inputs(examples, batch["input_ids"].shape[1], self.processor, self.max_pixels)


def image_inputs(examples: list[dict], width: int, processor, max_pixels: int) -> dict:
    """What the model reads beside the text of a batch of `examples` (each a row of the
    batch, its tokens padded on the right to `width`): their per-token inputs padded with
    0, where any is set, and their images (decoded from the examples' bytes) as the image
    processor makes them, all rows' in one call, in row order."""
    import torch

    out = {}
    for key in SEQUENCE_INPUTS:
        if any(e.get(key) and any(e[key]) for e in examples):
            rows = [e.get(key) or [0] * len(e["input_ids"]) for e in examples]
            out[key] = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    images = [[decode(b, max_pixels) for b in e.get("images", [])] for e in examples]
    if any(images):
        pixels = processor.image_processor(images=[i for i in images if i], return_tensors="pt")
        out |= {k: v for k, v in pixels.items() if k in MODEL_INPUTS}
    return out


def images_stamp(source) -> str:
    """The image files a source's rows name, each as (path, size, modification time): part
    of the cache key of its examples (kind.DataKind.stamp), which hold the images' bytes,
    so that an image changed in place is read again, as a changed data file is. Found by
    reading every row once; names that are no local file stamp as they are written."""
    import hashlib

    h = hashlib.sha256()
    for row in source.dataset:
        try:
            parsed = source.parse(row)
        except ValueError:  # a malformed line: the row pipeline reports it
            continue
        for name in _image_names(parsed):
            path = Path(name) if source.root is None else source.root / name
            try:
                st = path.stat()
                h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            except (OSError, ValueError):
                h.update(f"{name}\0".encode())
    return h.hexdigest()[:32]


def _image_names(row) -> list[str]:
    """The image file names a row gives, whatever its kind: those of the image parts of
    any of its messages (a chat row's, a pair's prompt, ...) and of its `images` column.
    Walked with a stack, not recursion: a row's nesting is the user's."""
    names, stack = [], [row]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if value.get("type") in IMAGE_PARTS:
                ref = next((value[k] for k in IMAGE_KEYS if value.get(k) is not None), None)
                names.append(ref.get("url") if isinstance(ref, dict) else ref)
            else:
                stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    column = row.get("images") if isinstance(row, dict) else None
    for ref in column if isinstance(column, list) else [column]:
        names.append(ref.get("path") if isinstance(ref, dict) else ref)  # a hub data set's {bytes, path}
    return [n for n in names if isinstance(n, str)]


def unpackable(processor, mcfg=None) -> str | None:
    """Why rows of this processor's model cannot be packed exactly, or None. A model whose
    forward reads token_type_ids lets an image's tokens attend to each other both ways
    (Gemma 3): packed, where they mark an image's tokens alone (objective.model_inputs adds
    those blocks to the packed mask), and an image's tokens fit in the sliding window of
    the model's config `mcfg`, if it has one (transformers joins the window and the blocks
    otherwise than the model's own mask does beyond it). mm_token_type_ids, Qwen-VL's
    positions, are packed too (model_inputs)."""
    from PIL import Image

    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    out = processor(text=[text], images=[[Image.new("RGB", (32, 32))]], add_special_tokens=False)
    if "token_type_ids" not in out:
        return None
    image_id = getattr(processor.tokenizer, "image_token_id", None)
    marked = [t == 1 for t in out["token_type_ids"][0]]
    if marked != [t == image_id for t in out["input_ids"][0]]:
        return "the model reads token_type_ids that mark more than an image's tokens"
    window = getattr(text_config(mcfg), "sliding_window", None) if mcfg is not None else None
    if window and sum(marked) > window:
        return (
            f"the model attends both ways among an image's {sum(marked)} tokens, more than its sliding window of "
            f"{window}"
        )
    return None


def image_kind(kind: DataKind, version: str, sequences: tuple[str, ...] = ("",)) -> DataKind:
    """`kind` with its image variant (DataKind.images), which rows_kind picks for a
    vision-language model: the same examples (its `make` adds their image columns when the
    tokenizer carries a processor) under `version`, a dropped row's columns with the images
    and each sequence's per-token inputs (`sequences`: their prefixes, a pair's "chosen_"
    and "rejected_"), the cache key stamped with the image files the rows name."""
    empty = kind.empty | {"images": []} | {f"{s}{k}": [] for s in sequences for k in SEQUENCE_INPUTS}
    return dataclasses.replace(kind, images=dataclasses.replace(kind, version=version, empty=empty, stamp=images_stamp))


# SFT rows of a vision-language model (`rows_kind`): a kind of their own, with their images'
# columns, packed with their images in order.
IMAGE_ROWS = DataKind(check_source, "images-v1", image_example, empty_example(), PackedImageRows, stamp=images_stamp)


def rows_kind(kind: DataKind, tokenizer, cfg, mcfg=None) -> DataKind:
    """The kind of a method's examples for this model: for a vision-language model, the
    kind's own with images (SFT rows, build.ROWS: IMAGE_ROWS; others their `images`), or
    the text kind where it has none (an image in its rows is a malformed row). Packing a
    model that `unpackable` names (`mcfg`: its config), and streaming rows with images, are
    refused in one line."""
    images = IMAGE_ROWS if kind is ROWS else kind.images
    if processor_of(tokenizer) is None or images is None:
        return kind
    if cfg.data.packing and (why := unpackable(processor_of(tokenizer), mcfg)):
        raise DataError(f"data.packing: {why}, which packed rows cannot keep exact yet; set data.packing=false")
    if cfg.data.streaming:
        raise DataError("data.streaming: rows with images are not streamed yet; set data.streaming=false")
    return images

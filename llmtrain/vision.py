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
its tokens, and the packed mask keeps rows apart. A model whose forward reads per-token
inputs beside the ids to attend is refused in one line (`unpackable`): Gemma 3 attends both
ways among an image's tokens, which the packed causal mask does not. Qwen-VL, which positions
image tokens in three dimensions, gets each sample's own positions
(processor.packed_positions, from objective.model_inputs).
"""

from __future__ import annotations

import difflib
import io
import re
from pathlib import Path

from .config import DataConfig
from .data.batches import Collator
from .data.build import ROWS
from .data.kind import DataKind
from .data.packing import PackedDataset, join_rows
from .data.prepare import check_source
from .data.rows import (
    IGNORE,
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


def image_example(row: dict, tokenizer, cfg: DataConfig) -> dict | str:
    """An SFT row of a vision-language model as its example: input_ids with the images'
    tokens, labels (shifted), its images as bytes and the processor's per-token inputs;
    or why it is dropped (rows.processed's contract). Rows of other formats than chat
    carry no images and are tokenized as text rows. Relative image paths are read from the
    folder of the row's data file (`row.root`, a rows.FileRow's)."""
    processor = processor_of(tokenizer)
    root = getattr(row, "root", None)
    check_line(row)
    fmt = row_format(row) if cfg.format == "auto" else cfg.format
    images, pictures = [], []
    if fmt == "chat":
        refs: list = []
        tools = row_tools(row)
        messages = to_messages(row, "chat", cfg.system_prompt, images=refs)
        refs = row_images(refs, row)
        if len(refs) > cfg.max_images:
            raise RowError(f"the row has {len(refs)} images, over data.max_images={cfg.max_images}")
        if refs:
            images, pictures = map(list, zip(*(read_image(r, root, cfg) for r in refs), strict=True))
        text, plain, plain_labels = labelled_chat(messages, tokenizer, cfg.loss_on, tools=tools)
    else:
        plain, plain_labels = tokenize_row(row, fmt, tokenizer, cfg)
        text = None
    if images:
        try:
            out = processor(text=[text], images=[pictures], add_special_tokens=False, return_tensors="pt")
        except Exception as e:  # the processor refuses the text and images together
            raise RowError(f"the processor cannot take this row's text and images ({describe(e)})") from None
        ids = out["input_ids"][0].tolist()
        labels, image_positions = carry_labels(plain, plain_labels, ids)
        extras = {k: out[k][0].tolist() if k in out else [0] * len(ids) for k in SEQUENCE_INPUTS}
    else:
        ids, labels, image_positions = plain, plain_labels, []
        extras = {k: [0] * len(ids) for k in SEQUENCE_INPUTS}
    width = cfg.max_seq_len
    status = length_status(len(ids), width, cfg)
    if status == "truncated" and image_positions and image_positions[-1] >= width:
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


class PackedImageRows(PackedDataset):
    """Image rows packed as text rows are (packing.PackedDataset), each sequence with its
    rows' images in order: a model puts an image's features at its tokens in order, so the
    features of each packed row land on that row's tokens."""

    def __getitem__(self, j: int) -> dict:
        rows = self.rows[self.bins[j]]
        out = join_rows([{"input_ids": ids, "labels": lab} for ids, lab in zip(rows["input_ids"], rows["labels"])])
        out["images"] = [image for images in rows["images"] for image in images]
        return out | {k: [t for row in rows[k] for t in row] for k in SEQUENCE_INPUTS if k in rows}


class ImageCollator(Collator):
    """batches.Collator's padded batch of a vision-language model's examples, with their
    per-token inputs padded with 0 and their images (decoded from the example's bytes) as
    the image processor makes them for the model, all rows' images in one call."""

    columns = ("input_ids", "labels", "images", *SEQUENCE_INPUTS)

    def __init__(self, pad_id: int, processor, max_pixels: int, pack_width: int = 0):
        super().__init__(pad_id, pack_width)
        self.processor, self.max_pixels = processor, max_pixels

    def __call__(self, examples: list[dict]) -> dict:
        import torch

        batch = super().__call__(examples)
        width = batch["input_ids"].shape[1]
        for key in SEQUENCE_INPUTS:
            if any(e.get(key) and any(e[key]) for e in examples):
                rows = [e.get(key) or [0] * len(e["input_ids"]) for e in examples]
                batch[key] = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        images = [[decode(b, self.max_pixels) for b in e.get("images", [])] for e in examples]
        if any(images):
            out = self.processor.image_processor(images=[i for i in images if i], return_tensors="pt")
            batch |= {k: v for k, v in out.items() if k in MODEL_INPUTS}
        return batch


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
    """The image file names a chat row gives, read as image_example reads them; none for a
    malformed row or one of another format (the row pipeline reports or reads it)."""
    refs: list = []
    try:
        check_line(row)
        to_messages(row, "chat", images=refs)
        refs = row_images(refs, row)
    except (RowError, KeyError, TypeError):
        return []
    names = [r.get("path") if isinstance(r, dict) else r for r in refs]  # a hub data set's {bytes, path}
    return [n for n in names if isinstance(n, str)]


def unpackable(processor) -> str | None:
    """Why rows of this processor's model cannot be packed exactly, or None: a model whose
    forward reads token_type_ids attends among its image tokens in a way the packed causal
    mask does not keep (mm_token_type_ids, Qwen-VL's positions, are packed: model_inputs)."""
    from PIL import Image

    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    out = processor(text=[text], images=[[Image.new("RGB", (32, 32))]], add_special_tokens=False)
    if "token_type_ids" in out:
        return "the model attends both ways among an image's tokens (token_type_ids, as Gemma 3)"
    return None


# SFT rows of a vision-language model (`rows_kind`): a kind of their own, with their images'
# columns, packed with their images in order.
IMAGE_ROWS = DataKind(check_source, "images-v1", image_example, empty_example(), PackedImageRows, stamp=images_stamp)


def rows_kind(kind: DataKind, tokenizer, cfg) -> DataKind:
    """The kind of a method's examples for this model: SFT rows (build.ROWS) of a
    vision-language model are IMAGE_ROWS; other kinds keep text rows (an image in them is a
    malformed row). Packing a model that `unpackable` names, and streaming rows with images,
    are refused in one line."""
    if processor_of(tokenizer) is None:
        return kind
    if cfg.data.packing and kind is ROWS and (why := unpackable(processor_of(tokenizer))):
        raise DataError(f"data.packing: {why}, which packed rows cannot keep exact yet; set data.packing=false")
    if cfg.data.streaming and kind is ROWS:
        raise DataError("data.streaming: rows with images are not streamed yet; set data.streaming=false")
    return IMAGE_ROWS if kind is ROWS else kind

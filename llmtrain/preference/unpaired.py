"""Unpaired preference rows for KTO (dpo.loss=kto): `{prompt, completion, label}`, TRL's
unpaired preference format. `prompt` is a string or a list of messages, `completion` a
string or assistant message(s), `label` true for a desirable completion, false for an
undesirable one. Messages are read as a pair's are (data/answers.py), with
data.system_prompt and a `tools` column; a string prompt with a string completion is plain
text followed by the completion and EOS for a tokenizer without a chat template.

Each row is tokenized as a pair's answer is: labels (already shifted) on the completion
only, end of turn included; an over-long row loses its prompt from the left (keeping one
token), then its completion's end (data/answers.fit), or is dropped or refused
(data.overlong). `UNPAIRED` is the kind the one row pipeline (data/prepare.prepare) makes
of them.

KTO's reference point is the policy's KL divergence from the reference, estimated on
completions that do not answer their prompt: row i's KL completion is row i's prompt
followed by the completion of row (i + 1) mod N of its split (training or evaluation set,
in dataset order; `KLCompletions`). TRL shifts completions by one within each batch
instead, so which completion a row's KL sequence gets there depends on the batch size and
on how rows fall into batches; here it depends on the data alone, so every batch layout
and process count trains the same thing. Over the whole split the KL completions are the
completions themselves, each once, as the KTO paper asks. Rows next to each other should
answer different prompts (a file that lists a prompt's completions together gives KL
sequences that answer their own prompt): `notes` counts them.
"""

from __future__ import annotations

import hashlib

import torch

from ..config import DataConfig
from ..data.answers import answer_messages, as_prompt, conversation, fit
from ..data.batches import Collator
from ..data.kind import DataKind
from ..data.rows import IGNORE, RowError, check_line, flag, length_status, shift
from ..errors import DataError, shown
from ..processor import SEQUENCE_INPUTS, processor_of
from ..vision import IMAGE_COLUMNS, answer_tokens, image_inputs, image_kind, kept_whole, read_images
from .pairs import PAIRS

COLUMNS = ("prompt", "completion", "label")


def unpaired_messages(row: dict, images: list | None = None) -> tuple[list[dict] | str, list[dict] | str, bool]:
    """(prompt, completion, desirable): two strings for a plain-text row, else message
    lists where the completion holds only what follows the prompt. `images` as
    pairs.pair_messages takes it."""
    check_line(row)
    missing = [k for k in COLUMNS if row.get(k) is None]
    if missing:
        raise RowError(f"a KTO row needs 'prompt', 'completion' and 'label'; this row has no value for {missing}")
    prompt, completion, label = row["prompt"], row["completion"], flag(row, "label")
    if not isinstance(label, bool):
        raise RowError(
            f"'label' must be true (a desirable completion) or false (an undesirable one), got {shown(label)}"
        )
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt, completion, label
    prompt = as_prompt(prompt, images)
    return prompt, answer_messages(completion, "completion", prompt, images is not None), label


def unpaired_example(row: dict, tokenizer, cfg: DataConfig) -> dict | str:
    """One row -> {input_ids, labels (shifted), prompt_tokens (where the completion starts
    in input_ids), prompt_hash (of those tokens), desirable, length, n_trained, status}, or
    why the row is dropped (UNPAIRED.make). For a vision-language model (IMAGE_UNPAIRED.make)
    also the prompt's images (as bytes) and the per-token inputs (vision.IMAGE_COLUMNS)."""
    vision = processor_of(tokenizer) is not None
    refs: list | None = [] if vision else None
    prompt, completion, desirable = unpaired_messages(row, refs)
    prompt, (completion,), tools = conversation(row, prompt, (completion,), tokenizer, cfg)
    images, pictures = read_images(refs, row, cfg) if vision else ([], [])
    ids, labels, start, inputs, at = answer_tokens(prompt, completion, tokenizer, tools, pictures)
    if not ids or all(t == IGNORE for t in labels):
        return "empty answer"
    if start < 1:  # plain text: nothing before the completion to predict its first token from
        raise RowError("the prompt has no tokens; give a non-empty 'prompt'")
    status = length_status(len(ids), cfg.max_seq_len, cfg)
    if status == "truncated":
        longest = len(ids)
        [(ids, labels)], cut = fit([(ids, labels)], start, cfg.max_seq_len)
        if not kept_whole(at, cut, cfg.max_seq_len):
            return f"too long ({longest} tokens, image tokens that a cut to data.max_seq_len would split)"
        inputs = {k: v[cut:][: cfg.max_seq_len] for k, v in inputs.items()}
        start -= cut
    elif status != "ok":
        return status
    labels = shift(labels)
    if all(t == IGNORE for t in labels):
        return "no trained tokens"
    example = {
        "input_ids": ids,
        "labels": labels,
        "prompt_tokens": start,
        "prompt_hash": prompt_hash(ids[:start]),
        "desirable": desirable,
        "length": len(ids),
        "n_trained": sum(t != IGNORE for t in labels),
        "status": status,
    }
    return example | {"images": images} | inputs if vision else example


def prompt_hash(ids: list[int]) -> int:
    """A 63-bit digest of a prompt's token ids, to tell rows with the same prompt apart cheaply."""
    digest = hashlib.blake2b(repr(ids).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def unpaired_columns(src, tokenizer, cfg: DataConfig) -> None:
    """A source of KTO rows has 'prompt', 'completion' and 'label' columns (UNPAIRED.columns)."""
    if not set(COLUMNS) <= set(src.columns):
        pairs = {"chosen", "rejected"} <= set(src.columns)
        fix = (
            "turn each pair into two rows ({prompt, completion: chosen, label: true} and {prompt, completion: "
            "rejected, label: false}), or train on the pairs with another dpo.loss"
            if pairs
            else "give unpaired rows, or train on pairs with another dpo.loss"
        )
        raise DataError(
            f"{src.key}: {src.name}: dpo.loss=kto reads unpaired rows with 'prompt', 'completion' and 'label' (true: "
            f"desirable); found columns {sorted(src.columns)}; {fix}"
        )


class KLCompletions(torch.utils.data.Dataset):
    """A split's tokenized rows (numbered by `row_index`), each with its KL sequence: its
    own prompt followed by the completion of the next row, (i + 1) mod N in dataset order
    (see the module docstring), cut to `width` tokens on the right. The KL sequence's
    labels are that completion's tokens, shifted as every label here is. A vision-language
    model's KL sequence shows its own prompt's images, with the per-token inputs joined as
    its tokens are."""

    columns = ("input_ids", "labels", "prompt_tokens", "prompt_hash", "desirable", "row_index")

    def __init__(self, rows, width: int):
        columns = [*self.columns, *(c for c in IMAGE_COLUMNS if c in rows.column_names)]
        self.rows, self.width = rows.select_columns(columns), width

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def _fingerprint(self) -> str:
        """The rows' (reference.data_key reads it), and the way KL completions are chosen."""
        return f"{self.rows._fingerprint}:kl-next-row"

    def __getitem__(self, i: int) -> dict:
        row, other = self.rows[i], self.rows[(i + 1) % len(self.rows)]
        p, q = row["prompt_tokens"], other["prompt_tokens"]
        # The other row's completion labels before shifting: raw[t] = shifted[t - 1].
        raw = [IGNORE] * p + other["labels"][q - 1 : -1]
        ids = (row["input_ids"][:p] + other["input_ids"][q:])[: self.width]
        out = {
            "input_ids": row["input_ids"],
            "labels": row["labels"],
            "kl_input_ids": ids,
            "kl_labels": shift(raw[: self.width]),
            "desirable": row["desirable"],
            "row_index": row["row_index"],
        }
        if "images" not in row:
            return out
        inputs = {k: row[k] for k in IMAGE_COLUMNS}
        kl = {f"kl_{k}": (row[k][:p] + other[k][q:])[: self.width] for k in SEQUENCE_INPUTS}
        return out | inputs | kl

    def notes(self, desirable_weight: float, undesirable_weight: float) -> tuple[str, list[str]]:
        """(a line on the split's balance, warnings): weights outside the KTO paper's
        advice, and rows whose KL completion answers their own prompt."""
        desirable, hashes = self.rows["desirable"], self.rows["prompt_hash"]
        n, good = len(desirable), sum(desirable)
        line = f"dpo.loss=kto: {good} desirable and {n - good} undesirable completions"
        warnings = []
        if good and n - good:
            ratio = desirable_weight * good / (undesirable_weight * (n - good))
            line += f"; weighted {ratio:.2f} : 1"
            if not 1 <= ratio <= 4 / 3:
                warnings.append(
                    f"dpo.desirable_weight: the desirable rows weigh {ratio:.2f} times the undesirable ones "
                    f"(dpo.desirable_weight={desirable_weight:g} x {good} rows against dpo.undesirable_weight="
                    f"{undesirable_weight:g} x {n - good}); the KTO paper advises between 1 and 4/3"
                )
        else:
            warnings.append(
                f"data.train: every completion is {'desirable' if good else 'undesirable'}; KTO learns from both "
                "kinds, so give rows with label true and rows with label false"
            )
        same = sum(hashes[i] == hashes[(i + 1) % n] for i in range(n)) if n > 1 else 0
        if same > n // 10:
            warnings.append(
                f"data.train: {same} of {n} rows have the same prompt as the next row, whose completion is their KL "
                "completion; KTO's reference point wants completions to other prompts: shuffle the file, or list "
                "a prompt's completions apart"
            )
        return line, warnings


class UnpairedCollator:
    """Makes one micro-batch of k rows: `input_ids`, `attention_mask` and `labels` of their
    completions, the same with a `kl_` prefix for their KL sequences (each padded on the
    right on its own), `desirable` (k booleans) and `row_index` (the rows' numbers, for
    the reference log-probs computed before training). With a vision-language model's
    `processor`, what the model reads of each row's images (vision.image_inputs), which
    its KL sequence shows too."""

    items = "completions"

    def __init__(self, pad_id: int, processor=None, max_pixels: int = 0):
        self.tokens = Collator(pad_id)
        self.processor, self.max_pixels = processor, max_pixels
        self.columns = KLCompletions.columns + (IMAGE_COLUMNS if processor is not None else ())

    def __call__(self, examples: list[dict]) -> dict:
        rows = [{k: e[k] for k in ("input_ids", "labels", *IMAGE_COLUMNS) if k in e} for e in examples]
        kl_keys = ("input_ids", "labels", *SEQUENCE_INPUTS)
        kl_rows = [{k: e[f"kl_{k}"] for k in kl_keys if f"kl_{k}" in e} for e in examples]
        batch, kl = self.tokens(rows), self.tokens(kl_rows)
        if self.processor is not None:  # the pixels once: the KL sequences show the same images
            shown = image_inputs(rows, batch["input_ids"].shape[1], self.processor, self.max_pixels)
            batch |= shown
            kl |= image_inputs(kl_rows, kl["input_ids"].shape[1], self.processor, self.max_pixels)
            kl |= {k: v for k, v in shown.items() if k not in SEQUENCE_INPUTS}
        batch |= {f"kl_{key}": value for key, value in kl.items()}
        batch["desirable"] = torch.tensor([e["desirable"] for e in examples], dtype=torch.bool)
        batch["row_index"] = torch.tensor([e["row_index"] for e in examples], dtype=torch.long)
        return batch

    def empty_batch(self, packed: bool = False) -> dict:
        """A batch with nothing to train and no row (objective count 0), whose completion
        and KL sequences are batches.Collator's empty one."""
        batch = self.tokens.empty_batch(False)
        batch |= {f"kl_{key}": value.clone() for key, value in batch.items()}
        return batch | {"desirable": torch.zeros(0, dtype=torch.bool), "row_index": torch.zeros(0, dtype=torch.long)}


# Unpaired rows for the one builder (build.build_datasets): numbered (`row_index`) for the
# reference log-probs computed once before training, each split given its KL completions;
# never packed (preference/config.DPOConfig refuses data.packing with dpo.loss=kto). A
# vision-language model's (IMAGE_UNPAIRED) add their images and per-token inputs.
UNPAIRED = DataKind(
    unpaired_columns,
    "unpaired-v3",
    unpaired_example,
    {
        "input_ids": [],
        "labels": [],
        "prompt_tokens": 0,
        "prompt_hash": 0,
        "desirable": False,
        "length": 0,
        "n_trained": 0,
    },
    None,
    unit="rows",
    pair_hints=True,
    batched=("completions", "completions"),
    index="row_index",
    view=KLCompletions,
)
UNPAIRED = image_kind(UNPAIRED, "image-unpaired-v1")
IMAGE_UNPAIRED = UNPAIRED.images


def preference_data(cfg) -> DataKind:
    """recipes/dpo.py's data: unpaired rows for KTO, pairs for every other dpo.loss."""
    return UNPAIRED if cfg.dpo.loss == "kto" else PAIRS

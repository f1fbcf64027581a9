"""Preference pairs: rows in three shapes, each made into a chosen and a rejected token
sequence that share their prompt, with labels (already shifted) on the answer tokens only.

Shapes, told apart by their fields:
- `prompt`, `chosen`, `rejected` strings: the prompt is a user message and each answer an
  assistant message (with a chat template), or plain text followed by the answer and EOS
  (without one);
- conversational: `prompt` a list of messages (several turns, a system message), `chosen`
  and `rejected` lists of assistant messages (or one such message, or a string);
- `chosen` and `rejected` whole conversations without a `prompt`: the prompt is their
  longest common prefix of messages (UltraFeedback's layout).
Messages are read as SFT chat rows' are (`data/rows.message`: content parts, tool calls
and tool results, a `tools` column), and data.system_prompt goes first in a conversational
prompt without a system message (data/answers.py, shared with KTO rows).

An over-long pair is cut from the left of its prompt (both sequences alike, keeping at
least one prompt token), then its answers on the right (data/answers.fit), or dropped or
refused, by data.overlong. A pair whose answers are identical or empty is dropped and
counted. `PAIRS` is the kind the one row pipeline (data/prepare.prepare) makes of them.
"""

from __future__ import annotations

import math

import torch

from ..config import DataConfig
from ..data.answers import answer_messages, as_messages, as_prompt, assistant_answer, conversation, fit, no_images
from ..data.batches import Collator
from ..data.kind import DataKind
from ..data.packing import PackedDataset, join_rows
from ..data.rows import IGNORE, RowError, check_line, length_status, number, shift
from ..errors import DataError, shown
from ..processor import SEQUENCE_INPUTS, processor_of
from ..vision import answer_tokens, image_inputs, image_kind, joined_images, kept_whole, read_images


def pair_messages(row: dict, images: list | None = None) -> tuple[list[dict] | str, list[dict] | str, list[dict] | str]:
    """(prompt, chosen, rejected): three strings for plain-text pairs, else message lists
    where the answers hold only what follows the prompt. With `images` (a vision-language
    model's rows), what the prompt's image parts name is appended to it (rows.message);
    answers hold none."""
    check_line(row)
    missing = [k for k in ("chosen", "rejected") if row.get(k) is None]
    if missing:
        raise RowError(f"a preference pair needs 'chosen' and 'rejected'; this row has no {missing}")
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        return prompt, chosen, rejected
    seen = images is not None
    if prompt is not None:
        prompt = as_prompt(prompt, images)
        chosen = answer_messages(chosen, "chosen", prompt, seen)
        return prompt, chosen, answer_messages(rejected, "rejected", prompt, seen)
    shown_c, shown_r = ([], []) if seen else (None, None)
    chosen, rejected = as_messages(chosen, "chosen", shown_c), as_messages(rejected, "rejected", shown_r)
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise RowError("'chosen' and 'rejected' share no prompt: their first messages differ (or give 'prompt')")
    answers = assistant_answer(chosen[shared:], "chosen"), assistant_answer(rejected[shared:], "rejected")
    if seen:  # every image is in the shared prompt, so each side names them all
        no_images(answers[0], "chosen")
        no_images(answers[1], "rejected")
        if shown_c != shown_r:
            raise RowError("'chosen' and 'rejected' show different images in the messages they share; give the same")
        images.extend(shown_c)
    return chosen[:shared], *answers


def pair_example(row: dict, tokenizer, cfg: DataConfig) -> dict | str:
    """One row -> {chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels
    (shifted), length, n_trained, status}, or why the pair is dropped (PAIRS.make). For a
    vision-language model (IMAGE_PAIRS.make) also the prompt's images (as bytes, once for
    both answers) and each answer's per-token inputs (vision.IMAGE_COLUMNS, prefixed)."""
    vision = processor_of(tokenizer) is not None
    refs: list | None = [] if vision else None
    prompt, chosen, rejected = pair_messages(row, refs)
    if chosen == rejected:
        return "identical answers"
    prompt, (chosen, rejected), tools = conversation(row, prompt, (chosen, rejected), tokenizer, cfg)
    images, pictures = read_images(refs, row, cfg) if vision else ([], [])
    sides = [answer_tokens(prompt, a, tokenizer, tools, pictures) for a in (chosen, rejected)]
    (ci, cl, cp, cx, c_at), (ri, rl, rp, rx, r_at) = sides
    if not ci or not ri or all(t == IGNORE for t in cl) or all(t == IGNORE for t in rl):
        return "an empty answer"
    width, longest = cfg.max_seq_len, max(len(ci), len(ri))
    status = length_status(longest, width, cfg)
    if status == "truncated":  # both sequences start with the same prompt tokens: cut alike
        [(ci, cl), (ri, rl)], cut = fit([(ci, cl), (ri, rl)], min(cp, rp), width)
        if not (kept_whole(c_at, cut, width) and kept_whole(r_at, cut, width)):
            return f"too long ({longest} tokens, image tokens that a cut to data.max_seq_len would split)"
        cx, rx = ({k: v[cut:][:width] for k, v in x.items()} for x in (cx, rx))
        if ci == ri and cl == rl:  # the answers differed only in what was cut off
            return "identical answers after truncation"
    elif status != "ok":
        return status
    cl, rl = shift(cl), shift(rl)
    if all(t == IGNORE for t in cl) or all(t == IGNORE for t in rl):
        return "no trained tokens"
    example = {
        "chosen_input_ids": ci,
        "chosen_labels": cl,
        "rejected_input_ids": ri,
        "rejected_labels": rl,
        "length": len(ci) + len(ri),
        "n_trained": sum(t != IGNORE for t in cl) + sum(t != IGNORE for t in rl),
        "status": status,
    }
    if not vision:
        return example
    inputs = {f"{side}_{k}": v for side, x in (("chosen", cx), ("rejected", rx)) for k, v in x.items()}
    return example | {"images": images} | inputs


def pair_margin(row: dict) -> float:
    """A pair's optional 'margin' column (recipes/reward.py): how far apart its scores
    should be, a finite number; 0 without one."""
    value = number(row, "margin")
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RowError(f"'margin' must be a finite number, got {shown(row['margin'])}")
    return float(value)


def pair_columns(src, tokenizer, cfg: DataConfig) -> None:
    """A source of pairs has 'chosen' and 'rejected' columns (PAIRS.columns)."""
    if not {"chosen", "rejected"} <= set(src.columns):
        other = (
            "recipes/dpo.py with dpo.loss=kto (they are unpaired rows)"
            if {"prompt", "completion", "label"} <= set(src.columns)
            else "recipes/finetune.py"
        )
        raise DataError(
            f"{src.key}: {src.name}: preference pairs need 'chosen' and 'rejected' (and 'prompt' unless they are "
            f"whole conversations); found columns {sorted(src.columns)}; give pair rows, or train on these "
            f"rows with {other}"
        )


class PackedPairs(PackedDataset):
    """A view of tokenized pairs (with `pair_index`) as packed sequences of `capacity`
    tokens: whole pairs (chosen, then rejected) best-fit packed together by their `length`,
    each answer sequence a sample of its own under the packed mask (attention.packed_mask),
    so a pair never straddles sequences or micro-batches and no padding is computed. The
    capacity is twice data.max_seq_len, so every pair fits."""

    @property
    def pairs(self):
        """The tokenized pairs (reference.data_key keys the reference log-probs on them)."""
        return self.rows

    def documents(self, j: int) -> list[dict]:
        return answers(self.rows[self.bins[j]])

    def __getitem__(self, j: int) -> dict:
        rows = self.rows[self.bins[j]]  # read once: the loader's hot path
        docs = answers(rows)
        margins = {"margin": rows["margin"]} if "margin" in rows else {}  # reward-model pairs
        out = join_rows(docs) | {"pair_index": rows["pair_index"]} | margins
        return out if "images" not in rows else out | joined_images(docs)


def answers(rows: dict) -> list[dict]:
    """The packed sequence of pairs `rows` (columns of the bin's pairs) as its samples: each
    pair's chosen answer, then its rejected one; a vision-language model's pairs show their
    images to each answer."""
    docs = []
    for i in range(len(rows["pair_index"])):
        for side in ("chosen", "rejected"):
            doc = {"input_ids": rows[f"{side}_input_ids"][i], "labels": rows[f"{side}_labels"][i]}
            if "images" in rows:
                doc |= {"images": rows["images"][i]} | {k: rows[f"{side}_{k}"][i] for k in SEQUENCE_INPUTS}
            docs.append(doc)
    return docs


class PairCollator:
    """Makes one micro-batch of k pairs, as 2k answers: the chosen ones first (answers
    0..k-1), then the rejected ones in the same order, with `answers` (each position's
    answer, -1 for none) and `pair_index` (the k pairs' numbers), and with `margins` each
    pair's `margin` (reward models). Padded: one row per answer, right padding, labels
    IGNORE there. Packed (examples from PackedPairs): the packed rows as
    batches.Collator pads them to `pack_width`. With a vision-language model's
    `processor`, each answer's images and per-token inputs (vision.image_inputs): a pair's
    images are shown to both its answers."""

    def __init__(self, pad_id: int, pack_width: int = 0, margins: bool = False, processor=None, max_pixels: int = 0):
        self.tokens = Collator(pad_id, pack_width)
        self.items = "packed sequences of whole pairs" if pack_width else "pairs"
        self.margins = margins
        self.processor, self.max_pixels = processor, max_pixels
        images = ("images", *(f"{side}_{k}" for side in ("chosen", "rejected") for k in SEQUENCE_INPUTS))
        self.columns = (
            "chosen_input_ids",
            "chosen_labels",
            "rejected_input_ids",
            "rejected_labels",
            "pair_index",
            *(("margin",) if margins else ()),
            *(images if processor is not None else ()),
        )

    def __call__(self, examples: list[dict]) -> dict:
        if "doc_ids" in examples[0]:
            return self._packed(examples)
        rows = [self._answer(p, "chosen") for p in examples] + [self._answer(p, "rejected") for p in examples]
        batch = self.tokens(rows)
        if self.processor is not None:
            batch |= image_inputs(rows, batch["input_ids"].shape[1], self.processor, self.max_pixels)
        batch["answers"] = torch.arange(len(rows))[:, None].expand_as(batch["input_ids"]).contiguous()
        batch["pair_index"] = torch.tensor([p["pair_index"] for p in examples], dtype=torch.long)
        if self.margins:
            batch["margin"] = torch.tensor([p["margin"] for p in examples], dtype=torch.float32)
        return batch

    def _answer(self, pair: dict, side: str) -> dict:
        row = {"input_ids": pair[f"{side}_input_ids"], "labels": pair[f"{side}_labels"]}
        if self.processor is None:
            return row
        return row | {"images": pair["images"]} | {k: pair[f"{side}_{k}"] for k in SEQUENCE_INPUTS}

    def _packed(self, examples: list[dict]) -> dict:
        batch = self.tokens([{k: e[k] for k in ("input_ids", "labels", "position_ids", "doc_ids")} for e in examples])
        if self.processor is not None:
            batch |= image_inputs(examples, batch["input_ids"].shape[1], self.processor, self.max_pixels)
        k = sum(len(e["pair_index"]) for e in examples)
        answers, first = torch.full_like(batch["doc_ids"], -1), 0  # first: the row's first pair in the batch
        for row, e in enumerate(examples):
            docs = batch["doc_ids"][row]
            real = docs >= 0  # document d is pair d // 2's chosen (d even) or rejected answer
            answers[row][real] = first + docs[real] // 2 + (docs[real] % 2) * k
            first += len(e["pair_index"])
        batch["answers"] = answers
        batch["pair_index"] = torch.tensor([i for e in examples for i in e["pair_index"]], dtype=torch.long)
        if self.margins:
            batch["margin"] = torch.tensor([m for e in examples for m in e["margin"]], dtype=torch.float32)
        return batch

    def empty_batch(self, packed: bool = False) -> dict:
        """A batch with nothing to train and no pair (objective count 0): batches.Collator's."""
        batch = self.tokens.empty_batch(packed)
        return batch | {
            "answers": torch.full_like(batch["input_ids"], -1),
            "pair_index": torch.zeros(0, dtype=torch.long),
            **({"margin": torch.zeros(0)} if self.margins else {}),
        }


# What a dropped pair holds besides its status.
EMPTY = {
    "chosen_input_ids": [],
    "chosen_labels": [],
    "rejected_input_ids": [],
    "rejected_labels": [],
    "length": 0,
    "n_trained": 0,
}

# Preference pairs for the one builder (build.build_datasets): whole pairs pack into
# sequences of twice data.max_seq_len, so every pair fits, and each pair is numbered
# (`pair_index`) for the reference log-probs computed once before training. A
# vision-language model's pairs (IMAGE_PAIRS) add their images and per-token inputs.
PAIRS = DataKind(
    pair_columns,
    "pairs-v4",
    pair_example,
    EMPTY,
    PackedPairs,
    2,
    "pairs",
    pair_hints=True,
    batched=("pairs", "packed sequences of whole pairs"),
    index="pair_index",
)
PAIRS = image_kind(PAIRS, "image-pairs-v1", ("chosen_", "rejected_"))
IMAGE_PAIRS = PAIRS.images

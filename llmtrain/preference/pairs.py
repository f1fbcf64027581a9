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
from ..data.answers import answer_ids, answer_messages, as_messages, as_prompt, assistant_answer, conversation, fit
from ..data.batches import Collator
from ..data.kind import DataKind
from ..data.packing import PackedDataset, join_rows
from ..data.rows import IGNORE, RowError, check_line, length_status, number, shift
from ..errors import DataError, shown


def pair_messages(row: dict) -> tuple[list[dict] | str, list[dict] | str, list[dict] | str]:
    """(prompt, chosen, rejected): three strings for plain-text pairs, else message lists
    where the answers hold only what follows the prompt."""
    check_line(row)
    missing = [k for k in ("chosen", "rejected") if row.get(k) is None]
    if missing:
        raise RowError(f"a preference pair needs 'chosen' and 'rejected'; this row has no {missing}")
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        return prompt, chosen, rejected
    if prompt is not None:
        prompt = as_prompt(prompt)
        return prompt, answer_messages(chosen, "chosen", prompt), answer_messages(rejected, "rejected", prompt)
    chosen, rejected = as_messages(chosen, "chosen"), as_messages(rejected, "rejected")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise RowError("'chosen' and 'rejected' share no prompt: their first messages differ (or give 'prompt')")
    return chosen[:shared], assistant_answer(chosen[shared:], "chosen"), assistant_answer(rejected[shared:], "rejected")


def pair_example(row: dict, tokenizer, cfg: DataConfig) -> dict | str:
    """One row -> {chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels
    (shifted), length, n_trained, status}, or why the pair is dropped (PAIRS.make)."""
    prompt, chosen, rejected = pair_messages(row)
    if chosen == rejected:
        return "identical answers"
    prompt, (chosen, rejected), tools = conversation(row, prompt, (chosen, rejected), tokenizer, cfg)
    (ci, cl, cp), (ri, rl, rp) = (answer_ids(prompt, a, tokenizer, tools) for a in (chosen, rejected))
    if not ci or not ri or all(t == IGNORE for t in cl) or all(t == IGNORE for t in rl):
        return "an empty answer"
    width = cfg.max_seq_len
    status = length_status(max(len(ci), len(ri)), width, cfg)
    if status == "truncated":  # both sequences start with the same prompt tokens: cut alike
        [(ci, cl), (ri, rl)], _ = fit([(ci, cl), (ri, rl)], min(cp, rp), width)
        if ci == ri and cl == rl:  # the answers differed only in what was cut off
            return "identical answers after truncation"
    elif status != "ok":
        return status
    cl, rl = shift(cl), shift(rl)
    if all(t == IGNORE for t in cl) or all(t == IGNORE for t in rl):
        return "no trained tokens"
    return {
        "chosen_input_ids": ci,
        "chosen_labels": cl,
        "rejected_input_ids": ri,
        "rejected_labels": rl,
        "length": len(ci) + len(ri),
        "n_trained": sum(t != IGNORE for t in cl) + sum(t != IGNORE for t in rl),
        "status": status,
    }


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

    def __getitem__(self, j: int) -> dict:
        rows = self.rows[self.bins[j]]
        docs = []
        for i in range(len(self.bins[j])):
            for side in ("chosen", "rejected"):
                docs.append({"input_ids": rows[f"{side}_input_ids"][i], "labels": rows[f"{side}_labels"][i]})
        margins = {"margin": rows["margin"]} if "margin" in rows else {}  # reward-model pairs
        return join_rows(docs) | {"pair_index": rows["pair_index"]} | margins


class PairCollator:
    """Makes one micro-batch of k pairs, as 2k answers: the chosen ones first (answers
    0..k-1), then the rejected ones in the same order, with `answers` (each position's
    answer, -1 for none) and `pair_index` (the k pairs' numbers), and with `margins` each
    pair's `margin` (reward models). Padded: one row per answer, right padding, labels
    IGNORE there. Packed (examples from PackedPairs): the packed rows as
    batches.Collator pads them to `pack_width`."""

    def __init__(self, pad_id: int, pack_width: int = 0, margins: bool = False):
        self.tokens = Collator(pad_id, pack_width)
        self.items = "packed sequences of whole pairs" if pack_width else "pairs"
        self.margins = margins
        self.columns = (
            "chosen_input_ids",
            "chosen_labels",
            "rejected_input_ids",
            "rejected_labels",
            "pair_index",
            *(("margin",) if margins else ()),
        )

    def __call__(self, examples: list[dict]) -> dict:
        if "doc_ids" in examples[0]:
            return self._packed(examples)
        rows = [{"input_ids": p["chosen_input_ids"], "labels": p["chosen_labels"]} for p in examples]
        rows += [{"input_ids": p["rejected_input_ids"], "labels": p["rejected_labels"]} for p in examples]
        batch = self.tokens(rows)
        batch["answers"] = torch.arange(len(rows))[:, None].expand_as(batch["input_ids"]).contiguous()
        batch["pair_index"] = torch.tensor([p["pair_index"] for p in examples], dtype=torch.long)
        if self.margins:
            batch["margin"] = torch.tensor([p["margin"] for p in examples], dtype=torch.float32)
        return batch

    def _packed(self, examples: list[dict]) -> dict:
        batch = self.tokens([{k: e[k] for k in ("input_ids", "labels", "position_ids", "doc_ids")} for e in examples])
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
# (`pair_index`) for the reference log-probs computed once before training.
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

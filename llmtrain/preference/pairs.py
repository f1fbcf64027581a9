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
Messages are read as SFT chat rows' are (`data.message`: content parts, tool calls and
tool results, a `tools` column), and data.system_prompt goes first in a conversational
prompt without a system message.

An over-long pair is cut from the left of its prompt (both sequences alike, keeping at
least one prompt token), then its answers on the right, or dropped or refused, by
data.overlong. A pair whose answers are identical or empty is dropped and counted.
"""

from __future__ import annotations

import math

import torch

from ..config import DataConfig
from ..data.batches import Collator
from ..data.build import DataKind
from ..data.packing import join_rows, pack_sources
from ..data.rows import (
    IGNORE,
    NothingToTrain,
    RowError,
    SystemPrompt,
    _with_eos,
    chat_ids,
    check_line,
    message,
    number,
    shift,
)
from ..errors import shown


def _messages(value, what: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise RowError(f"'{what}' must be a string or a non-empty list of {{role, content}} messages")
    messages = [message(m, i, what) for i, m in enumerate(value)]
    return [{k: v for k, v in m.items() if k != "train" or not v} for m in messages]  # train: true is the default


def _answer(messages: list[dict], what: str) -> list[dict]:
    """An answer's messages, which hold the assistant's turn where there are any and end
    with it: messages of other roles alone answer nothing (the row is malformed, not an
    empty answer), and after the last assistant turn they would be read as its end."""
    roles = [m["role"] for m in messages]
    if messages and "assistant" not in roles:
        raise RowError(f"'{what}' holds no assistant message (roles {roles}); an answer is the assistant's turn")
    if messages and roles[-1] != "assistant":
        raise RowError(
            f"'{what}' ends with a {roles[-1]} message (roles {roles}); an answer ends with the assistant's turn"
        )
    return messages


def _answer_messages(value, what: str, prompt: list[dict]) -> list[dict]:
    """An answer given beside 'prompt': what follows it. Data sets that repeat the whole
    conversation in each answer (UltraFeedback as HuggingFaceH4 publishes it, a 'prompt'
    string beside whole 'chosen' and 'rejected' conversations) begin it with the prompt's
    messages, which are taken off, as TRL does; any other user or system message before the
    answer's assistant turn would make it the answer to another conversation (tool results
    may come first, continuing a prompt that ends in a tool call)."""
    messages = _messages(value, what)
    if len(messages) > len(prompt) and messages[: len(prompt)] == prompt:
        messages = messages[len(prompt) :]
    roles = [m["role"] for m in _answer(messages, what)]
    before = roles[: roles.index("assistant")]
    if {"user", "system"} & set(before):
        raise RowError(
            f"'{what}' starts with {before} messages that are not the prompt's; give the answer alone beside "
            "'prompt', or whole conversations without a 'prompt' column"
        )
    return messages


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
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        prompt = _messages(prompt, "prompt")
        return prompt, _answer_messages(chosen, "chosen", prompt), _answer_messages(rejected, "rejected", prompt)
    chosen, rejected = _messages(chosen, "chosen"), _messages(rejected, "rejected")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise RowError("'chosen' and 'rejected' share no prompt: their first messages differ (or give 'prompt')")
    return chosen[:shared], _answer(chosen[shared:], "chosen"), _answer(rejected[shared:], "rejected")


def _answer_ids(prompt, answer, tokenizer, tools=None) -> tuple[list[int], list[int], int]:
    """(input_ids, labels before shifting, prompt length in tokens) of one answer."""
    if isinstance(prompt, str):
        p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        a = _with_eos(tokenizer(answer, add_special_tokens=False)["input_ids"], tokenizer) if answer else []
        return p + a, [IGNORE] * len(p) + a, len(p)
    if not answer or not any(m["role"] == "assistant" and (m["content"] or m.get("tool_calls")) for m in answer):
        return [], [], 0
    ids, labels = chat_ids(prompt + answer, tokenizer, "assistant", train_from=len(prompt), tools=tools)
    first = next(i for i, t in enumerate(labels) if t != IGNORE)
    return ids, labels, first


def conversation(row: dict, prompt, answers: tuple, tokenizer, cfg: DataConfig) -> tuple:
    """(prompt, answers, tools) as a preference row is tokenized: plain-text prompt and
    answers become one user and one assistant message each when the tokenizer has a chat
    template; data.system_prompt goes first in a conversation that has no system message;
    the row's `tools`, if any, must be a list."""
    if isinstance(prompt, str) and tokenizer.chat_template:
        prompt = [{"role": "user", "content": prompt}]
        answers = tuple([{"role": "assistant", "content": a}] for a in answers)
    if cfg.system_prompt and isinstance(prompt, list) and not any(m["role"] == "system" for m in prompt):
        prompt = [SystemPrompt(role="system", content=cfg.system_prompt), *prompt]
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RowError("'tools' must be a list of tool definitions")
    return prompt, answers, tools


def _fit(ids: list[int], labels: list[int], cut: int, width: int) -> tuple[list[int], list[int]]:
    ids, labels = ids[cut:], labels[cut:]
    return ids[:width], labels[:width]


def process_pair(row: dict, tokenizer, cfg: DataConfig) -> dict:
    """One row -> {chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels
    (shifted), length, status}; status as for data.process_row ('ok', 'truncated', or why
    the pair is dropped, 'error: ...' for a malformed row)."""
    try:
        prompt, chosen, rejected = pair_messages(row)
        if chosen == rejected:
            return _dropped("identical answers")
        prompt, (chosen, rejected), tools = conversation(row, prompt, (chosen, rejected), tokenizer, cfg)
        (ci, cl, cp), (ri, rl, rp) = (_answer_ids(prompt, a, tokenizer, tools) for a in (chosen, rejected))
    except NothingToTrain as e:
        return _dropped(str(e))
    except RowError as e:
        return _dropped(f"error: {e}")
    if not ci or not ri or all(t == IGNORE for t in cl) or all(t == IGNORE for t in rl):
        return _dropped("an empty answer")
    status, longest, width = "ok", max(len(ci), len(ri)), cfg.max_seq_len
    if longest > width:
        if cfg.overlong != "truncate":
            return _dropped(f"too long ({longest} tokens)")
        # Both sequences start with the same prompt tokens: cut them alike from the left,
        # keeping one prompt token to predict the first answer token from.
        cut = min(longest - width, min(cp, rp) - 1) if min(cp, rp) > 0 else 0
        (ci, cl), (ri, rl), status = _fit(ci, cl, cut, width), _fit(ri, rl, cut, width), "truncated"
        if ci == ri and cl == rl:  # the answers differed only in what was cut off
            return _dropped("identical answers after truncation")
    cl, rl = shift(cl), shift(rl)
    if all(t == IGNORE for t in cl) or all(t == IGNORE for t in rl):
        return _dropped("no trained tokens")
    return {
        "chosen_input_ids": ci,
        "chosen_labels": cl,
        "rejected_input_ids": ri,
        "rejected_labels": rl,
        "length": len(ci) + len(ri),
        "n_trained": sum(t != IGNORE for t in cl) + sum(t != IGNORE for t in rl),
        "status": status,
    }


def _dropped(status: str) -> dict:
    empty: list[int] = []
    return {
        "chosen_input_ids": empty,
        "chosen_labels": empty,
        "rejected_input_ids": empty,
        "rejected_labels": empty,
        "length": 0,
        "n_trained": 0,
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


def prepare_pairs(key: str, names: list[str], tokenizer, cfg: DataConfig, margins: bool = False):
    """Load, tokenize, filter and concatenate the preference sources of one split, as
    data.prepare_split does for SFT rows, with each pair's `margin` column when `margins`
    (reward models). Returns (datasets.Dataset, DataStats); raises DataError naming the
    file and line for a malformed row, an over-long one under data.overlong=error, or a
    split left with no pair."""
    from ..data.prepare import tokenize_sources
    from ..errors import DataError

    def check(src) -> str:
        if not {"chosen", "rejected"} <= set(src.columns):
            other = (
                "recipes/dpo.py with dpo.loss=kto (they are unpaired rows)"
                if {"prompt", "completion", "label"} <= set(src.columns)
                else "recipes/finetune.py"
            )
            raise DataError(
                f"{key}: {src.name}: preference pairs need 'chosen' and 'rejected' (and 'prompt' unless they are "
                f"whole conversations); found columns {sorted(src.columns)}; give pair rows, or train on these "
                f"rows with {other}"
            )
        return "pairs-v4" + ("-margins-v2" if margins else "")  # v4: answers without an assistant turn are errors

    def process(src, row: dict) -> dict:
        if not margins:
            return process_pair(row, tokenizer, cfg)
        try:
            margin = pair_margin(row)
        except RowError as e:
            return _dropped(f"error: {e}") | {"margin": 0.0}
        return process_pair(row, tokenizer, cfg) | {"margin": margin}

    ds, stats = tokenize_sources(key, names, tokenizer, cfg, check, process)
    if stats.kept == 0:
        raise DataError(f"{key}: no usable pairs: {stats.summary(key)}; {stats.fixes(pairs=True)}")
    return ds, stats


class PackedPairs(torch.utils.data.Dataset):
    """A view of tokenized pairs (with `pair_index`) as packed sequences of `capacity`
    tokens: whole pairs (chosen, then rejected) best-fit packed together, each answer
    sequence a sample of its own under the packed mask (attention.packed_mask), so
    a pair never straddles sequences or micro-batches and no padding is computed. The
    capacity is twice data.max_seq_len, so every pair fits."""

    def __init__(self, pairs, capacity: int, sizes: list[int] | None = None):
        self.pairs, self.capacity = pairs, capacity
        self.bins, self.sizes = pack_sources(pairs["length"], capacity, sizes)

    def __len__(self) -> int:
        return len(self.bins)

    def efficiency(self) -> float:
        return sum(self.pairs["length"]) / (len(self.bins) * self.capacity)

    def __getitem__(self, j: int) -> dict:
        rows = self.pairs[self.bins[j]]
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


# Preference pairs for the one builder (build.build_datasets): whole pairs pack into
# sequences of twice data.max_seq_len, so every pair fits, and each pair is numbered
# (`pair_index`) for the reference log-probs computed once before training.
PAIRS = DataKind(
    prepare_pairs, PackedPairs, 2, "pairs", ("pairs", "packed sequences of whole pairs"), index="pair_index"
)

"""Training data: load sources, detect row formats, tokenize with loss masks, apply the
length policy, and report what was dropped.

Every example leaves here as `input_ids` plus `labels` that are already shifted: labels[t]
is the token that position t must predict, or -100. Shifting per row (before any packing)
means a packed sequence never trains a row's last token to predict the next row's first.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .config import DataConfig

IGNORE = -100
FORMATS = ("text", "prompt_completion", "alpaca", "chat", "sharegpt")
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


class DataError(ValueError):
    """Bad data: the message names the config key, the file and the line or row."""


@dataclass
class Source:
    key: str  # the config key it came from: data.train or data.eval
    name: str  # path or hub name as the user wrote it
    dataset: object  # datasets.Dataset
    format: str = ""
    local_path: Path | None = None

    def where(self, index: int) -> str:
        """'file.jsonl line 12' for a row index, or 'name row 12'."""
        if self.local_path is not None and self.local_path.suffix == ".jsonl":
            with open(self.local_path, encoding="utf-8") as f:
                seen = -1
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        seen += 1
                        if seen == index:
                            return f"{self.name} line {lineno}"
        return f"{self.name} row {index}"


@dataclass
class DataStats:
    rows: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0
    trained_tokens: int = 0

    def count(self, statuses) -> None:
        """Count rows by their process_row status (kept, truncated, or why dropped)."""
        for s in statuses:
            self.rows += 1
            if s in KEPT:
                self.kept += 1
                self.truncated += s == "truncated"
            else:
                self.dropped["longer than data.max_seq_len" if s.startswith("too long") else s] += 1

    def summary(self, key: str) -> str:
        parts = [f"{key}: {self.kept}/{self.rows} rows kept, {self.trained_tokens} trained tokens"]
        if self.truncated:
            parts.append(f"{self.truncated} truncated to data.max_seq_len")
        for reason, n in sorted(self.dropped.items()):
            parts.append(f"{n} dropped ({reason})")
        return "; ".join(parts)


def as_list(x) -> list[str]:
    return [x] if isinstance(x, str) and x else list(x or [])


# --- loading -------------------------------------------------------------------------------


def check_json_file(path: Path, key: str) -> None:
    """Fail on the first malformed line with its number; datasets' own error gives none."""
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{key}: {path} line {lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                        "each line must be one JSON object"
                    ) from None
                if not isinstance(row, dict):
                    raise DataError(f"{key}: {path} line {lineno}: expected a JSON object, got {type(row).__name__}")
    else:
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(
                f"{key}: {path} line {e.lineno}: invalid JSON ({e.msg}); "
                "use a JSON array of objects or JSON Lines (.jsonl)"
            ) from None


def load_source(name: str, key: str, streaming: bool = False) -> Source:
    """A file or hub data set as a datasets.Dataset, or with `streaming` as an
    IterableDataset read while it is iterated (a JSON file is then checked as it is read,
    not up front, see `StreamedRows`)."""
    import datasets

    path = Path(name)
    if path.suffix in FILE_BUILDERS:
        if not path.is_file():
            raise DataError(f"{key}: no such file: {name}")
        if FILE_BUILDERS[path.suffix] == "json" and not streaming:
            check_json_file(path, key)
        try:
            ds = datasets.load_dataset(
                FILE_BUILDERS[path.suffix], data_files=str(path), split="train", streaming=streaming
            )
        except Exception as e:  # Arrow schema errors and the like
            raise DataError(f"{key}: could not read {name}: {str(e).splitlines()[0]}") from None
        return Source(key, name, ds, local_path=path)
    if path.exists():
        raise DataError(f"{key}: {name}: unsupported file type; use .jsonl, .json, .parquet or .csv")
    hub, _, split = name.partition(":")
    try:
        ds = datasets.load_dataset(hub, split=split or "train", streaming=streaming)
    except Exception as e:
        raise DataError(
            f"{key}: could not load '{name}' as a file or hub data set "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return Source(key, name, ds)


REQUIRED = {
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}


def detect_format(columns: list[str], wanted: str, source: str, key: str) -> str:
    """Check that a source's columns fit data.format; for 'auto', that some format fits
    (each row's own format is then taken from the fields it fills, see `row_format`)."""
    cols = set(columns)
    if wanted != "auto":
        if not set(REQUIRED[wanted]) <= cols:
            raise DataError(
                f"{key}: {source}: data.format={wanted} needs columns {sorted(REQUIRED[wanted])}, found {sorted(cols)}"
            )
        return wanted
    if not any(set(need) <= cols for need in REQUIRED.values()):
        raise DataError(
            f"{key}: {source}: cannot tell the row format from columns {sorted(cols)}; expected 'text', "
            "'prompt'+'completion', 'instruction'+'output', 'messages' or 'conversations' "
            "(or set data.format)"
        )
    return "auto"


def row_format(row: dict) -> str:
    for fmt, need in REQUIRED.items():
        if all(row.get(c) is not None for c in need):
            return fmt
    raise RowError(f"no known format fits this row's fields {sorted(k for k, v in row.items() if v is not None)}")


# --- one row -> token ids and labels -------------------------------------------------------------


class RowError(ValueError):
    pass


def to_messages(row: dict, fmt: str) -> list[dict]:
    if fmt == "chat":
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise RowError("'messages' must be a non-empty list of {role, content}")
        out = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RowError(f"each message needs a string 'role' and 'content', got {m!r}")
            out.append({"role": m["role"], "content": m["content"]})
        return out
    if fmt == "sharegpt":
        turns = row["conversations"]
        if not isinstance(turns, list) or not turns:
            raise RowError("'conversations' must be a non-empty list of {from, value}")
        out = []
        for t in turns:
            if not isinstance(t, dict) or t.get("from") not in SHAREGPT_ROLES or not isinstance(t.get("value"), str):
                raise RowError(f"each turn needs 'from' in {sorted(SHAREGPT_ROLES)} and a string 'value', got {t!r}")
            out.append({"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]})
        return out
    if fmt == "alpaca":
        instruction, extra, output = row.get("instruction"), row.get("input") or "", row.get("output")
        if not isinstance(instruction, str) or not isinstance(output, str) or not isinstance(extra, str):
            raise RowError("'instruction', 'input' and 'output' must be strings")
        out = (
            [{"role": "system", "content": row["system"]}]
            if isinstance(row.get("system"), str) and row["system"]
            else []
        )
        user = f"{instruction}\n\n{extra}" if extra else instruction
        return out + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    raise AssertionError(fmt)


def _chat_ids(messages: list[dict], tokenizer, template: str | None, loss_on: str) -> tuple[list[int], list[int]]:
    """Render messages with the chat template; label the assistant turns by character span.

    The span of assistant turn i runs from the end of render(messages[:i], generation prompt)
    to the end of render(messages[:i+1]), so it includes the template's end-of-turn token."""

    def render(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=gen)

    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("the conversation has no assistant turn")
    text = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or loss_on == "all":
            continue
        start, end = render(messages[:i], gen=True), render(messages[: i + 1])
        if not (end.startswith(start) and text.startswith(end)):
            raise RowError(
                "the chat template does not render conversations as growing prefixes, so assistant "
                "turns cannot be located; use another data.chat_template or data.loss_on=all"
            )
        spans.append((len(start), len(end)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if loss_on == "all":
        return ids, list(ids)
    labels = [
        tok if any(s < e2 and e > s2 for s2, e2 in spans) else IGNORE for tok, (s, e) in zip(ids, enc["offset_mapping"])
    ]
    return ids, labels


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def tokenize_row(row: dict, fmt: str, tokenizer, template: str | None, loss_on: str) -> tuple[list[int], list[int]]:
    """Return (input_ids, labels) before shifting; labels are IGNORE where no loss is taken."""
    if fmt == "auto":
        fmt = row_format(row)
    if fmt == "text":
        if not isinstance(row["text"], str):
            raise RowError("'text' must be a string")
        ids = _with_eos(tokenizer(row["text"], add_special_tokens=True)["input_ids"], tokenizer)
        return ids, list(ids)
    if fmt == "prompt_completion":
        prompt, completion = row["prompt"], row["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise RowError("'prompt' and 'completion' must be strings")
        p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        c = _with_eos(tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer)
        return p + c, (list(p) if loss_on == "all" else [IGNORE] * len(p)) + c
    return _chat_ids(to_messages(row, fmt), tokenizer, template, loss_on)


def shift(labels: list[int]) -> list[int]:
    return labels[1:] + [IGNORE]


def process_row(row: dict, fmt: str, tokenizer, template: str | None, cfg: DataConfig) -> dict:
    """One row -> {input_ids, labels (shifted), status}. status is 'ok', 'truncated', or a
    reason the row is dropped ('too long', 'no trained tokens', 'error: ...')."""
    try:
        ids, labels = tokenize_row(row, fmt, tokenizer, template, cfg.loss_on)
    except RowError as e:
        return _dropped(f"error: {e}")
    status = "ok"
    if len(ids) > cfg.max_seq_len:
        if cfg.overlong != "truncate":
            return _dropped(f"too long ({len(ids)} tokens)")
        ids, labels, status = ids[: cfg.max_seq_len], labels[: cfg.max_seq_len], "truncated"
    labels = shift(labels)
    if all(t == IGNORE for t in labels):
        return _dropped("no trained tokens")
    n_trained = sum(1 for t in labels if t != IGNORE)
    return {"input_ids": ids, "labels": labels, "length": len(ids), "n_trained": n_trained, "status": status}


KEPT = ("ok", "truncated")


def row_problem(status: str, cfg: DataConfig) -> str | None:
    """Why a row of this process_row status stops the run (a malformed row, or an
    over-long one under data.overlong=error), for the caller to put after the row's
    location; None for rows that are kept or dropped."""
    if status.startswith("error"):
        return status[len("error: ") :]
    if status.startswith("too long") and cfg.overlong == "error":
        return (
            f"row is {status[len('too long (') : -1]}, above data.max_seq_len={cfg.max_seq_len}; "
            "raise data.max_seq_len or set data.overlong=truncate or drop"
        )
    return None


def _dropped(status: str) -> dict:
    return {"input_ids": [], "labels": [], "length": 0, "n_trained": 0, "status": status}


# --- a whole split ---------------------------------------------------------------------------


def resolve_chat_template(cfg: DataConfig) -> str | None:
    t = cfg.chat_template
    if t and "{" not in t and Path(t).is_file():
        return Path(t).read_text()
    return t or None


def check_source(src: Source, columns: list[str], tokenizer, template: str | None, cfg: DataConfig) -> None:
    """Set src.format from its columns; refuse chat rows with no chat template to render them."""
    src.format = detect_format(columns, cfg.format, src.name, src.key)
    conversational = any(set(REQUIRED[f]) <= set(columns) for f in ("chat", "sharegpt", "alpaca"))
    if (
        conversational
        and src.format in ("auto", "chat", "sharegpt", "alpaca")
        and not (template or tokenizer.chat_template)
    ):
        raise DataError(
            f"{src.key}: {src.name} has conversational rows but the tokenizer has no chat template; "
            "set data.chat_template to a Jinja template or a .jinja file"
        )


def _fingerprint(source: Source, fmt: str, tokenizer, template: str | None, cfg: DataConfig) -> str:
    """A stable cache key, so every rank (and the next run) finds the tokenized rows that
    the main process wrote instead of tokenizing again."""
    tok = tokenizer.backend_tokenizer.to_str() if getattr(tokenizer, "is_fast", False) else repr(tokenizer)
    h = hashlib.sha256()
    for part in (
        source.dataset._fingerprint,
        fmt,
        template or str(tokenizer.chat_template),
        cfg.loss_on,
        str(cfg.max_seq_len),
        cfg.overlong,
        tok,
        str(tokenizer.eos_token_id),
        "llmtrain-data-v1",
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def prepare_split(key: str, names: list[str], tokenizer, cfg: DataConfig):
    """Load, tokenize, filter and concatenate the sources of one split.

    Returns (datasets.Dataset with input_ids/labels, DataStats). Raises DataError for
    malformed rows, over-long rows under data.overlong=error, or a split left empty."""
    import datasets

    template = resolve_chat_template(cfg)
    parts, stats = [], DataStats()
    for name in names:
        src = load_source(name, key)
        check_source(src, src.dataset.column_names, tokenizer, template, cfg)
        fmt = src.format
        ds = src.dataset.map(
            lambda row, fmt=fmt: process_row(row, fmt, tokenizer, template, cfg),
            remove_columns=src.dataset.column_names,
            new_fingerprint=_fingerprint(src, fmt, tokenizer, template, cfg),
            desc=f"tokenizing {Path(name).name}",
        )
        status = ds["status"]
        for i, s in enumerate(status):
            if problem := row_problem(s, cfg):
                raise DataError(f"{key}: {src.where(i)}: {problem}")
        stats.count(status)
        ds = ds.filter(lambda s: s in KEPT, input_columns="status").remove_columns("status")
        parts.append(ds)
    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if stats.kept == 0:
        raise DataError(
            f"{key}: no usable rows: {stats.summary(key)}; check data.max_seq_len, data.overlong and data.loss_on"
        )
    stats.trained_tokens = sum(ds["n_trained"])
    return ds, stats

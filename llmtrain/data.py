"""Training data: load sources, detect row formats, tokenize with loss masks, apply the
length policy, and report what was dropped.

Every example leaves here as `input_ids` plus `labels` that are already shifted: labels[t]
is the token that position t must predict, or -100. Shifting per row (before any packing)
means a packed sequence never trains a row's last token to predict the next row's first.
"""

from __future__ import annotations

import hashlib
import json
import re
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .config import DataConfig
from .errors import DataError, describe, shown
from .files import BAD, LINE, RAW, TEXT_FILES, content_hash, first_rows, row_dataset
from .template import MAX_RENDERED, MAX_TEMPLATE_CHARS, TemplateLimit, install, template_source, time_limit

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


@dataclass
class Source:
    key: str  # the config key it came from: data.train or data.eval
    name: str  # path or hub name as the user wrote it
    dataset: object  # datasets.Dataset (or IterableDataset when streamed)
    columns: list[str]  # the fields its rows fill (for a local text file: those of its first rows)
    format: str = ""
    raw: bool = False  # rows are files.RAW JSON text with their files.LINE (local .jsonl/.json/.csv)

    def where(self, row: dict, index: int) -> str:
        """'file.jsonl line 12' for a row of a local text file, else 'name row 12'."""
        return f"{self.name} line {row[LINE]}" if self.raw else f"{self.name} row {index}"

    def parse(self, row: dict) -> dict:
        """The row as the user wrote it."""
        return json.loads(row[RAW]) if self.raw else row


MALFORMED = "malformed, data.bad_rows=skip"
# Why a well-formed row has nothing to train (NothingToTrain), as DataStats counts it.
NOTHING_TO_TRAIN = {
    "empty conversation",
    "no assistant turn",
    "every assistant turn has train: false",
    "empty answer",
    "empty text",
}
SHOWN_BAD = 3  # malformed rows whose location the summary names


@dataclass
class DataStats:
    rows: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0
    trained_tokens: int = 0
    bad: list[str] = field(default_factory=list)  # where the first malformed rows are, and why
    per_source: list[tuple[str, int, int]] = field(default_factory=list)  # (name, kept rows, trained tokens)

    def count(self, statuses) -> None:
        """Count rows by their process_row status (kept, truncated, or why dropped)."""
        for s in statuses:
            self.rows += 1
            if s in KEPT:
                self.kept += 1
                self.truncated += s == "truncated"
            elif s.startswith("error"):
                self.dropped[MALFORMED] += 1
            else:
                self.dropped["longer than data.max_seq_len" if s.startswith("too long") else s] += 1

    def skip_bad(self, where: str, status: str) -> None:
        """Note a malformed row dropped under data.bad_rows=skip (`count` counts it)."""
        if len(self.bad) < SHOWN_BAD:
            self.bad.append(f"{where}: {status[len('error: ') :]}")

    def check_bad(self, key: str, cfg: DataConfig) -> None:
        """Stop the run when more than data.max_bad_fraction of the rows were malformed."""
        bad = self.dropped[MALFORMED]
        if bad and bad > cfg.max_bad_fraction * self.rows:
            raise DataError(
                f"data.max_bad_fraction: {bad} of {self.rows} rows of {key} are malformed ({bad / self.rows:.1%}), "
                f"more than {cfg.max_bad_fraction:g}; the first: {'; '.join(self.bad)}. Fix the rows, or raise "
                "data.max_bad_fraction"
            )

    def fixes(self, pairs: bool = False) -> str:
        """What to change about the dropped rows (or `pairs`, whose loss is always on the
        answers), by why they were dropped: for an error saying a split has no usable row."""
        reasons, hints = set(self.dropped), []
        if "longer than data.max_seq_len" in reasons:
            hints.append("raise data.max_seq_len, or set data.overlong=truncate")
        if "no trained tokens" in reasons:
            hints.append(
                "raise data.max_seq_len (truncation can cut off what is trained)"
                + ("" if pairs else ", or set data.loss_on=all")
            )
        if reasons & NOTHING_TO_TRAIN:
            hints.append("give rows with something to train (an answer, or text)")
        if "identical answers" in reasons or "an empty answer" in reasons:
            hints.append("give pairs with two different, non-empty answers")
        if MALFORMED in reasons:
            hints.append("fix the malformed rows")
        return "; ".join(hints) or "check data.max_seq_len and data.overlong" + ("" if pairs else " and data.loss_on")

    def summary(self, key: str) -> str:
        parts = [f"{key}: {self.kept}/{self.rows} rows kept, {self.trained_tokens} trained tokens"]
        if self.truncated:
            parts.append(f"{self.truncated} truncated to data.max_seq_len")
        for reason, n in sorted(self.dropped.items()):
            if reason == MALFORMED and self.bad:
                more = f" and {n - len(self.bad)} more" if n > len(self.bad) else ""
                reason = f"{reason}: {'; '.join(self.bad)}{more}"
            parts.append(f"{n} dropped ({reason})")
        return "; ".join(parts)


def as_list(x) -> list[str]:
    return [x] if isinstance(x, str) and x else list(x or [])


# --- loading -------------------------------------------------------------------------------


def load_source(name: str, key: str, streaming: bool = False) -> Source:
    """A file or hub data set as a datasets.Dataset, or with `streaming` as an
    IterableDataset read while it is iterated. Local .jsonl/.json/.csv files are read by
    `files.read_rows`, so every row keeps its file line."""
    import datasets

    path = Path(name)
    suffix = path.suffix.lower()
    if suffix in FILE_BUILDERS:
        if not path.exists():
            several = f"; several files go in a list: {key}=[{', '.join(n.strip() for n in name.split(','))}]"
            raise DataError(f"{key}: no such file: {name}{several if ',' in name else ''}")
        if not path.is_file():
            raise DataError(f"{key}: {name} is not a regular file; give a data file")
        if suffix in TEXT_FILES:
            first = first_rows(path, key)  # a file that cannot be read fails here, with its line
            if not first:
                raise DataError(f"{key}: {name} has no rows; give a file with at least one row")
            ds = row_dataset(path, key, streaming)
            return Source(key, name, ds, sorted({k for row in first for k in row}), raw=True)
        if suffix == ".parquet" and parquet_rows(path) == 0:  # datasets fails on it with "BatchSize must be > 0"
            raise DataError(f"{key}: {name} has no rows; give a file with at least one row")
        try:
            # datasets keys a local file's cache on its modification time only; the config
            # name, part of the cache's directory, keys it on the content instead.
            ds = datasets.load_dataset(
                FILE_BUILDERS[suffix],
                name=f"llmtrain-{content_hash(path)[:32]}",
                data_files=str(path),
                split="train",
                streaming=streaming,
            )
        except Exception as e:  # Arrow schema errors and the like
            if isinstance(e, datasets.exceptions.DatasetGenerationError) and e.__cause__ is not None:
                e = e.__cause__  # "An error occurred while generating the dataset" says nothing
            raise DataError(f"{key}: could not read {name} ({no_rows(e) or describe(e)})") from None
        return Source(key, name, ds, list(ds.column_names or []))
    if path.is_dir():
        raise DataError(
            f"{key}: {name} is a directory; give its data files (.jsonl, .json, .parquet or .csv), "
            f"e.g. {key}=[{name}/a.jsonl, {name}/b.jsonl]"
        )
    if path.exists():
        raise DataError(f"{key}: {name}: unsupported file type; use .jsonl, .json, .parquet or .csv")
    hub, _, split = name.partition(":")
    try:
        ds = datasets.load_dataset(hub, split=split or "train", streaming=streaming)
    except Exception as e:
        raise DataError(
            f"{key}: could not load '{name}' as a file or hub data set ({no_rows(e) or describe(e)}); no such "
            "local file, so it was looked up on the hub: give a .jsonl, .json, .parquet or .csv path, or a hub "
            "name 'owner/name' (or 'owner/name:split')"
        ) from None
    return Source(key, name, ds, list(ds.column_names or []))


def parquet_rows(path: Path) -> int | None:
    """The row count a Parquet file's footer gives, or None if it is no readable Parquet
    (datasets then says why)."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:
        return None


def no_rows(e: Exception) -> str | None:
    """datasets' words for a source with no rows ("Instruction 'train' corresponds to no
    data!"), in the user's."""
    return "it has no rows" if "corresponds to no data" in str(e) else None


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
                f"{key}: {source}: data.format={wanted} needs columns {sorted(REQUIRED[wanted])}, found "
                f"{sorted(cols)}; set data.format=auto to take each row's format from its fields"
            )
        return wanted
    if not any(set(need) <= cols for need in REQUIRED.values()):
        raise DataError(
            f"{key}: {source}: cannot tell the row format from columns {sorted(cols)}; expected 'text', "
            "'prompt'+'completion', 'instruction'+'output', 'messages' or 'conversations' "
            "(or set data.format)"
        )
    return "auto"


def check_line(row: dict) -> None:
    """A line of a JSON Lines file that is not a row (files.BadLine) is a malformed row."""
    if BAD in row:
        raise RowError(row[BAD])


def row_format(row: dict) -> str:
    for fmt, need in REQUIRED.items():
        if all(row.get(c) is not None for c in need):
            return fmt
    null = sorted(k for k, v in row.items() if v is None)
    raise RowError(
        f"no known format fits this row's fields {sorted(k for k, v in row.items() if v is not None)}"
        + (f" ({', '.join(null)}: null)" if null else "")
        + "; a row needs 'text', 'prompt'+'completion', 'instruction'+'output', 'messages' or 'conversations'"
    )


# --- one row -> token ids and labels -------------------------------------------------------------


class RowError(ValueError):
    """A malformed row: it stops the run, naming its file and line (or, with
    data.bad_rows=skip, is dropped and counted)."""


class NothingToTrain(RowError):
    """A well-formed row with nothing to train (no assistant turn, an empty conversation
    or answer): dropped and counted with the reason, never an error."""


ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")  # ipython: Llama 3's tool results


def message(m, i: int, field: str = "messages") -> dict:
    """Message `i` of a chat row as the chat template takes it: its content parts joined
    as text, its tool calls kept, and whether its assistant turn is trained (`train`).
    Errors name it as `field`[i] (a preference pair's messages are 'chosen', ...)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RowError(f"{field}[{i}]: needs a 'role' of {', '.join(ROLES)}, got {shown(m)}")
    out = {"role": m["role"], "content": content_text(m.get("content"), i, field)}
    if m.get("tool_calls") is not None:
        if m["role"] != "assistant" or not isinstance(m["tool_calls"], list):
            raise RowError(f"{field}[{i}]: 'tool_calls' must be a list, on an assistant message")
        out["tool_calls"] = m["tool_calls"]
    elif m.get("content") is None:
        raise RowError(f"{field}[{i}]: needs a 'content' (text or a list of text parts)")
    for name in ("tool_call_id", "name"):
        if m.get(name) is not None:
            out[name] = m[name]
    train, weight = m.get("train", True), m.get("weight", 1)
    if not isinstance(train, bool) or weight not in (0, 1) or isinstance(weight, bool):
        raise RowError(
            f"{field}[{i}]: 'train' must be true or false and 'weight' 0 or 1, got {shown(train)}, {shown(weight)}"
        )
    out["train"] = train and weight == 1
    return out


def content_text(content, i: int, field: str = "messages") -> str:
    """A message's content as text: a string, or OpenAI-style parts of type text joined
    by newlines (as the chat APIs read them). Other part types cannot be trained here."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RowError(f"{field}[{i}]: 'content' must be a string or a list of parts, got {type(content).__name__}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RowError(
                f"{field}[{i}]: content part {shown(part)} is not supported; only {{type: text, text: ...}} parts "
                "can be trained"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def to_messages(row: dict, fmt: str, system_prompt: str = "") -> list[dict]:
    """A chat, sharegpt or alpaca row as chat messages, with `system_prompt` (data.system_prompt)
    first when the row has no system message of its own."""
    if fmt == "chat":
        messages = row["messages"]
        if not isinstance(messages, list):
            raise RowError("'messages' must be a list of {role, content}")
        out = [message(m, i) for i, m in enumerate(messages)]
    elif fmt == "sharegpt":
        turns = row["conversations"]
        if not isinstance(turns, list):
            raise RowError("'conversations' must be a list of {from, value}")
        out = []
        for t in turns:
            if not isinstance(t, dict) or t.get("from") not in SHAREGPT_ROLES or not isinstance(t.get("value"), str):
                raise RowError(
                    f"each turn needs 'from' in {sorted(SHAREGPT_ROLES)} and a string 'value', got {shown(t)}"
                )
            out.append({"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]})
    elif fmt == "alpaca":
        instruction, extra, output = row.get("instruction"), row.get("input") or "", row.get("output")
        if not isinstance(instruction, str) or not isinstance(output, str) or not isinstance(extra, str):
            raise RowError("'instruction', 'input' and 'output' must be strings")
        out = (
            [{"role": "system", "content": row["system"]}]
            if isinstance(row.get("system"), str) and row["system"]
            else []
        )
        user = f"{instruction}\n\n{extra}" if extra else instruction
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    else:
        raise AssertionError(fmt)
    if not out:
        raise NothingToTrain("empty conversation")
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def chat_ids(
    messages: list[dict], tokenizer, loss_on: str, train_from: int = 0, tools=None
) -> tuple[list[int], list[int]]:
    """Render messages (and `tools`, the row's tool definitions) with the tokenizer's chat
    template (data.chat_template, where set, was put on the tokenizer when it was loaded);
    label the assistant turns from message `train_from` on by character span, except
    those marked `train: false`. Tool calls are part of their assistant turn.

    The span of assistant turn i runs from the end of render(messages[:i], generation prompt)
    to the end of render(messages[:i+1]), so it includes the template's end-of-turn token."""

    install()  # bounds rendering in size (llmtrain.template), in this process too

    def render(msgs, gen=False, tools_=tools):
        try:
            with time_limit():
                text = tokenizer.apply_chat_template(msgs, tools=tools_, tokenize=False, add_generation_prompt=gen)
        except TemplateLimit:
            raise
        except Exception as e:  # the template refused this conversation (raise_exception) or failed on it
            raise RowError(
                f"the chat template failed on this conversation ({describe(e)}); fix the row or set data.chat_template"
            ) from None
        if isinstance(text, str) and len(text) > MAX_RENDERED:
            raise TemplateLimit(f"builds a text of more than {MAX_RENDERED} characters")
        return text

    check_control_tokens(messages, tools, tokenizer)
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= train_from]
    if not trained:
        raise NothingToTrain("no assistant turn")
    trained = [i for i in trained if messages[i].get("train", True)]
    if loss_on != "all":
        if not trained:
            raise NothingToTrain("every assistant turn has train: false")
        if not any(messages[i]["content"].strip() or messages[i].get("tool_calls") for i in trained):
            raise NothingToTrain("empty answer")
    text = render(messages)
    check_rendered(messages, tools, text, render)
    spans = []
    for i in [] if loss_on == "all" else trained:
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


_CONTROL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its size, control_tokens)


def control_tokens(tokenizer) -> re.Pattern | None:
    """A pattern matching the tokenizer's special added tokens (`<|im_end|>`, `<|eot_id|>`,
    `<|im_start|>`, ...), longest first, or None when it has none. Kept per tokenizer
    (and its size, should tokens be added): listing them costs more than a row's render."""
    size = len(tokenizer)
    cached = _CONTROL.get(tokenizer)
    if cached is None or cached[0] != size:
        found = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
        cached = _CONTROL[tokenizer] = (size, re.compile("|".join(map(re.escape, found))) if found else None)
    return cached[1]


def check_control_tokens(messages: list[dict], tools, tokenizer) -> None:
    """Refuse a conversation whose text (message content, tool calls, tool definitions)
    spells one of the tokenizer's special tokens: the rendered chat is tokenized as a
    whole, so such a string would become the control token itself, an answer holding
    `<|im_end|>` would teach the model to stop there, and a user message holding
    `<|im_start|>assistant` would forge an assistant turn.

    Reported rather than encoded as text: transformers can encode user strings as text
    (apply_chat_template(sanitize_control_tokens=True)), but only when it tokenizes the
    chat itself, without the character offsets that locate the trained assistant turns;
    and such a string in training data is nearly always a scraping or formatting slip
    that the user should see, not silently reinterpret. Plain `text` and
    `prompt_completion` rows are left alone: they are tokenized as written, often
    pre-rendered with a template on purpose."""
    pattern = control_tokens(tokenizer)
    if pattern is None:
        return
    for m in messages:
        for what, value in (("content", m["content"]), ("tool_calls", m.get("tool_calls"))):
            text = value if isinstance(value, str) else json.dumps(value) if value else ""
            if found := pattern.search(text):
                raise RowError(
                    f"{_a(m['role'])} message's {what} holds {found.group()!r}, a control token of the tokenizer: it "
                    "would be read as that token (ending or forging a turn), not as text; remove it from the row"
                )
    if tools and (found := pattern.search(json.dumps(tools))):
        raise RowError(f"'tools' holds {found.group()!r}, a control token of the tokenizer; remove it from the row")


def _a(role: str) -> str:
    return f"{'an' if role in ('assistant', 'ipython') else 'a'} {role}"


def check_rendered(messages: list[dict], tools, text: str, render) -> None:
    """Refuse a conversation whose chat template drops something the row carries: its
    tool definitions, an assistant turn's tool calls, or a whole message of another role
    than user and assistant (a system or tool message). The template renders the same
    text without it, so it would be trained as if absent (a tool-call turn as an empty
    answer). Found by rendering without each such part, only for rows that have one."""

    def same(msgs, **kw) -> bool:
        try:
            return render(msgs, **kw) == text
        except RowError:  # the template refuses the conversation without it: it does use it
            return False

    fix = "set data.chat_template to a template that renders it"
    if tools and same(messages, tools_=None):
        raise RowError(f"the chat template does not render the row's 'tools'; {fix}")
    for i, m in enumerate(messages):
        if m.get("tool_calls") and same([*messages[:i], {**m, "tool_calls": None}, *messages[i + 1 :]]):
            raise RowError(f"the chat template does not render the 'tool_calls' of an assistant message; {fix}")
        # A template that writes a default system prompt when there is none renders a row
        # whose system message is that default the same without it: dropped only if its
        # text is nowhere in the rendering.
        content = m["content"].strip()
        other_role = m["role"] not in ("user", "assistant")
        if other_role and content and content not in text and same(messages[:i] + messages[i + 1 :]):
            raise RowError(f"the chat template drops {_a(m['role'])} message; {fix}")


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def tokenize_row(row: dict, fmt: str, tokenizer, cfg: DataConfig) -> tuple[list[int], list[int]]:
    """Return (input_ids, labels) before shifting; labels are IGNORE where no loss is taken."""
    check_line(row)
    if fmt == "auto":
        fmt = row_format(row)
    elif missing := [c for c in REQUIRED[fmt] if row.get(c) is None]:
        raise RowError(f"data.format={fmt} needs {missing}, which this row does not fill")
    if fmt == "text":
        if not isinstance(row["text"], str):
            raise RowError("'text' must be a string")
        if not row["text"].strip():
            raise NothingToTrain("empty text")
        ids = _with_eos(tokenizer(row["text"], add_special_tokens=True)["input_ids"], tokenizer)
        return ids, list(ids)
    if fmt == "prompt_completion":
        prompt, completion = row["prompt"], row["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise RowError("'prompt' and 'completion' must be strings")
        if not completion.strip() and cfg.loss_on != "all":
            raise NothingToTrain("empty answer")
        p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        c = _with_eos(tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer)
        return p + c, (list(p) if cfg.loss_on == "all" else [IGNORE] * len(p)) + c
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RowError("'tools' must be a list of tool definitions")
    messages = to_messages(row, fmt, cfg.system_prompt)
    return chat_ids(messages, tokenizer, cfg.loss_on, tools=tools or None)


def shift(labels: list[int]) -> list[int]:
    return labels[1:] + [IGNORE]


def process_row(row: dict, fmt: str, tokenizer, cfg: DataConfig) -> dict:
    """One row -> {input_ids, labels (shifted), status}. status is 'ok', 'truncated', or a
    reason the row is dropped ('too long', 'no trained tokens', 'error: ...')."""
    try:
        ids, labels = tokenize_row(row, fmt, tokenizer, cfg)
    except NothingToTrain as e:
        return _dropped(str(e))
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
    location; None for rows that are kept or dropped (a malformed one too, under
    data.bad_rows=skip)."""
    if status.startswith("error") and cfg.bad_rows == "error":
        return f"{status[len('error: ') :]}; data.bad_rows=skip would drop malformed rows instead"
    if status.startswith("too long") and cfg.overlong == "error":
        return (
            f"row is {status[len('too long (') : -1]}, above data.max_seq_len={cfg.max_seq_len}; "
            "raise data.max_seq_len or set data.overlong=truncate or drop"
        )
    return None


def _dropped(status: str) -> dict:
    return {"input_ids": [], "labels": [], "length": 0, "n_trained": 0, "status": status}


# --- a whole split ---------------------------------------------------------------------------


def check_source(src: Source, tokenizer, cfg: DataConfig) -> None:
    """Set src.format from its columns; refuse chat rows with no chat template to render them."""
    src.format = detect_format(src.columns, cfg.format, src.name, src.key)
    conversational = any(set(REQUIRED[f]) <= set(src.columns) for f in ("chat", "sharegpt", "alpaca"))
    own = tokenizer.chat_template  # a configured one was checked at start-up (config.validate)
    if isinstance(own, str) and len(own) > MAX_TEMPLATE_CHARS:
        raise DataError(
            f"{src.key}: {template_source('', tokenizer)} is longer than {MAX_TEMPLATE_CHARS} characters, which no "
            "chat template needs; set data.chat_template to another"
        )
    if conversational and src.format in ("auto", "chat", "sharegpt", "alpaca") and not tokenizer.chat_template:
        raise DataError(
            f"{src.key}: {src.name} has conversational rows but the tokenizer has no chat template; "
            "set data.chat_template to a Jinja template or a .jinja file"
        )


def _fingerprint(source: Source, fmt: str, tokenizer, cfg: DataConfig) -> str:
    """A stable cache key, so every rank (and the next run) finds the tokenized rows that
    the main process wrote instead of tokenizing again."""
    tok = tokenizer.backend_tokenizer.to_str() if getattr(tokenizer, "is_fast", False) else repr(tokenizer)
    h = hashlib.sha256()
    for part in (
        source.dataset._fingerprint,
        fmt,
        str(tokenizer.chat_template),
        cfg.loss_on,
        str(cfg.max_seq_len),
        cfg.overlong,
        cfg.system_prompt,
        tok,
        str(tokenizer.eos_token_id),
        "llmtrain-data-v4",
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def prepare_split(key: str, names: list[str], tokenizer, cfg: DataConfig):
    """Load, tokenize, filter and concatenate the sources of one split.

    Returns (datasets.Dataset with input_ids/labels, DataStats). Raises DataError for
    malformed rows, over-long rows under data.overlong=error, or a split left empty."""

    def check(src: Source) -> str:
        check_source(src, tokenizer, cfg)
        return src.format

    def process(src: Source, row: dict) -> dict:
        return process_row(row, src.format, tokenizer, cfg)

    ds, stats = tokenize_sources(key, names, tokenizer, cfg, check, process)
    if stats.kept == 0:
        raise DataError(f"{key}: no usable rows: {stats.summary(key)}; {stats.fixes()}")
    return ds, stats


def template_error(key: str, where: str, e: TemplateLimit, cfg: DataConfig, tokenizer) -> TemplateLimit:
    """The one line for a chat template past a bound (llmtrain.template) on a row: it stops
    the run whatever data.bad_rows says, since the template is at fault, not the row."""
    return TemplateLimit(
        f"{key}: {where}: {template_source(cfg.chat_template, tokenizer)} {e} on this row, past the bounds "
        "on rendering; fix the template, or set data.chat_template to another"
    )


def tokenize_sources(key: str, names: list[str], tokenizer, cfg: DataConfig, check, process):
    """The sources of one split, each loaded, checked (`check(src)` raises DataError or
    returns what the cache key adds for it), tokenized row by row (`process(src, row)`
    gives a dict with a status as process_row's, and n_trained), stopped at the first
    row that must stop the run (with its file line), filtered to the kept rows, and
    concatenated. Returns (datasets.Dataset, DataStats); the caller decides what an
    empty split means."""
    import datasets

    parts, stats = [], DataStats()
    for name in names:
        src = load_source(name, key)
        tag = check(src)

        def tokenized(row: dict, i: int, src: Source = src) -> dict:
            try:
                return process(src, src.parse(row)) | ({LINE: row[LINE]} if src.raw else {})
            except TemplateLimit as e:
                raise template_error(key, src.where(row, i), e, cfg, tokenizer) from None

        ds = src.dataset.map(
            tokenized,
            with_indices=True,
            remove_columns=[c for c in src.dataset.column_names if c != LINE],
            new_fingerprint=_fingerprint(src, tag, tokenizer, cfg),
            desc=f"tokenizing {Path(name).name}",
        )
        status = ds["status"]
        for i, s in enumerate(status):
            if problem := row_problem(s, cfg):
                raise DataError(f"{key}: {src.where(ds[i], i)}: {problem}")
            if s.startswith("error"):
                stats.skip_bad(src.where(ds[i], i), s)
        stats.count(status)
        ds = ds.filter(lambda s: s in KEPT, input_columns="status").remove_columns(["status", LINE][: 1 + src.raw])
        stats.per_source.append((name, len(ds), sum(ds["n_trained"])))
        parts.append(ds)
    stats.check_bad(key, cfg)
    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    stats.trained_tokens = sum(n for _, _, n in stats.per_source)
    return ds, stats

"""One row to token ids and labels: its format, its messages, the chat template's rendering
(assistant turns located by character span), the loss mask and the length policy.

Every example leaves here as `input_ids` plus `labels` that are already shifted: labels[t]
is the token that position t must predict, or -100. Shifting per row (before any packing)
means a packed sequence never trains a row's last token to predict the next row's first.
"""

from __future__ import annotations

import copy
import json
import re
import weakref
from collections.abc import Mapping

from ..config import DataConfig
from ..errors import describe, shown
from ..files import BAD
from ..template import MAX_RENDERED, TemplateLimit, install, time_limit

IGNORE = -100
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


REQUIRED = {
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}


# Characters of text one row may hold, from any source (files bound a line's bytes as they
# read it; a Parquet cell or a hub row is bounded only here). A tokenizer takes about 200
# bytes of memory per character of its input: 8 Mi characters (a few million tokens, beyond
# any context length) is 1-2 GB; a 57 MiB row took 11 GB and the process was killed.
MAX_ROW_CHARS = 8 << 20


def check_line(row: dict) -> None:
    """What every row processor checks first: a line of a JSON Lines file that is not a row
    (files.BadLine), or a row holding more than MAX_ROW_CHARS characters of text, is a
    malformed row."""
    if BAD in row:
        raise RowError(row[BAD])
    if text_chars(row, MAX_ROW_CHARS) > MAX_ROW_CHARS:
        raise RowError(
            f"the row holds more than {MAX_ROW_CHARS:,} characters of text, the most a row may have (tokenizing "
            "it would take gigabytes of memory); split it into rows of its own"
        )


def text_chars(value, limit: int) -> int:
    """The characters of the strings in `value` (a row: mappings, lists and strings), counted
    until they pass `limit`."""
    total, todo = 0, [value]
    while todo and total <= limit:
        item = todo.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    return total


def formats_filled(row: dict) -> list[str]:
    """The formats whose fields this row fills, in REQUIRED's order (data.format=auto reads
    a row as the first)."""
    if not isinstance(row, Mapping):  # datasets hands map functions a Mapping that is no dict
        return []
    return [fmt for fmt, need in REQUIRED.items() if all(row.get(c) is not None for c in need)]


def row_format(row: dict) -> str:
    if fits := formats_filled(row):
        return fits[0]
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


SYSTEM_REFUSED = "the chat template refuses the system message data.system_prompt puts first"


class SystemPrompt(dict):
    """data.system_prompt's message, put first by llmtrain in a conversation that has no
    system message of its own: a template that refuses it is the setting's fault, not the
    row's (`render_chat`)."""


class FileRow(dict):
    """A row of a local data file, which knows the file's folder (`root`): relative image
    paths in it are read from there (llmtrain.vision)."""

    root = None


class TextRow(FileRow):
    """A row whose fields are all text: a CSV row (CSV has no types; an empty field is None).
    A column read as a boolean or a number reads that text (`flag`, `number`)."""


def flag(row: dict, key: str):
    """row[key], where a text row's 'true' or 'false' (any case) is the boolean it spells;
    any other value as it is, for the caller to check."""
    value = row.get(key)
    if isinstance(row, TextRow) and isinstance(value, str):
        return {"true": True, "false": False}.get(value.strip().lower(), value)
    return value


def number(row: dict, key: str):
    """row[key], where a text row's number ('1.5', '-2') is that float; any other value as it
    is, for the caller to check."""
    value = row.get(key)
    if isinstance(row, TextRow) and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


class NothingToTrain(RowError):
    """A well-formed row with nothing to train (no assistant turn, an empty conversation
    or answer): dropped and counted with the reason, never an error."""


ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")  # ipython: Llama 3's tool results


def message(m, i: int, field: str = "messages", images: list | None = None) -> dict:
    """Message `i` of a chat row as the chat template takes it: its content parts joined
    as text, its tool calls kept, and whether its assistant turn is trained (`train`).
    Errors name it as `field`[i] (a preference pair's messages are 'chosen', ...). With
    `images` (a list), a content with image parts stays a list of parts, each image part
    a bare {type: image} for the template, and what it named (a path, or None for a
    placeholder) appended to `images`; without, an image part is an error."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RowError(f"{field}[{i}]: needs a 'role' of {', '.join(ROLES)}, got {shown(m)}")
    out = {"role": m["role"], "content": content_text(m.get("content"), i, field, images)}
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


# A content part that is an image, and the keys that may name it (Hugging Face's chat
# messages use image, url or path; OpenAI's image_url parts hold {url: ...}).
IMAGE_PARTS = ("image", "image_url")
IMAGE_KEYS = ("image", "path", "url", "image_url")
IMAGES_WHERE = (
    "recipes/finetune.py, recipes/dpo.py, recipes/grpo.py and recipes/distill.py take images, for a "
    "vision-language model (one with a processor)"
)


def content_text(content, i: int, field: str = "messages", images: list | None = None) -> str | list[dict]:
    """A message's content as text: a string, or OpenAI-style parts of type text joined
    by newlines (as the chat APIs read them); with `images` and image parts, the parts
    (`message`). Other part types cannot be trained here."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RowError(f"{field}[{i}]: 'content' must be a string or a list of parts, got {type(content).__name__}")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS:
            if images is None:
                raise RowError(f"{field}[{i}]: holds an image; only {IMAGES_WHERE}")
            ref = next((part[k] for k in IMAGE_KEYS if part.get(k) is not None), None)
            images.append(ref.get("url") if isinstance(ref, dict) else ref)
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise RowError(
                f"{field}[{i}]: content part {shown(part)} is not supported; only {{type: text, text: ...}} parts "
                "(and images, for a vision-language model) can be trained"
            )
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def text_of(content) -> str:
    """A message's text: its content, or the text of its parts (`content_text`)."""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if p["type"] == "text")


def to_messages(row: dict, fmt: str, system_prompt: str = "", images: list | None = None) -> list[dict]:
    """A chat, sharegpt or alpaca row as chat messages, with `system_prompt` (data.system_prompt)
    first when the row has no system message of its own; `images` as `message` takes it."""
    if fmt == "chat":
        messages = row["messages"]
        if not isinstance(messages, list):
            raise RowError("'messages' must be a list of {role, content}")
        out = [message(m, i, images=images) for i, m in enumerate(messages)]
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
        out.insert(0, SystemPrompt(role="system", content=system_prompt))
    return out


def chat_ids(
    messages: list[dict], tokenizer, loss_on: str, train_from: int = 0, tools=None
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of `labelled_chat`."""
    return labelled_chat(messages, tokenizer, loss_on, train_from, tools)[1:]


def labelled_chat(
    messages: list[dict], tokenizer, loss_on: str, train_from: int = 0, tools=None
) -> tuple[str, list[int], list[int]]:
    """(text, input_ids, labels): render messages (and `tools`, the row's tool definitions) with the tokenizer's chat
    template (data.chat_template, where set, was put on the tokenizer when it was loaded);
    label the assistant turns from message `train_from` on by character span, except
    those marked `train: false`. Tool calls are part of their assistant turn.

    The span of assistant turn i runs from the end of render(messages[:i], generation prompt)
    to the end of render(messages[:i+1]), so it includes the template's end-of-turn token."""

    def render(msgs, gen=False, tools_=tools):
        return render_chat(tokenizer, msgs, tools_, gen)

    check_control_tokens(messages, tools, tokenizer)
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= train_from]
    if not answers:
        raise NothingToTrain("no assistant turn")
    trained = [i for i in answers if messages[i].get("train", True)]
    if loss_on != "all":
        if not trained:
            raise NothingToTrain("every assistant turn has train: false")
        if not any(text_of(messages[i]["content"]).strip() or messages[i].get("tool_calls") for i in trained):
            raise NothingToTrain("empty answer")
    text = render(messages)
    check_rendered(messages, tools, text, render)
    # loss_on=all trains every token but those of the turns marked train: false; otherwise
    # only the trained assistant turns.
    marked = [i for i in answers if i not in trained] if loss_on == "all" else trained
    spans = []
    for i in marked:
        if i == 0:  # its span starts where a generation prompt after nothing would end, which no template renders
            raise RowError(
                "messages[0]: the conversation opens with an assistant turn, which answers nothing; start it with "
                "a user or system message (data.system_prompt puts a system message first)"
            )
        start, end = render(messages[:i], gen=True), render(messages[: i + 1])
        if not (end.startswith(start) and text.startswith(end)):
            other = "remove train: false (weight: 0) from its messages" if loss_on == "all" else "data.loss_on=all"
            raise RowError(
                "the chat template does not render conversations as growing prefixes, so assistant "
                f"turns cannot be located; use another data.chat_template or {other}"
            )
        spans.append((len(start), len(end)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    inside = [any(s < e2 and e > s2 for s2, e2 in spans) for s, e in enc["offset_mapping"]]
    trains_inside = loss_on != "all"  # the spans are what trains, or under loss_on=all what does not
    return text, ids, [tok if hit == trains_inside else IGNORE for tok, hit in zip(ids, inside, strict=True)]


def render_chat(
    tokenizer, messages: list[dict], tools=None, generation_prompt: bool = False, continue_final: bool = False
) -> str:
    """The chat template's text for `messages`, bounded in time and size (llmtrain.template);
    a template that refuses or fails on the conversation is the row's RowError. With
    `continue_final` the text stops inside the last message (transformers'
    continue_final_message), for the model to continue it."""
    install()  # bounds rendering in size (llmtrain.template), in this process too
    try:
        with time_limit():
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **({"continue_final_message": True} if continue_final else {}),
            )
    except TemplateLimit:
        raise
    except (RecursionError, MemoryError) as e:  # the template's fault, not the row's
        raise TemplateLimit(
            "is nested too deeply to compile" if isinstance(e, RecursionError) else "ran out of memory"
        ) from None
    except Exception as e:  # the template refused this conversation (raise_exception) or failed on it
        if messages and isinstance(messages[0], SystemPrompt) and renders(tokenizer, messages[1:], tools):
            raise RowError(
                f"{SYSTEM_REFUSED} ({describe(e)}); unset data.system_prompt, or set data.chat_template to a "
                "template that takes one"
            ) from None
        raise RowError(
            f"the chat template failed on this conversation ({describe(e)}); fix the row or set data.chat_template"
        ) from None
    if isinstance(text, str) and len(text) > MAX_RENDERED:
        raise TemplateLimit(f"builds a text of more than {MAX_RENDERED} characters")
    return text


def renders(tokenizer, messages: list[dict], tools=None) -> bool:
    """Whether the chat template renders `messages` (`render_chat`, within its bounds)."""
    try:
        render_chat(tokenizer, messages, tools)
    except (RowError, TemplateLimit):
        return False
    return True


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


def end_of_turn_ids(tokenizer) -> list[int]:
    """The special token the chat template puts right after an assistant message
    (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`): trained with every assistant turn, it is
    how a tuned model ends one. A base model's end of sequence is often another (Llama 3's
    `<|end_of_text|>`, Qwen2.5's `<|endoftext|>`), so generation stops at it only where its
    settings list it too. Empty without a template, or where none follows the message."""
    pattern = control_tokens(tokenizer)
    if not tokenizer.chat_template or pattern is None:
        return []
    mark = "Ok, 42."
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": mark}]
    text = ""
    for messages in (turns, [{"role": "system", "content": "Be brief."}, *turns]):  # some require a system message
        try:
            text = render_chat(tokenizer, messages)
            break
        except (RowError, TemplateLimit):
            continue
    tail = text[text.rfind(mark) + len(mark) :] if mark in text else ""
    found = pattern.search(tail)
    if found is None or tail[: found.start()].strip():
        return []
    return [tokenizer.convert_tokens_to_ids(found.group())]


def stop_ids(generation_config, tokenizer) -> list[int]:
    """The tokens that end a generated answer: the tokenizer's end of sequence, those of the
    model's generation config (a chat model's lists its end-of-turn tokens), and the end of
    turn the chat template writes (`end_of_turn_ids`), which a base model tuned with a
    template learns to end with while its own settings may not list it."""
    found = getattr(generation_config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id, *end_of_turn_ids(tokenizer)}
    ids |= set(found) if isinstance(found, (list, tuple)) else {found}
    return sorted(i for i in ids if i is not None)


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
        for what, value in (("content", text_of(m["content"])), ("tool_calls", m.get("tool_calls"))):
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
        content = text_of(m["content"]).strip()
        other_role = m["role"] not in ("user", "assistant")
        if other_role and content and content not in text and same(messages[:i] + messages[i + 1 :]):
            raise RowError(f"the chat template drops {_a(m['role'])} message; {fix}")


def with_eos(ids: list[int], tokenizer) -> list[int]:
    """`ids` ending with the tokenizer's end of sequence (a plain-text answer's end, trained)."""
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
        ids = with_eos(tokenizer(row["text"], add_special_tokens=True)["input_ids"], tokenizer)
        return ids, list(ids)
    if fmt == "prompt_completion":
        prompt, completion = row["prompt"], row["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise RowError("'prompt' and 'completion' must be strings")
        if not completion.strip() and cfg.loss_on != "all":
            raise NothingToTrain("empty answer")
        p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        c = with_eos(tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer)
        return p + c, (list(p) if cfg.loss_on == "all" else [IGNORE] * len(p)) + c
    messages = to_messages(row, fmt, cfg.system_prompt)
    return chat_ids(messages, tokenizer, cfg.loss_on, tools=row_tools(row))


def row_tools(row: dict) -> list | None:
    """The row's tool definitions (its `tools` column), or None."""
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RowError("'tools' must be a list of tool definitions")
    return tools or None


def shift(labels: list[int]) -> list[int]:
    return labels[1:] + [IGNORE]


def process_row(row: dict, fmt: str, tokenizer, cfg: DataConfig) -> dict:
    """One row -> {input_ids, labels (shifted), status, fits}. status is 'ok', 'truncated', or
    a reason the row is dropped ('too long', 'no trained tokens', 'error: ...'). fits names,
    comma-separated, the formats a row read with data.format=auto fills the fields of, where
    it fills more than one (it is read as the first; a row with `instruction`, `output` and a
    `text` of its own, say), else ''."""
    fits = formats_filled(row) if fmt == "auto" else []
    read_as = fits[0] if fits else fmt  # auto's choice, made once here (row_format raises for none)
    out = processed(_row_example, EMPTY, row, read_as, tokenizer, cfg)
    return out | {"fits": ",".join(fits) if len(fits) > 1 else ""}


def several_formats(fits: str) -> str:
    """What to say of rows whose `fits` (process_row's) names more than one format."""
    first, *others = fits.split(",")
    fields = {f: "+".join(f"'{c}'" for c in REQUIRED[f]) for f in (first, *others)}
    return (
        f"fill the fields of more than one row format ({', '.join(f'{f}: {fields[f]}' for f in fields)}) and are "
        f"read as {first}, the first in data.format=auto's order; set data.format="
        + " or data.format=".join(others)
        + " to read them as that instead"
    )


def _row_example(row: dict, fmt: str, tokenizer, cfg: DataConfig) -> dict | str:
    """process_row's example, or why the row is dropped (`processed`)."""
    ids, labels = tokenize_row(row, fmt, tokenizer, cfg)
    return sft_example(ids, labels, length_status(len(ids), cfg.max_seq_len, cfg), cfg.max_seq_len)


def sft_example(ids: list[int], labels: list[int], status: str, width: int) -> dict | str:
    """An SFT example of `ids` and their (unshifted) `labels` under the length policy's
    `status` for them: cut on the right to `width` and shifted; or why it is dropped (a
    status not kept, or no trained token left)."""
    if status not in KEPT:
        return status
    ids, labels = ids[:width], labels[:width]  # cut on the right
    labels = shift(labels)
    if all(t == IGNORE for t in labels):
        return "no trained tokens"
    n_trained = sum(1 for t in labels if t != IGNORE)
    return {"input_ids": ids, "labels": labels, "length": len(ids), "n_trained": n_trained, "status": status}


KEPT = ("ok", "truncated")
# What a dropped SFT row holds besides its status (`processed`).
EMPTY = {"input_ids": [], "labels": [], "length": 0, "n_trained": 0}


def processed(make, empty: dict, *args) -> dict:
    """The one head of every kind's row processing: `make(*args)`, a row's example with its
    `status` ('ok' or 'truncated'), or `empty` (the kind's columns of a dropped row, copied)
    with the status of a row dropped: the reason `make` returned, or raised as
    NothingToTrain, or 'error: ...' for a malformed row (RowError)."""
    try:
        out = make(*args)
    except NothingToTrain as e:
        out = str(e)
    except RowError as e:
        out = f"error: {e}"
    return out if isinstance(out, dict) else copy.deepcopy(empty) | {"status": out}


def length_status(length: int, width: int, cfg: DataConfig, tokens: str = "") -> str:
    """The length policy every kind shares, for an example of `length` tokens that must fit in
    `width`: 'ok'; 'truncated' under data.overlong=truncate (the kind cuts it, each its own
    way); else why it is dropped, 'too long (`tokens`)' (its length in tokens unless given),
    which `row_problem` makes an error under data.overlong=error."""
    if length <= width:
        return "ok"
    if cfg.overlong == "truncate":
        return "truncated"
    return f"too long ({tokens or f'{length} tokens'})"


def row_problem(status: str, cfg: DataConfig) -> str | None:
    """Why a row of this process_row status stops the run (a malformed row, or an
    over-long one under data.overlong=error), for the caller to put after the row's
    location; None for rows that are kept or dropped (a malformed one too, under
    data.bad_rows=skip, but not one failed by data.system_prompt: the setting's fault)."""
    if status.startswith("error") and SYSTEM_REFUSED in status:
        return status[len("error: ") :]
    if status.startswith("error") and cfg.bad_rows == "error":
        return f"{status[len('error: ') :]}; data.bad_rows=skip would drop malformed rows instead"
    if status.startswith("too long") and cfg.overlong == "error":
        return (
            f"row is {status[len('too long (') : -1]}, above data.max_seq_len={cfg.max_seq_len}; "
            "raise data.max_seq_len or set data.overlong=truncate or drop"
        )
    return None

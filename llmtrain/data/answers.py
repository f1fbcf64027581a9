"""A prompt and its answers as token ids: what preference pairs (preference/pairs.py), KTO
rows (preference/unpaired.py) and a reward model scoring completions (rl/rewards.py)
share.

An answer follows its prompt either as plain text (the prompt's tokens, then the answer's
and EOS, for a tokenizer without a chat template) or as messages rendered with the chat
template, where the answer is the assistant's turn that follows the prompt's messages.
Its labels (not yet shifted) are the answer's tokens, end of turn included, and IGNORE on
the prompt. Messages are read as SFT chat rows' are (`rows.message`).

An over-long prompt and answer lose their prompt from the left first, keeping one prompt
token to predict the first answer token from, then the answer's end (`fit`).
"""

from __future__ import annotations

from ..config import DataConfig
from .rows import IGNORE, RowError, SystemPrompt, chat_ids, message, with_eos


def as_messages(value, what: str, images: list | None = None) -> list[dict]:
    """A prompt's or an answer's messages: a string is one assistant message, a dict one
    message; `what` names the field in errors. `train: true` (the default) is dropped.
    `images` as rows.message takes it (a vision-language model's rows)."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise RowError(f"'{what}' must be a string or a non-empty list of {{role, content}} messages")
    messages = [message(m, i, what, images) for i, m in enumerate(value)]
    return [{k: v for k, v in m.items() if k != "train" or not v} for m in messages]  # train: true is the default


def as_prompt(prompt, images: list | None = None) -> list[dict]:
    """A row's `prompt` as messages: a string is one user message. `images` as
    rows.message takes it."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return as_messages(prompt, "prompt", images)


def no_images(messages: list[dict], what: str) -> None:
    """Refuse images in an answer: the model reads images, it does not write them."""
    if any(not isinstance(m["content"], str) for m in messages):
        raise RowError(f"'{what}' holds an image; images go in the prompt, which the model reads")


def assistant_answer(messages: list[dict], what: str) -> list[dict]:
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


def answer_messages(value, what: str, prompt: list[dict], images: bool = False) -> list[dict]:
    """An answer given beside 'prompt': what follows it. Data sets that repeat the whole
    conversation in each answer (UltraFeedback as HuggingFaceH4 publishes it, a 'prompt'
    string beside whole 'chosen' and 'rejected' conversations) begin it with the prompt's
    messages, which are taken off, as TRL does; any other user or system message before the
    answer's assistant turn would make it the answer to another conversation (tool results
    may come first, continuing a prompt that ends in a tool call). With `images` (a
    vision-language model's rows) the repeated prompt may show images; the answer may not."""
    messages = as_messages(value, what, [] if images else None)
    if len(messages) > len(prompt) and messages[: len(prompt)] == prompt:
        messages = messages[len(prompt) :]
    no_images(messages, what)
    roles = [m["role"] for m in assistant_answer(messages, what)]
    before = roles[: roles.index("assistant")]
    if {"user", "system"} & set(before):
        raise RowError(
            f"'{what}' starts with {before} messages that are not the prompt's; give the answer alone beside "
            "'prompt', or whole conversations without a 'prompt' column"
        )
    return messages


def conversation(row: dict, prompt, answers: tuple, tokenizer, cfg: DataConfig) -> tuple:
    """(prompt, answers, tools) as a prompt and its answers are tokenized: plain-text prompt
    and answers become one user and one assistant message each when the tokenizer has a
    chat template; data.system_prompt goes first in a conversation that has no system
    message; the row's `tools`, if any, must be a list."""
    if isinstance(prompt, str) and tokenizer.chat_template:
        prompt = [{"role": "user", "content": prompt}]
        answers = tuple([{"role": "assistant", "content": a}] for a in answers)
    if cfg.system_prompt and isinstance(prompt, list) and not any(m["role"] == "system" for m in prompt):
        prompt = [SystemPrompt(role="system", content=cfg.system_prompt), *prompt]
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RowError("'tools' must be a list of tool definitions")
    return prompt, answers, tools


def answer_ids(prompt, answer, tokenizer, tools=None) -> tuple[list[int], list[int], int]:
    """(input_ids, labels before shifting, prompt length in tokens) of one answer after its
    prompt: both strings, or both message lists (`conversation`). Empty for an answer with
    nothing to train (no content, no tool call)."""
    if isinstance(prompt, str):
        p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        a = with_eos(tokenizer(answer, add_special_tokens=False)["input_ids"], tokenizer) if answer else []
        return p + a, [IGNORE] * len(p) + a, len(p)
    if empty_answer(answer):
        return [], [], 0
    ids, labels = chat_ids(prompt + answer, tokenizer, "assistant", train_from=len(prompt), tools=tools)
    first = next(i for i, t in enumerate(labels) if t != IGNORE)
    return ids, labels, first


def empty_answer(answer: list[dict]) -> bool:
    """Whether an answer's messages have nothing to train: no assistant content, no tool call."""
    return not answer or not any(m["role"] == "assistant" and (m["content"] or m.get("tool_calls")) for m in answer)


def fit(sequences: list[tuple[list[int], list[int]]], prompt: int, width: int) -> tuple[list, int]:
    """Sequences (input_ids, labels) that begin with the same `prompt` tokens (a prompt and
    its answers), cut to `width` tokens as data.overlong=truncate cuts them: all alike from
    the left of the prompt, by what the longest is over, keeping one prompt token to predict
    the first answer token from; then each on the right. Returns (the sequences, the tokens
    cut from the left)."""
    longest = max(len(ids) for ids, _ in sequences)
    cut = max(0, min(longest - width, prompt - 1))
    return [(ids[cut:][:width], labels[cut:][:width]) for ids, labels in sequences], cut

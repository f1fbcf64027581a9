"""Turns of an episode as tokens: what follows a turn that called tools, rendered as the chat
template renders tool messages, without tokenizing anything the policy sampled again.

Token in, token out: an episode's tokens are the prompt's, then each turn's tokens exactly
as sampled, then the tokens of the tool results and the next turn's header (`tool_suffix_ids`),
and so on. Decoding a turn and tokenizing the conversation again could give other tokens for
the same text (a merge across the turn's end, a normalised space), and the policy would then
be trained on tokens it never sampled.

`tool_suffix_ids` renders a stand-in conversation twice, with and without the tool messages
(the user's message, then an assistant turn calling the same tool by name: some templates
name it in the tool message's header), and keeps what the second adds. That is right only
for a template that renders the earlier messages alike whatever follows them (prefix-
preserving); one that does not is refused, in one line. A sampled turn ends at its stop
token (stop_ids: the end-of-turn or end-of-text token), so the stand-in is cut just after
its last stop token, and what a template writes after one (Qwen's newline after
<|im_end|>) belongs to the suffix.

`parse_turn` reads a turn's tool calls with the tokenizer's own response parser
(transformers' `parse_response`, from the tokenizer's `response_template`), so that a model's
own tool-call format is read as its makers wrote it; for a ChatML template with <tool_call>
blocks (Qwen's) without one, ours (`CHATML_TOOL_CALLS`); any other is refused at start
(`check_parser`). A turn whose calls cannot be parsed (cut-off JSON) calls nothing and
is marked malformed, as TRL falls back to plain text: the episode ends there, counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ToolError, describe

STAND_IN_USER = "Use the tool."


def render_ids(tokenizer, messages: list[dict], tools: list[dict] | None, template: str | None, prompt: bool):
    ids = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        add_generation_prompt=prompt,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)


def tool_suffix_ids(
    tokenizer,
    tool_messages: list[dict],
    stops: list[int],
    tools: list[dict] | None = None,
    template: str | None = None,
    key: str = "grpo.tools",
) -> list[int]:
    """The tokens that follow a turn ending in a stop token (one of `stops`) and calling
    tools: the tool messages, as the template renders them, and the header of the next
    assistant turn. See the module docstring."""
    calls = [{"type": "function", "function": {"name": m["name"], "arguments": {}}} for m in tool_messages]
    before = [{"role": "user", "content": STAND_IN_USER}, {"role": "assistant", "content": "", "tool_calls": calls}]
    try:
        prefix = render_ids(tokenizer, before, tools, template, prompt=False)
        full = render_ids(tokenizer, before + tool_messages, tools, template, prompt=True)
    except Exception as e:  # the template's own error (jinja raise_exception, a missing key)
        raise ToolError(
            f"{key}: the chat template cannot render tool calls and their results ({describe(e)}); use a model "
            "whose template renders `tools`, assistant `tool_calls` and `tool` messages"
        ) from None
    ends = [i for i, t in enumerate(prefix) if t in stops]
    if not ends:
        raise ToolError(
            f"{key}: the chat template ends an assistant turn with none of the stop tokens "
            f"{tokenizer.convert_ids_to_tokens(stops)}, so a turn's end cannot be told; use a model whose template "
            "ends each turn with its end-of-turn token"
        )
    prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ToolError(
            f"{key}: the chat template renders earlier messages differently once tool results follow them, so an "
            "episode's tokens cannot be kept as sampled; use a model whose template keeps earlier turns as they are"
        )
    suffix = full[len(prefix) :]
    if not all(m["content"] in tokenizer.decode(suffix) for m in tool_messages if m["content"]):
        raise ToolError(
            f"{key}: the chat template does not render `tool` messages (a tool's result is not in what follows the "
            "turn); use a model whose template renders them"
        )
    return suffix


@dataclass
class Turn:
    """What a sampled turn says: its text and the tool calls it makes, as (name, arguments)."""

    content: str
    calls: list[tuple[str, object]] = field(default_factory=list)
    malformed: bool = False  # it tried to call a tool in a form the parser could not read


# The tool-call format of ChatML templates that write calls as <tool_call>{json}</tool_call> in
# the assistant turn (Qwen 2.5 and 3, and the many models tuned from them), for transformers'
# response parser. Written here because most of those tokenizers ship no response_template yet;
# a tokenizer that ships one is read by its own.
CHATML_TOOL_CALLS = {
    "version": 1,
    "start_anchor": "<|im_start|>assistant\n",
    "defaults": {"role": "assistant"},
    "fields": {
        "content": {},
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "content": "json",
            "repeats": True,
            "transform": {"type": "function", "function": "{content}"},
        },
    },
}


def check_parser(tokenizer, template: str | None = None, key: str = "grpo.tools") -> None:
    """Make sure the model's tool calls can be read, at start: the tokenizer's own
    response_template, else ours for a ChatML template that writes <tool_call> blocks (set on
    the tokenizer), else one line saying what to do."""
    if getattr(tokenizer, "response_template", None) is not None:
        return
    text = template or getattr(tokenizer, "chat_template", None) or ""
    if isinstance(text, str) and "<tool_call>" in text and "<|im_start|>" in text:
        tokenizer.response_template = CHATML_TOOL_CALLS
        return
    raise ToolError(
        f"{key}: the tokenizer has no response_template and its chat template is not one whose tool calls llmtrain "
        "reads (ChatML with <tool_call> blocks, as Qwen's), so the model's tool calls cannot be read; use such a "
        "model, or set tokenizer.response_template (transformers' response parsing) for its format"
    )


def parse_turn(tokenizer, turn_ids: list[int], prefix_ids: list[int], stops: list[int], tools=None) -> Turn:
    """The turn `turn_ids` (sampled after `prefix_ids`, its stop token included if it ended)
    read by the tokenizer's response parser, with arguments typed by the tools' schemas."""
    ids = turn_ids[:-1] if turn_ids and turn_ids[-1] in stops else turn_ids
    try:
        parsed = tokenizer.parse_response(list(ids), prefix=list(prefix_ids), tools=tools)
    except ValueError:  # the parser's error for a region it cannot read (JSON cut short, say)
        return Turn(tokenizer.decode(ids, skip_special_tokens=True), malformed=True)
    calls, malformed = [], False
    for call in parsed.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            malformed = True
            continue
        calls.append((name, function.get("arguments", {})))
    content = parsed.get("content")
    return Turn(content if isinstance(content, str) else "", calls, malformed)

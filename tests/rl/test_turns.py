"""Token in, token out (rl/turns.py): the tokens after a turn that called tools are what the
chat template renders for the tool results and the next header, so that prompt + the turn
as sampled + that suffix is the whole conversation's rendering, for two real tool-calling
template shapes written out here (ChatML with <tool_call> as Qwen's, and headers with
<|eot_id|> as Llama 3.1's); templates that cannot keep a turn as sampled are refused."""

import pytest

from llmtrain.errors import ToolError
from llmtrain.rl.turns import CHATML_TOOL_CALLS, check_parser, parse_turn, tool_suffix_ids

# ChatML: tool calls inside the assistant turn, results in a user turn of <tool_response>s,
# and a newline after every <|im_end|> (which a sampled turn does not include).
CHATML_TOOLS = """\
{%- if tools %}<|im_start|>system
You may call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls or [] %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}<|im_end|>
{% endif %}
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Headers: a call as JSON in the assistant turn, each result an "ipython" turn.
HEADERS_TOOLS = """\
{{- '<|begin_of_text|>' }}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- {"name": call.name, "parameters": call.arguments} | tojson }}{{ '<|eot_id|>' }}
{%- elif message.role == "tool" %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def render(tok, messages, template, prompt):
    return list(
        tok.apply_chat_template(
            messages,
            tools=[ADD],
            chat_template=template,
            add_generation_prompt=prompt,
            tokenize=True,
            return_dict=False,
        )
    )


@pytest.mark.parametrize(
    "template, stop, results",
    [
        (CHATML_TOOLS, "<|im_end|>", ["5"]),
        (CHATML_TOOLS, "<|im_end|>", ["5", '{"error": "timed out after 10 s"}']),  # two results: one user turn
        (HEADERS_TOOLS, "<|eot_id|>", ["5"]),
    ],
)
def test_prompt_then_the_sampled_turn_then_the_suffix_is_the_whole_conversation(tok, template, stop, results):
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}} for _ in results]
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    turn = {"role": "assistant", "content": "", "tool_calls": calls}
    tools = [{"role": "tool", "name": "add", "content": r} for r in results]
    prompt = render(tok, user, template, prompt=True)
    whole = render(tok, user + [turn] + tools, template, prompt=True)
    stop_id = tok.convert_tokens_to_ids(stop)
    assert whole[: len(prompt)] == prompt
    sampled = whole[len(prompt) : whole.index(stop_id, len(prompt)) + 1]  # the turn, through its stop token
    suffix = tool_suffix_ids(tok, tools, [stop_id, tok.eos_token_id], tools=[ADD], template=template)
    assert prompt + sampled + suffix == whole
    assert all(r in tok.decode(suffix) for r in results)
    assert tok.decode(suffix).endswith("assistant\n" if template is CHATML_TOOLS else "assistant<|end_header_id|>\n\n")


def test_templates_that_cannot_keep_a_turn_as_sampled_are_refused(tok):
    tools = [{"role": "tool", "name": "add", "content": "5"}]
    stops = [tok.convert_tokens_to_ids("<|im_end|>")]
    # An earlier assistant turn rendered otherwise once others follow (as templates that drop
    # earlier turns' reasoning do).
    rewrites = CHATML_TOOLS.replace("{{ message.content }}{% for call", "{{ 'x' if not loop.last }}{% for call")
    with pytest.raises(ToolError, match="renders earlier messages differently once tool results follow"):
        tool_suffix_ids(tok, tools, stops, template=rewrites)
    refuses = CHATML_TOOLS.replace("<tool_response>\n{{", "{{ raise_exception('no tools here') }}{{")
    with pytest.raises(ToolError, match=r"cannot render tool calls and their results \(.*no tools here"):
        tool_suffix_ids(tok, tools, stops, template=refuses)
    drops = CHATML_TOOLS.replace("<tool_response>\n{{ message.content }}\n</tool_response>", "")
    with pytest.raises(ToolError, match="does not render `tool` messages"):
        tool_suffix_ids(tok, tools, stops, template=drops)
    with pytest.raises(ToolError, match="ends an assistant turn with none of the stop tokens"):
        tool_suffix_ids(tok, tools, [tok.convert_tokens_to_ids("<|eot_id|>")], template=CHATML_TOOLS)


def test_a_turns_tool_calls_are_read_by_the_tokenizers_own_parser(tok):
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ToolError, match="the tokenizer has no response_template and its chat template is not one"):
        check_parser(tok)  # the demo's plain ChatML template writes no tool calls
    check_parser(tok, CHATML_TOOLS)  # a ChatML template with <tool_call> blocks: llmtrain's parser for it
    assert tok.response_template == CHATML_TOOL_CALLS
    prefix = render(tok, [{"role": "user", "content": "What is 2 + 3 + 4?"}], CHATML_TOOLS, prompt=True)

    def turn(text: str, ended: bool = True):
        ids = tok(text, add_special_tokens=False)["input_ids"] + ([stop] if ended else [])
        return parse_turn(tok, ids, prefix, [stop], tools=[ADD])

    two = turn(
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        '<tool_call>\n{"name": "add", "arguments": {"a": "5", "b": 4}}\n</tool_call>'
    )
    assert two.calls == [("add", {"a": 2, "b": 3}), ("add", {"a": 5, "b": 4})]  # "5" typed by the schema
    assert not two.malformed
    answer = turn("9")
    assert (answer.content, answer.calls, answer.malformed) == ("9", [], False)
    cut = turn('<tool_call>\n{"name": "add", "arguments": {"a": 2,', ended=False)  # the token budget ran out
    assert cut.calls == [] and cut.malformed
    nameless = turn('<tool_call>\n{"arguments": {"a": 2}}\n</tool_call>')
    assert nameless.calls == [] and nameless.malformed

"""One row to token ids and labels (data/rows.py's process_row): every row format, the chat
template's assistant turns and end-of-turn tokens, the loss mask (turns marked not to
train, data.loss_on=all, tool calls), truncation, the system prompt, and content parts;
padding a batch without a pad token. A whole split: tests/data/test_prepare.py."""

import typing

import pytest

from llmtrain.config import DataConfig
from llmtrain.data.build import ROWS
from llmtrain.data.rows import IGNORE, REQUIRED, process_row
from tests.support.data import CHAT, TOOLS_TEMPLATE, templated, write


def trained_text(tokenizer, example) -> str:
    """The tokens that carry a loss, as text (labels are shifted: labels[t] = ids[t+1])."""
    return tokenizer.decode([t for t in example["labels"] if t != IGNORE])


def row(tokenizer, data, fmt, **cfg):
    return process_row(data, fmt, tokenizer, DataConfig(**cfg))


def test_data_format_offers_auto_and_every_row_format_rows_reads():
    """config's DataConfig.format and rows.REQUIRED (the formats, in data.format=auto's
    order) name the same formats: a format added to one is added to the other."""
    offered = typing.get_args(typing.get_type_hints(DataConfig)["format"])
    assert sorted(offered) == sorted(["auto", *REQUIRED])


def test_labels_are_shifted_inputs(tokenizer):
    ex = row(tokenizer, {"text": "hello"}, "text")
    assert ex["labels"] == ex["input_ids"][1:] + [IGNORE]


def test_chat_trains_assistant_turns_only_with_end_of_turn(tokenizer):
    ex = row(tokenizer, CHAT, "chat")
    assert trained_text(tokenizer, ex) == "4<|im_end|>\n6<|im_end|>\n"
    assert ex["status"] == "ok" and ex["n_trained"] == 6


def test_chat_loss_on_all(tokenizer):
    ex = row(tokenizer, CHAT, "chat", loss_on="all")
    assert ex["n_trained"] == len(ex["input_ids"]) - 1


def test_sharegpt_matches_chat(tokenizer):
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    share = {"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in CHAT["messages"]]}
    assert row(tokenizer, share, "sharegpt") == row(tokenizer, CHAT, "chat")


def test_alpaca_goes_through_the_chat_template(tokenizer):
    ex = row(tokenizer, {"instruction": "Add.", "input": "2 + 2", "output": "4"}, "alpaca")
    text = tokenizer.decode(ex["input_ids"])
    assert text == "<|im_start|>user\nAdd.\n\n2 + 2<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert trained_text(tokenizer, ex) == "4<|im_end|>\n"


def test_prompt_completion_trains_completion_and_eos(tokenizer):
    ex = row(tokenizer, {"prompt": "2 + 2 =", "completion": " 4"}, "prompt_completion")
    assert trained_text(tokenizer, ex) == " 4<|im_end|>"
    assert ex["input_ids"][-1] == tokenizer.eos_token_id
    all_ex = row(tokenizer, {"prompt": "2 + 2 =", "completion": " 4"}, "prompt_completion", loss_on="all")
    assert all_ex["n_trained"] == len(all_ex["input_ids"]) - 1
    assert trained_text(tokenizer, all_ex) == " + 2 = 4<|im_end|>"  # all but the first token


def test_text_trains_everything_and_keeps_eos(tokenizer):
    ex = row(tokenizer, {"text": "abc"}, "text")
    assert tokenizer.decode(ex["input_ids"]) == "abc<|im_end|>"
    assert trained_text(tokenizer, ex) == "bc<|im_end|>"


def test_truncation_that_removes_every_trained_token_drops_the_row(tokenizer):
    long_prompt = {"messages": [{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "y"}]}
    assert row(tokenizer, long_prompt, "chat", max_seq_len=40)["status"] == "no trained tokens"
    assert row(tokenizer, long_prompt, "chat", max_seq_len=40, overlong="drop")["status"].startswith("too long")
    ok = row(tokenizer, {"text": "x" * 80}, "text", max_seq_len=40)
    assert ok["status"] == "truncated" and len(ok["input_ids"]) == 40 and ok["labels"][-1] == IGNORE


def test_tokenizer_without_pad_token_pads_with_eos(tokenizer):
    from llmtrain.data.batches import Collator
    from llmtrain.model import pad_id

    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.pad_token = None
    assert tok.pad_token_id is None and pad_id(tok) == tok.eos_token_id
    a, b = (row(tok, {"text": t}, "text") for t in ("hi", "hello"))
    batch = Collator(pad_id(tok))([a, b])
    assert batch["input_ids"][0, -1] == tok.eos_token_id and batch["labels"][0, -1] == IGNORE
    assert (batch["labels"][1] == tok.eos_token_id).sum() == 1  # the real EOS stays a target
    assert batch["attention_mask"].tolist() == [[1] * len(a["input_ids"]) + [0] * 3, [1] * len(b["input_ids"])]


def test_text_content_parts_are_joined_and_other_parts_refused(tokenizer):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]
    as_parts = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": [parts[1]]}]}
    joined = {"messages": [{"role": "user", "content": "What is\n2 + 2?"}, {"role": "assistant", "content": "2 + 2?"}]}
    ex = row(tokenizer, as_parts, "auto")
    assert ex["status"] == "ok" and ex == row(tokenizer, joined, "auto")
    image = {"type": "image_url", "image_url": {"url": "x.png"}}
    bad = {"messages": [{"role": "user", "content": [parts[0], image]}, {"role": "assistant", "content": "4"}]}
    assert row(tokenizer, bad, "auto")["status"] == (
        "error: messages[0]: holds an image; only recipes/finetune.py, recipes/dpo.py, recipes/grpo.py and "
        "recipes/distill.py take images, for a vision-language model (one with a processor)"
    )
    audio = {"type": "input_audio", "input_audio": {"data": "..."}}
    bad = {"messages": [{"role": "user", "content": [parts[0], audio]}, {"role": "assistant", "content": "4"}]}
    assert row(tokenizer, bad, "auto")["status"] == (
        f"error: messages[0]: content part {audio!r} is not supported; only {{type: text, text: ...}} parts (and "
        "images, for a vision-language model) can be trained"
    )


@pytest.mark.parametrize("flag", [{"train": False}, {"weight": 0}])
def test_an_assistant_turn_marked_not_to_train_has_no_loss(tokenizer, flag):
    messages = [dict(m) for m in CHAT["messages"]]
    messages[2] |= flag
    ex = row(tokenizer, {"messages": messages}, "chat")
    assert trained_text(tokenizer, ex) == "6<|im_end|>\n"
    assert ex["input_ids"] == row(tokenizer, CHAT, "chat")["input_ids"]  # still in the context
    messages[2] |= {"weight": 0.5}
    assert row(tokenizer, {"messages": messages}, "chat")["status"].startswith(
        "error: messages[2]: 'train' must be true or false and 'weight' 0 or 1"
    )


@pytest.mark.parametrize("flag", [{"train": False}, {"weight": 0}])
def test_a_turn_marked_not_to_train_has_no_loss_under_loss_on_all_too(tokenizer, flag):
    """data.loss_on=all trains every token of the row but those of a turn marked train: false
    (weight: 0); a row whose only answer is marked keeps its other tokens."""
    messages = [dict(m) for m in CHAT["messages"]]
    messages[2] |= flag
    every = row(tokenizer, CHAT, "chat", loss_on="all")
    ex = row(tokenizer, {"messages": messages}, "chat", loss_on="all")
    assert ex["input_ids"] == every["input_ids"]
    assert ex["n_trained"] == every["n_trained"] - len(
        tokenizer("4<|im_end|>\n", add_special_tokens=False)["input_ids"]
    )
    assert "4<|im_end|>" not in trained_text(tokenizer, ex) and "6<|im_end|>" in trained_text(tokenizer, ex)
    assert "What is 2 + 2?" in trained_text(tokenizer, ex)
    only = row(tokenizer, {"messages": messages[:3]}, "chat", loss_on="all")
    assert only["status"] == "ok" and "4<|im_end|>" not in trained_text(tokenizer, only)


def test_a_conversation_opening_with_an_assistant_turn_is_one_clear_row_error(tokenizer):
    messages = CHAT["messages"][2:]  # assistant, user, assistant
    assert row(tokenizer, {"messages": messages}, "chat")["status"] == (
        "error: messages[0]: the conversation opens with an assistant turn, which answers nothing; start it with a "
        "user or system message (data.system_prompt puts a system message first)"
    )
    assert row(tokenizer, {"messages": messages}, "chat", system_prompt="Be brief.")["status"] == "ok"


def test_system_prompt_goes_first_in_rows_without_their_own(tmp_path, tokenizer):
    plain = {"messages": CHAT["messages"][1:]}
    with_system = row(tokenizer, plain, "chat", system_prompt="Be brief.")
    assert with_system["input_ids"] == row(tokenizer, CHAT, "chat")["input_ids"]
    own = {"messages": [{"role": "system", "content": "Be long."}] + plain["messages"]}
    assert (
        row(tokenizer, own, "chat", system_prompt="Be brief.")["input_ids"] == row(tokenizer, own, "chat")["input_ids"]
    )
    path = write(tmp_path / "rows.jsonl", [plain])
    a, _ = ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path))
    b, _ = ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path, system_prompt="Be brief."))
    assert len(b[0]["input_ids"]) > len(a[0]["input_ids"])  # not the cached tokens of the first
    assert b[0]["input_ids"] == with_system["input_ids"]


def test_tool_calls_are_trained_and_tool_results_and_definitions_are_not(tokenizer):
    call = {"type": "function", "function": {"name": "add", "arguments": "2,2"}}
    data = {
        "tools": [{"name": "add"}],
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "1", "content": "4"},
            {"role": "assistant", "content": "4"},
        ],
    }
    ex = process_row(data, "auto", templated(tokenizer, TOOLS_TEMPLATE), DataConfig())
    assert ex["status"] == "ok"
    assert trained_text(tokenizer, ex) == "<call>add(2,2)</call><|im_end|>\n4<|im_end|>\n"
    assert tokenizer.decode(ex["input_ids"]).startswith("<|im_start|>system\ntools: add<|im_end|>")
    data["tools"] = "add"
    assert process_row(data, "auto", templated(tokenizer, TOOLS_TEMPLATE), DataConfig())["status"] == (
        "error: 'tools' must be a list of tool definitions"
    )

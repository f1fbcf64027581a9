import json
import typing

import pytest

from llmtrain.config import DataConfig
from llmtrain.data.build import ROWS
from llmtrain.data.rows import IGNORE, REQUIRED, process_row
from llmtrain.errors import DataError
from tests.conftest import templated


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


CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6"},
    ]
}


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


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_every_format_detected_and_sources_mixed(tmp_path, tokenizer):
    import pandas as pd

    files = [
        write(tmp_path / "text.jsonl", [{"text": "hello there"}]),
        write(tmp_path / "pc.jsonl", [{"prompt": "Q", "completion": "A"}]),
        write(tmp_path / "alpaca.jsonl", [{"instruction": "Say hi", "input": "", "output": "hi"}]),
        write(tmp_path / "chat.jsonl", [CHAT]),
        write(
            tmp_path / "share.jsonl",
            [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}],
        ),
    ]
    pd.DataFrame([{"prompt": "P", "completion": "C"}]).to_parquet(tmp_path / "pc.parquet")
    pd.DataFrame([{"text": "csv row"}]).to_csv(tmp_path / "t.csv", index=False)
    (tmp_path / "arr.json").write_text(json.dumps([{"text": "from a json array"}]))
    files += [str(tmp_path / "pc.parquet"), str(tmp_path / "t.csv"), str(tmp_path / "arr.json")]
    ds, stats = ROWS.prepare("data.train", files, tokenizer, DataConfig(train=files))
    assert len(ds) == stats.kept == stats.rows == 8
    texts = [tokenizer.decode(ids) for ids in ds["input_ids"]]
    assert texts[0] == "hello there<|im_end|>"
    assert texts[4].startswith("<|im_start|>user\nhi<|im_end|>")
    assert texts[7] == "from a json array<|im_end|>"


def test_length_policy_counts(tmp_path, tokenizer):
    path = write(
        tmp_path / "d.jsonl",
        [
            {"text": "short"},
            {"text": "y" * 100},
            {"messages": [{"role": "user", "content": "z" * 100}, {"role": "assistant", "content": "a"}]},
        ],
    )
    _, stats = ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path, max_seq_len=32))
    assert (stats.rows, stats.kept, stats.truncated) == (3, 2, 1)
    assert stats.dropped == {"no trained tokens": 1}
    _, stats = ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path, max_seq_len=32, overlong="drop"))
    assert stats.kept == 1 and stats.dropped == {"longer than data.max_seq_len": 2}
    assert "2 dropped (longer than data.max_seq_len)" in stats.summary("data.train")
    with pytest.raises(DataError, match=r"data.train: .*d.jsonl line 2: row is 101 tokens, above data.max_seq_len=32"):
        ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path, max_seq_len=32, overlong="error"))


def test_malformed_jsonl_names_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"text": "broken"\n')
    with pytest.raises(DataError, match=r"^data.train: .*bad.jsonl line 4: invalid JSON"):
        ROWS.prepare("data.train", [str(path)], tokenizer, DataConfig(train=str(path)))


def test_bad_row_names_file_and_line(tmp_path, tokenizer):
    path = write(
        tmp_path / "rows.jsonl", [CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}]
    )
    problem = r"messages\[1\]: needs a 'content' \(text or a list of text parts\)"
    with pytest.raises(DataError, match=rf"rows.jsonl line 2: {problem}; data.bad_rows=skip would drop"):
        ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path))


def test_unknown_columns_and_missing_file(tmp_path, tokenizer):
    path = write(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"cannot tell the row format from columns \['answer', 'question'\]"):
        ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path))
    with pytest.raises(DataError, match="data.eval: no such file: nope.jsonl"):
        ROWS.prepare("data.eval", ["nope.jsonl"], tokenizer, DataConfig(train="nope.jsonl"))


def test_all_rows_dropped_is_an_error(tmp_path, tokenizer):
    path = write(tmp_path / "long.jsonl", [{"text": "y" * 100}])
    with pytest.raises(DataError, match="no usable rows"):
        ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path, max_seq_len=16, overlong="drop"))


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


def test_tokenization_is_cached(tmp_path, tokenizer):
    path = write(tmp_path / "c.jsonl", [CHAT] * 3)
    first, _ = ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path))
    second, _ = ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path))
    assert first.cache_files and first.cache_files == second.cache_files


def test_unreachable_hub_data_set_is_one_clear_error(tokenizer, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    with pytest.raises(DataError, match=r"^data.train: could not load 'nobody/no-such-data:test' as a file or hub"):
        ROWS.prepare("data.train", ["nobody/no-such-data:test"], tokenizer, DataConfig(train="x"))


# --- the row policy: nothing to train is dropped; malformed stops, or is skipped and counted


def test_rows_with_nothing_to_train_are_dropped_and_counted_with_the_reason(tmp_path, tokenizer):
    path = write(
        tmp_path / "rows.jsonl",
        [
            CHAT,
            {"messages": [{"role": "user", "content": "hi"}]},
            {"messages": []},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "train": False}]},
            {"prompt": "hi", "completion": ""},
            {"text": ""},
        ],
    )
    _, stats = ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path))
    assert stats.summary("data.train") == (
        "data.train: 1/7 rows kept, 6 trained tokens; 2 dropped (empty answer); 1 dropped (empty conversation); "
        "1 dropped (empty text); 1 dropped (every assistant turn has train: false); 1 dropped (no assistant turn)"
    )


BAD = {"messages": [{"role": "robot", "content": "beep"}]}


def test_malformed_rows_are_skipped_and_named_under_bad_rows_skip(tmp_path, tokenizer):
    rows = [CHAT] * 200
    rows[2], rows[150] = BAD, {"messages": [{"role": "user", "content": 5}]}
    path = write(tmp_path / "rows.jsonl", rows)
    cfg = DataConfig(train=path, bad_rows="skip")
    ds, stats = ROWS.prepare("data.train", [path], tokenizer, cfg)
    assert len(ds) == stats.kept == 198
    assert stats.summary("data.train").endswith(
        f"2 dropped (malformed, data.bad_rows=skip: {path} line 3: messages[0]: needs a 'role' of system, developer, "
        f"user, assistant, tool, ipython, got {{'role': 'robot', 'content': 'beep'}}; {path} line 151: messages[0]: "
        "'content' must be a string or a list of parts, got int)"
    )
    with pytest.raises(DataError, match=r"line 3: messages\[0\]: needs a 'role'.*data.bad_rows=skip would drop"):
        ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path))


def test_too_many_malformed_rows_stop_the_run_anyway(tmp_path, tokenizer):
    rows = [CHAT] * 100
    rows[10] = rows[20] = rows[30] = BAD
    path = write(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError) as e:
        ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path, bad_rows="skip", max_bad_fraction=0.02))
    message = str(e.value)
    assert message.startswith(
        "data.max_bad_fraction: 3 of 100 rows of data.train are malformed (3.0%), more than 0.02; the first 3: "
        f"{path} line 11: messages[0]: needs a 'role'"
    )
    assert message.endswith("Fix the rows, or raise data.max_bad_fraction") and "\n" not in message
    ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path, bad_rows="skip", max_bad_fraction=0.03))


def test_text_content_parts_are_joined_and_other_parts_refused(tokenizer):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]
    as_parts = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": [parts[1]]}]}
    joined = {"messages": [{"role": "user", "content": "What is\n2 + 2?"}, {"role": "assistant", "content": "2 + 2?"}]}
    ex = row(tokenizer, as_parts, "auto")
    assert ex["status"] == "ok" and ex == row(tokenizer, joined, "auto")
    image = {"type": "image_url", "image_url": {"url": "x.png"}}
    bad = {"messages": [{"role": "user", "content": [parts[0], image]}, {"role": "assistant", "content": "4"}]}
    assert row(tokenizer, bad, "auto")["status"] == (
        f"error: messages[0]: content part {image!r} is not supported; only {{type: text, text: ...}} parts can be "
        "trained"
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


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='name') | join(',') }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}({{ c.function.arguments }})</call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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


def test_rows_that_fill_two_formats_are_read_as_the_first_and_said_so(tmp_path, tokenizer, capsys):
    """Alpaca as published has a `text` column (the whole rendered example) beside
    `instruction` and `output`: such rows are read as alpaca, and the run says so, naming the
    file, the count and the setting that reads the other; data.format=text reads the text. A
    file mixing rows of one format each says nothing."""
    alpaca = {"instruction": "Say hi", "input": "", "output": "hi", "text": "Below is an instruction. Say hi. hi"}
    path = write(tmp_path / "a.jsonl", [alpaca, alpaca, {"text": "plain"}])
    ds, _ = ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path))
    err = capsys.readouterr().err
    assert (
        f"warning: data.train: {path}: 2 rows fill the fields of more than one row format (alpaca: "
        "'instruction'+'output', text: 'text') and are read as alpaca, the first in data.format=auto's order; "
        "set data.format=text to read them as that instead"
    ) in err
    assert tokenizer.decode(ds["input_ids"][0]).startswith("<|im_start|>user\nSay hi")
    ds, _ = ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path, format="text"))
    assert tokenizer.decode(ds["input_ids"][0]) == alpaca["text"] + "<|im_end|>"
    assert "more than one row format" not in capsys.readouterr().err
    mixed = write(tmp_path / "m.jsonl", [{"text": "plain"}, CHAT])
    ROWS.prepare("data.train", [mixed], tokenizer, DataConfig(train=mixed))
    assert "more than one row format" not in capsys.readouterr().err


def test_a_row_with_more_text_than_a_row_may_hold_is_malformed_from_any_source(tmp_path, tokenizer):
    """Files bound a line as they read it, but a Parquet cell (compressed to a few KiB) or a
    hub row is bounded only by the row check: tokenizing a 57 MiB row took 11 GB."""
    import pandas as pd

    from llmtrain.data.rows import MAX_ROW_CHARS

    huge = "a" * (MAX_ROW_CHARS + 1)
    pd.DataFrame([{"text": "fine"}, {"text": huge}]).to_parquet(tmp_path / "big.parquet", compression="zstd")
    path = str(tmp_path / "big.parquet")
    assert (tmp_path / "big.parquet").stat().st_size < 1 << 20
    with pytest.raises(DataError, match=rf"big.parquet row 1: the row holds more than {MAX_ROW_CHARS:,} characters"):
        ROWS.prepare("data.train", [path], tokenizer, DataConfig(train=path))
    chat = write(tmp_path / "c.jsonl", [CHAT, {"messages": [{"role": "user", "content": huge}, CHAT["messages"][1]]}])
    ds, stats = ROWS.prepare(
        "data.train", [chat], tokenizer, DataConfig(train=chat, bad_rows="skip", max_bad_fraction=0.5)
    )
    assert len(ds) == 1 and stats.kept == 1

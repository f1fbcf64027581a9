"""A whole split through data/prepare.py (ROWS.prepare): every file format and row format
detected and mixed, the length policy, the datasets cache, the errors that name a file and
line, and the row policy (nothing to train is dropped and counted; malformed stops, or is
skipped and counted up to data.max_bad_fraction). One row alone: tests/data/test_rows.py."""

import json

import pytest

from llmtrain.config import DataConfig
from llmtrain.data.build import ROWS
from llmtrain.errors import DataError
from tests.support.data import CHAT, write


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

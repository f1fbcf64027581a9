import json

import pytest

from llmtrain.config import DataConfig
from llmtrain.data import IGNORE, DataError, prepare_split, process_row

from .conftest import ROOT  # noqa: F401


def trained_text(tokenizer, example) -> str:
    """The tokens that carry a loss, as text (labels are shifted: labels[t] = ids[t+1])."""
    return tokenizer.decode([t for t in example["labels"] if t != IGNORE])


def row(tokenizer, data, fmt, **cfg):
    return process_row(data, fmt, tokenizer, None, DataConfig(**cfg))


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
    ds, stats = prepare_split("data.train", files, tokenizer, DataConfig(train=files))
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
    _, stats = prepare_split("data.train", [path], tokenizer, DataConfig(train=path, max_seq_len=32))
    assert (stats.rows, stats.kept, stats.truncated) == (3, 2, 1)
    assert stats.dropped == {"no trained tokens": 1}
    _, stats = prepare_split("data.train", [path], tokenizer, DataConfig(train=path, max_seq_len=32, overlong="drop"))
    assert stats.kept == 1 and stats.dropped == {"longer than data.max_seq_len": 2}
    assert "2 dropped (longer than data.max_seq_len)" in stats.summary("data.train")
    with pytest.raises(DataError, match=r"data.train: .*d.jsonl line 2: row is 101 tokens, above data.max_seq_len=32"):
        prepare_split("data.train", [path], tokenizer, DataConfig(train=path, max_seq_len=32, overlong="error"))


def test_malformed_jsonl_names_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"text": "broken"\n')
    with pytest.raises(DataError, match=r"^data.train: .*bad.jsonl line 4: invalid JSON"):
        prepare_split("data.train", [str(path)], tokenizer, DataConfig(train=str(path)))


def test_bad_row_names_file_and_line(tmp_path, tokenizer):
    path = write(
        tmp_path / "rows.jsonl", [CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}]
    )
    with pytest.raises(DataError, match=r"rows.jsonl line 2: each message needs a string 'role' and 'content'"):
        prepare_split("data.train", [path], tokenizer, DataConfig(train=path))


def test_unknown_columns_and_missing_file(tmp_path, tokenizer):
    path = write(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"cannot tell the row format from columns \['answer', 'question'\]"):
        prepare_split("data.train", [path], tokenizer, DataConfig(train=path))
    with pytest.raises(DataError, match="data.eval: no such file: nope.jsonl"):
        prepare_split("data.eval", ["nope.jsonl"], tokenizer, DataConfig(train="nope.jsonl"))


def test_all_rows_dropped_is_an_error(tmp_path, tokenizer):
    path = write(tmp_path / "long.jsonl", [{"text": "y" * 100}])
    with pytest.raises(DataError, match="no usable rows"):
        prepare_split("data.train", [path], tokenizer, DataConfig(train=path, max_seq_len=16, overlong="drop"))


def test_tokenizer_without_pad_token_pads_with_eos(tokenizer):
    from llmtrain.batches import Collator
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
    first, _ = prepare_split("data.train", [path], tokenizer, DataConfig(train=path))
    second, _ = prepare_split("data.train", [path], tokenizer, DataConfig(train=path))
    assert first.cache_files and first.cache_files == second.cache_files


def test_unreachable_hub_data_set_is_one_clear_error(tokenizer, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    with pytest.raises(DataError, match=r"^data.train: could not load 'nobody/no-such-data:test' as a file or hub"):
        prepare_split("data.train", ["nobody/no-such-data:test"], tokenizer, DataConfig(train="x"))

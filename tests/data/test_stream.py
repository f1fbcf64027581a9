"""Streamed training data: each process's share, packing on the fly, and bad rows met
mid-run. The real recipe on two DDP processes (same losses as prepared data; uneven ranks;
a stop on a bad row that keeps a checkpoint and resumes to the same run):
tests/launch/test_stream.py."""

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from llmtrain.config import DataConfig
from llmtrain.data.rows import process_row
from llmtrain.data.stream import StreamedRows, pack_stream
from llmtrain.demo import make_rows, write_jsonl
from llmtrain.errors import DataError
from tests.support.data import mixed_rows, stream_config


def shares(path: Path, tokenizer, config: DataConfig, world: int = 2, epoch: int = 0) -> list[list[tuple]]:
    out = []
    for rank in range(world):
        given = dataclasses.replace(config, train=str(path))
        stream = StreamedRows("data.train", tokenizer, given, seed=7, rank=rank, world=world)
        stream.set_epoch(epoch)
        out.append([tuple(e["input_ids"]) for e in stream])
    return out


def test_processes_read_disjoint_shares_that_cover_every_kept_row(tmp_path, tokenizer):
    rows = mixed_rows(40, seed=5)
    path = tmp_path / "rows.jsonl"
    write_jsonl(rows, path)
    kept = Counter(
        tuple(k["input_ids"])
        for r in rows
        if (k := process_row(r, "auto", tokenizer, stream_config()))["status"] == "ok"
    )
    first = shares(path, tokenizer, stream_config())
    assert Counter(first[0] + first[1]) == kept  # every kept row once, on one process
    assert len(first[0]) != len(first[1])  # the drops fall unevenly: the processes run out at different times
    assert shares(path, tokenizer, stream_config()) == first  # a pass can be read again, row for row (resume)
    second = shares(path, tokenizer, stream_config(), epoch=1)
    assert Counter(second[0] + second[1]) == kept and second != first  # reshuffled each pass
    # Unshuffled, a one-file source is dealt out row by row: process r reads rows r, r+2, ...
    processed = [process_row(r, "auto", tokenizer, stream_config()) for r in rows]
    assert shares(path, tokenizer, stream_config(shuffle=False)) == [
        [tuple(k["input_ids"]) for k in processed[rank::2] if k["status"] == "ok"] for rank in (0, 1)
    ]


def test_sources_are_read_in_turn(tmp_path, tokenizer):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl([{"text": f"a{i}"} for i in range(3)], a)
    write_jsonl([{"text": f"b{i}"} for i in range(1)], b)
    stream = StreamedRows(
        "data.train", tokenizer, stream_config(train=[str(a), str(b)], shuffle=False), seed=7, rank=0, world=1
    )
    texts = [tokenizer.decode(e["input_ids"], skip_special_tokens=True) for e in stream]
    assert texts == ["a0", "b0", "a1", "a2"]


def test_packing_a_stream_keeps_every_row_whole_and_within_the_width():
    rows = [{"input_ids": [i] * n, "labels": [i] * n} for i, n in enumerate([50, 90, 30, 128, 10, 70, 60, 5] * 5)]
    packs = list(pack_stream(iter(rows), 128, open_bins=3))
    assert all(len(p["input_ids"]) <= 128 for p in packs)
    pieces = []
    for p in packs:
        assert p["labels"] == p["input_ids"]
        for d in set(p["doc_ids"]):
            at = [i for i, x in enumerate(p["doc_ids"]) if x == d]
            assert at == list(range(at[0], at[-1] + 1))  # a row stays contiguous, positions restart at 0
            assert [p["position_ids"][i] for i in at] == list(range(len(at)))
            pieces.append(tuple(p["input_ids"][i] for i in at))
    assert sorted(pieces) == sorted(tuple(r["input_ids"]) for r in rows)
    assert sum(map(len, pieces)) / (128 * len(packs)) > 0.9


@pytest.mark.parametrize("world", [1, 2])
def test_a_bad_row_is_met_as_an_error_naming_file_and_line(tmp_path, tokenizer, world):
    rows = make_rows(6, seed=1)
    rows[4] = {"messages": "hi"}
    path = tmp_path / "bad.jsonl"
    write_jsonl(rows, path)
    with pytest.raises(DataError, match=rf"^data.train: {re.escape(str(path))} line 5: 'messages' must be a list"):
        shares(path, tokenizer, stream_config(shuffle=False), world=world)


def test_a_bad_parquet_row_is_named_by_its_index_and_its_own_fields(tmp_path, tokenizer):
    """A Parquet (or hub) stream numbers its rows in a column of llmtrain's own, which the
    error must not show as one of the row's fields."""
    import pandas as pd

    path = tmp_path / "bad.parquet"
    pd.DataFrame([{"text": "fine"}] * 3 + [{"text": None}]).to_parquet(path)
    with pytest.raises(DataError) as e:
        shares(path, tokenizer, stream_config(shuffle=False), world=1)
    assert str(e.value).startswith(f"data.train: {path} row 3: no known format fits this row's fields [] (text: null)")


def test_streamed_rows_that_fill_two_formats_are_said_once(tmp_path, tokenizer, capsys):
    """As prepared data (tests/data/test_prepare.py): rows read as the first of two formats they
    fill are named once per source, with the setting that reads the other."""
    rows = make_rows(6, seed=1)
    for i in (2, 4):
        rows[i] = dict(rows[i], text="the same example written out")
    path = tmp_path / "both.jsonl"
    write_jsonl(rows, path)
    shares(path, tokenizer, stream_config(shuffle=False), world=1)
    warned = [line for line in capsys.readouterr().err.splitlines() if "more than one row format" in line]
    assert warned == [
        f"warning: data.train: {path}: rows like {path} line 3 fill the fields of more than one row format "
        "(chat: 'messages', text: 'text') and are read as chat, the first in data.format=auto's order; set "
        "data.format=text to read them as that instead"
    ]


def test_a_streamed_malformed_row_is_skipped_under_bad_rows_skip_until_too_many_are(tmp_path, tokenizer):
    rows = make_rows(50, seed=1)
    rows[4] = {"messages": "hi"}
    path = tmp_path / "bad.jsonl"
    write_jsonl(rows, path)
    stream = StreamedRows(
        "data.train",
        tokenizer,
        stream_config(train=str(path), shuffle=False, bad_rows="skip", max_bad_fraction=0.05),
        seed=7,
        rank=0,
        world=1,
    )
    kept = list(stream)
    assert stream.stats.rows == 50 and len(kept) == stream.stats.kept == 50 - sum(stream.stats.dropped.values())
    assert (
        f"1 dropped (malformed, data.bad_rows=skip: {path} line 5: 'messages' must be a list"
        in stream.stats.summary("data.train")
    )
    rows[20] = rows[30] = rows[40] = rows[4]
    write_jsonl(rows, path)
    with pytest.raises(DataError, match=r"^data.max_bad_fraction: 4 of 50 rows of data.train are malformed \(8.0%\)"):
        shares(path, tokenizer, stream_config(shuffle=False, bad_rows="skip", max_bad_fraction=0.05), world=1)


def test_a_malformed_line_is_an_error_naming_it(tmp_path, tokenizer):
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in make_rows(30, seed=1)) + '\n{"text": "cut off\n')
    with pytest.raises(DataError, match=r"broken.jsonl line 31: invalid JSON.*data.bad_rows=skip would drop"):
        shares(path, tokenizer, stream_config(shuffle=False))
    skip = stream_config(shuffle=False, bad_rows="skip", max_bad_fraction=0.05)
    good = tmp_path / "good.jsonl"
    write_jsonl(make_rows(30, seed=1), good)
    assert shares(path, tokenizer, skip, world=1) == shares(good, tokenizer, skip, world=1)  # only the line is dropped

"""Streamed training data: each process's share, packing on the fly, bad rows met mid-run,
and the real recipe on two DDP processes (same losses as prepared data; uneven ranks; a
stop on a bad row that keeps a checkpoint and resumes to the same run)."""

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
from tests.conftest import metrics, recipe_args, run_recipe, train_rows


def mixed_rows(n: int, seed: int) -> list[dict]:
    """Chat rows of many lengths, and after every third an over-long text row (dropped
    with data.overlong=drop at data.max_seq_len=128)."""
    rows = []
    for i, row in enumerate(make_rows(n, seed=seed)):
        rows.append(row)
        if i % 3 == 0:
            rows.append({"text": "x" * 300})
    return rows


def cfg(**kw) -> DataConfig:
    return DataConfig(**({"train": "x", "max_seq_len": 128, "overlong": "drop", "shuffle_buffer": 8} | kw))


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
        tuple(k["input_ids"]) for r in rows if (k := process_row(r, "auto", tokenizer, cfg()))["status"] == "ok"
    )
    first = shares(path, tokenizer, cfg())
    assert Counter(first[0] + first[1]) == kept  # every kept row once, on one process
    assert len(first[0]) != len(first[1])  # the drops fall unevenly: the processes run out at different times
    assert shares(path, tokenizer, cfg()) == first  # a pass can be read again, row for row (resume)
    second = shares(path, tokenizer, cfg(), epoch=1)
    assert Counter(second[0] + second[1]) == kept and second != first  # reshuffled each pass
    # Unshuffled, a one-file source is dealt out row by row: process r reads rows r, r+2, ...
    processed = [process_row(r, "auto", tokenizer, cfg()) for r in rows]
    assert shares(path, tokenizer, cfg(shuffle=False)) == [
        [tuple(k["input_ids"]) for k in processed[rank::2] if k["status"] == "ok"] for rank in (0, 1)
    ]


def test_sources_are_read_in_turn(tmp_path, tokenizer):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl([{"text": f"a{i}"} for i in range(3)], a)
    write_jsonl([{"text": f"b{i}"} for i in range(1)], b)
    stream = StreamedRows("data.train", tokenizer, cfg(train=[str(a), str(b)], shuffle=False), seed=7, rank=0, world=1)
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
        shares(path, tokenizer, cfg(shuffle=False), world=world)


def test_a_bad_parquet_row_is_named_by_its_index_and_its_own_fields(tmp_path, tokenizer):
    """A Parquet (or hub) stream numbers its rows in a column of llmtrain's own, which the
    error must not show as one of the row's fields."""
    import pandas as pd

    path = tmp_path / "bad.parquet"
    pd.DataFrame([{"text": "fine"}] * 3 + [{"text": None}]).to_parquet(path)
    with pytest.raises(DataError) as e:
        shares(path, tokenizer, cfg(shuffle=False), world=1)
    assert str(e.value).startswith(f"data.train: {path} row 3: no known format fits this row's fields [] (text: null)")


def test_streamed_rows_that_fill_two_formats_are_said_once(tmp_path, tokenizer, capsys):
    """As prepared data (tests/data/test_data.py): rows read as the first of two formats they
    fill are named once per source, with the setting that reads the other."""
    rows = make_rows(6, seed=1)
    for i in (2, 4):
        rows[i] = dict(rows[i], text="the same example written out")
    path = tmp_path / "both.jsonl"
    write_jsonl(rows, path)
    shares(path, tokenizer, cfg(shuffle=False), world=1)
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
        cfg(train=str(path), shuffle=False, bad_rows="skip", max_bad_fraction=0.05),
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
        shares(path, tokenizer, cfg(shuffle=False, bad_rows="skip", max_bad_fraction=0.05), world=1)


def test_a_malformed_line_is_an_error_naming_it(tmp_path, tokenizer):
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in make_rows(30, seed=1)) + '\n{"text": "cut off\n')
    with pytest.raises(DataError, match=r"broken.jsonl line 31: invalid JSON.*data.bad_rows=skip would drop"):
        shares(path, tokenizer, cfg(shuffle=False))
    skip = cfg(shuffle=False, bad_rows="skip", max_bad_fraction=0.05)
    good = tmp_path / "good.jsonl"
    write_jsonl(make_rows(30, seed=1), good)
    assert shares(path, tokenizer, skip, world=1) == shares(good, tokenizer, skip, world=1)  # only the line is dropped


# --- the recipe --------------------------------------------------------------------------------------------------


def streamed_args(base_config, tiny_model, data, out, *extra):
    return recipe_args(
        base_config,
        tiny_model,
        data,
        out,
        "data.streaming=true",
        *extra,
    )


@pytest.mark.slow
def test_streamed_data_trains_exactly_like_prepared_data(base_config, tiny_model, cache_env, tmp_path):
    """17 rows on 2 processes: one process has a row more. Without shuffling, both paths
    give each process the same rows in the same order, so the runs must match exactly."""
    data = tmp_path / "rows17.jsonl"
    write_jsonl(make_rows(17, seed=11), data)
    runs = {}
    for streaming in ("false", "true"):
        out = tmp_path / f"streaming-{streaming}"
        run_recipe(
            streamed_args(
                base_config,
                tiny_model,
                data,
                out,
                f"data.streaming={streaming}",
                "data.shuffle=false",
                "train.micro_batch_size=1",
                "train.grad_accum_steps=2",
                "train.max_steps=10",
            ),
            cache_env,
            nproc=2,
        )
        runs[streaming] = train_rows(out)
    assert [r["epoch"] for r in runs["true"]] == [0] * 5 + [1] * 5  # 17 rows: a pass is 5 steps of up to 4 rows
    for key in ("loss", "grad_norm", "tokens"):
        assert [r[key] for r in runs["true"]] == [r[key] for r in runs["false"]], key


@pytest.mark.slow
def test_a_bad_row_mid_stream_stops_with_a_checkpoint_and_the_fixed_run_resumes_exactly(
    base_config, tiny_model, tokenizer, cache_env, tmp_path
):
    """Packed, shuffled, with rows dropped unevenly across the two processes. The reference
    run reads the good file; the other meets a bad row mid-run, stops every process after
    the same step with a checkpoint and one error naming the line, and, with the row
    fixed, resumes from that checkpoint to exactly the reference's losses."""
    rows = mixed_rows(100, seed=5)
    good = tmp_path / "good.jsonl"
    write_jsonl(rows, good)
    data = tmp_path / "data.jsonl"
    bad_rows = list(rows)
    bad_rows[90] = {"messages": "hi"}
    write_jsonl(bad_rows, data)
    extra = [
        "data.packing=true",
        "data.max_seq_len=128",
        "data.overlong=drop",
        "data.shuffle_buffer=8",
        "train.micro_batch_size=1",
        "train.max_steps=40",
        "checkpoint.every_steps=100",
    ]

    ref = tmp_path / "ref"
    proc = run_recipe(streamed_args(base_config, tiny_model, good, ref, *extra), cache_env, nproc=2)
    ref_rows = train_rows(ref)
    assert [r["step"] for r in ref_rows] == list(range(1, 41))
    kept = [process_row(r, "auto", tokenizer, cfg()) for r in rows]
    in_pass_0 = sum(r["tokens"] for r in ref_rows if r["epoch"] == 0)
    assert in_pass_0 == sum(k["n_trained"] for k in kept if k["status"] == "ok")  # no row lost or read twice
    assert ref_rows[-1]["epoch"] >= 1
    assert "dropped (longer than data.max_seq_len)" in proc.stderr

    out = tmp_path / "out"
    proc = run_recipe(streamed_args(base_config, tiny_model, data, out, *extra), cache_env, nproc=2, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    stopped = train_rows(out)[-1]["step"]
    assert 5 <= stopped < 30, stopped  # mid-way through the first pass
    assert errors[0] == (
        f"error: data.train: {data} line 91: 'messages' must be a list of {{role, content}}; data.bad_rows=skip would "
        f"drop malformed rows instead. Training stopped after step {stopped} with checkpoint "
        f"{out}/checkpoints/step-{stopped} complete; fix or remove the row and run the same "
        "command again to continue from it"
    )
    assert not (out / "final").exists()

    write_jsonl(rows, data)  # the row fixed
    proc = run_recipe(streamed_args(base_config, tiny_model, data, out, *extra), cache_env, nproc=2)
    assert f"resumed from {out}/checkpoints/step-{stopped} at step {stopped}" in proc.stdout
    got = train_rows(out)
    assert [r["step"] for r in got] == list(range(1, 41))
    assert [r["loss"] for r in got] == [r["loss"] for r in ref_rows]  # exactly
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref_rows]
    assert (out / "final").exists() and len([r for r in metrics(out) if "skipped" in r]) == 0


@pytest.mark.slow
def test_a_resume_after_one_process_ran_out_continues_exactly(base_config, tiny_model, cache_env, tmp_path):
    """Unshuffled, process 0 reads rows 0, 2, 4, ... and process 1 rows 1, 3, 5, ...; most
    of process 0's rows are too long and dropped, so it runs out at step 2 of a 6-step pass
    while process 1 goes on. A resume from step 4 must give process 1 the rows after the 8
    it had drawn, not after process 0's 3 (the position every process resumes from is the
    most any process drew)."""
    import shutil

    rows = []
    for i, row in enumerate(make_rows(24, seed=8)):
        rows.append(row if i % 2 or i in (0, 2, 4) else {"text": "x" * 400})
    data = tmp_path / "uneven.jsonl"
    write_jsonl(rows, data)
    extra = [
        "data.shuffle=false",
        "data.max_seq_len=256",
        "data.overlong=drop",
        "train.micro_batch_size=1",
        "train.grad_accum_steps=2",
        "train.max_steps=9",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=0",
    ]
    ref = tmp_path / "ref"
    run_recipe(streamed_args(base_config, tiny_model, data, ref, *extra), cache_env, nproc=2)
    ref_rows = train_rows(ref)
    assert [r["epoch"] for r in ref_rows] == [0] * 6 + [1] * 3
    assert [r["tokens"] > 0 for r in ref_rows] == [True] * 9

    out = tmp_path / "resumed"
    shutil.copytree(ref, out)
    shutil.rmtree(out / "final")
    for step in range(5, 10):
        shutil.rmtree(out / "checkpoints" / f"step-{step}")
    proc = run_recipe(streamed_args(base_config, tiny_model, data, out, *extra), cache_env, nproc=2)
    assert f"resumed from {out}/checkpoints/step-4 at step 4" in proc.stdout
    got = train_rows(out)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref_rows]
    assert [r["loss"] for r in got] == [r["loss"] for r in ref_rows]  # exactly

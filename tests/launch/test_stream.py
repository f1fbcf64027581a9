"""Streamed training data in the real recipe on two DDP processes: the same losses as
prepared data, a bad row met mid-run that stops every process with a checkpoint and resumes
to the same run once fixed, and a resume after one process ran out (the stream itself:
tests/data/test_stream.py)."""

import pytest

from llmtrain.data.rows import process_row
from llmtrain.demo import make_rows, write_jsonl
from tests.support.data import mixed_rows, stream_config
from tests.support.runs import metrics, recipe_args, run_recipe, train_rows

pytestmark = pytest.mark.slow


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
    kept = [process_row(r, "auto", tokenizer, stream_config()) for r in rows]
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


def streamed_args(base_config, tiny_model, data, out, *extra):
    return recipe_args(
        base_config,
        tiny_model,
        data,
        out,
        "data.streaming=true",
        *extra,
    )

"""The recipe and its checkpoints: a restart falls back past a checkpoint cut short, a
checkpoint past the end of a shortened run is refused, an unwritable output_dir stops the
run at start-up, a write that fails inside torch's writer is the documented one-line error,
and a run resumes on another process count and split of the same global batch (the
checkpoint code itself: tests/output/test_checkpoint.py)."""

import shutil

import pytest

from llmtrain.output.checkpoint import find_resume
from tests.support.runs import ROOT, copy_run, launch_command, recipe_args, rewind, run_recipe, snapshot, train_rows

pytestmark = pytest.mark.slow


def test_recipe_falls_back_past_a_truncated_checkpoint(finished_run, cache_env, tmp_path):
    """A node died mid-write of step-4 (a shard cut short): the restart warns, resumes from
    step-2 and redoes steps 3-4 exactly."""
    out = tmp_path / "run"
    args = copy_run(finished_run, out)
    before = [(r["step"], r["loss"]) for r in train_rows(out)]
    weights = out / "checkpoints" / "step-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shutil.rmtree(out / "final")  # the run died writing step-4: it never exported
    proc = run_recipe(args, cache_env)
    assert "warning: checkpoint" in proc.stderr and "step-4 is damaged (model.safetensors is" in proc.stderr
    assert "resumed from" in proc.stdout and "step-2 at step 2" in proc.stdout
    assert [(r["step"], r["loss"]) for r in train_rows(out)] == before
    assert find_resume(str(out), "auto").name == "step-4"  # rewritten whole


def test_a_checkpoint_past_the_end_of_the_run_is_refused(finished_run, cache_env, tmp_path):
    """The run made shorter than its newest checkpoint: one line naming the file and the
    key, and the run's files as they were (it said final/ was up to date)."""
    out = tmp_path / "run"
    args = copy_run(finished_run, out)
    before = snapshot(out)
    proc = run_recipe(args + ["train.max_steps=2"], cache_env, check=False)
    assert proc.returncode == 2
    assert (
        f"error: checkpoint.resume: {out}/checkpoints/step-4/train_state.json: step 4 is past the end of this run "
        "(2 steps); resume from an earlier checkpoint, or set train.max_steps to at least 4" in proc.stderr
    )
    assert snapshot(out) == before


def test_recipe_stops_at_start_up_on_an_unwritable_output_dir(base_config, tiny_model, chat_file, cache_env, tmp_path):
    (tmp_path / "a_file").write_text("")
    proc = run_recipe(
        recipe_args(base_config, tiny_model, chat_file, tmp_path / "a_file" / "run"),
        cache_env,
        nproc=2,
        check=False,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and all("output_dir: cannot write to" in line for line in errors), proc.stderr[-3000:]


def test_a_write_that_fails_in_torchs_writer_is_the_documented_error(
    base_config, tiny_model, chat_file, cache_env, tmp_path
):
    """For real: the recipe with a limit on file size (as a full disk does, writes fail
    part way), so torch's zip writer fails on optimizer.bin with a RuntimeError, not an
    OSError. One error line, exit 2, and no partial directory left behind."""
    import resource
    import signal
    import subprocess

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (700_000, 700_000))  # the weights fit, the optimizer does not

    out = tmp_path / "run"
    args = recipe_args(
        base_config,
        tiny_model,
        chat_file,
        out,
        "train.micro_batch_size=2",
        "train.max_steps=2",
        "checkpoint.every_steps=1",
        "checkpoint.write_retry_s=0",  # give up at once, not wait for space
    )
    proc = subprocess.run(
        launch_command(args, "one"),
        env=cache_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_file_size,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: checkpoint: writing {out}/checkpoints/.tmp-step-1 failed (unexpected pos: RuntimeError: "
    ), errors
    assert "there is no earlier checkpoint" in errors[0] and "Traceback" not in proc.stderr
    assert list((out / "checkpoints").iterdir()) == []


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_run_resumes_on_another_process_count_and_split(base_config, tiny_model, cache_env, tmp_path, packing):
    """A requeued job that comes back with fewer or more processes (DDP) and another split
    of the same global batch of 8: every later step reads the rows it would have read, so
    the losses and token counts are those of the run that was not interrupted (to float
    rounding: the sums are taken in another order), resumed mid-epoch."""
    # Packed sequences are made once from the whole data, whatever the processes: two of
    # the four cases show that they resplit alike.
    cases = {k: v for i, (k, v) in enumerate(RESPLIT.items()) if not packing or i in (1, 3)}
    from llmtrain.demo import make_rows, write_jsonl

    data = tmp_path / "rows.jsonl"
    write_jsonl(make_rows(48 if not packing else 160, seed=19), data)

    def args(out, layout):
        nproc, micro, accum = layout
        return recipe_args(
            base_config,
            tiny_model,
            data,
            out,
            f"data.packing={str(packing).lower()}",
            "train.epochs=2",
            "checkpoint.every_steps=4",
            "checkpoint.keep_last=5",
            "checkpoint.resume=auto",
            f"train.micro_batch_size={micro}",
            f"train.grad_accum_steps={accum}",
        ), nproc

    firsts = {}
    for name, (first, then) in cases.items():
        if first not in firsts:
            out = tmp_path / f"whole-{'x'.join(map(str, first))}"
            a, n = args(out, first)
            run_recipe(a, cache_env, nproc=n)
            firsts[first] = out
        whole = firsts[first]
        rows = train_rows(whole)
        assert len(rows) >= 10 and rows[4]["epoch"] == 0  # two epochs, the checkpoint at step 4 mid-epoch
        out = tmp_path / name.replace(" -> ", "-to-")
        rewind(out, 4, whole)
        a, n = args(out, then)
        proc = run_recipe(a, cache_env, nproc=n)
        assert f"as {then[0]} process(es) x {then[1]} x {then[2]}, the same global batch of 8" in proc.stdout
        got = train_rows(out)
        assert [r["step"] for r in got] == [r["step"] for r in rows], name
        assert [r["tokens"] for r in got] == [r["tokens"] for r in rows], name
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in rows], rel=1e-5), name


RESPLIT = {
    # name: (processes, micro-batch, accumulation) of the first run, then of the resumed one
    "2x2x2 -> 1x8x1": ((2, 2, 2), (1, 8, 1)),
    "2x2x2 -> 1x4x2": ((2, 2, 2), (1, 4, 2)),
    "1x8x1 -> 2x1x4": ((1, 8, 1), (2, 1, 4)),
    "1x4x2 -> 2x2x2": ((1, 4, 2), (2, 2, 2)),
}

"""The recipe against a run directory that holds a run: a rerun that fails on bad input or
changes settings, a fresh start over a finished run, a second run while the first holds the
lock, the free-space check before anything loads, a run started from another run's
checkpoint or taken back to an earlier one, and a finished run whose data, recipe or export
settings changed (the checks themselves: tests/output/test_rundir.py)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.support.runs import (
    DPO_RECIPE,
    ROOT,
    copy_run,
    kill_tree,
    launch_command,
    recipe_args,
    rewind,
    run_recipe,
    snapshot,
    start_run,
    train_rows,
    wait_for,
)

pytestmark = pytest.mark.slow


def test_a_rerun_that_fails_on_bad_input_overwrites_nothing(finished_run, cache_env, tmp_path):
    out, args = finished_run
    before = snapshot(out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": oops}\n')
    proc = run_recipe(
        [a for a in args if not a.startswith("data.train=")] + [f"data.train={bad}"], cache_env, check=False
    )
    assert proc.returncode == 2 and f"error: data.train: {bad} line 1: invalid JSON" in proc.stderr
    assert snapshot(out) == before


def test_every_file_a_run_leaves_follows_the_umask(finished_run):
    """Files 0666 and directories 0777 less the umask the run had (the suite's), whoever
    wrote them: llmtrain, Accelerate, transformers, the tracker (the writers one by one,
    under umask 002: tests/test_safefs.py)."""
    import stat

    out, _ = finished_run
    umask = os.umask(0)
    os.umask(umask)
    if umask & 0o066 == 0o066:
        pytest.skip(f"under umask {umask:03o} a private file has the mode of any other")
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.lstat().st_mode) for p in out.rglob("*")}
    assert "metrics.jsonl" in modes and "final/train_state.json" in modes
    wrong = {n: oct(m) for n, m in modes.items() if m != (0o777 if (out / n).is_dir() else 0o666) & ~umask}
    assert wrong == {}


def test_a_resume_with_other_settings_names_them(finished_run, cache_env, tmp_path):
    """The learning rate changed, the length did not: the checkpoint at step 4 is the end,
    so nothing is trained or exported again."""
    out, args = finished_run
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    args = [a if not a.startswith("output_dir=") else f"output_dir={copy}" for a in args]
    before = snapshot(copy)
    proc = run_recipe(args + ["train.lr=5e-4"], cache_env)
    assert (
        f"warning: checkpoint.resume: {copy}/checkpoints/step-4 was written with other settings; the run goes "
        "on with the new ones: train.lr: 0.001 -> 0.0005" in proc.stderr
    )
    assert "nothing left to train at step 4; final/ is up to date, and changed settings apply to no step" in proc.stdout
    assert snapshot(copy) == before


def test_a_resume_that_trains_otherwise_keeps_the_finished_runs_final(finished_run, cache_env, tmp_path):
    """The newest checkpoint is step 2 and the rate changed: steps 3 and 4 are trained again
    with the new rate. The finished run's final/ is kept, byte for byte, beside the new one."""
    out, args = finished_run
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    subprocess.run(["rm", "-r", str(copy / "checkpoints" / "step-4")], check=True)
    args = [a if not a.startswith("output_dir=") else f"output_dir={copy}" for a in args]
    old_final = {k: v for k, v in snapshot(copy).items() if k.startswith("final/")}
    proc = run_recipe(args + ["train.lr=5e-4"], cache_env)
    assert (
        "warning: output_dir: final/ held a finished run trained with other settings (train.lr: 0.001 -> 0.0005); "
        "it is kept as final-step-4/ and this run's model becomes final/" in proc.stderr
    )
    now = snapshot(copy)
    assert {k.replace("final-step-4/", "final/", 1): v for k, v in now.items() if k.startswith("final-step-4/")} == (
        old_final
    )
    assert now["final/model.safetensors"] != old_final["final/model.safetensors"]
    assert "lr: 0.0005" in (copy / "final" / "llmtrain_config.yaml").read_text()
    proc = run_recipe(args + ["train.lr=5e-4"], cache_env)  # the new final/ is this run's: nothing to do
    assert f"{copy} already finished at step 4 with these settings; final/ is up to date" in proc.stdout
    assert snapshot(copy) == now


def test_a_fresh_start_over_a_finished_run_is_refused(finished_run, cache_env, tmp_path):
    """No checkpoint to continue from (say checkpoints were removed): training again from
    scratch would replace the finished run."""
    out, args = finished_run
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    subprocess.run(["rm", "-r", str(copy / "checkpoints")], check=True)
    args = [a if not a.startswith("output_dir=") else f"output_dir={copy}" for a in args]
    before = snapshot(copy)
    proc = run_recipe(args + ["train.max_steps=6"], cache_env, check=False)
    assert proc.returncode == 2
    assert (
        f"error: output_dir: {copy} holds a finished run (final/ exported at step 4) with other settings" in proc.stderr
    )
    assert snapshot(copy) == before


def test_a_second_run_into_the_same_output_dir_stops_at_once_naming_the_first(
    base_config, tiny_model, chat_file, cache_env, tmp_path
):
    out = tmp_path / "run"
    args = recipe_args(
        base_config,
        tiny_model,
        chat_file,
        out,
        "train.micro_batch_size=1",
        "train.epochs=1000",
        "checkpoint.every_steps=5",
    )
    first = start_run(args, cache_env, nproc=2)
    try:
        assert wait_for(lambda: (out / "metrics.jsonl").exists() and len(train_rows(out)) >= 2, first)
        rows = len(train_rows(out))
        second = run_recipe(args, cache_env, nproc=2, check=False, timeout=120)
        assert second.returncode != 0
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: output_dir: {out} is in use by another run (pid ")
        assert "started 20" in errors[0] and first.poll() is None  # the first run goes on
        assert wait_for(lambda: len(train_rows(out)) > rows + 2, first)
    finally:
        kill_tree(first)  # SIGKILL: the kernel releases its lock
        first.wait()
    assert first.returncode == -signal.SIGKILL
    proc = run_recipe(args[:-2] + ["train.epochs=1", "checkpoint.every_steps=5"], cache_env, check=False)
    assert "is in use by another run" not in proc.stderr  # no stale lock after a crash


def test_free_space_is_checked_before_data_or_weights_load(base_config, tiny_model, cache_env, tmp_path):
    """A full disk and a malformed data file: the disk is what the run reports, at once."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": oops}\n')
    script = (
        "import shutil, sys, runpy\n"
        "from types import SimpleNamespace\n"
        "shutil.disk_usage = lambda path: SimpleNamespace(total=10**12, used=10**12, free=1000)\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    args = recipe_args(base_config, tiny_model, bad, tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-c", script, *launch_command(args, "one")[1:]],
        env=cache_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: output_dir: {tmp_path / 'run'} has 0.00 GiB free")


def test_a_run_started_from_another_runs_checkpoint_continues_when_run_again(finished_run, cache_env, tmp_path):
    """checkpoint.resume=<another run's step-2>, killed after its step 6: the same command
    continues from its own step-6, to the uninterrupted run's losses (it was refused as
    'another run'); killed before its first checkpoint, it starts from step-2 again."""
    import shutil

    source, args = finished_run
    start = source / "checkpoints" / "step-2"
    again = [a for a in args if not a.startswith(("output_dir=", "train.max_steps="))]
    again += ["train.max_steps=8", f"checkpoint.resume={start}"]
    ref = tmp_path / "ref"
    run_recipe([*again, f"output_dir={ref}"], cache_env)
    assert json.loads((ref / "run.json").read_text())["started_from"] == str(start.resolve())
    for kept, resumed, resume in ((6, "checkpoints/step-6", None), (2, None, None), (2, None, "auto")):
        out = tmp_path / f"killed-after-{kept}-{resume}"
        rewind(out, kept, ref)
        if resumed is None:  # no checkpoint of its own yet: metrics and run.json only
            shutil.rmtree(out / "checkpoints")
        command = [*again, f"output_dir={out}"] + ([f"checkpoint.resume={resume}"] if resume else [])
        proc = run_recipe(command, cache_env)
        assert f"resumed from {out / resumed if resumed else start} at step {kept}" in proc.stdout
        assert [r["loss"] for r in train_rows(out)] == [r["loss"] for r in train_rows(ref)]
        assert json.loads((out / "run.json").read_text())["started_from"] == str(start.resolve())
    rewind(out, 6)  # other settings with the same path: not the same run; auto continues it with them
    proc = run_recipe([*again, f"output_dir={out}", "train.lr=2e-3"], cache_env, check=False)
    assert proc.returncode == 2
    assert f"error: output_dir: {out} holds the run that started from {start}, and this command changes its " in (
        proc.stderr
    )
    assert "(train.lr: 0.001 -> 0.002); to continue that run with them, use checkpoint.resume=auto" in proc.stderr


def test_going_back_to_an_earlier_checkpoint_sets_the_later_ones_aside(finished_run, cache_env, tmp_path):
    """checkpoint.resume=<step-2 of the same output_dir>: the run's step-4 belongs to the
    run it leaves, and as the newest would be what a later resume takes and pruning keeps.
    It moves to checkpoints/earlier-run/; the same command run again after a kill continues
    the new run, not going back again."""
    out = tmp_path / "run"
    args = copy_run(finished_run, out)
    old_step_4 = snapshot(out / "checkpoints" / "step-4")
    (tmp_path / "best").symlink_to(out / "checkpoints" / "step-2")  # a link names it as well
    back = [a for a in args if not a.startswith("train.max_steps=")]
    back += ["train.max_steps=6", f"checkpoint.resume={tmp_path / 'best'}"]
    run_recipe([*back, "--prepare-only"], cache_env)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]  # nothing moved yet
    proc = run_recipe(back, cache_env)
    assert "going back to step-2, the later checkpoints of the run it leaves (step-4) are moved to" in proc.stderr
    assert snapshot(out / "checkpoints" / "earlier-run" / "step-4") == old_step_4
    finished = [r["loss"] for r in train_rows(out)]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["earlier-run", "step-4", "step-6"]
    import shutil

    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / "step-6")
    proc = run_recipe(back, cache_env)
    assert f"resumed from {out / 'checkpoints' / 'step-4'} at step 4" in proc.stdout
    assert "going back" not in proc.stderr
    assert [r["loss"] for r in train_rows(out)] == finished
    # Back again, to step-4 (step-2 was pruned), with other settings: not a rerun of the same run.
    back[-1] = f"checkpoint.resume={out / 'checkpoints' / 'step-4'}"
    proc = run_recipe([*back, "train.lr=2e-3"], cache_env)
    assert "going back to step-4, the later checkpoints of the run it leaves (step-6) are moved to" in proc.stderr
    assert (out / "checkpoints" / "earlier-run-2" / "step-6").is_dir()


def test_a_finished_run_is_not_up_to_date_for_new_data_a_new_model_or_another_recipe(
    base_config, tiny_model, chat_file, cache_env, tmp_path
):
    """The training file replaced by one of the same size and mtime: final/ is from the
    old rows, and the checkpoint would resume their position. The DPO recipe on the same
    output_dir would take on the fine-tune's optimizer and metrics. Both are refused,
    changing nothing. The base model changed in its directory (its config.json, under the
    old size and time): a change of model.name_or_path, named; with nothing left to train,
    nothing is trained or exported (it said "already finished")."""
    data, out, model = tmp_path / "chat.jsonl", tmp_path / "run", tmp_path / "model"
    subprocess.run(["cp", "-p", str(chat_file), str(data)], check=True)
    subprocess.run(["cp", "-rp", str(tiny_model), str(model)], check=True)
    args = recipe_args(base_config, model, data, out, "train.micro_batch_size=4", "train.max_steps=2")
    run_recipe(args + ["checkpoint.every_steps=1"], cache_env)
    before, stat, text = snapshot(out), data.stat(), data.read_text()
    data.write_text(text.replace("a", "b"))
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    proc = run_recipe(args, cache_env, check=False)
    assert proc.returncode == 2
    assert f"error: output_dir: {out}/final was trained on other content of {data} (the file changed since" in (
        proc.stderr
    )
    data.write_text(text)
    proc = run_recipe(args, cache_env, check=False, recipe=DPO_RECIPE)
    assert proc.returncode == 2
    assert f"error: output_dir: {out}/final was trained by the finetune recipe, not dpo" in proc.stderr
    config, stat = model / "config.json", (model / "config.json").stat()
    changed = config.read_text().replace('"hidden_act": "silu"', '"hidden_act": "gelu"')
    assert changed != config.read_text()
    config.write_text(changed)
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    proc = run_recipe(args, cache_env)
    assert f"the run goes on with the new ones: model.name_or_path: {model} changed (config.json)" in proc.stderr
    assert "nothing left to train at step 2; final/ is up to date, and changed settings apply to no step" in proc.stdout
    assert snapshot(out) == before


def test_other_export_settings_export_a_finished_run_again(base_config, tiny_model, chat_file, cache_env, tmp_path):
    """export.merge_lora turned on after a LoRA run finished: its last checkpoint is
    exported again, merged (it said final/ was up to date and kept the adapter alone).
    Without a checkpoint to export from, the refusal names the setting."""
    out = tmp_path / "run"
    lora = ["model.lora.enabled=true", "model.lora.dropout=0", "train.micro_batch_size=4", "train.max_steps=2"]
    args = recipe_args(base_config, tiny_model, chat_file, out, *lora, "checkpoint.every_steps=1")
    run_recipe(args, cache_env)
    assert (out / "final" / "adapter_config.json").is_file() and not (out / "final" / "model.safetensors").exists()
    steps = [r["loss"] for r in train_rows(out)]
    proc = run_recipe([*args, "export.merge_lora=true"], cache_env)
    assert (out / "final" / "model.safetensors").is_file() and (
        out / "final" / "adapter" / "adapter_config.json"
    ).is_file()
    assert [r["loss"] for r in train_rows(out)] == steps  # nothing trained again
    assert sorted(p.name for p in out.glob("final*")) == ["final"]  # the same training: replaced, not kept
    proc = run_recipe([*args, "export.merge_lora=true"], cache_env)
    assert "already finished at step 2 with these settings; final/ is up to date" in proc.stdout
    # With a setting that changes training too, nothing is exported: final/ would record a
    # rate no step was trained with.
    before = (out / "final" / "llmtrain_config.yaml").read_text()
    proc = run_recipe([*args, "export.merge_lora=false", "train.lr=1e-6"], cache_env)
    assert "final/ is up to date, and changed settings apply to no step" in proc.stdout
    assert (out / "final" / "llmtrain_config.yaml").read_text() == before

    bare = tmp_path / "bare"
    args = recipe_args(base_config, tiny_model, chat_file, bare, *lora, "checkpoint.every_steps=0")
    run_recipe(args, cache_env)
    proc = run_recipe([*args, "export.merge_lora=true"], cache_env, check=False)
    assert proc.returncode == 2
    assert "with other settings (export.merge_lora: False -> True), and no checkpoint" in proc.stderr

"""The sbatch templates, submitted to a real two-node Slurm cluster started on this machine
(CPU processes over gloo). Skipped, with the reason, where Slurm cannot be installed."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from llmtrain.demo import make_rows, write_jsonl
from llmtrain.errors import ConfigError
from tests.support.runs import ROOT, recipe_args, run_recipe, train_rows
from tests.support.slurm_cluster import LocalSlurm, missing_reason

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    c = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("slurmdata") / "rows.jsonl"
    write_jsonl(make_rows(80, seed=21), path)  # 2 nodes x 1 process x 2 rows: 20 steps
    return path


@pytest.fixture(scope="module")
def args(base_config, tiny_model, data):
    def make(out: Path) -> list[str]:
        return recipe_args(
            base_config,
            tiny_model,
            data,
            out,
            "train.schedule=cosine",
            "checkpoint.every_steps=4",
            "checkpoint.keep_last=2",
        )

    return make


@pytest.fixture(scope="module")
def reference(args, cache_env, tmp_path_factory) -> list[dict]:
    """The same global batch (4 rows) in one process: micro-batch 2 x 2 accumulation steps."""
    out = tmp_path_factory.mktemp("slurmref") / "ref"
    run_recipe(args(out) + ["train.micro_batch_size=2", "train.grad_accum_steps=2"], cache_env)
    return train_rows(out)


def submit(cluster, template: str, args: list[str], cache_env: dict, log: Path, **extra_env) -> str:
    # The templates run `python` and `accelerate` from PATH, as in the user's activated
    # environment: put this interpreter's first, also when pytest was started without activating it.
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "ACCELERATE_USE_CPU": "1",
        "LLMTRAIN_PROCS_PER_NODE": "1",
        "LLMTRAIN_MIXED_PRECISION": "no",
        "HF_DATASETS_CACHE": cache_env["HF_DATASETS_CACHE"],
        "LLMTRAIN_CACHE": cache_env["LLMTRAIN_CACHE"],
        "OMP_NUM_THREADS": "1",
        **extra_env,
    }
    proc = cluster.run(
        "sbatch",
        "--parsable",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        "--time=10",
        f"--output={log}",
        "--export=ALL," + ",".join(f"{k}={v}" for k, v in env.items()),
        f"recipes/slurm/{template}",
        *args,
        "train.micro_batch_size=2",
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_until(condition, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise TimeoutError


def assert_matches(rows: list[dict], reference: list[dict]):
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == list(range(1, 21))
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in reference]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=1e-5)


def test_templates_read_rank_inside_each_task():
    body = (ROOT / "recipes/slurm/job.sh").read_text()
    per_node = body.split("bash -c '", 1)[1].split("\n'", 1)[0]  # what each srun task runs
    batch_shell = body.replace(per_node, "")
    for var in ("$SLURM_NODEID", "$SLURM_NNODES", "SLURM_GPUS_ON_NODE"):
        assert var in per_node and var not in batch_shell, var
    for name in ("single_node.sbatch", "multi_node.sbatch"):
        for line in (ROOT / "recipes/slurm" / name).read_text().splitlines():
            if line.startswith("#SBATCH"):
                assert "$" not in line, f"{name}: {line}"


def stand_in_slurm(tmp_path: Path, srun: str) -> tuple[dict, Path]:
    """An environment whose Slurm commands are stand-ins that log their calls (to the
    returned file), for running job.sh as a batch job's shell; `srun` is its srun's body."""
    import textwrap

    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    stubs = {
        "scontrol": 'case "$1 $2" in "show hostnames") echo node1;; "show node") echo "NodeAddr=127.0.0.1";; '
        '*) echo "scontrol $*" >> "$LOG";; esac',
        "srun": srun,
        "scancel": 'echo "scancel $*" >> "$LOG"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(textwrap.dedent(f"#!/bin/bash\n{body}\n"))
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", LOG=str(log))
    env |= {"SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "1"}
    return env, log


def run_job(env: dict, *args: str):
    import subprocess

    return subprocess.run(
        ["bash", "recipes/slurm/job.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_a_preemption_warning_before_training_requeues_the_job(tmp_path):
    """USR1 while the data are prepared (the batch shell waits on that srun step) must not
    kill the batch shell, which would end the job without a requeue: it is requeued once the
    step ends, and training does not start. Slurm's commands are stand-ins that log their
    calls; the stand-in srun sends the warning to the batch shell as Slurm would."""
    srun = 'case "$*" in *--prepare-only*) kill -USR1 "$PPID"; sleep 0.3;; *) echo "srun train" >> "$LOG";; esac'
    env, log = stand_in_slurm(tmp_path, srun)
    proc = run_job(env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "preemption warning before training; requeueing job 42" in proc.stdout
    assert log.read_text().splitlines() == ["scontrol requeue 42"]


def test_a_first_argument_naming_a_recipe_runs_that_recipe(tmp_path):
    """recipes/finetune.py unless the first argument names a recipe script; one that does
    not exist stops the job with one line before any step starts."""
    env, log = stand_in_slurm(tmp_path, 'echo "srun ${*//$\'\\n\'/ }" >> "$LOG"')  # one line a call
    for args, recipe in ([[], "recipes/finetune.py"], [["recipes/dpo.py"], "recipes/dpo.py"]):
        log.unlink(missing_ok=True)
        proc = run_job(env, *args, "--config", "c.yaml")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        prepare, train = log.read_text().splitlines()
        assert prepare.endswith(f"python {recipe} --prepare-only --restartable --config c.yaml")
        assert train.endswith(f"{recipe} --restartable --config c.yaml")
    log.unlink()
    proc = run_job(env, "recipes/dpo_typo.py", "--config", "c.yaml")
    assert proc.returncode == 2 and not log.exists()
    assert proc.stderr.startswith("llmtrain: error: recipes/dpo_typo.py: no such recipe script here;")
    assert len(proc.stderr.splitlines()) == 1


# A stand-in srun that logs each call's arguments: \x1f after each, \x1e after the call.
SRUN_ARGS = 'printf "%s\\x1f" "$@" >> "$LOG"; printf "\\x1e" >> "$LOG"'


def recipe_args_of_job(env: dict, log: Path, *args: str) -> list[str]:
    """The recipe's arguments in the training step that job.sh starts, with SRUN_ARGS."""
    log.unlink(missing_ok=True)
    proc = run_job(env, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    train = log.read_text().split("\x1e")[1].split("\x1f")[:-1]
    return train[train.index("recipes/finetune.py") + 1 :]


def test_the_job_keeps_the_checkpoint_to_start_from_wherever_it_is_given(tmp_path):
    """Each start of the job resumes as the recipe reads checkpoint.resume from the config
    file and the command line (auto by default): a checkpoint to start from is kept
    whether the command line, a checkpoint={resume: ...} mapping or the YAML file gives it,
    at the first start, a requeue and under worker restarts alike (run again, such a run
    continues from its own newest: tests/output/test_rundir.py). The template once added
    checkpoint.resume=auto unless the command line named the key, so the job trained from
    scratch."""
    from llmtrain.cli import parse_args
    from llmtrain.methods import METHODS

    finetune = METHODS["finetune"]
    env, log = stand_in_slurm(tmp_path, SRUN_ARGS)
    given = str(tmp_path / "runs/a/checkpoints/step-100")
    base = "model:\n  name_or_path: m\ndata:\n  train: d.jsonl\n"
    plain, in_file = tmp_path / "plain.yaml", tmp_path / "resume.yaml"
    plain.write_text(base)
    in_file.write_text(base + f"checkpoint:\n  resume: {given}\n")
    cases = [
        (["--config", str(plain)], "auto"),
        (["--config", str(plain), f"checkpoint.resume={given}"], given),
        (["--config", str(plain), f"checkpoint={{resume: {given}}}"], given),
        (["--config", str(in_file)], given),
    ]
    for args, resume in cases:
        for extra in ({"SLURM_RESTART_COUNT": "0"}, {"SLURM_RESTART_COUNT": "1", "LLMTRAIN_MAX_RESTARTS": "2"}):
            cfg, _ = parse_args(recipe_args_of_job(env | extra, log, *args), finetune, None)
            assert cfg.checkpoint.resume == resume, args
    with pytest.raises(ConfigError, match="checkpoint.resume: none cannot hold in a job that restarts itself"):
        parse_args(recipe_args_of_job(env, log, "--config", str(plain), "checkpoint.resume=none"), finetune, None)


def test_multi_node_job_matches_a_single_process_run(cluster, args, reference, cache_env, tmp_path):
    out = tmp_path / "out"
    job = submit(cluster, "multi_node.sbatch", args(out), cache_env, tmp_path / "job.log")
    state = cluster.wait(job)
    log = (tmp_path / "job.log").read_text()
    assert state["JobState"] == "COMPLETED", log[-3000:]
    assert "2 node(s), head n1 at 127.0.0.1" in log
    assert "on 2 process(es)" in log
    assert log.replace("\r", "\n").count("tokenizing rows.jsonl: 100%") <= 1  # never once per node
    assert_matches(train_rows(out), reference)
    assert (out / "final" / "model.safetensors").exists()


def test_preempted_job_checkpoints_requeues_and_resumes(cluster, args, reference, cache_env, tmp_path):
    out = tmp_path / "out"
    job = submit(cluster, "multi_node.sbatch", args(out), cache_env, tmp_path / "job.log")
    wait_until(lambda: (out / "metrics.jsonl").exists() and len(train_rows(out)) >= 6)
    # What `#SBATCH --signal=B:USR1@300` does 300 s before the time limit:
    cluster.run("scancel", "--batch", f"--signal={signal.SIGUSR1.name[3:]}", job, check=True)
    state = cluster.wait(job, timeout=300)
    log = (tmp_path / "job.log").read_text()
    assert state["JobState"] == "COMPLETED", log[-3000:]
    assert state["Restarts"] == "1", log[-3000:]
    assert "requeueing job" in log and "stopped on SIGUSR1 after step" in log and "resumed from" in log
    assert_matches(train_rows(out), reference)


def test_killed_rank_restarts_from_the_newest_checkpoint(cluster, args, reference, cache_env, tmp_path):
    import psutil

    from llmtrain.output.checkpoint import complete_checkpoints

    out = tmp_path / "out"
    job = submit(cluster, "multi_node.sbatch", args(out), cache_env, tmp_path / "job.log", LLMTRAIN_MAX_RESTARTS="1")
    wait_until(lambda: any(step >= 4 for step, _ in complete_checkpoints(out)))

    def workers():
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            # a training process: python [-u] recipes/finetune.py ..., started by the launcher
            if f"output_dir={out}" in cmd and "python" in Path(cmd[0]).name and "recipes/finetune.py" in cmd[1:3]:
                yield p

    victim = next(workers())
    victim.send_signal(signal.SIGKILL)
    state = cluster.wait(job, timeout=300)
    log = (tmp_path / "job.log").read_text()
    assert state["JobState"] == "COMPLETED", log[-3000:]
    assert "resumed from" in log, log[-3000:]
    assert_matches(train_rows(out), reference)
    assert json.loads((out / "checkpoints" / "step-20" / "train_state.json").read_text())["step"] == 20

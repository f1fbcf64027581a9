"""Launching the suite's runs and reading what they leave: the recipes' paths, a test run's
arguments (`recipe_args`, over BASE_CONFIG), a recipe launched as users launch it (`launch`,
`run_recipe`, `start_run`; one-process commands go through the fork server,
tests/support/forkserver.py, where the environment allows), stopping a started run
(`kill_tree`, `kill_run`), its metrics and weights (`metrics`, `train_rows`, `final_weights`),
and a run directory made into what a killed or copied run leaves (`rewind`, `copy_run`,
`snapshot`)."""

import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "finetune.py"
DPO_RECIPE = ROOT / "recipes" / "dpo.py"
REWARD_RECIPE = ROOT / "recipes" / "reward.py"


BASE_CONFIG = """\
# Test runs: plain settings, no demo tuning, quiet output.
log: {tracker: none, progress_bar: false}
train: {schedule: constant, lr: 1.0e-3, seed: 7, epochs: 1}
data: {max_seq_len: 256}
"""


class ForkServer:
    """Runs one-process commands through tests/support/forkserver.py, which has imported the
    stack once, when the command's environment is the one it started with (conftest's
    cache_env); see that file for why this is the same run a subprocess would give."""

    def __init__(self):
        self.env, self.proc = None, None

    # Read at run time, so a command may differ from the server's environment in these.
    RUNTIME = {"ACCELERATE_USE_CPU"}

    def serves(self, env: dict) -> bool:
        def imported(e):
            return {k: v for k, v in e.items() if k not in self.RUNTIME}

        on = os.environ.get("LLMTRAIN_TEST_NO_FORK") != "1"
        return on and self.env is not None and imported(env) == imported(self.env)

    def run(self, argv: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "support" / "forkserver.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=self.env,
                cwd=ROOT,
                text=True,
            )
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            request = {"argv": argv, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._answer(60 + 60)["pid"]  # the first request waits for the imports
            answer = self._answer(timeout)
            if answer is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                self._answer(60)
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess([sys.executable, *argv], answer["rc"], out.read_text(), err.read_text())

    def _answer(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                "tests/support/forkserver.py died; run with LLMTRAIN_TEST_NO_FORK=1 to see the command alone"
            )
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc = None


FORKS = ForkServer()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_args(config, model, data, out, *extra: str) -> list[str]:
    """A test run's recipe arguments: its config, model, training data and output directory,
    then `extra` overrides."""
    return ["--config", str(config), f"model.name_or_path={model}", f"data.train={data}", f"output_dir={out}", *extra]


def launch_command(
    args: list[str], topology: str = "cpu_ddp", nproc: int = 2, precision: str = "no", recipe: Path = RECIPE
) -> list[str]:
    """A recipe's command as the docs give it: `python recipes/<r>.py ...` for topology
    "one", else `accelerate launch --config_file accelerate_configs/<topology>.yaml` (a
    shipped config, by name) with this process count and precision."""
    if topology == "one":
        return [sys.executable, str(recipe), *args]
    config = ROOT / "accelerate_configs" / f"{topology}.yaml"
    flags = ["--config_file", str(config), "--num_processes", str(nproc), "--mixed_precision", precision]
    port = ["--main_process_port", str(free_port())]
    return [sys.executable, "-m", "accelerate.commands.launch", *flags, *port, str(recipe), *args]


def launch_env(env: dict, topology: str) -> dict:
    """A launch's environment: DeepSpeed picks its CPU accelerator itself; every other
    multi-process CPU launch needs ACCELERATE_USE_CPU=1 (accelerate's launcher does not
    pass the config's use_cpu on to the processes)."""
    if topology == "one" or topology.startswith("ds_"):
        return {k: v for k, v in env.items() if k != "ACCELERATE_USE_CPU"}
    return dict(env, ACCELERATE_USE_CPU="1")


def run_python(command: list[str], env: dict, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True) for a `python ...` command,
    through the fork server where it serves `env`."""
    assert command[0] == sys.executable
    if FORKS.serves(env):
        return FORKS.run(command[1:], env, cwd, timeout)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def launch(
    args: list[str],
    env: dict,
    topology: str = "cpu_ddp",
    nproc: int = 2,
    precision: str = "no",
    recipe: Path = RECIPE,
    check: bool = True,
    timeout: int = 600,
) -> subprocess.CompletedProcess:
    """Run a recipe (recipes/finetune.py unless told) as a user would, on one process
    (topology "one") or through a shipped accelerate config; returns the CompletedProcess,
    after checking it succeeded unless `check` is false."""
    proc = run_python(launch_command(args, topology, nproc, precision, recipe), launch_env(env, topology), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"recipe failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_recipe(args: list[str], env: dict, nproc: int = 1, **kw) -> subprocess.CompletedProcess:
    """`launch` on one process, or on `nproc` CPU processes under DDP (cpu_ddp.yaml)."""
    return launch(args, env, "one" if nproc == 1 else "cpu_ddp", nproc, **kw)


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines() if line]


def train_rows(output_dir: Path) -> list[dict]:
    return [r for r in metrics(output_dir) if "loss" in r]


def assert_same_weights(got: Path, want: Path, name: str, atol: float = 1e-5) -> None:
    """Two runs' final/ weights alike, up to float rounding (rtol 1e-4 and `atol`)."""
    import torch
    from safetensors.torch import load_file

    mine, theirs = load_file(got / "final" / "model.safetensors"), load_file(want / "final" / "model.safetensors")
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=1e-4, atol=atol, msg=f"{name}: {key}")


def assert_same_rounds(got: Path, want: Path, name: str, same: list[str], weights: bool = True, atol: float = 1e-5):
    """Two GRPO runs trained alike: the same steps; per step the `same` metrics exactly (the
    same completions or episodes, and their rewards) and the same count of the loss's units
    (tokens or completions); loss, clip_ratio and kl within rel 1e-4; and, with `weights`,
    their final weights (assert_same_weights)."""
    import pytest

    rows, ref = train_rows(got), train_rows(want)
    assert [r["step"] for r in rows] == [r["step"] for r in ref], name
    for a, b in zip(rows, ref):
        assert {k: a[k] for k in same} == {k: b[k] for k in same}, (name, a["step"])
        unit = "tokens" if "tokens" in b else "completions"
        assert a[unit] == b[unit], (name, a["step"])
        for key in ("loss", "clip_ratio", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (name, a["step"], key)
    if weights:
        assert_same_weights(got, want, name, atol)


def start_run(args, cache_env, nproc=2, recipe: Path = RECIPE, topology: str = "", **popen) -> subprocess.Popen:
    """Start a recipe in the background as a real process (its own session, output on
    stdout), on one process or `nproc` under DDP, or under the given topology; `popen`
    goes to subprocess.Popen (a preexec_fn, say)."""
    topology = topology or ("one" if nproc == 1 else "cpu_ddp")
    return subprocess.Popen(
        launch_command(args, topology, nproc, recipe=recipe),
        env=launch_env(cache_env, topology),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )


def wait_for(condition, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if condition():
            return True
        time.sleep(0.01)
    return False


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker (torchrun starts workers in sessions of their
    own, so killing the launcher's process group alone would leave them running)."""
    import psutil

    parent = psutil.Process(proc.pid)
    procs = [parent, *parent.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()

    def gone(p) -> bool:  # exited: a zombie has closed its files (and released its locks) too
        try:
            return p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    # SIGKILL is delivered at once but a process takes a moment to exit; until it has, it
    # holds its files, the output_dir lock among them, which the next run would find held.
    deadline = time.time() + 30
    while not all(gone(p) for p in procs) and time.time() < deadline:
        time.sleep(0.01)


def kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL a started run, every rank and the launcher, and wait until it is gone."""
    kill_tree(proc)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    time.sleep(0.5)


def rewind(out: Path, step: int, source: Path | None = None) -> None:
    """Make `out` what a run killed right after checkpoint step-`step` leaves behind (a copy
    of the finished run `source`, if given): final/ and every later checkpoint removed."""
    import shutil

    if source is not None:
        shutil.copytree(source, out)
    shutil.rmtree(out / "final")
    for ckpt in (out / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)


def copy_run(run: tuple[Path, list[str]], to: Path) -> list[str]:
    """Copy a finished run (`finished_run`) to `to`; returns its arguments writing there."""
    import shutil

    source, args = run
    shutil.copytree(source, to)
    return [f"output_dir={to}" if a.startswith("output_dir=") else a for a in args]


def final_weights(directory: Path) -> dict:
    """Every weight a save_pretrained directory holds, from model.safetensors or from the
    shards its model.safetensors.index.json lists (checked to cover them all)."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return load_file(directory / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    weights = {}
    for shard in sorted(set(weight_map.values())):
        weights |= load_file(directory / shard)
    assert weights.keys() == weight_map.keys()
    return weights


def snapshot(out: Path) -> dict:
    """Content hash of every file of a run directory but the lock file."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != ".llmtrain.lock"
    }


def check_card(final: Path, tags: list[str], loads: str) -> dict:
    """final/README.md, the model card: the Hub's front matter with `tags` among its tags, the
    class it `loads` with, the loss curve beside it, and no absolute path anywhere in it.
    Returns the front matter."""
    import re

    import yaml

    text = (final / "README.md").read_text()
    assert text.startswith("---\n"), text[:200]
    meta = yaml.safe_load(text.split("---\n")[1])
    assert set(tags) <= set(meta["tags"]) and meta["tags"][0] == "llmtrain", meta
    assert f"{loads}.from_pretrained(path)" in text, text
    assert not re.search(r"(^|[\s`'\"(=:])/[\w.-]+/", text, re.M), text  # no absolute path
    assert "![loss curve](loss.png)" not in text or (final / "loss.png").is_file()
    assert not (final / "adapter" / "README.md").exists()  # peft's card names the base by its path
    return meta


LLMTRAIN = Path(sys.executable).parent / "llmtrain"  # the installed command


def llmtrain_eval(args: list[str], env: dict, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    """`llmtrain eval *args` as a user runs it: on one process, or under `accelerate launch`
    on `nproc` processes (DDP over gloo)."""
    if nproc == 1:
        proc = run_python([sys.executable, str(LLMTRAIN), "eval", *args], env, 600)
    else:
        command = launch_command(["eval", *args], "cpu_ddp", nproc, recipe=LLMTRAIN)
        proc = run_python(command, launch_env(env, "cpu_ddp"), 600)
    if check and proc.returncode != 0:
        raise AssertionError(f"llmtrain eval failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc

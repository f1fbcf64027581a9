"""eval.lm_eval_tasks during training: lm-eval on each checkpoint a run writes, in a process
of its own, joined to the checkpoint's step when it finishes.

The checkpoint's files are linked (hard links: no copy, and they outlive the checkpoint when
checkpoint.keep_last removes it) into output_dir/evals/step-N/, and

    python -m llmtrain.commands eval evals/step-N --recipe R --lm-eval-only --output evals/step-N.json

runs on them on the main process's machine, as a subprocess: the training's memory and its
numbers are untouched, and training goes on meanwhile. At each step the loop joins the
evaluations that finished: their figures go into metrics.jsonl and the tracker at the step
they measured, as lm_eval/<task>/<metric>, and the linked files are removed. A failed one is
one warning with its log (evals/step-N.log), and training goes on.

The result file records that a step was evaluated. A resumed run joins results that a
killed run never joined, starts again the evaluations it left unfinished (linked files
without a result), and never redoes a finished one. The run waits for the last ones before
it ends.

A sharded run's checkpoints (DeepSpeed, FSDP2) are gathered by `llmtrain eval` on its one
process. A QLoRA run's are not evaluated: the run says at its start to measure final/ with
`llmtrain eval` instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .. import safefs
from ..errors import warn
from ..files import read_own
from ..observe.metrics import METRICS_FILE, read_metrics

EVALS_DIR = "evals"
PREFIX = "lm_eval/"  # the figures' keys in metrics.jsonl: lm_eval/<task>/<metric>
# The settings of a distributed launch that the evaluation, one plain process, must not inherit.
LAUNCH_ENV = re.compile(
    r"(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|MASTER_\w+|TORCHELASTIC_\w+)"
)
LAUNCH_ENV_PREFIXES = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_DEEPSPEED", "FSDP_")


class CheckpointEvals:
    """The lm-eval evaluations of a run's checkpoints (see the module docstring); only the
    main process starts and joins them, and only where eval.lm_eval_tasks are named."""

    def __init__(self, output_dir: str, recipe: str, main: bool):
        self.root = Path(output_dir) / EVALS_DIR
        self.output_dir, self.recipe, self.on = Path(output_dir), recipe, main
        self.log = None
        self.running: dict[int, subprocess.Popen] = {}

    def start(self, log, resumed_at: int | None) -> None:
        """At the run's start: a fresh run drops an earlier run's evaluations; a resumed
        one joins those finished but not yet in metrics.jsonl and starts again the ones left
        unfinished, for steps up to `resumed_at` (later ones belonged to steps set aside)."""
        self.log = log  # observe.metrics.MetricsLog: the rows go with the run's
        if not self.on:
            return
        if resumed_at is None:
            safefs.rmtree(self.root)
            return
        if not self.root.is_dir():
            return
        safefs.check_entry(self.root, directory=True)
        joined = {
            r["step"] for r in read_metrics(self.output_dir / METRICS_FILE) if any(k.startswith(PREFIX) for k in r)
        }
        for path in sorted(self.root.iterdir()):
            found = re.fullmatch(r"step-(\d+)(\.json)?", path.name)
            if found is None or path.is_symlink():
                continue
            step = int(found[1])
            if step > resumed_at:
                continue
            if found[2] and step not in joined:
                self.record(step, resumed_at)
            elif not found[2] and not self.result(step).exists():
                self.run(step)

    def launch(self, step: int, checkpoint: Path) -> None:
        """Evaluate the checkpoint just written for `step`."""
        if not self.on:
            return
        copy = self.root / f"step-{step}"
        safefs.make_dir(self.root)
        safefs.check_entry(self.root, directory=True)
        safefs.fresh_dir(copy)
        for src in sorted(checkpoint.rglob("*")):  # a sharded run's shards are in folders of their own
            dst = copy / src.relative_to(checkpoint)
            if src.is_symlink():
                continue
            if src.is_dir():
                dst.mkdir()
                continue
            try:
                os.link(src, dst)
            except OSError:  # another filesystem, or links refused there: a copy
                with open(src, "rb") as f, safefs.open_write(dst, binary=True) as out:
                    shutil.copyfileobj(f, out)
        safefs.opened(copy)
        self.result(step).unlink(missing_ok=True)  # a step set aside and trained again
        self.run(step)

    def run(self, step: int) -> None:
        copy, result = self.root / f"step-{step}", self.result(step)
        command = [sys.executable, "-m", "llmtrain.commands", "eval", str(copy), "--config", str(copy / "config.yaml")]
        command += ["--recipe", self.recipe, "--lm-eval-only", "--output", str(result)]
        env = {
            k: v for k, v in os.environ.items() if not (LAUNCH_ENV.fullmatch(k) or k.startswith(LAUNCH_ENV_PREFIXES))
        }
        with safefs.open_write(self.root / f"step-{step}.log") as out:
            self.running[step] = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def result(self, step: int) -> Path:
        return self.root / f"step-{step}.json"

    def join(self, now: int, wait: bool = False) -> None:
        """Record the evaluations that finished, at step `now` of the run (with `wait`, all
        of them, once finished, and every row a tracker still waits for)."""
        for step, proc in sorted(self.running.items()):
            if wait and proc.poll() is None:
                print(f"waiting for lm-eval on the checkpoint of step {step}", flush=True)
                proc.wait()
            if proc.poll() is None:
                continue
            del self.running[step]
            if proc.returncode == 0 and self.result(step).is_file():
                self.record(step, now)
            else:
                log = self.root / f"step-{step}.log"
                said = [line for line in read_own(log, 1 << 20).splitlines() if line.startswith("error:")]
                reason = said[-1] if said else f"exit status {proc.returncode}"
                warn(f"eval.lm_eval_tasks: lm-eval on the checkpoint of step {step} failed ({reason}); see {log}")
            safefs.rmtree(self.root / f"step-{step}")
        if self.log is not None:
            self.log.flush_late(now, last=wait)

    def record(self, step: int, now: int) -> None:
        """A finished evaluation's figures, in metrics.jsonl and the tracker at its step
        (wandb: at step `now`, MetricsLog.log_late)."""
        try:
            models = json.loads(read_own(self.result(step), 1 << 24))["models"]
            figures = next(iter(models.values()))
        except (OSError, ValueError, KeyError, TypeError, StopIteration):
            warn(f"eval.lm_eval_tasks: {self.result(step)} cannot be read; the step's lm-eval figures are left out")
            return
        row = {f"{PREFIX}{k}": v for k, v in figures.items() if isinstance(v, (int, float))}
        self.log.log_late({"step": step} | row, now, PREFIX)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in row.items())
        print(f"step {step}: {shown}", flush=True)

    def close(self, now: int) -> None:
        """At the run's end (step `now`): wait for the evaluations still running and join them."""
        if self.on:
            self.join(now, wait=True)

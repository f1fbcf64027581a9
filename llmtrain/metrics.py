"""Run records: metrics.jsonl, the tracker, the loss-curve PNG, and the run description."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import math
import platform
from pathlib import Path

from . import safefs
from .errors import warn

METRICS_FILE = "metrics.jsonl"


def tracker_name(choice: str) -> str | None:
    """The Accelerate `log_with` value for log.tracker ('auto': TensorBoard when installed)."""
    if choice == "auto":
        installed = importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
        return "tensorboard" if installed else None
    return None if choice == "none" else choice


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("llmtrain", "torch", "accelerate", "transformers", "datasets", "peft", "deepspeed"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[pkg] = importlib.metadata.version(pkg)
    return out


def describe_run(cfg, accelerator, resume_from) -> None:
    """config.yaml (every key, defaults included) and run.json (library versions, world
    size, distributed type, mixed precision, the checkpoint resumed from) in output_dir, by
    the main process."""
    from .config import to_yaml

    if not accelerator.is_main_process:
        return
    out = Path(cfg.output_dir)
    safefs.write_text(out / "config.yaml", to_yaml(cfg))
    run = {
        "versions": versions(),
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type.value),
        "mixed_precision": accelerator.mixed_precision,
        "resumed_from": str(resume_from or ""),
    }
    safefs.write_text(out / "run.json", json.dumps(run, indent=2))


class MetricsLog:
    """Appends rows to metrics.jsonl and the tracker, on the main process only.

    On resume, rows after the checkpoint's step are dropped first, so the file reads as
    one uninterrupted run."""

    def __init__(self, accelerator, output_dir: str, resume_step: int | None):
        self.accelerator = accelerator
        self.path = Path(output_dir) / METRICS_FILE
        self.write_failed = False
        if accelerator.is_main_process:
            kept = []
            if resume_step is not None and self.path.exists():
                kept = [line for line in self.path.read_text().splitlines() if _step(line) <= resume_step]
            safefs.write_text(self.path, "".join(line + "\n" for line in kept))

    def log(self, row: dict) -> None:
        if self.accelerator.is_main_process:
            try:
                with safefs.open_write(self.path, append=True) as f:
                    f.write(json.dumps(row) + "\n")
            except OSError as e:  # a full disk: training goes on to its next checkpoint, which says so
                if not self.write_failed:
                    warn(f"{self.path}: cannot write ({e.strerror}); training goes on, rows are lost until it can")
                self.write_failed = True
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        self.accelerator.log(scalars, step=row["step"])


def _step(line: str) -> float:
    """A row's step; a line cut short by a kill mid-write (or empty) counts as past any
    step, so a resume drops it."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_losses(metrics_path: str | Path, png_path: str | Path) -> bool:
    """Train and eval loss against step; returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over trained tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with safefs.open_write(png_path, binary=True) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return True

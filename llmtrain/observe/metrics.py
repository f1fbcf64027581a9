"""Run records: metrics.jsonl, the tracker, the loss-curve PNG, and the run description."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import math
import platform
from pathlib import Path

from .. import safefs
from ..config import to_yaml
from ..errors import CheckpointError, warn

METRICS_FILE = "metrics.jsonl"


def tracker_name(choice: str) -> str | None:
    """The Accelerate `log_with` value for log.tracker ('auto': TensorBoard when installed)."""
    if choice == "auto":
        installed = importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
        return "tensorboard" if installed else None
    return None if choice == "none" else choice


def tracker_kwargs(cfg) -> dict:
    """What each tracker is started with beyond the project name (Accelerate's
    `init_trackers(init_kwargs=...)`): the run named after output_dir, wandb's files under
    output_dir/logs (TensorBoard's are there by Accelerate's logging_dir; trackio keeps its
    own local database, where `trackio show` finds every run)."""
    name = Path(cfg.output_dir).name
    logs = Path(cfg.output_dir) / "logs"
    return {"trackio": {"name": name}, "wandb": {"name": name, "dir": str(logs)}}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("llmtrain", "torch", "accelerate", "transformers", "datasets", "peft", "deepspeed"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[pkg] = importlib.metadata.version(pkg)
    return out


def describe_run(cfg, accelerator, resume_from, identity: dict | None = None, started_from: str = "") -> None:
    """config.yaml (every key, defaults included) and run.json (library versions, world
    size, distributed type, mixed precision, the checkpoint resumed from and the one a
    checkpoint.resume=<path> run started from, the recipe, its training files' content
    hashes and the other files it reads, `rundir.identity`) in output_dir, by the main
    process."""
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
        "started_from": started_from,
        **(identity or {}),
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
        self.axes: set[str] = set()  # the prefixes of late rows wandb was given an axis for
        self.late: list[dict] = []  # late rows waiting for a wandb step of their own (log_late)
        self.late_at = -1  # the step the last of them went to
        error = None
        if accelerator.is_main_process:
            kept, unread = [], []
            if resume_step is not None and self.path.exists():
                lines = list(_lines(self.path))
                for number, line in enumerate(lines, 1):
                    step = _step(line)
                    if step is None and line.strip():
                        unread.append(number)
                    elif step is not None and step <= resume_step:
                        kept.append(line)
            if unread[:-1] or (unread and unread[-1] != len(lines)):  # more than a last line cut short by a kill
                warn(
                    f"{self.path}: {len(unread)} line(s) are not a metrics row (a JSON object with a numeric step; "
                    f"first at line {unread[0]}), dropped on resume"
                )
            safefs.check_entry(self.path, directory=False)  # a link planted there is refused, not replaced
            try:  # replaced whole: a failed write or a kill keeps the rows it held
                safefs.replace_text(self.path, "".join(line + "\n" for line in kept))
            except OSError as e:
                error = e.strerror or str(e)
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            error = broadcast_object_list([error])[0]  # every process stops alike
        if error:
            raise CheckpointError(
                f"output_dir: cannot write {self.path} ({error}); the rows it held are kept. Free space in "
                f"{output_dir} (or fix its permissions) and run the same command again"
            )

    def log(self, row: dict) -> None:
        if self.accelerator.is_main_process:
            self.write(row)
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        self.accelerator.log(scalars, step=row["step"])

    def write(self, row: dict) -> None:
        """`row` appended to metrics.jsonl (main process)."""
        try:
            with safefs.open_write(self.path, append=True) as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:  # a full disk: training goes on to its next checkpoint, which says so
            if not self.write_failed:
                warn(f"{self.path}: cannot write ({e.strerror}); training goes on, rows are lost until it can")
            self.write_failed = True

    def log_late(self, row: dict, now: int, prefix: str) -> None:
        """A row of an earlier step (row["step"]; its keys start with `prefix`) known only at
        step `now` (lm-eval on a checkpoint, joined when it finished), on the main process:
        metrics.jsonl and the trackers get it at its own step. Weights & Biases keeps one
        history row per step and drops a step earlier than its last: it gets the row later,
        with its step as `<prefix>step` (the axis it is told to plot those keys on), at a
        step of the run that no other late row took (`flush_late`)."""
        if not self.accelerator.is_main_process:
            return
        self.write(row)
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        for tracker in self.accelerator.trackers:
            if tracker.name != "wandb":
                tracker.log(scalars, step=row["step"])
                continue
            if prefix not in self.axes:
                tracker.tracker.define_metric(f"{prefix}*", step_metric=f"{prefix}step")
                self.axes.add(prefix)
            self.late.append(scalars | {f"{prefix}step": row["step"]})
        self.flush_late(now)

    def flush_late(self, now: int, last: bool = False) -> None:
        """wandb's late rows: one at step `now` if no late row went there yet (the run's own
        row of `now` is already logged: they share its history row, with keys of their own);
        with `last` (nothing is logged after), all that wait, at `now` and the steps after."""
        wandb = next((t for t in self.accelerator.trackers if t.name == "wandb"), None)
        while self.late and wandb is not None and (now > self.late_at or last):
            self.late_at = max(now, self.late_at + 1)
            wandb.log(self.late.pop(0), step=self.late_at)
            if not last:
                break


MAX_ROW_BYTES = 1 << 20  # a row llmtrain writes has a few hundred bytes


def _lines(path: Path):
    """The lines of metrics.jsonl, each read with a limit: a longer one (not a row
    llmtrain wrote: the file was edited or replaced) is not read whole into memory but
    comes back as a line that is not a row."""
    with open(path, "rb") as f:
        while data := f.readline(MAX_ROW_BYTES + 1):
            if len(data) > MAX_ROW_BYTES:
                while not data.endswith(b"\n") and (data := f.readline(MAX_ROW_BYTES + 1)):
                    pass
                yield "(a line longer than MAX_ROW_BYTES)"
                continue
            yield data.decode("utf-8", errors="replace").rstrip("\n")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _row(line: str) -> dict | None:
    """The line as a metrics row: a JSON object with a numeric step; else None (a line cut
    short by a kill mid-write, or one edited by hand)."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return row if isinstance(row, dict) and _number(row.get("step")) else None


def _step(line: str) -> float | None:
    """A row's step, or None for a line that is not a row (a resume drops it)."""
    row = _row(line)
    return None if row is None else row["step"]


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl, leaving out lines that are not rows."""
    rows = (_row(line) for line in _lines(Path(path)))
    return [row for row in rows if row is not None]


def plot_losses(metrics_path: str | Path, png_path: str | Path) -> bool:
    """Train and eval loss against step; returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = read_metrics(metrics_path)
    # A value that is not a number (a line edited by hand) is left out of the curve.
    train = [(r["step"], r["loss"]) for r in rows if _number(r.get("loss"))]
    evals = [(r["step"], r["eval_loss"]) for r in rows if _number(r.get("eval_loss"))]
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

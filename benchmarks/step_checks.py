"""What each part of an llmtrain SFT step costs, timed inside a real run: the checks and
bookkeeping around the forward and backward passes (window agreement, loss reduce,
gradient norm, spike guard, the non-finite weights check, the metrics row) against the
step as a whole, on one process and on two (DDP over gloo, CPU).

    python benchmarks/step_checks.py             # about 2 minutes on 2 CPU cores

The workload is benchmarks/sft_step_time.py's (a 6-layer, 384-wide Llama, 8 padded rows a
step, float32). Each part is timed with perf_counter around the function that does it
(CPU work is synchronous, so the time is the work's); steps 1-2 are left out as warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import harness
import sft_step_time
import sft_vs_trl

STEPS, WARMUP = 22, 2
BACKEND = "llmtrain.distributed.backend"
# (label, module, attribute path) of what is timed. train_step, draw_window and report make
# up the loop's step (OUTER); the parts of train_step (INNER) are subtracted from it to give
# the forward and backward passes' time.
PARTS = [
    ("train_step", "llmtrain.train", "run_step"),
    ("drawing the window: batches + agreement (draw_window)", "llmtrain.train", "draw_window"),
    ("  window agreement: one all-gather (Report.exchange)", "llmtrain.core.window", "Report.exchange"),
    ("optimizer step, fused AdamW (Backend.optimizer_step)", BACKEND, "Backend.optimizer_step"),
    ("gradient norm and clipping (Backend.clip_grad_norm)", BACKEND, "Backend.clip_grad_norm"),
    ("loss and metrics reduce (Backend.sum_over_processes)", BACKEND, "Backend.sum_over_processes"),
    ("spike guard (SpikeGuard.is_spike)", "llmtrain.core.spike", "SpikeGuard.is_spike"),
    ("non-finite weights after the update (Backend.nonfinite_weights)", BACKEND, "Backend.nonfinite_weights"),
    ("metrics row, progress bar, throughput (report)", "llmtrain.train", "report"),
    ("watchdog heartbeats (Watchdog.beat)", "llmtrain.distributed.watchdog", "Watchdog.beat"),
]
OUTER = ("run_step", "draw_window", "report")
INNER = ("Backend.optimizer_step", "Backend.clip_grad_norm", "Backend.sum_over_processes", "SpikeGuard.is_spike",
         "Backend.nonfinite_weights")  # fmt: skip


def timed_run(argv: list[str], out: Path) -> None:
    """In a launched process: run finetune.py with PARTS wrapped in timers; rank 0 writes
    the seconds per part over the steps after the warm-up to `out`."""
    import importlib

    sys.path.insert(0, str(harness.ROOT / "recipes"))
    import finetune

    seconds: dict[str, float] = defaultdict(float)
    steps = [0]

    def wrap(owner, name, label):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if steps[0] >= WARMUP:
                    seconds[label] += time.perf_counter() - started
                if name == "run_step":
                    steps[0] += 1

        setattr(owner, name, timed)

    for label, module, path in PARTS:
        owner = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        wrap(owner, name, label)
    finetune.main(argv)
    if os.environ.get("RANK", "0") == "0":
        out.write_text(json.dumps({"steps": steps[0] - WARMUP, "seconds": seconds}))


def main() -> None:
    if sys.argv[1:2] == ["--inner"]:
        timed_run(sys.argv[3:], Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=harness.ROOT / "runs" / "bench-checks")
    parser.add_argument("--results", type=Path, default=harness.HERE / "RESULTS.md")
    parser.add_argument("--ours", nargs="*", default=[], metavar="key=value", help="overrides for llmtrain")
    args = parser.parse_args()
    root = args.dir
    root.mkdir(parents=True, exist_ok=True)
    sft_vs_trl.WORKLOADS["step"] = sft_step_time.WORKLOAD
    setup = sft_vs_trl.prepare("step", root)
    results = {}
    for processes in (1, 2):
        out = root / f"run-{processes}"
        shutil.rmtree(out, ignore_errors=True)
        # One process as `python recipes/finetune.py` runs (accelerate launch would set one thread).
        launch = [sys.executable]
        if processes > 1:
            launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--multi_gpu"]
        cmd = [*launch, __file__, "--inner", str(root / f"times-{processes}.json")]
        # sft_step_time's run, its 8 rows a step split over the processes
        per_process = dict(setup, micro=setup["micro"] // processes)
        cmd += sft_step_time.ours_args(per_process, STEPS, (f"output_dir={out}", *args.ours))
        env = dict(os.environ, ACCELERATE_USE_CPU="1", ACCELERATE_MIXED_PRECISION="no")
        subprocess.run(cmd, check=True, env=env, capture_output=True, cwd=harness.ROOT)
        results[processes] = json.loads((root / f"times-{processes}.json").read_text())
        print(f"{processes} process(es) done", flush=True)
    report(args, results)


def report(args, results: dict) -> None:
    lines = [
        harness.heading("Per-step cost of each check, SFT"),
        "",
        f"`python benchmarks/step_checks.py{' --ours ' + ' '.join(args.ours) if args.ours else ''}`; "
        "benchmarks/sft_step_time.py's workload (6 layers x 384, float32, 8 "
        f"padded rows a step: 8 x 1 on one process, 4 x 1 on each of two), steps {WARMUP + 1}-{STEPS}, mean ms a "
        "step; timed in the run around each function.",
        "",
        "| part of the step | 1 process | share | 2 processes (DDP, gloo) | share |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    outer = [label for label, _, path in PARTS if path in OUTER]
    inner = [label for label, _, path in PARTS if path in INNER]
    for r in results.values():
        t = r["seconds"]
        t["the whole step"] = sum(t[label] for label in outer)
        t["forward and backward passes (the rest of train_step)"] = t["train_step"] - sum(t[label] for label in inner)
    rows = ["the whole step", "forward and backward passes (the rest of train_step)"]
    rows += [label for label, _, path in PARTS if path != "run_step"]
    for label in rows:
        cells = []
        for r in results.values():
            seconds = r["seconds"].get(label, 0.0)
            cells += [f"{seconds / r['steps'] * 1000:.2f}", f"{seconds / r['seconds']['the whole step']:.2%}"]
        lines.append(f"| {label.strip()} | {' | '.join(cells)} |")
    harness.publish(lines, args.results)


if __name__ == "__main__":
    main()

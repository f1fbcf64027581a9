"""Step time of a demo on CPU cores that other processes share, and without added load:
llmtrain's default (OpenMP's idle threads spin briefly, then sleep: GOMP_SPINCOUNT=3000,
set by `import llmtrain`) against libgomp's own default (each waiting thread spins about
3 ms first), against sleeping at once (OMP_WAIT_POLICY=PASSIVE), and with one thread a
process.

The measured run is `python recipes/finetune.py` (the SFT demo: a 4-layer Llama, packed
256-token sequences, 8 a step; `--recipe grpo`: the GRPO demo, generation included), one
process, every core's thread (torch's default). Its environment, OMP_NUM_THREADS,
OMP_WAIT_POLICY and GOMP_SPINCOUNT removed first, then:
  libgomp's default  GOMP_SPINCOUNT=300000, what libgomp does with neither variable set
                     (llmtrain then leaves the spin alone): the behaviour before llmtrain set it
  short spin         nothing: llmtrain's default
  passive            OMP_WAIT_POLICY=PASSIVE
  1 thread           OMP_NUM_THREADS=1
The load is another process multiplying 512 x 512 matrices in a loop with torch's default
threads and libgomp's default wait, as a neighbour's program would (--loads N: N of them).
For each repeat, each condition (no added load, then beside the load) runs the variants in
turn, so that a drift in the machine's load reaches every variant alike. A run's figure is
the median `step_s` of its metrics.jsonl, the first two steps left out (warm-up); a
variant's is the median of its repeats. The first three variants must train the same
losses: how idle threads wait changes no number (checked; the 1-thread run's kernels may sum
in another order).

    python benchmarks/cpu_load.py --loads 2         # about 8 minutes on 2 cores
    python benchmarks/cpu_load.py --recipe grpo --steps 5

Run it on a machine nobody else uses for the "no added load" column to be an idle machine's
(niceness does not help on a shared one: it orders processes only within one cgroup, and
other Slurm jobs, containers or virtual machines on the same cores are outside it). The
demo's files are built by a first, unmeasured run into LLMTRAIN_CACHE (or ~/.cache/llmtrain;
the GRPO demo's SFT model takes a few minutes). Results are appended to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness

VARIANTS = {
    "libgomp's default (3 ms spin)": {"GOMP_SPINCOUNT": "300000"},
    "short spin (llmtrain's default)": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}
THREAD_KEYS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")
LOAD = """
import torch
a = torch.randn(512, 512)
while True:
    a = torch.tanh(a @ a)
"""
WARMUP = 2  # steps left out of a run's figure


def base_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in THREAD_KEYS}


def demo_run(recipe: str, out: Path, steps: int, env: dict) -> tuple[list[float], list[float]]:
    """One demo run of `recipe` for `steps` steps in a fresh process: each step's time and loss."""
    shutil.rmtree(out, ignore_errors=True)  # a finished run there would be taken as this one
    command = [
        sys.executable,
        str(harness.ROOT / "recipes" / f"{recipe}.py"),
        f"output_dir={out}",
        f"train.max_steps={steps}",
        "train.warmup_steps=0",
        "eval.every_steps=0",
        "eval.sample_prompts=[]",
        "checkpoint.every_steps=0",
        "log.every_steps=1",
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=harness.ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    rows = [r for r in rows if "loss" in r]
    assert len(rows) == steps, f"{len(rows)} steps logged, not {steps}"
    return [r["step_s"] for r in rows], [r["loss"] for r in rows]


def start_load() -> subprocess.Popen:
    load = subprocess.Popen([sys.executable, "-c", LOAD], env=base_env())
    time.sleep(2)  # torch imported, the loop running
    return load


CONDITIONS = {"alone": "no added load", "loaded": "beside the load"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", choices=("finetune", "grpo"), default="finetune", help="whose demo runs")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="steps a run (the first two are left out)")
    p.add_argument("--conditions", nargs="+", choices=sorted(CONDITIONS), default=list(CONDITIONS))
    p.add_argument("--loads", type=int, default=1, help="load processes beside the measured run")
    p.add_argument("--dir", type=Path, default=harness.ROOT / "runs" / "bench-cpu-load")
    p.add_argument("--results", type=Path, default=harness.HERE / "RESULTS.md")
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    demo_run(args.recipe, args.dir / "build", 1, base_env())  # builds the demo's files and data cache, unmeasured
    conditions = [c for c in CONDITIONS if c in args.conditions]
    seconds: dict[tuple[str, str], list[float]] = {(v, c): [] for v in VARIANTS for c in conditions}
    losses: dict[tuple[str, str], list[list[float]]] = {key: [] for key in seconds}
    averages: list[str] = []
    for repeat in range(args.repeats):
        for condition in conditions:
            loads_running = [start_load() for _ in range(args.loads)] if condition == "loaded" else []
            try:
                averages.append(f"{os.getloadavg()[0]:.1f}")
                for name, extra in VARIANTS.items():
                    out = args.dir / "run"
                    times, run_losses = demo_run(args.recipe, out, args.steps, base_env() | extra)
                    seconds[name, condition].append(statistics.median(times[WARMUP:]))
                    losses[name, condition].append(run_losses)
                    print(f"repeat {repeat + 1}, {condition}, {name}: {seconds[name, condition][-1]:.3f} s a step")
            finally:
                for load in loads_running:
                    load.kill()
                    load.wait()
    *waits, one = VARIANTS
    first = losses[waits[0], conditions[0]][0]
    if any(run != first for v in waits for c in conditions for run in losses[v, c]):
        raise AssertionError("runs that differ only in how idle threads wait trained different losses")
    one_same = all(run == first for c in conditions for run in losses[one, c])

    def cell(name: str, condition: str) -> str:
        runs = seconds[name, condition]
        return f"{statistics.median(runs):.3f} ({', '.join(f'{s:.2f}' for s in runs)})"

    flags = f" --conditions {' '.join(conditions)}" if conditions != list(CONDITIONS) else ""
    flags += f" --loads {args.loads}" if args.loads != 1 and "loaded" in conditions else ""
    args.loads = args.loads if "loaded" in conditions else 0
    lines = [
        harness.heading(f"{'SFT' if args.recipe == 'finetune' else 'GRPO'} demo step time, cores shared"),
        "",
        f"`python benchmarks/cpu_load.py --recipe {args.recipe} --repeats {args.repeats} --steps {args.steps}"
        f"{flags}`; one process, every core's thread; median s a "
        f"step of steps {WARMUP + 1}-{args.steps}, then each repeat's"
        + (f"; the load: {args.loads} other process(es) multiplying matrices on every core" if args.loads else "")
        + f". The 1-minute load average as each block began: {', '.join(averages)} "
        f"({', '.join(conditions)}, ...). The first three rows' runs trained the same losses; the 1-thread runs "
        f"{'the same' if one_same else 'other'} losses.",
        "",
        f"| OpenMP threads | {' | '.join(f'{CONDITIONS[c]}: s a step' for c in conditions)} |",
        f"| --- |{' ---: |' * len(conditions)}",
        *(f"| {name} | {' | '.join(cell(name, c) for c in conditions)} |" for name in VARIANTS),
    ]
    harness.publish(lines, args.results)


if __name__ == "__main__":
    main()

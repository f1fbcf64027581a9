"""What the side-by-side benchmarks (sft_vs_trl.py, dpo_vs_trl.py) share: the model both
systems train, the timer of TRL's steps, a peer run in a process of its own, and the
results file. The scripts import it from their own folder (python puts a script's folder
first on sys.path)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS = ("trl-default", "trl-best")
# Settings every TRL run here shares: no tracker, no checkpoints, no progress bar, the same
# seed, and batches made in the training process (as llmtrain's data.num_workers=0).
TRL_RUN = dict(report_to=[], save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True)


def save_llama(w: dict, tokenizer, path: Path) -> None:
    """A randomly initialized Llama of workload `w`'s shape (same weights every time), saved
    with `tokenizer` where both systems load it with from_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=w["vocab"] or len(tokenizer),
        hidden_size=w["hidden"],
        intermediate_size=w["ffn"],
        num_hidden_layers=w["layers"],
        num_attention_heads=w["heads"],
        num_key_value_heads=w["kv"],
        max_position_embeddings=max(2048, w["seq"]),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def sync() -> None:
    """Wait for the GPU's queued work, so that a timer measures it (a no-op on CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_timer():
    """A TrainerCallback adding up the time of the optimizer steps (in `.seconds`; each
    step's in `.steps`)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps = []

        @property
        def seconds(self) -> float:
            return sum(self.steps)

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.steps.append(time.perf_counter() - self.start)

    return StepTimer()


def peak_memory_gib() -> float:
    """Peak GPU memory allocated, or on CPU the process's peak resident set."""
    import resource

    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def parser(doc: str, workloads: dict, default_dir: Path) -> argparse.ArgumentParser:
    """The options both scripts take; --worker/--setup run one peer (see `run_peer`)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--workload", choices=sorted(workloads), default="cpu")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rows", type=int, help="train on this many rows (pairs for DPO) instead of the workload's")
    p.add_argument("--dir", type=Path, default=default_dir)
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--ours", nargs="*", default=[], metavar="key=value", help="overrides for llmtrain's side")
    p.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    p.add_argument("--setup", help=argparse.SUPPRESS)
    return p


SYSTEMS = ("llmtrain", *PEERS)


def systems_option(options: argparse.ArgumentParser) -> None:
    """--systems, for the benchmarks that run some of SYSTEMS only."""
    options.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="which systems to run")


def systems_flag(args) -> str:
    """The --systems part of the command line that reproduces a run, where it ran some only."""
    return f" --systems {' '.join(args.systems)}" if list(args.systems) != list(SYSTEMS) else ""


def run_ours(recipe: str, setup: dict, out: Path, args: list[str]) -> tuple[list[dict], str]:
    """One llmtrain run of `recipe` with `args` (--config first) in a fresh process, writing
    to `out`: its training rows of metrics.jsonl, and what it printed. `out` is emptied
    first: llmtrain would take a finished run there for this one and train nothing."""
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, ACCELERATE_MIXED_PRECISION=setup["precision"])
    cmd = [sys.executable, str(ROOT / "recipes" / recipe), *args, f"output_dir={out}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in rows if "loss" in r], proc.stdout + proc.stderr


def run_peer(script: str, name: str, setup: dict, out: Path, env: dict | None = None) -> dict:
    """One peer run (`script --worker name`) in a fresh process; the dict it printed."""
    proc = subprocess.run(
        [sys.executable, script, "--worker", name, "--setup", json.dumps(setup), "--dir", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT ") :])


def rl_progress(r: dict) -> str:
    """A run's line as the RL benchmarks print it, whose runs report step_s and held_out."""
    return f"{r['step_s']:.2f} s/step, held-out {r['held_out']:.3f}"


def run_systems(
    script: str, args, root: Path, setup: dict, systems: list[str], ours, progress=rl_progress
) -> dict[str, list[dict]]:
    """Each of `systems` run `args.repeats` times, in the order A B C A B C, each run in a
    fresh process and an empty `root/<system>-<repeat>`: llmtrain through `ours(setup, out,
    overrides)`, a peer through `script --worker`; each run's line is `progress(result)`.
    For the benchmarks whose runs report step_s (the RL ones, vision_vs_trl.py)."""
    results: dict[str, list[dict]] = {name: [] for name in systems}
    for repeat in range(args.repeats):
        for name in results:
            out = root / f"{name}-{repeat}"
            shutil.rmtree(out, ignore_errors=True)
            if name == "llmtrain":
                r = ours(setup, out, args.ours)
            else:
                env = dict(os.environ, HF_DATASETS_CACHE=str(out / "datasets-cache"))
                r = run_peer(script, name, setup, out, env)
            print(f"{name} run {repeat + 1}: {progress(r)}", flush=True)
            results[name].append(r)
    return results


def rl_benchmark(script: str, doc: str, workloads: dict, name: str, sized_by: str, prepare, before, ours, peer, report):
    """The main() of the RL benchmarks (grpo_vs_trl.py, agents_vs_trl.py, distill_vs_trl.py):
    as a --worker, one peer's run (`peer(setup, out, best)`); otherwise the workload prepared
    in runs/bench-<name>/<workload> (`prepare(workload, root)` -> setup), the held-out figure
    before training (`before(setup)`), every system's runs (run_systems) and
    `report(args, setup, before, results)`. `sized_by` says what sizes the workload, in the
    line refusing --rows."""
    options = parser(doc, workloads, ROOT / "runs" / f"bench-{name}")
    systems_option(options)
    args = options.parse_args()
    if args.rows:
        options.error(f"--rows: the {sized_by}; leave --rows out")
    if args.worker:  # one TRL run, in its own process
        worker_result(peer(json.loads(args.setup), args.dir, args.worker == "trl-best"))
        return
    root = args.dir / args.workload
    root.mkdir(parents=True, exist_ok=True)
    setup = prepare(args.workload, root)
    held = before(setup)
    results = run_systems(script, args, root, setup, [n for n in SYSTEMS if n in args.systems], ours)
    report(args, setup, held, results)


def rl_rows(results: dict[str, list[dict]], digits: int):
    """For each system: (its name, its fastest repeat, the least disturbed; every repeat's
    held-out figure to `digits` places; the fastest repeat's step time over llmtrain's)."""
    ours = min(results["llmtrain"], key=lambda r: r["step_s"]) if "llmtrain" in results else None
    for name, runs in results.items():
        r = min(runs, key=lambda x: x["step_s"])
        held = ", ".join(f"{x['held_out']:.{digits}f}" for x in runs)
        yield name, r, held, f"{r['step_s'] / ours['step_s']:.2f}x" if ours else "n/a"


def worker_result(result: dict) -> None:
    """What a --worker process prints for `run_peer`."""
    print("RESULT " + json.dumps(result))


def heading(title: str) -> str:
    import torch

    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"
    )
    return f"### {title}: {time.strftime('%Y-%m-%d')}, {device}"


def command(script: str, args, extra: str = "") -> str:
    """The command line that reproduces these results."""
    ours = f" --ours {' '.join(args.ours)}" if args.ours else ""
    rows = f" --rows {args.rows}" if getattr(args, "rows", None) else ""
    return f"`python benchmarks/{script} --workload {args.workload} --repeats {args.repeats}{rows}{ours}{extra}`"


def publish(lines: list[str], results: Path) -> None:
    """Print the results table and append it to `results`."""
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    with open(results, "a") as f:
        f.write("\n" + text)

"""Per-step cost on equal padded work: llmtrain's recipes/finetune.py against TRL's SFTTrainer,
one process, no packing, 8 rows a step, the same rows and model (a 6-layer, 384-wide Llama).
A step's time is the difference between a 22-step and a 2-step run's wall time, divided by
20, so every per-step cost counts (the checks after each update, metrics, logging), and
start-up does not.

    python benchmarks/sft_step_time.py            # about 4 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import harness
import sft_vs_trl

WORKLOAD = dict(hidden=384, layers=6, heads=6, kv=2, ffn=1024, vocab=None, seq=512, rows=600, micro=8, precision="no")
SHORT, LONG = 2, 22


def ours(setup: dict, out: Path, steps: int) -> float:
    cmd = [
        sys.executable,
        str(harness.ROOT / "recipes" / "finetune.py"),
        "--config",
        str(harness.HERE / "llmtrain_bench.yaml"),
        f"model.name_or_path={setup['model']}",
        f"data.train={setup['data']}",
        f"data.max_seq_len={setup['seq']}",
        "data.packing=false",
        f"train.micro_batch_size={setup['micro']}",
        f"train.max_steps={steps}",
        "checkpoint.every_steps=0",
        "eval.sample_prompts=[]",
        f"output_dir={out}",
    ]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=harness.ROOT)
    return time.perf_counter() - started


def trl(setup: dict, out: Path, steps: int) -> float:
    cmd = [sys.executable, __file__, "--worker", str(steps), "--setup", json.dumps(setup), "--dir", str(out)]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=harness.ROOT)
    return time.perf_counter() - started


def run_trl(setup: dict, out: Path, steps: int) -> None:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    data = datasets.load_dataset("json", data_files=setup["data"], split="train")
    config = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=setup["micro"],
        max_steps=steps,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        max_length=setup["seq"],
        assistant_only_loss=True,
        packing=False,
        bf16=False,  # TRL's configs turn bf16 on by default; both systems train in float32 here
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer).train()


def main() -> None:
    if "--worker" in sys.argv:
        steps = int(sys.argv[sys.argv.index("--worker") + 1])
        setup, out = json.loads(sys.argv[sys.argv.index("--setup") + 1]), Path(sys.argv[sys.argv.index("--dir") + 1])
        run_trl(setup, out, steps)
        return
    root = harness.ROOT / "runs" / "bench-step"
    root.mkdir(parents=True, exist_ok=True)
    sft_vs_trl.WORKLOADS["step"] = WORKLOAD
    setup = sft_vs_trl.prepare("step", root)
    per_step: dict[str, list[float]] = {"llmtrain": [], "trl": []}
    for repeat in range(2):
        for name, run in (("llmtrain", ours), ("trl", trl)):
            short, long = run(setup, root / f"{name}-short", SHORT), run(setup, root / f"{name}-long", LONG)
            per_step[name].append((long - short) / (LONG - SHORT))
            print(f"{name} run {repeat + 1}: {per_step[name][-1] * 1000:.0f} ms a step", flush=True)
    import trl as trl_module

    ms = {name: [f"{x * 1000:.0f}" for x in runs] for name, runs in per_step.items()}
    best = {name: min(runs) for name, runs in per_step.items()}
    lines = [
        harness.heading("SFT step time, equal padded work"),
        "",
        f"`python benchmarks/sft_step_time.py`; {WORKLOAD['layers']} layers x {WORKLOAD['hidden']} wide, 8 rows a "
        f"step padded to the longest, one process, float32; ({LONG}-step run - {SHORT}-step run) / {LONG - SHORT}, "
        f"wall time; TRL {trl_module.__version__}.",
        "",
        "| system | ms a step (each repeat) | best | TRL / llmtrain |",
        "| --- | ---: | ---: | ---: |",
        f"| llmtrain | {', '.join(ms['llmtrain'])} | {best['llmtrain'] * 1000:.0f} "
        f"| {best['trl'] / best['llmtrain']:.2f}x |",
        f"| TRL SFTTrainer | {', '.join(ms['trl'])} | {best['trl'] * 1000:.0f} | 1.00x |",
    ]
    harness.publish(lines, harness.HERE / "RESULTS.md")


if __name__ == "__main__":
    main()

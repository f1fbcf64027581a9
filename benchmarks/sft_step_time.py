"""Per-step cost on equal padded work: llmtrain's recipes/finetune.py against TRL's SFTTrainer,
one process, no packing, 8 rows a step padded to the longest, float32, the same model (a
6-layer, 384-wide Llama) and the same rows in the same order (both read the file in order,
unshuffled, so every step of one system pads the same 8 rows as the other's). Both train
without gradient checkpointing (TRL's SFTConfig turns it on by default; llmtrain's is off).
A step's time is the difference between a 22-step and a 2-step run's wall time, divided by
20, so every per-step cost counts (the checks after each update, metrics, logging), and
start-up does not.

With --compile both compile their model: llmtrain each transformer block (train.compile=true),
TRL the whole model (TrainingArguments.torch_compile=True). Every run then gets an empty
compile cache of its own, so the 22-step run does not reuse what the 2-step run compiled: the
compiles of the first steps fall in both runs and cancel, and any later recompile (a padded
width the compiled graphs do not cover) counts as a per-step cost.

    python benchmarks/sft_step_time.py            # about 5 minutes on 2 CPU cores
    python benchmarks/sft_step_time.py --compile  # both compiled
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import harness
import sft_vs_trl

WORKLOAD = dict(hidden=384, layers=6, heads=6, kv=2, ffn=1024, vocab=None, seq=512, rows=600, micro=8, precision="no")
SHORT, LONG = 2, 22


def ours_args(setup: dict, steps: int, overrides: tuple[str, ...] = ()) -> list[str]:
    """llmtrain's side: the same work as TRL's `trl_config` (then `overrides`, from --ours)."""
    return [
        "--config",
        str(harness.HERE / "llmtrain_bench.yaml"),
        f"model.name_or_path={setup['model']}",
        f"data.train={setup['data']}",
        f"data.max_seq_len={setup['seq']}",
        "data.packing=false",
        "data.shuffle=false",
        f"train.micro_batch_size={setup['micro']}",
        f"train.max_steps={steps}",
        "checkpoint.every_steps=0",
        "eval.sample_prompts=[]",
        f"train.compile={str(setup.get('compile', False)).lower()}",
        *overrides,
    ]


def ours(setup: dict, out: Path, steps: int) -> float:
    started = time.perf_counter()
    rows, _ = harness.run_ours("finetune.py", setup, out, ours_args(setup, steps, setup["overrides"]))
    seconds = time.perf_counter() - started
    assert len(rows) == steps, f"llmtrain logged {len(rows)} steps, not {steps}"
    return seconds


def trl(setup: dict, out: Path, steps: int) -> float:
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    harness.run_peer(__file__, "trl-best", dict(setup, steps=steps), out)
    return time.perf_counter() - started


def trl_config(setup: dict, out: Path):
    """TRL's SFTConfig for the same work as llmtrain's run in `ours`."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=setup["micro"],
        max_steps=setup["steps"],
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        max_length=setup["seq"],
        assistant_only_loss=True,
        packing=False,
        bf16=False,  # TRL's configs turn bf16 on by default; both systems train in float32 here
        gradient_checkpointing=False,  # SFTConfig's default is on; llmtrain's is off
        train_sampling_strategy="sequential",  # the rows in file order, as llmtrain's data.shuffle=false
        torch_compile=setup.get("compile", False),
        use_cpu=True,
        **harness.TRL_RUN,
        logging_steps=1,
    )


def run_trl(setup: dict, out: Path) -> dict:
    """Runs in its own process (see --worker)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    data = datasets.load_dataset("json", data_files=setup["data"], split="train")
    trainer = SFTTrainer(model=model, args=trl_config(setup, out), train_dataset=data, processing_class=tokenizer)
    trainer.train()
    return {"steps": trainer.state.global_step, "rows": len(trainer.train_dataset)}


def main() -> None:
    parser = harness.parser(__doc__, {"cpu": WORKLOAD}, harness.ROOT / "runs" / "bench-step")
    parser.add_argument("--compile", action="store_true", help="both systems compile their model (see above)")
    args = parser.parse_args()
    if args.worker:  # one TRL run, in its own process
        setup = json.loads(args.setup)
        result = run_trl(setup, args.dir)
        assert result["steps"] == setup["steps"] and result["rows"] == setup["rows"], result
        harness.worker_result(result)
        return
    if args.rows:
        WORKLOAD["rows"] = args.rows
    root = args.dir
    root.mkdir(parents=True, exist_ok=True)
    compile_caches = tempfile.mkdtemp(prefix="compile-caches-", dir=root) if args.compile else None
    sft_vs_trl.WORKLOADS["step"] = WORKLOAD
    setup = sft_vs_trl.prepare("step", root) | {"overrides": args.ours, "compile": args.compile}
    # Same rows in the same order: llmtrain keeps every row (none loses all its trained
    # tokens to truncation), as TRL does.
    kept = len(sft_vs_trl.prepared_rows(setup))
    assert kept == WORKLOAD["rows"], f"llmtrain keeps {kept} of {WORKLOAD['rows']} rows"
    per_step: dict[str, list[float]] = {"llmtrain": [], "trl": []}
    try:
        for repeat in range(args.repeats):
            for name, run in (("llmtrain", ours), ("trl", trl)):
                times = {}
                for length, steps in (("short", SHORT), ("long", LONG)):
                    if compile_caches:  # an empty compile cache for each run (inherited by its process)
                        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(dir=compile_caches)
                    times[length] = run(setup, root / f"{name}-{length}", steps)
                short, long = times["short"], times["long"]
                per_step[name].append((long - short) / (LONG - SHORT))
                print(f"{name} run {repeat + 1}: {per_step[name][-1] * 1000:.0f} ms a step", flush=True)
    finally:
        if compile_caches:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            shutil.rmtree(compile_caches, ignore_errors=True)
    import trl as trl_module

    ms = {name: [f"{x * 1000:.0f}" for x in runs] for name, runs in per_step.items()}
    compiled = (
        ", compiled (llmtrain: each block, train.compile=true; TRL: the whole model, torch_compile=True; an "
        "empty compile cache for each run)"
        if args.compile
        else ""
    )
    best = {name: min(runs) for name, runs in per_step.items()}
    lines = [
        harness.heading("SFT step time, equal padded work"),
        "",
        f"{harness.command('sft_step_time.py', args, ' --compile' if args.compile else '')}; {WORKLOAD['layers']} "
        f"layers x {WORKLOAD['hidden']} wide, the same 8 rows a step in both (file order), padded to the longest, "
        f"one process, float32, no gradient checkpointing{compiled}; ({LONG}-step run - {SHORT}-step run) / "
        f"{LONG - SHORT}, wall time; TRL {trl_module.__version__}.",
        "",
        "| system | ms a step (each repeat) | best | TRL / llmtrain |",
        "| --- | ---: | ---: | ---: |",
        f"| llmtrain | {', '.join(ms['llmtrain'])} | {best['llmtrain'] * 1000:.0f} "
        f"| {best['trl'] / best['llmtrain']:.2f}x |",
        f"| TRL SFTTrainer | {', '.join(ms['trl'])} | {best['trl'] * 1000:.0f} | 1.00x |",
    ]
    harness.publish(lines, args.results)


if __name__ == "__main__":
    main()

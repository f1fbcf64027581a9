"""llmtrain vs TRL's SFTTrainer on a vision-language model, side by side: the same model,
pictures, questions, batches and precision.

    python benchmarks/vision_vs_trl.py                   # CPU workload, a few minutes on 2 idle cores
    python benchmarks/vision_vs_trl.py --repeats 1 --ours data.packing=true

Needs `pip install trl` beside llmtrain. The workload is the images demo's (docs/vision.md):
its LLaVA-shaped model with random weights (demo:tiny-vlm, 64 image tokens a picture) and its
generated pictures with one question each. llmtrain reads them as chat rows with an image
part; TRL as prompt-completion rows with an `images` column (its vision collator then trains
the completion alone), so both train the same tokens: the answer and its end of turn. One
epoch, micro-batches padded to their longest row, the whole model trained (the tower is
random), fp32, one process, in a fresh process per run, in the order A B C A B C. A run's
time is the sum of its optimizer steps. Peers: TRL's defaults (gradient checkpointing on),
and TRL's best (off).
"""

from __future__ import annotations

import json
from pathlib import Path

import harness

LR = 1e-3
WORKLOADS = {
    # rows, rows per micro-batch
    "cpu": dict(rows=480, micro=8, seq=256, precision="no"),
}
OURS_CONFIG = """\
# llmtrain's side of benchmarks/vision_vs_trl.py (written by it; the rest comes on the command line)
train: {schedule: constant, warmup_steps: 0, grad_accum_steps: 1, epochs: 1}
model: {freeze_vision: false, dtype: float32}
data: {packing: false}
eval: {every_steps: 0, sample_prompts: []}
checkpoint: {every_steps: 0}
log: {tracker: none, progress_bar: false, every_steps: 1}
"""


def prepare(workload: str, root: Path) -> dict:
    """The demo's model, the first rows of its pictures (paths made absolute), and llmtrain's config."""
    from llmtrain import demo

    w = WORKLOADS[workload]
    cache = demo.cache_dir()
    demo.build_vision_model(cache)
    demo.build_shapes(cache)
    shapes = cache / "shapes"
    rows = [json.loads(line) for line in (shapes / "train.jsonl").read_text().splitlines()][: w["rows"]]
    for r in rows:
        part = r["messages"][0]["content"][0]
        part["image"] = str(shapes / part["image"])
    demo.write_jsonl(rows, root / "train.jsonl")
    (root / "llmtrain_vision.yaml").write_text(OURS_CONFIG)
    return {"model": str(cache / "tiny-vlm"), "data": str(root / "train.jsonl"), **w}


def ours(setup: dict, out: Path, overrides: list[str]) -> dict:
    args = [
        "--config",
        str(Path(setup["data"]).parent / "llmtrain_vision.yaml"),
        f"model.name_or_path={setup['model']}",
        f"data.train={setup['data']}",
        f"data.max_seq_len={setup['seq']}",
        f"train.micro_batch_size={setup['micro']}",
        f"train.lr={LR}",
        *overrides,
    ]
    steps, _ = harness.run_ours("finetune.py", setup, out, args)
    return {
        "step_s": sum(r["step_s"] for r in steps) / len(steps),
        "steps": len(steps),
        "loss": sum(r["loss"] for r in steps) / len(steps),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in steps),
    }


def run_trl(setup: dict, out: Path, best: bool) -> dict:
    """Runs in its own process (see --worker)."""
    import datasets
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(line) for line in Path(setup["data"]).read_text().splitlines()]
    data = datasets.Dataset.from_list(
        [
            {
                "prompt": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image"},
                            {"type": "text", "text": r["messages"][0]["content"][1]["text"]},
                        ],
                    }
                ],
                "completion": [
                    {"role": "assistant", "content": [{"type": "text", "text": r["messages"][1]["content"]}]}
                ],
                "images": [Image.open(r["messages"][0]["content"][0]["image"]).convert("RGB")],
            }
            for r in rows
        ]
    )
    model = AutoModelForImageTextToText.from_pretrained(setup["model"], dtype=torch.float32, attn_implementation="sdpa")
    processor = AutoProcessor.from_pretrained(setup["model"])
    config = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=setup["micro"],
        gradient_accumulation_steps=1,
        num_train_epochs=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_length=None,  # TRL truncates image rows only without images; no row is near the limit here
        gradient_checkpointing=not best,  # SFTConfig's default is on
        use_cpu=not torch.cuda.is_available(),
        **harness.TRL_RUN,
        logging_steps=1,
    )
    timer = harness.step_timer()
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=processor, callbacks=[timer])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "step_s": timer.seconds / trainer.state.global_step,
        "steps": trainer.state.global_step,
        "loss": sum(losses) / len(losses),
        "peak_mem_gib": harness.peak_memory_gib(),
    }


def main() -> None:
    args = harness.parser(__doc__, WORKLOADS, harness.ROOT / "runs" / "bench-vision").parse_args()
    if args.rows:
        WORKLOADS[args.workload]["rows"] = args.rows
    if args.worker:  # one TRL run, in its own process
        harness.worker_result(run_trl(json.loads(args.setup), args.dir / f"{args.worker}", args.worker == "trl-best"))
        return
    root = args.dir / args.workload
    root.mkdir(parents=True, exist_ok=True)
    setup = prepare(args.workload, root)
    results = harness.run_systems(
        __file__, args, root, setup, list(harness.SYSTEMS), ours, lambda r: f"{r['step_s']:.3f} s/step"
    )
    report(args, setup, results)


def report(args, setup: dict, results: dict) -> None:
    import trl

    def best_of(runs):  # the fastest repeat: the least disturbed by the machine
        return min(runs, key=lambda r: r["step_s"])

    ours = best_of(results["llmtrain"])["step_s"]
    lines = [
        harness.heading(f"Images, {args.workload}"),
        "",
        harness.command("vision_vs_trl.py", args) + "; "
        f"the images demo's model (demo:tiny-vlm) and its first {setup['rows']} pictures with a question each, "
        f"{setup['micro']} rows a step padded to the longest, one epoch, lr {LR}, the whole model trained, fp32, "
        f"one process; TRL {trl.__version__}.",
        "",
        "| system | step time | steps | mean loss | peak memory | ours / this, step time |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        r = best_of(runs)
        step = r["step_s"]
        lines.append(
            f"| {name} | {step:.3f} s | {r['steps']} | {r['loss']:.4f} | {r['peak_mem_gib']:.2f} GiB | "
            f"{step / ours:.2f}x |"
        )
    harness.publish(lines, args.results)


if __name__ == "__main__":
    main()

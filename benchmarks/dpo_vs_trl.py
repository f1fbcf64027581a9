"""llmtrain's DPO recipe vs TRL's DPOTrainer, side by side, on the same model, pairs and precision.

    python benchmarks/dpo_vs_trl.py                     # CPU workload, about 3 minutes on 2 idle cores
    python benchmarks/dpo_vs_trl.py --workload gpu-1b   # Llama-3.2-1B shape, seq 2048, bf16 (one GPU)
    python benchmarks/dpo_vs_trl.py --ours data.packing=true      # llmtrain overrides
    python benchmarks/dpo_vs_trl.py --systems trl-default trl-best --results /tmp/r.md   # some systems only

Needs `pip install trl` beside llmtrain. Each system trains one epoch of the same
conversational pairs (a prompt, a chosen and a rejected answer, of their own lengths),
with DPO's sigmoid loss, beta 0.1, the same learning rate and pairs per micro-batch, one
process, in a fresh process per run, in the order A B C A B C. Both train the same tokens:
each answer's content and its end of turn. No pair is longer than the maximum length, as
the two truncate differently (TRL cuts the end of a sequence, llmtrain the start of the
prompt).

A run's time is the sum of its optimizer steps (start-up, tokenization and saving
excluded, for all systems alike). The reference log-probs cost time too, and where they
are computed differs: llmtrain computes them once before training (full fine-tune), TRL
by default with a second model inside every step, and with precompute_ref_log_probs=True
once before training (both in batches of the training micro-batch size). So each system
reports its reference pass apart, and pairs/s over the steps alone and over the steps
plus that pass, with "ours / this" for each (the second is the fair one against TRL's
defaults, whose steps include the reference forward).
Also reported: peak memory (GPU memory allocated, or the process's peak RSS on CPU) and
the mean training loss (close, not equal: same model, loss and learning rate, but each
system shuffles the pairs its own way). On CPU, run it on an otherwise idle machine:
with another busy process, torch's threads wait on each other and a run can take ten
times as long; the fastest repeat is reported, but only an idle one is a measurement.

Peers: TRL's defaults (a reference model in memory, its forward in every step, gradient
checkpointing on) and TRL's best (reference log-probs precomputed, gradient checkpointing
off as llmtrain's default; Liger kernels when installed). TRL 1.16 has padding_free for
DPO but disables it: setting it only warns and falls back to padding (it would need
FlashAttention 2/3 anyway, not available on CPU), so both TRL runs pad each micro-batch
to its longest sequence.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import time
from pathlib import Path

import harness

BETA, LR = 0.1, 1e-5
WORKLOADS = {
    # hidden, layers, heads, kv heads, ffn, vocab (None: the tokenizer's), max length, pairs,
    # pairs per micro-batch, precision
    "cpu": dict(hidden=256, layers=4, heads=4, kv=2, ffn=768, vocab=None, seq=512, pairs=128, micro=4, precision="no"),
    "gpu-1b": dict(
        hidden=2048, layers=16, heads=32, kv=8, ffn=8192, vocab=128256, seq=2048, pairs=2000, micro=4, precision="bf16"
    ),
}
# llmtrain's side: what the command line does not set (see ours).
OURS_CONFIG = """\
# llmtrain's side of benchmarks/dpo_vs_trl.py (written by it; model, data, length,
# batch, lr, beta and loss come on the command line)
train: {epochs: 1, schedule: constant, warmup_steps: 0, grad_accum_steps: 1}
eval: {every_steps: 0, sample_prompts: []}
checkpoint: {every_steps: 0}
log: {tracker: none, progress_bar: false, every_steps: 1}
"""
# Room for the chat template's tokens (role headers, ends of turn) and a system message.
TEMPLATE_ROOM = 96
SYSTEM = "You are a helpful assistant. Answer briefly."


def text(rng: random.Random, chars: int) -> str:
    """Words of 2-8 letters, cut to `chars` characters (one token each with the benchmark's
    byte-level tokenizer)."""
    out = ""
    while len(out) < chars:
        out += "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) + " "
    return out[:chars].strip() or "a"


def make_pairs(n: int, seed: int, seq: int) -> list[dict]:
    """Conversational pairs whose lengths spread like preference data: log-normal, a long
    tail, answers of their own lengths; a system message in a third of them. Every pair
    fits `seq` tokens (see the module docstring)."""
    rng = random.Random(seed)
    budget = seq - TEMPLATE_ROOM  # characters of prompt + the longer answer
    pairs = []
    for _ in range(n):
        total = min(int(rng.lognormvariate(math.log(seq * 0.3), 0.6)), budget)
        prompt = max(8, int(total * rng.uniform(0.2, 0.6)))
        answers = [max(2, int((total - prompt) * rng.uniform(0.3, 1.0))) for _ in range(2)]
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 1 / 3 else []
        pairs.append(
            {
                "prompt": messages + [{"role": "user", "content": text(rng, prompt)}],
                "chosen": [{"role": "assistant", "content": text(rng, answers[0])}],
                "rejected": [{"role": "assistant", "content": text(rng, answers[1])}],
            }
        )
    return pairs


def prepare(workload: str, root: Path) -> dict:
    """Write the model directory, the pairs and llmtrain's config; returns paths and settings."""
    from llmtrain.demo import build_tokenizer, write_jsonl

    w = WORKLOADS[workload]
    pairs = make_pairs(w["pairs"], seed=0, seq=w["seq"])
    write_jsonl(pairs, root / "pairs.jsonl")
    tokenizer = build_tokenizer([m["content"] for p in pairs[:200] for k in ("prompt", "chosen") for m in p[k]])
    tokenizer.model_max_length = w["seq"]
    harness.save_llama(w, tokenizer, root / "model")
    (root / "llmtrain_dpo.yaml").write_text(OURS_CONFIG)
    return {
        "model": str(root / "model"),
        "data": str(root / "pairs.jsonl"),
        "config": str(root / "llmtrain_dpo.yaml"),
        **w,
    }


def ours(setup: dict, out: Path, overrides: list[str]) -> dict:
    args = [
        "--config",
        setup["config"],
        f"model.name_or_path={setup['model']}",
        f"data.train={setup['data']}",
        f"data.max_seq_len={setup['seq']}",
        f"train.micro_batch_size={setup['micro']}",
        f"train.lr={LR}",
        "model.dtype=float32",
        f"dpo.beta={BETA}",
        "dpo.loss=sigmoid",
        *overrides,
    ]
    steps, printed = harness.run_ours("dpo.py", setup, out, args)
    # The recipe prints this line after computing the reference log-probs before training
    # (a full fine-tune); a LoRA run (the adapters switched off in each step) prints none.
    found = re.search(r"reference log-probs: (\d+) pairs in ([\d.]+) s", printed)
    return {
        "seconds": sum(r["pairs"] / r["pairs_per_s"] for r in steps),
        "reference_seconds": float(found.group(2)) if found else None,
        "steps": len(steps),
        "loss": sum(r["loss"] for r in steps) / len(steps),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in steps),
    }


def run_trl(setup: dict, out: Path, best: bool) -> dict:
    """Runs in its own process (see --worker)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    class TimedDPOTrainer(DPOTrainer):
        """Times the reference pass that precompute_ref_log_probs runs in __init__."""

        reference_seconds = 0.0

        def _precompute_ref_logps(self, *args, **kwargs):
            harness.sync()
            start = time.perf_counter()
            try:
                return super()._precompute_ref_logps(*args, **kwargs)
            finally:
                harness.sync()
                self.reference_seconds += time.perf_counter() - start

    dtype = torch.bfloat16 if setup["precision"] == "bf16" else torch.float32
    # fp32 master weights with bf16 autocast, as in llmtrain; sdpa for both (flash-attn is not installed)
    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    data = datasets.load_dataset("json", data_files=setup["data"], split="train")
    config = DPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=setup["micro"],  # pairs
        gradient_accumulation_steps=1,
        num_train_epochs=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=setup["seq"],
        precompute_ref_log_probs=best,
        gradient_checkpointing=not best,  # TRL's default is on
        bf16=dtype == torch.bfloat16,  # TRL's default is on, also on CPU
        use_cpu=not torch.cuda.is_available(),
        **harness.TRL_RUN,
        logging_steps=10**6,
        use_liger_kernel=best and harness.has("liger_kernel"),
    )
    timer = harness.step_timer()
    trainer = TimedDPOTrainer(
        model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[timer]
    )
    result = trainer.train()
    return {
        "seconds": timer.seconds,
        "reference_seconds": trainer.reference_seconds if best else None,
        "steps": trainer.state.global_step,
        "loss": result.training_loss,
        "peak_mem_gib": harness.peak_memory_gib(),
    }


def data_counts(setup: dict) -> dict:
    """Pairs, trained tokens and all tokens of one epoch, counted with llmtrain's
    tokenization (tests/test_benchmarks.py checks TRL's trains the same tokens). Refuses
    data in which a pair would be truncated or dropped."""
    from transformers import AutoTokenizer

    from llmtrain.config import DataConfig
    from llmtrain.preference.pairs import PAIRS

    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    cfg = DataConfig(max_seq_len=setup["seq"])
    rows = [json.loads(line) for line in Path(setup["data"]).read_text().splitlines()]
    done = [PAIRS.process(row, tokenizer, cfg) for row in rows]
    bad = sorted({d["status"] for d in done if d["status"] != "ok"})
    if bad:
        raise RuntimeError(f"the benchmark's pairs must fit max length whole; found {bad}: raise TEMPLATE_ROOM")
    return {"pairs": len(done), "trained": sum(d["n_trained"] for d in done), "tokens": sum(d["length"] for d in done)}


def main() -> None:
    options = harness.parser(__doc__, WORKLOADS, harness.ROOT / "runs" / "bench-dpo")
    harness.systems_option(options)
    args = options.parse_args()
    if args.rows:
        WORKLOADS[args.workload]["pairs"] = args.rows
    if args.worker:  # one TRL run, in its own process
        harness.worker_result(run_trl(json.loads(args.setup), args.dir, args.worker == "trl-best"))
        return

    root = args.dir / args.workload
    root.mkdir(parents=True, exist_ok=True)
    setup = prepare(args.workload, root)
    counts = data_counts(setup)
    results: dict[str, list[dict]] = {name: [] for name in harness.SYSTEMS if name in args.systems}
    for repeat in range(args.repeats):
        for name in results:
            out = root / f"{name}-{repeat}"
            shutil.rmtree(out, ignore_errors=True)  # a fresh run: nothing resumed, no cached reference log-probs
            if name == "llmtrain":
                r = ours(setup, out, args.ours)
            else:
                # Its own datasets cache, so that TRL computes the reference log-probs
                # again instead of reading an earlier run's.
                env = dict(os.environ, HF_DATASETS_CACHE=str(out / "datasets-cache"))
                r = harness.run_peer(__file__, name, setup, out, env)
            reference = f", reference pass {r['reference_seconds']:.1f} s" if r["reference_seconds"] is not None else ""
            print(f"{name} run {repeat + 1}: {r['seconds']:.1f} s over {r['steps']} steps{reference}", flush=True)
            results[name].append(r)
    report(args, setup, counts, results)


def report(args, setup: dict, counts: dict, results: dict) -> None:
    import trl

    def total(r):  # the steps and the reference pass before them, where there is one
        return r["seconds"] + (r["reference_seconds"] or 0.0)

    def best_of(runs):  # the fastest repeat: the least disturbed by the machine
        return min(runs, key=total)

    pairs = counts["pairs"]
    ours = best_of(results["llmtrain"]) if "llmtrain" in results else None
    lines = [
        harness.heading(f"DPO, {args.workload}"),
        "",
        harness.command("dpo_vs_trl.py", args, harness.systems_flag(args)) + "; "
        f"{pairs} pairs, {counts['trained']:,} trained / {counts['tokens']:,} tokens per epoch, "
        f"max length {setup['seq']}, {setup['micro']} pairs per step, beta {BETA}, lr {LR}, "
        f"precision {setup['precision']}; TRL {trl.__version__}.",
        "",
        "| system | pairs/s, steps | pairs/s, steps + reference | reference pass | peak memory | steps | mean loss "
        "| ours / this, steps | ours / this, steps + reference |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        r = best_of(runs)
        ref = f"{r['reference_seconds']:.1f} s" if r["reference_seconds"] is not None else "in the steps"
        if name == "llmtrain" and r["reference_seconds"] is None:
            ref = "not reported"
        # ours / this in pairs/s: this system's time over ours
        steps_ratio = f"{r['seconds'] / ours['seconds']:.2f}x" if ours else "n/a"
        total_ratio = f"{total(r) / total(ours):.2f}x" if ours else "n/a"
        lines.append(
            f"| {name} | {pairs / r['seconds']:.2f} | {pairs / total(r):.2f} | {ref} | {r['peak_mem_gib']:.2f} GiB | "
            f"{r['steps']} | {r['loss']:.4f} | {steps_ratio} | {total_ratio} |"
        )
    harness.publish(lines, args.results)


if __name__ == "__main__":
    main()

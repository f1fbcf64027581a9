"""llmtrain vs TRL's SFTTrainer, side by side, on the same model, data and precision.

    python benchmarks/sft_vs_trl.py                     # CPU workload, about 6 minutes on 2 cores (two repeats)
    python benchmarks/sft_vs_trl.py --workload gpu-1b   # Llama-3.2-1B shape, seq 2048, bf16 (one GPU)
    python benchmarks/sft_vs_trl.py --workload gpu-125m
    python benchmarks/sft_vs_trl.py --workload gpu-1b --ours train.compile=true   # llmtrain overrides

Needs `pip install trl` beside llmtrain. Each system trains one epoch of the same
variable-length chat rows (loss on assistant turns only, so the trained tokens are the
same), one process, in a fresh process per run, in the order A B C A B C. A run's time is
the sum of its optimizer steps (start-up, tokenization and saving excluded, for all
systems alike). Reported: trained tokens/s, all (non-padding) tokens/s, MFU (GPU), peak
memory, and ours / peer. Peers: TRL's defaults (padding to the longest row, gradient
checkpointing on), and TRL's best (packing with its best-fit-decreasing, padding-free batches,
no gradient checkpointing; Liger kernels when installed). llmtrain's default is no
checkpointing (`--ours model.gradient_checkpointing=true` turns it on).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import harness

# ChatML with TRL's generation markers around what the assistant says, so TRL's
# assistant_only_loss trains the same tokens llmtrain does (content + end of turn).
TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ message['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORKLOADS = {
    # name: (hidden, layers, heads, kv heads, ffn, vocab, seq len, rows, sequences per micro-batch, dtype)
    "cpu": dict(hidden=256, layers=4, heads=4, kv=2, ffn=768, vocab=None, seq=512, rows=600, micro=4, precision="no"),
    "gpu-125m": dict(
        hidden=768, layers=12, heads=12, kv=12, ffn=3072, vocab=32000, seq=2048, rows=20000, micro=16, precision="bf16"
    ),
    "gpu-1b": dict(
        hidden=2048, layers=16, heads=32, kv=8, ffn=8192, vocab=128256, seq=2048, rows=6000, micro=4, precision="bf16"
    ),
}


def words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(max(1, n))
    )


def make_rows(n: int, seed: int, seq: int) -> list[dict]:
    """Chat rows whose lengths spread like instruction data: log-normal, a long tail,
    a few over the sequence length (truncated by both systems)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        total = min(int(rng.lognormvariate(math.log(seq * 0.25), 0.8)), int(seq * 1.2))
        user = max(3, int(total * rng.uniform(0.2, 0.6)) // 6)
        answer = max(1, (total - user * 6) // 6)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": words(rng, user)},
                    {"role": "assistant", "content": words(rng, answer)},
                ]
            }
        )
    return rows


def prepare(workload: str, root: Path) -> dict:
    """Write the model directory and data; returns paths and settings."""
    from llmtrain.demo import build_tokenizer, write_jsonl

    w = WORKLOADS[workload]
    rows = make_rows(w["rows"], seed=0, seq=w["seq"])
    write_jsonl(rows, root / "train.jsonl")
    tokenizer = build_tokenizer([m["content"] for r in rows[:200] for m in r["messages"]])
    tokenizer.chat_template = TEMPLATE
    tokenizer.model_max_length = w["seq"]
    harness.save_llama(w, tokenizer, root / "model")
    return {"model": str(root / "model"), "data": str(root / "train.jsonl"), **w}


def ours(setup: dict, out: Path, overrides: list[str]) -> dict:
    args = [
        "--config",
        str(harness.HERE / "llmtrain_bench.yaml"),
        f"model.name_or_path={setup['model']}",
        f"data.train={setup['data']}",
        f"data.max_seq_len={setup['seq']}",
        f"train.micro_batch_size={setup['micro']}",
        "model.dtype=float32",
        *overrides,
    ]
    steps, _ = harness.run_ours("finetune.py", setup, out, args)
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in steps)
    mfu = [r["mfu"] for r in steps if "mfu" in r]
    return {
        "seconds": seconds,
        "steps": len(steps),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in steps),
        "mfu": sum(mfu) / len(mfu) if mfu else None,
    }


def trl_config(setup: dict, out: Path, best: bool):
    """TRL's SFTConfig for its defaults (best=False) or its best settings."""
    import torch
    from trl import SFTConfig

    mean_len = setup["mean_row_tokens"]
    # Same token budget per step: TRL's default pads rows, so it gets as many rows as fit
    # the packed systems' micro_batch_size x max_length tokens.
    rows_per_batch = setup["micro"] if best else max(1, round(setup["micro"] * setup["seq"] / mean_len))
    return SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=rows_per_batch,
        gradient_accumulation_steps=1,
        num_train_epochs=1,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        max_length=setup["seq"],
        assistant_only_loss=True,
        packing=best,
        padding_free=best,
        gradient_checkpointing=not best,  # SFTConfig's default is on; recomputing is slower
        bf16=setup["precision"] == "bf16",
        use_cpu=not torch.cuda.is_available(),
        **harness.TRL_RUN,
        logging_steps=10**6,
        use_liger_kernel=best and harness.has("liger_kernel"),
    )


def run_trl(setup: dict, out: Path, best: bool) -> dict:
    """Runs in its own process (see --worker)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    # fp32 master weights with bf16 autocast, as in llmtrain; sdpa for both (flash-attn is not installed)
    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    data = datasets.load_dataset("json", data_files=setup["data"], split="train")
    config = trl_config(setup, out, best)
    timer = harness.step_timer()
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    return {
        "seconds": timer.seconds,
        "steps": trainer.state.global_step,
        "peak_mem_gib": harness.peak_memory_gib(),
        "mfu": None,
    }


def prepared_rows(setup: dict):
    """The rows as llmtrain tokenizes them for this setup (rows that keep no trained token
    after truncation are left out)."""
    from transformers import AutoTokenizer

    from llmtrain.config import DataConfig
    from llmtrain.data.build import ROWS

    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    return ROWS.prepare("data.train", [setup["data"]], tokenizer, DataConfig(max_seq_len=setup["seq"]))[0]


def data_tokens(setup: dict) -> tuple[int, int]:
    """(trained tokens, all tokens) of one epoch, counted with llmtrain's tokenization,
    which trains the same tokens as TRL's assistant_only_loss on this template."""
    ds = prepared_rows(setup)
    return sum(ds["n_trained"]), sum(ds["length"])


def main() -> None:
    args = harness.parser(__doc__, WORKLOADS, harness.ROOT / "runs" / "bench").parse_args()
    if args.rows:
        WORKLOADS[args.workload]["rows"] = args.rows
    if args.worker:  # one TRL run, in its own process
        harness.worker_result(run_trl(json.loads(args.setup), args.dir / f"{args.worker}", args.worker == "trl-best"))
        return

    root = args.dir / args.workload
    root.mkdir(parents=True, exist_ok=True)
    setup = prepare(args.workload, root)
    trained, total = data_tokens(setup)
    setup["mean_row_tokens"] = total / WORKLOADS[args.workload]["rows"]
    results: dict[str, list[dict]] = {"llmtrain": [], "trl-default": [], "trl-best": []}
    for repeat in range(args.repeats):
        for name in results:
            out = root / f"{name}-{repeat}"
            r = ours(setup, out, args.ours) if name == "llmtrain" else harness.run_peer(__file__, name, setup, out)
            print(f"{name} run {repeat + 1}: {r['seconds']:.1f} s over {r['steps']} steps", flush=True)
            results[name].append(r)
    report(args, setup, trained, total, results)


def report(args, setup: dict, trained: int, total: int, results: dict) -> None:
    def best_of(runs):  # the fastest repeat: the least disturbed by the machine
        return min(runs, key=lambda r: r["seconds"])

    ours = trained / best_of(results["llmtrain"])["seconds"]
    lines = [
        harness.heading(args.workload),
        "",
        harness.command("sft_vs_trl.py", args) + "; "
        f"{WORKLOADS[args.workload]['rows']} chat rows, {trained:,} trained / {total:,} tokens per epoch, "
        f"max length {setup['seq']}, precision {setup['precision']}.",
        "",
        "| system | trained tok/s | all tok/s | MFU | peak memory | steps | ours / this |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        r = best_of(runs)
        tps = trained / r["seconds"]
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        lines.append(
            f"| {name} | {tps:,.0f} | {total / r['seconds']:,.0f} | {mfu} | {r['peak_mem_gib']:.2f} GiB | "
            f"{r['steps']} | {ours / tps:.2f}x |"
        )
    harness.publish(lines, args.results)


if __name__ == "__main__":
    main()

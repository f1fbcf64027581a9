"""llmtrain vs TRL's SFTTrainer, side by side, on the same model, data and precision.

    python benchmarks/sft_vs_trl.py                     # CPU workload, about 3 minutes on 2 cores
    python benchmarks/sft_vs_trl.py --workload gpu-1b   # Llama-3.2-1B shape, seq 2048, bf16 (one GPU)
    python benchmarks/sft_vs_trl.py --workload gpu-125m
    python benchmarks/sft_vs_trl.py --workload gpu-1b --ours train.compile=true   # llmtrain overrides

Needs `pip install trl` beside llmtrain. Each system trains one epoch of the same
variable-length chat rows (loss on assistant turns only, so the trained tokens are the
same), one process, in a fresh process per run, in the order A B C A B C. A run's time is
the sum of its optimizer steps (start-up, tokenization and saving excluded, for all
systems alike). Reported: trained tokens/s, all (non-padding) tokens/s, MFU (GPU), peak
memory, and ours / peer. Peers: TRL's defaults (padding to the longest row), and TRL's best
(packing with its best-fit-decreasing, padding-free batches; Liger kernels when installed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
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
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.demo import build_tokenizer, write_jsonl

    w = WORKLOADS[workload]
    rows = make_rows(w["rows"], seed=0, seq=w["seq"])
    write_jsonl(rows, root / "train.jsonl")
    tokenizer = build_tokenizer([m["content"] for r in rows[:200] for m in r["messages"]])
    tokenizer.chat_template = TEMPLATE
    tokenizer.model_max_length = w["seq"]
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
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return {"model": str(root / "model"), "data": str(root / "train.jsonl"), **w}


def run_ours(setup: dict, out: Path, overrides: list[str]) -> dict:
    args = [
        sys.executable,
        str(ROOT / "recipes" / "finetune.py"),
        "--config",
        str(HERE / "llmtrain_bench.yaml"),
        f"output_dir={out}",
        f"model.name_or_path={setup['model']}",
        f"data.train={setup['data']}",
        f"data.max_seq_len={setup['seq']}",
        f"train.micro_batch_size={setup['micro']}",
        "model.dtype=float32",
        *overrides,
    ]
    env = dict(os.environ, ACCELERATE_MIXED_PRECISION=setup["precision"])
    proc = subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in steps)
    mfu = [r["mfu"] for r in steps if "mfu" in r]
    return {
        "seconds": seconds,
        "steps": len(steps),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in steps),
        "mfu": sum(mfu) / len(mfu) if mfu else None,
    }


def run_trl(setup: dict, out: Path, best: bool) -> dict:
    """Runs in its own process (see --worker)."""
    import resource

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class StepTimer(TrainerCallback):
        seconds = 0.0

        def on_step_begin(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - self.start

    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if setup["precision"] == "bf16" else torch.float32
    # fp32 master weights with bf16 autocast, as in llmtrain; sdpa for both (flash-attn is not installed)
    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    data = datasets.load_dataset("json", data_files=setup["data"], split="train")
    mean_len = setup["mean_row_tokens"]
    # Same token budget per step: TRL's default pads rows, so it gets as many rows as fit
    # the packed systems' micro_batch_size x max_length tokens.
    rows_per_batch = setup["micro"] if best else max(1, round(setup["micro"] * setup["seq"] / mean_len))
    config = SFTConfig(
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
        bf16=dtype == torch.bfloat16,
        use_cpu=not gpu,
        report_to=[],
        save_strategy="no",
        logging_steps=10**6,
        seed=0,
        use_liger_kernel=best and _has("liger_kernel"),
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    timer = StepTimer()
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    peak = torch.cuda.max_memory_allocated() if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": timer.seconds, "steps": trainer.state.global_step, "peak_mem_gib": peak / 2**30, "mfu": None}


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def data_tokens(setup: dict) -> tuple[int, int]:
    """(trained tokens, all tokens) of one epoch, counted with llmtrain's tokenization,
    which trains the same tokens as TRL's assistant_only_loss on this template."""
    from transformers import AutoTokenizer

    from llmtrain.config import DataConfig
    from llmtrain.data import prepare_split

    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    ds, _ = prepare_split("data.train", [setup["data"]], tokenizer, DataConfig(max_seq_len=setup["seq"]))
    return sum(ds["n_trained"]), sum(ds["length"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=ROOT / "runs" / "bench")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument(
        "--ours",
        nargs="*",
        default=[],
        metavar="key=value",
        help="overrides for llmtrain's side (shown in the results)",
    )
    parser.add_argument("--worker", choices=["trl-default", "trl-best"], help=argparse.SUPPRESS)
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # one TRL run, in its own process
        setup = json.loads(args.setup)
        print("RESULT " + json.dumps(run_trl(setup, args.dir / f"{args.worker}", args.worker == "trl-best")))
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
            if name == "llmtrain":
                r = run_ours(setup, out, args.ours)
            else:
                proc = subprocess.run(
                    [sys.executable, __file__, "--worker", name, "--setup", json.dumps(setup), "--dir", str(out)],
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                )
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode != 0 or not line:
                    raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
                r = json.loads(line[0][len("RESULT ") :])
            print(f"{name} run {repeat + 1}: {r['seconds']:.1f} s over {r['steps']} steps", flush=True)
            results[name].append(r)
    report(args, setup, trained, total, results)


def report(args, setup: dict, trained: int, total: int, results: dict) -> None:
    import torch

    def best_of(runs):  # the fastest repeat: the least disturbed by the machine
        return min(runs, key=lambda r: r["seconds"])

    ours = trained / best_of(results["llmtrain"])["seconds"]
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"
    )
    lines = [
        f"### {args.workload}: {time.strftime('%Y-%m-%d')}, {device}",
        "",
        f"`python benchmarks/sft_vs_trl.py --workload {args.workload} --repeats {args.repeats}"
        + (f" --ours {' '.join(args.ours)}" if args.ours else "")
        + "`; "
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
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    with open(args.results, "a") as f:
        f.write("\n" + text)


if __name__ == "__main__":
    main()

"""llmtrain's reward model vs TRL's RewardTrainer, side by side: the same model (the SFT demo's,
with a new score head), the same pairs, settings and held-out pairs.

    python benchmarks/reward_vs_trl.py            # CPU, about 3 minutes on 2 cores

Each system trains one epoch of the demo's 2000 training pairs (batch 8 pairs, lr 1e-4,
cosine to 10%, centring 0.01, padded batches for both: TRL 1.16's RewardTrainer does not pack),
in a fresh process. Reported: held-out accuracy on the demo's 200 eval pairs, scored the same way
for both (final/ loaded with AutoModelForSequenceClassification, each conversation rendered with
the model's chat template), time of the optimizer steps, pairs/s and peak memory.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import harness

LR, BATCH, CENTER, SEQ = 1e-4, 8, 0.01, 128
OURS_CONFIG = """\
# llmtrain's side of benchmarks/reward_vs_trl.py (written by it)
data: {max_seq_len: 128, packing: false}
train: {micro_batch_size: 8, grad_accum_steps: 1, epochs: 1, lr: 1.0e-4, warmup_steps: 10, schedule: cosine,
        min_lr_ratio: 0.1}
eval: {every_steps: 0}
checkpoint: {every_steps: 0}
log: {tracker: none, progress_bar: false, every_steps: 1}
reward: {center_coefficient: 0.01}
"""


def prepare(root: Path) -> dict:
    from llmtrain import demo

    root.mkdir(parents=True, exist_ok=True)
    cache = demo.cache_dir()
    demo.build_assets(cache)
    demo.build_pairs(cache)  # builds the SFT demo model first if absent
    model, train, evals = cache / "tiny-llama-sft", cache / "pairs-train.jsonl", cache / "pairs-eval.jsonl"
    (root / "llmtrain_reward.yaml").write_text(OURS_CONFIG)
    # TRL reads one row shape per file; the demo mixes three. The same pairs as conversations
    # with an explicit prompt, as llmtrain reads each of them (preference/pairs.pair_messages).
    from llmtrain.preference.pairs import pair_messages

    rows = []
    for line in train.read_text().splitlines():
        prompt, chosen, rejected = pair_messages(json.loads(line))
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
            chosen, rejected = [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    demo.write_jsonl(rows, root / "trl-train.jsonl")
    return {
        "model": str(model),
        "train": str(train),
        "trl_train": str(root / "trl-train.jsonl"),
        "eval": str(evals),
        "config": str(root / "llmtrain_reward.yaml"),
    }


def accuracy(final: str, eval_file: str) -> float:
    """Held-out accuracy of a saved reward model, scored in plain transformers."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from llmtrain.config import DataConfig
    from llmtrain.preference.pairs import PAIRS

    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    right = total = 0
    with torch.no_grad():
        for line in Path(eval_file).read_text().splitlines():
            row = PAIRS.process(json.loads(line), tokenizer, DataConfig(max_seq_len=SEQ))
            if row["status"] not in ("ok", "truncated"):
                continue
            c, r = (model(input_ids=torch.tensor([row[f"{s}_input_ids"]])).logits[0, 0] for s in ("chosen", "rejected"))
            right, total = right + int(c > r), total + 1
    return right / total


def ours(setup: dict, out: Path) -> dict:
    args = ["--config", setup["config"], f"model.name_or_path={setup['model']}", f"data.train={setup['train']}"]
    steps, _ = harness.run_ours("reward.py", dict(setup, precision="no"), out, args)
    seconds = sum(r["step_s"] for r in steps)
    return {
        "seconds": seconds,
        "pairs": sum(r["pairs"] for r in steps),
        "final": str(out / "final"),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in steps),
    }


def run_trl(setup: dict, out: Path, best: bool) -> dict:
    """TRL's RewardTrainer, in its own process (see --worker): its defaults (bf16 autocast
    and gradient checkpointing, which its RewardConfig turns on), or at its best here
    (float32 as llmtrain, no checkpointing)."""
    import datasets
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(setup["model"], num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    data = datasets.load_dataset("json", data_files=setup["trl_train"], split="train")
    config = RewardConfig(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        num_train_epochs=1,
        learning_rate=LR,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=10,
        max_length=SEQ,
        center_rewards_coefficient=CENTER,
        use_cpu=not torch.cuda.is_available(),
        **harness.TRL_RUN,
        logging_steps=10**6,
        **({"bf16": False, "gradient_checkpointing": False} if best else {}),
    )
    timer = harness.step_timer()
    trainer = RewardTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    trainer.save_model(str(out / "final"))
    tokenizer.save_pretrained(out / "final")
    return {
        "seconds": timer.seconds,
        "pairs": len(data),
        "final": str(out / "final"),
        "peak_mem_gib": harness.peak_memory_gib(),
    }


def main() -> None:
    args = harness.parser(__doc__, {"cpu": None}, harness.ROOT / "runs" / "bench-reward").parse_args()
    if args.ours or args.rows:
        raise SystemExit("reward_vs_trl.py: --ours and --rows are not taken; the workload is the demo's")
    if args.worker:  # one TRL run, in its own process
        harness.worker_result(run_trl(json.loads(args.setup), args.dir, args.worker == "trl-best"))
        return
    root = args.dir
    setup = prepare(root)
    results: dict[str, list[dict]] = {"llmtrain": [], **{peer: [] for peer in harness.PEERS}}
    for repeat in range(args.repeats):  # A B C A B C; a system's figure is its fastest run
        for name in results:
            out = root / f"{name}-{repeat}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            r = ours(setup, out) if name == "llmtrain" else harness.run_peer(__file__, name, setup, out)
            r["accuracy"] = accuracy(r["final"], setup["eval"])
            print(f"{name} run {repeat + 1}: {r['seconds']:.1f} s, held-out accuracy {r['accuracy']:.1%}", flush=True)
            results[name].append(r)
    import trl

    lines = [
        harness.heading("Reward model, cpu"),
        "",
        harness.command("reward_vs_trl.py", args) + "; the SFT demo model with a new score head, 2000 demo pairs, one "
        f"epoch, {BATCH} pairs a step, lr {LR}, centring {CENTER}, max length {SEQ}, padded; TRL {trl.__version__}.",
        "",
        "Held-out accuracy is given for each run. trl-default is TRL's "
        "RewardConfig as it comes (bf16 autocast, gradient checkpointing); trl-best is float32 without "
        "checkpointing, as llmtrain runs here.",
        "",
        "| system | held-out accuracy | steps time | pairs/s | peak memory |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        r = min(runs, key=lambda x: x["seconds"])
        accuracies = ", ".join(f"{x['accuracy']:.1%}" for x in runs)
        lines.append(
            f"| {name} | {accuracies} | {r['seconds']:.1f} s | {r['pairs'] / r['seconds']:.0f} | "
            f"{r['peak_mem_gib']:.2f} GiB |"
        )
    harness.publish(lines, args.results)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

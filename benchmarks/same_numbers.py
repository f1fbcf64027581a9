"""Digests of what a few fixed runs train, to show that a refactor changes no number.

    python benchmarks/same_numbers.py > before.txt     # on the commit before the change
    python benchmarks/same_numbers.py > after.txt      # on the change
    diff before.txt after.txt                          # must print nothing
    python benchmarks/same_numbers.py grpo kto         # only the runs whose names start so

Runs the shipped demo configs on CPU with their fixed seeds (the demo model and data are
built offline on first use), each method on one process and on two: SFT packed, and padded
with LoRA and gradient accumulation; DPO packed against the frozen reference, and with LoRA;
a reward model packed, and padded with accumulation; KTO full, and with LoRA; ORPO packed,
and padded; GRPO with its demo's accumulation, and with LoRA; distillation offline packed,
and GKD with the student's own answers. For each it prints a sha256 of
the metrics rows without the wall-clock fields and one of every tensor in final/ (name,
dtype, shape and bytes). The data is tokenized afresh in a datasets cache of the run's own.
Takes about five minutes on 2 idle cores.
"""

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Fields that measure the machine, not the training: times and rates (every "_s" field:
# step_s, tokens_per_s, completions_per_s, generation_s, ...), memory, MFU.
CLOCK = ("_s", "data_wait", "peak_mem_gib", "mfu", "time")

RUNS = {
    "sft-packed-1proc": (1, "finetune.py", "demo.yaml", ["train.max_steps=6"]),
    "sft-padded-lora-2proc": (
        2,
        "finetune.py",
        "demo.yaml",
        [
            "train.max_steps=4",
            "data.packing=false",
            "model.lora.enabled=true",
            "model.lora.dropout=0.05",
            "train.grad_accum_steps=2",
        ],
    ),
    "dpo-packed-1proc": (1, "dpo.py", "dpo_demo.yaml", ["train.max_steps=4"]),
    "dpo-lora-2proc": (
        2,
        "dpo.py",
        "dpo_demo.yaml",
        ["train.max_steps=3", "model.lora.enabled=true", "model.lora.dropout=0.05"],
    ),
    "reward-packed-1proc": (1, "reward.py", "reward_demo.yaml", ["train.max_steps=4"]),
    "reward-padded-2proc": (
        2,
        "reward.py",
        "reward_demo.yaml",
        ["train.max_steps=3", "data.packing=false", "train.micro_batch_size=2", "train.grad_accum_steps=2"],
    ),
    "kto-1proc": (1, "dpo.py", "kto_demo.yaml", ["train.max_steps=3"]),
    "kto-lora-2proc": (2, "dpo.py", "kto_demo.yaml", ["train.max_steps=3", "model.lora.enabled=true"]),
    "orpo-packed-1proc": (1, "dpo.py", "orpo_demo.yaml", ["train.max_steps=4"]),
    "orpo-padded-2proc": (2, "dpo.py", "orpo_demo.yaml", ["train.max_steps=3", "data.packing=false"]),
    "grpo-1proc": (1, "grpo.py", "grpo_demo.yaml", ["train.max_steps=3", "eval.every_steps=2"]),
    "grpo-lora-2proc": (
        2,
        "grpo.py",
        "grpo_demo.yaml",
        ["train.max_steps=2", "model.lora.enabled=true", "eval.every_steps=0"],
    ),
    "distill-packed-1proc": (1, "distill.py", "distill_demo.yaml", ["train.max_steps=4"]),
    "distill-gkd-2proc": (
        2,
        "distill.py",
        "distill_demo.yaml",
        [
            "train.max_steps=4",
            "data.packing=false",
            "distill.on_policy_fraction=0.5",
            "distill.beta=0.5",
            "distill.top_k=0",
            "distill.max_completion_length=12",
        ],
    ),
}


def digest_metrics(out: Path) -> str:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    kept = [{k: v for k, v in row.items() if not k.endswith(CLOCK)} for row in rows]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def digest_weights(final: Path) -> str:
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    for path in sorted(final.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name)
                h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
                h.update(t.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory() as tmp:
        # A datasets cache of its own: the rows' cache keys are the same before and after a
        # refactor, so a shared cache would hand the second run the first run's tokenized rows.
        env["HF_DATASETS_CACHE"] = str(Path(tmp) / "datasets")
        for name, (nproc, recipe, config, overrides) in RUNS.items():
            if sys.argv[1:] and not name.startswith(tuple(sys.argv[1:])):
                continue
            out = Path(tmp) / name
            script = [str(ROOT / "recipes" / recipe), "--config", str(ROOT / "recipes" / "configs" / config)]
            args = [*script, f"output_dir={out}", "log.tracker=none", "log.progress_bar=false", *overrides]
            launch = [sys.executable]
            if nproc > 1:
                launch += ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc)]
                launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
            proc = subprocess.run([*launch, *args], env=env, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            print(f"{name}: metrics {digest_metrics(out)} final {digest_weights(out / 'final')}", flush=True)


if __name__ == "__main__":
    main()

"""Fine-tune a causal language model (full or LoRA) on instruction, chat or text data.

    accelerate launch recipes/finetune.py                       # offline demo (recipes/configs/demo.yaml)
    accelerate launch recipes/finetune.py --config recipes/configs/llama_full.yaml train.lr=2e-5
    python recipes/finetune.py output_dir=runs/try data.packing=true     # one process, same thing
    python recipes/finetune.py --config ... --prepare-only                # only tokenize into the cache
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/finetune.py   # DDP on CPU

Writes to output_dir: config.yaml, run.json, metrics.jsonl, loss.png, checkpoints/step-N/, final/.
SIGUSR1 (exit 0), SIGTERM or Ctrl-C (exit 128+signal) stop every process at the same step
after a complete checkpoint; run the same command again to continue.

The method is declared in llmtrain/core/finetune.py and listed in llmtrain/methods.py.
"""

import sys

from llmtrain.cli import run_cli
from llmtrain.recipe import run


def main(argv=None):
    run("finetune", argv)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])

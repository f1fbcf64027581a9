"""Fine-tune a causal language model (full or LoRA) on instruction, chat or text data.

    accelerate launch recipes/finetune.py                       # offline demo (recipes/configs/demo.yaml)
    accelerate launch recipes/finetune.py --config recipes/configs/llama_full.yaml train.lr=2e-5
    python recipes/finetune.py output_dir=runs/try data.packing=true     # one process, same thing
    python recipes/finetune.py --config ... --prepare-only                # only tokenize into the cache
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/finetune.py   # DDP on CPU

Writes to output_dir: config.yaml, run.json, metrics.jsonl, loss.png, checkpoints/step-N/, final/.
SIGUSR1 (exit 0), SIGTERM or Ctrl-C (exit 128+signal) stop every process at the same step
after a complete checkpoint; run the same command again to continue.
"""

import sys
from pathlib import Path

from llmtrain.cli import run_cli
from llmtrain.config import Config
from llmtrain.core.objective import TokenLoss
from llmtrain.data.build import ROWS
from llmtrain.model import disable_dropout
from llmtrain.recipe import Parts, Recipe, run


def sft_parts(cfg, accelerator, model, tokenizer, train_set, eval_set) -> Parts:
    """The summed cross-entropy of the trained tokens, over padded or packed rows."""
    if cfg.model.dropout == "none":
        disable_dropout(model)
    return Parts(TokenLoss.for_model(model, cfg.train.loss_chunk_logits, cfg.model.router_aux_loss))


RECIPE = Recipe(
    schema=Config,
    default_config=Path(__file__).parent / "configs" / "demo.yaml",
    description=__doc__.splitlines()[0],
    data=ROWS,
    parts=sft_parts,
    name="finetune",
)


def main(argv=None):
    run(RECIPE, argv)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])

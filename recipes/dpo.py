"""Preference-tune a causal LM (full or LoRA): DPO, IPO, SimPO or ORPO on chosen/rejected pairs, KTO on labelled rows.

    accelerate launch recipes/dpo.py                            # offline demo (recipes/configs/dpo_demo.yaml)
    accelerate launch recipes/dpo.py --config recipes/configs/dpo_lora.yaml \\
        model.name_or_path=runs/sft/final data.train=prefs.jsonl
    python recipes/dpo.py dpo.loss=ipo dpo.beta=0.5                      # one process, same thing
    python recipes/dpo.py --config recipes/configs/kto_demo.yaml         # KTO: {prompt, completion, label} rows
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/dpo.py   # DDP on CPU

The same config tree and outputs as finetune.py, plus the dpo section (beta, loss,
simpo_gamma, sft_weight, reference, desirable_weight, undesirable_weight). The step's loss
is the mean over every pair (KTO: every row) of the global batch; a pair's two answers
always sit in one micro-batch.

The method is declared in llmtrain/preference/method.py and listed in llmtrain/methods.py.
"""

import sys

from llmtrain.cli import run_cli
from llmtrain.recipe import run


def main(argv=None):
    run("dpo", argv)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])

"""Distil a teacher model into a causal language model: GKD, on-policy or offline (full or LoRA).

    accelerate launch recipes/distill.py                          # offline demo (recipes/configs/distill_demo.yaml)
    accelerate launch recipes/distill.py --config recipes/configs/distill.yaml \\
        model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct distill.teacher=Qwen/Qwen2.5-7B-Instruct data.train=chats.jsonl
    python recipes/distill.py distill.on_policy_fraction=0 distill.beta=0     # offline, forward KL, one process
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/distill.py   # DDP on CPU

The same config tree and outputs as finetune.py, plus the distill section (the teacher,
the divergence, how many answers the student samples itself). The rows are SFT rows; the
loss is a divergence between the student's and the frozen teacher's next-token
distributions at every trained token, the same on any number of processes and any split
into micro-batches (docs/distill.md).

The method is declared in llmtrain/distill/method.py and listed in llmtrain/methods.py.
"""

import sys

from llmtrain.cli import run_cli
from llmtrain.recipe import run


def main(argv=None):
    run("distill", argv)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])

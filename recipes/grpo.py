"""Train a causal language model with online RL from verifiable rewards: GRPO (full or LoRA).

    accelerate launch recipes/grpo.py                            # offline demo (recipes/configs/grpo_demo.yaml)
    accelerate launch recipes/grpo.py --config recipes/configs/grpo.yaml \\
        model.name_or_path=runs/sft/final data.train=prompts.jsonl grpo.rewards=[accuracy,my_rewards.py:short]
    python recipes/grpo.py grpo.num_generations=4 grpo.loss_type=grpo        # one process, same thing
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/grpo.py   # DDP on CPU

The same config tree and outputs as finetune.py, plus the grpo section (group size,
sampling, rewards, advantages, loss, KL). train.micro_batch_size counts prompts; each
brings grpo.num_generations completions. A step's generations, rewards, advantages and
loss are the same on any number of processes and any split into micro-batches
(docs/grpo.md).

The method is declared in llmtrain/rl/method.py and listed in llmtrain/methods.py.
"""

import sys

from llmtrain.cli import run_cli
from llmtrain.recipe import run


def main(argv=None):
    run("grpo", argv)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])

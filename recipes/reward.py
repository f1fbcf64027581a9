"""Train a reward model (full or LoRA): a causal LM with a one-number score head, on chosen/rejected pairs.

    accelerate launch recipes/reward.py                         # offline demo (recipes/configs/reward_demo.yaml)
    accelerate launch recipes/reward.py --config recipes/configs/reward.yaml \\
        model.name_or_path=runs/sft/final data.train=prefs.jsonl data.eval=prefs_eval.jsonl
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/reward.py   # DDP on CPU

The same config tree, pair data and outputs as dpo.py, plus the reward section. The model
loads with AutoModelForSequenceClassification (one label; the score head starts random);
the loss is the Bradley-Terry loss, the mean over every pair of the global batch, less a
pair's 'margin' column where the data has one. final/ loads with
AutoModelForSequenceClassification and scores text in plain transformers, and serves
recipes/grpo.py as a reward (grpo.rewards=[reward_model:DIR]).

The method is declared in llmtrain/preference/method.py and listed in llmtrain/methods.py.
"""

import sys

from llmtrain.cli import run_cli
from llmtrain.recipe import run


def main(argv=None):
    run("reward", argv)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])

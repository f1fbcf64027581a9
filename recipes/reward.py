"""Train a reward model (full or LoRA): a causal LM with a one-number score head, on chosen/rejected pairs.

    accelerate launch recipes/reward.py                         # offline demo (recipes/configs/reward_demo.yaml)
    accelerate launch recipes/reward.py --config recipes/configs/reward_demo.yaml \\
        model.name_or_path=runs/sft/final data.train=prefs.jsonl reward.center_coefficient=0.01
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/reward.py   # DDP on CPU

The same config tree, pair data and outputs as dpo.py, plus the reward section. The model
loads with AutoModelForSequenceClassification (one label; the score head starts random);
the loss is the Bradley-Terry loss, the mean over every pair of the global batch, less a
pair's 'margin' column where the data has one. final/ loads with
AutoModelForSequenceClassification and scores text in plain transformers, and serves
recipes/grpo.py as a reward (grpo.rewards=[reward_model:DIR]).
"""

import sys
from pathlib import Path

from llmtrain.attention import transformers_model
from llmtrain.cli import run_cli
from llmtrain.config import RewardConfig
from llmtrain.model import disable_dropout, pad_id
from llmtrain.preference.pairs import PairCollator
from llmtrain.preference.reward import REWARD_PAIRS, RewardLoss, score_head
from llmtrain.recipe import Parts, Recipe, run


def reward_parts(cfg, accelerator, model, tokenizer, train_set, eval_set) -> Parts:
    """The Bradley-Terry loss over pair batches that carry each pair's margin."""
    disable_dropout(model)
    pad = pad_id(tokenizer)
    # Where transformers' sequence classifiers read a sequence's score (its last token that
    # is not padding): set before training, so final/config.json carries it.
    transformers_model(model).config.pad_token_id = pad
    objective = RewardLoss(score_head(model), pad, cfg.reward.center_coefficient)
    collator = PairCollator(pad, 2 * cfg.data.max_seq_len if cfg.data.packing else 0, margins=True)
    return Parts(objective, collator)


RECIPE = Recipe(
    schema=RewardConfig,
    default_config=Path(__file__).parent / "configs" / "reward_demo.yaml",
    description=__doc__.splitlines()[0],
    data=REWARD_PAIRS,
    parts=reward_parts,
    name="reward",
)


def main(argv=None):
    run(RECIPE, argv)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])

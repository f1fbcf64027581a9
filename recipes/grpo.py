"""Train a causal language model with online RL from verifiable rewards: GRPO (full or LoRA).

    accelerate launch recipes/grpo.py                            # offline demo (recipes/configs/grpo_demo.yaml)
    accelerate launch recipes/grpo.py --config recipes/configs/grpo_demo.yaml \\
        model.name_or_path=runs/sft/final data.train=prompts.jsonl grpo.rewards=[accuracy,my_rewards.py:short]
    python recipes/grpo.py grpo.num_generations=4 grpo.loss_type=grpo        # one process, same thing
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/grpo.py   # DDP on CPU

The same config tree and outputs as finetune.py, plus the grpo section (group size,
sampling, rewards, advantages, loss, KL). train.micro_batch_size counts prompts; each
brings grpo.num_generations completions. A step's generations, rewards, advantages and
loss are the same on any number of processes and any split into micro-batches
(docs/grpo.md).
"""

import sys
from pathlib import Path

from llmtrain.cli import run_cli
from llmtrain.config import GRPOConfig
from llmtrain.core.logps import label_logps
from llmtrain.core.objective import chunk_positions, model_inputs
from llmtrain.model import chunkable_head, disable_dropout, load_model, reference_config, whole_models
from llmtrain.recipe import Parts, Recipe, run
from llmtrain.rl.loss import GRPOLoss
from llmtrain.rl.prompts import grpo_prompts, prompt_columns
from llmtrain.rl.rewards import check_grpo, load_rewards
from llmtrain.rl.rollout import Rollouts, RolloutSettings
from llmtrain.rl.sampling import HFGenerator


def grpo_parts(cfg, accelerator, model, tokenizer, train_set, eval_set) -> Parts:
    """The GRPO loss, and the rollouts that generate its micro-batches from the prepared
    model; with grpo.beta, the reference (adapters off with LoRA, else a frozen copy)."""
    disable_dropout(model)
    g, logits = cfg.grpo, cfg.train.loss_chunk_logits
    rewards = load_rewards(cfg.reward_names(), prompt_columns(train_set), g.format_pattern)  # checked: grpo_prompts
    head = chunkable_head(model) if logits else None
    chunk = chunk_positions(head, logits)
    objective = GRPOLoss(
        g.loss_type,
        g.epsilon,
        g.epsilon_high,
        g.beta,
        g.temperature,
        g.max_completion_length,
        chunk,
        head,
        estimator=g.scale_rewards,
    )
    frozen = None
    if g.beta and not cfg.model.lora.enabled:  # a full fine-tune's reference: the starting weights, kept apart
        with whole_models():  # a whole copy on each process, never partitioned by ZeRO-3
            frozen = load_model(reference_config(cfg.model, g.reference))
        frozen.requires_grad_(False).eval().to(accelerator.device)

    def source(prepared, backend, beat):
        reference = None
        if g.beta and frozen is None:

            def reference(batch):
                with accelerator.unwrap_model(prepared).disable_adapter():
                    return objective.logps(prepared, batch)

        elif frozen is not None:
            frozen_head = chunkable_head(frozen) if logits else None
            frozen_chunk = chunk_positions(frozen_head, logits)

            def reference(batch):
                with accelerator.autocast():
                    inputs = model_inputs(frozen, batch)
                    return label_logps(frozen, inputs, batch["labels"], frozen_head, frozen_chunk, g.temperature)

        synced = backend.sharded and accelerator.num_processes > 1
        generator = HFGenerator(tokenizer, g.max_completion_length, g.temperature, g.top_k, g.top_p, synced)
        settings = RolloutSettings.from_config(cfg)
        return Rollouts(
            settings,
            accelerator,
            prepared,
            tokenizer,
            train_set,
            objective,
            generator,
            rewards,
            reference,
            beat,
            eval_set,
        )

    return Parts(objective, source=source)


RECIPE = Recipe(
    schema=GRPOConfig,
    default_config=Path(__file__).parent / "configs" / "grpo_demo.yaml",
    description=__doc__.splitlines()[0],
    data=grpo_prompts,
    parts=grpo_parts,
    name="grpo",
    check=check_grpo,
)


def main(argv=None):
    run(RECIPE, argv)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])

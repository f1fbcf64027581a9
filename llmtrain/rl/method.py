"""GRPO as a method (recipes/grpo.py), as the method table (llmtrain/methods.py) lists it:
prompt rows, rollouts generated from the policy as the loop draws them, and the clipped
policy-gradient objective."""

from __future__ import annotations

import copy

from ..core.logps import label_logps
from ..core.method import Method, Parts, PlanFigures, scaled_length
from ..core.objective import chunk_positions, model_inputs
from ..data.rows import stop_ids
from ..model import (
    chunkable_head,
    disable_dropout,
    kv_cache_bytes,
    load_frozen,
    saved_weights_bytes,
)
from .agent import Agent, check_positions
from .config import GRPOConfig
from .loss import GRPOLoss
from .prompts import grpo_prompts, prompt_columns
from .rewards import REWARD_MODEL, check_grpo, load_rewards
from .rollout import Rollouts, RolloutSettings
from .sampling import HFGenerator


def grpo_parts(cfg, accelerator, model, tokenizer, train_set, eval_set) -> Parts:
    """The GRPO loss (its advantage estimator: grpo.scale_rewards), and the rollouts that
    generate its micro-batches from the prepared model; with grpo.beta, the reference
    (adapters off with LoRA, else a frozen copy)."""
    disable_dropout(model)
    g, logits = cfg.grpo, cfg.train.loss_chunk_logits
    agent = Agent.load(cfg)  # loaded by grpo_prompts too (the files run once): None for one turn
    if agent is not None:
        agent.check_template(tokenizer, stop_ids(getattr(model, "generation_config", None), tokenizer))
        check_positions(model, cfg)
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
        cispo_epsilon_high=g.cispo_epsilon_high,
    )
    frozen = None
    if g.beta and not cfg.model.lora.enabled:  # a full fine-tune's reference: the starting weights, kept apart
        frozen = load_frozen(cfg.model, g.reference, accelerator.device)  # whole on each process

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

        synced = backend.topology.sharded and accelerator.num_processes > 1
        generator = HFGenerator(
            tokenizer, g.max_completion_length, g.temperature, g.top_k, g.top_p, synced, cfg.data.max_image_pixels
        )
        evaluating = copy.copy(generator)  # grpo.eval_samples > 1 samples at a temperature of its own
        evaluating.temperature = g.eval_temperature
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
            agent,
            evaluating,
        )

    return Parts(objective, source)


def grpo_data(cfg):
    """recipes/grpo.py's prompts (prompts.grpo_prompts), with the run's tools and environments."""
    return grpo_prompts(cfg, Agent.load(cfg))


def describe_prompts(cfg, first: dict, tokenizer) -> list[str]:
    g, t = cfg.grpo, cfg.train
    per_micro = t.micro_batch_size * g.num_generations
    if g.beta:
        reference = (
            "the model with its LoRA adapters off"
            if cfg.model.lora.enabled
            else f"{g.reference or 'the starting weights'}: a frozen copy, whole on each process"
        )
    else:
        reference = "none (grpo.beta=0)"
    return [
        f"\n== GRPO ({g.loss_type}, {g.num_generations} completions per prompt) ==",
        f"  per micro-batch: {t.micro_batch_size} prompt(s) x {g.num_generations} = {per_micro} sequences "
        f"of at most {cfg.data.max_seq_len} tokens",
        f"  generated per process and round: {t.micro_batch_size * t.grad_accum_steps * g.num_generations} "
        f"completions, at most {g.max_completion_length} tokens each; each round trains {g.num_iterations} "
        "optimizer step(s)",
        f"  sampling: temperature {g.temperature:g}, top_p {g.top_p:g}, top_k {g.top_k or 'all'}",
        f"  rewards: {', '.join(cfg.reward_names())}"
        + (f" (weights {', '.join(f'{w:g}' for w in g.reward_weights)})" if g.reward_weights else ""),
        f"  advantages: scale_rewards={g.scale_rewards}; clip [1 - {g.epsilon:g}, 1 + {g.epsilon_high or g.epsilon:g}]",
        f"  KL reference: {reference}",
        *agent_lines(cfg),
        "\n== first training prompt (as the model is asked it) ==",
        tokenizer.decode(first["prompt_ids"]),
    ]


def agent_lines(cfg) -> list[str]:
    """What `llmtrain plan` says of a multi-turn run's episodes: turns, budget, tools."""
    if not cfg.agentic():
        return []
    g = cfg.grpo
    lines = [
        f"  episodes: at most {g.max_turns} turns, sharing {g.max_completion_length} completion tokens (the model's "
        "turns and the tool results between them; only the model's are trained)",
        f"  tool calls: {g.tool_timeout_s:g} s each at most, results cut at {g.max_tool_output_chars} characters",
    ]
    if g.tools:
        lines.append(f"  tools: {', '.join(g.tools)}")
    if cfg.environment_names():
        lines.append(f"  environment: {', '.join(cfg.environment_names())} (one instance per episode)")
    return lines


def verify_overrides(cfg, max_seq_len: int) -> list[str]:
    """`llmtrain verify`'s runs: the user's rewards and one that a random model's answers
    spread over (rewards.even_tokens), so that the groups have advantages and the runs
    train; with reward weights given, a weight of 1 for it. The completions are as much
    shorter as the runs' sequences (`max_seq_len`), so they leave a prompt room still."""
    rewards = [*cfg.reward_names(), "llmtrain.rl.rewards:even_tokens"]
    completions = scaled_length(cfg.grpo.max_completion_length, cfg, max_seq_len)
    out = [f"grpo.rewards=[{', '.join(rewards)}]", f"grpo.max_completion_length={completions}"]
    if cfg.grpo.reward_weights:
        out.append(f"grpo.reward_weights=[{', '.join(str(w) for w in [*cfg.grpo.reward_weights, 1.0])}]")
    return out


def position(cfg) -> dict:
    """An RL run's position counts generation rounds of this many prompts and steps."""
    return {"grpo.num_generations": cfg.grpo.num_generations, "grpo.num_iterations": cfg.grpo.num_iterations}


def steps_per_epoch(cfg, prompts: int, world: int) -> int:
    """Whole generation rounds of a pass, each trained grpo.num_iterations times (Rollouts)."""
    return RolloutSettings.from_config(cfg).steps_per_epoch(prompts, world)


def memory(cfg, mcfg, total: int, width: int, tokens: int) -> dict[str, float]:
    """Generation's KV cache, the frozen reference copy and the reward models."""
    out = {"generation KV cache": kv_cache_bytes(mcfg, width, tokens)}
    if cfg.grpo.beta and not cfg.model.lora.enabled:  # the frozen reference copy, whole on each process
        out["reference model"] = float(total * width)
    for name in cfg.reward_names():
        if name.startswith(REWARD_MODEL):  # loaded whole on each process, in the dtype it was saved in
            path = name[len(REWARD_MODEL) :]
            out[f"reward model {path}"] = saved_weights_bytes(path)
    return out


GRPO = Method(
    name="grpo",
    schema=GRPOConfig,
    description="Train a causal language model with online RL from verifiable rewards: GRPO (full or LoRA).",
    data=grpo_data,
    parts=grpo_parts,
    describe=describe_prompts,
    demo="grpo_demo.yaml",
    template="grpo.yaml",
    check=check_grpo,
    position=position,
    tags=lambda cfg: ["grpo"] + (["tool-use"] if cfg.grpo.tools or cfg.grpo.environment else []),
    verify=verify_overrides,
    plan=PlanFigures(
        sequences=lambda cfg: cfg.grpo.num_generations,  # a prompt brings a group of completions
        # A prompt's whole group, at most max_completion_length tokens each.
        tokens=lambda cfg, mean: (mean + cfg.grpo.max_completion_length) * cfg.grpo.num_generations,
        steps_per_epoch=steps_per_epoch,
        memory=memory,
    ),
)

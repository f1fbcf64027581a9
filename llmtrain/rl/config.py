"""recipes/grpo.py's config tree: Config plus the grpo section (group size, sampling,
rewards, advantages, loss, KL), with the checks GRPO makes of the shared sections.
grpo.loss_type and grpo.scale_rewards take the names of rl/loss.LOSS_TYPES and
rl/advantages.ESTIMATORS, so a new loss type or estimator is one entry there."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from ..config import Config
from ..config.validate import ASSET, AT_LEAST_1, PATHS_IN_NAME, POSITIVE, Bounds
from .advantages import ESTIMATORS
from .correction import CORRECTIONS, LEVELS
from .loss import LOSS_TYPES


@dataclass
class GRPOSection:
    num_generations: Annotated[int, Bounds(2)] = 8
    """Completions sampled per prompt: a group, whose rewards are compared with each other
    (recipes/grpo.py). A micro-batch holds train.micro_batch_size prompts x this many
    completions."""
    max_completion_length: Annotated[int, AT_LEAST_1] = 256
    """Tokens generated per completion at most; a completion that reaches it without ending
    its turn is clipped (and counted in the metrics). A prompt must leave room for it within
    data.max_seq_len."""
    temperature: Annotated[float, POSITIVE] = 1.0
    """Sampling temperature; the log-probs the loss uses are those of the same tempered
    distribution."""
    top_p: Annotated[float, Bounds(0, 1, low_open=True)] = 1.0
    """Nucleus sampling: sample among the most likely tokens whose probabilities add up to
    this; 1 for all."""
    top_k: int = 0
    """Sample among this many most likely tokens; 0 for all."""
    rewards: Annotated[str | list[str], PATHS_IN_NAME] = field(default_factory=lambda: ["accuracy"])
    """Reward functions: built-in 'accuracy' (the completion's answer against the row's
    'answer' column, numbers compared as numbers), 'format' (the completion matches
    grpo.format_pattern) and 'reward_model:DIR' (a reward model's score, recipes/reward.py),
    or your own as 'module:function' or 'path/to/file.py:function',
    called as TRL calls them: f(prompts, completions, completion_ids, **columns) -> a
    number (or None) per completion."""
    reward_weights: list[float] = field(default_factory=list)
    """A weight per reward function (empty: 1 each); a completion's reward is the weighted
    sum, its unscored (None) terms left out."""
    format_pattern: str = ""
    """The regular expression the built-in 'format' reward asks a whole completion to match
    (after stripping spaces at its ends)."""
    scale_rewards: Literal[tuple(ESTIMATORS)] = "group"
    """The advantage estimator (docs/grpo.md): reward - its group's mean, divided by the
    group's standard deviation (group), the whole global batch's (batch), or not divided
    (none, as Dr. GRPO); or reward - the mean of the rest of its group (rloo, REINFORCE
    leave-one-out, as TRL's RLOOTrainer)."""
    loss_type: Literal[tuple(LOSS_TYPES)] = "dapo"
    """The policy loss and how per-token losses become the step's loss (docs/grpo.md): grpo,
    the mean over completions of each one's per-token mean; dr_grpo, the sum over tokens
    divided by completions x grpo.max_completion_length; dapo, the mean over every
    completion token of the global batch; gspo and gspo_token, one importance ratio per
    completion (GSPO: use a small grpo.epsilon, e.g. 3e-4 and epsilon_high 4e-4), averaged as
    grpo; cispo, the capped importance weight (grpo.cispo_epsilon_high) times each token's
    log-prob, averaged as dapo."""
    epsilon: Annotated[float, POSITIVE] = 0.2
    """The importance ratio is clipped to [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float = 0.0
    """The clip's upper side (DAPO's clip-higher, e.g. 0.28); 0 means grpo.epsilon."""
    cispo_epsilon_high: Annotated[float, POSITIVE] = 4.0
    """With grpo.loss_type=cispo: the importance weight is capped at 1 + this (TRL's
    epsilon_high of 5.0 under cispo is 4.0 here); its gradient is never dropped."""
    num_iterations: Annotated[int, AT_LEAST_1] = 1
    """Optimizer steps taken on each generation batch (GRPO's mu); after the first, the loss
    uses importance ratios against the log-probs the completions were sampled with."""
    importance_correction: Literal[CORRECTIONS] = "none"
    """Correct for the gap between the log-probs a completion was sampled with and the
    trainer's (docs/grpo.md#the-sampler-correction): tis weights each token's loss by the
    ratio trainer / sampler capped at grpo.importance_cap; mis by the ratio, or 0 where it
    exceeds the cap; none, no correction. Costs one no-grad forward per round."""
    importance_level: Literal[LEVELS] = "token"
    """With grpo.importance_correction: a ratio per token, or one per completion (the
    product of its tokens')."""
    importance_cap: Annotated[float, Bounds(1)] = 3.0
    """With grpo.importance_correction: the ratio's cap (tis) or the ratio above which the
    weight is 0 (mis), as TRL's vllm_importance_sampling_clip_max."""
    beta: float = 0.0
    """Weight of the KL term to the reference model (0: none, no reference is computed).
    The reference is the starting policy: with LoRA the model with its adapters off, for a
    full fine-tune a frozen copy of the starting weights (or grpo.reference)."""
    reference: Annotated[str, ASSET] = ""
    """With grpo.beta > 0 on a full fine-tune: the hub name or directory of another
    reference model; empty for the starting weights."""
    eval_samples: Annotated[int, AT_LEAST_1] = 1
    """Completions per evaluation prompt (data.eval). 1: one greedy completion, as the
    baseline's and every evaluation's reward. More: that many sampled at
    grpo.eval_temperature, seeded per (train.seed, prompt, sample) so every evaluation and
    every process count draws the same ones; the reward is their mean, and pass@k is
    reported for k = 1, the powers of 2 below, and this many."""
    eval_temperature: Annotated[float, POSITIVE] = 1.0
    """Sampling temperature of the evaluation's completions when grpo.eval_samples > 1
    (grpo.top_p and grpo.top_k apply as in training)."""
    eval_pass_threshold: float = 1.0
    """A completion passes a reward function when it scores at least this (1: a verifier's
    full score); pass@k is reported per function and for completions that pass every
    function that scored them."""
    log_completions: int = 2
    """Completions printed (with prompt and reward) every log.every_steps steps; 0 for
    none."""
    tools: Annotated[list[str], PATHS_IN_NAME] = field(default_factory=list)
    """Tools the model may call (docs/agents.md): Python functions as 'module:function' or
    'path/to/file.py:function', with type hints and a Google-style docstring, taken as TRL's
    `tools=` takes them. Their schemas go to the chat template's `tools`; a completion is
    then an episode of turns, each tool call's result appended between them."""
    environment: Annotated[str | list[str], PATHS_IN_NAME] = ""
    """An environment class (or factory) as 'module:Name' or 'path/to/file.py:Name', TRL's
    `environment_factory`: one instance per episode, its public methods its tools, an
    optional reset(**row) whose text is added to the prompt and get_reward() that scores
    the episode. A list of several: each row's 'environment' column names its own (Name)."""
    max_turns: Annotated[int, AT_LEAST_1] = 5
    """With tools: the model's turns per episode at most; the last one's tool calls are not
    made (counted as out_of_turns). All turns and tool results share
    grpo.max_completion_length tokens."""
    tool_timeout_s: Annotated[float, POSITIVE] = 30.0
    """With tools: seconds a tool call may run; one still running then is an error result
    the model sees ('timed out')."""
    max_tool_output_chars: Annotated[int, AT_LEAST_1] = 4000
    """With tools: characters of a tool's result the model sees at most; the rest is cut,
    with a note saying how much."""


@dataclass
class GRPOConfig(Config):
    """recipes/grpo.py's tree: every section of Config, plus grpo. train.micro_batch_size
    counts prompts."""

    RECIPE: ClassVar[str] = "recipes/grpo.py"

    grpo: GRPOSection = field(default_factory=GRPOSection)

    def reward_names(self) -> list[str]:
        r = self.grpo.rewards
        return [r] if isinstance(r, str) else list(r)

    def environment_names(self) -> list[str]:
        e = self.grpo.environment
        return ([e] if e else []) if isinstance(e, str) else list(e)

    def agentic(self) -> bool:
        """Whether completions are episodes of turns with tool calls (grpo.tools or
        grpo.environment)."""
        return bool(self.grpo.tools or self.environment_names())

    def problems(self) -> list[str]:
        p, g = super().problems(), self.grpo
        names = self.reward_names()
        environments = self.environment_names()
        if not names and not environments:
            p.append("grpo.rewards: give at least one reward function, e.g. grpo.rewards=[accuracy]")
        # An environment's get_reward is weighted last, when it has one (checked once loaded).
        if g.reward_weights and len(g.reward_weights) not in (len(names), len(names) + bool(environments)):
            extra = " (and one more, last, for the environment's get_reward)" if environments else ""
            p.append(
                f"grpo.reward_weights: {len(g.reward_weights)} weights for {len(names)} reward functions; give one "
                f"per function{extra}, or none for 1 each"
            )
        if any(not math.isfinite(w) for w in g.reward_weights):
            p.append("grpo.reward_weights: every weight must be a finite number")
        if "format" in names and not g.format_pattern:
            p.append("grpo.format_pattern: the 'format' reward needs the pattern completions must match, e.g. '\\S+'")
        if g.format_pattern:
            try:
                re.compile(g.format_pattern)
            except re.error as e:
                p.append(f"grpo.format_pattern: not a regular expression ({e}); fix it")
        if g.reference and not g.beta:
            p.append("grpo.reference: used only with grpo.beta > 0; set grpo.beta or remove grpo.reference")
        if g.reference and self.model.lora.enabled:
            p.append("grpo.reference: with LoRA the reference is the model with its adapters off; remove it")
        if g.max_completion_length >= self.data.max_seq_len:
            p.append(
                f"grpo.max_completion_length: {g.max_completion_length} leaves no room for a prompt within "
                f"data.max_seq_len={self.data.max_seq_len}; raise data.max_seq_len or lower it"
            )
        if self.data.packing:
            p.append("data.packing: recipes/grpo.py trains on generated completions, which it does not pack; remove it")
        if self.data.streaming:
            p.append("data.streaming: recipes/grpo.py reads its prompts whole; set data.streaming=false")
        if self.data.format != "auto":
            p.append(f"data.format: recipes/grpo.py reads prompt rows; remove data.format={self.data.format}")
        return p

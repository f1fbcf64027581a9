"""Held-out prompts answered and scored: the one evaluation behind GRPO's eval_reward and
pass@k (rollout.Rollouts.evaluate) and eval.tasks' generation tasks (tasks.Tasks), in
training and in `llmtrain eval`.

Each prompt gets `each` completions: one greedy, or sampled with seeds of their own
(sampling.sample_seed of train.seed, EVAL_PASS, the prompt's index, the completion's
number), so every evaluation of a run, every process layout and every rerun draws the same
ones. Process r takes prompts r, r + world, ...; every process makes the same number of
generate calls (a sharded model generates together), one with no prompt left repeats
its first. The rewards (completions x functions, NaN where a function left one
unscored) are summed over the processes into: the mean reward (the functions' weighted
sum), each function's mean, and pass@k (passk.py) per function and for every function
together.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from accelerate.utils import gather_object

from ..errors import RewardError
from .passk import pass_sums, reported_ks
from .sampling import sample_seed

# The pass number the evaluation's sampling seeds are drawn for (sampling.sample_seed): no
# training pass has it, so an evaluation never repeats a training round's draws.
EVAL_PASS = -1


def evaluate_prompts(
    prompts,
    each: int,
    seed: int,
    micro: int,
    accelerator,
    draw: Callable,
    score: Callable,
    labels: list[str],
    weights: torch.Tensor,
    threshold: float,
    beat,
    prefix: str = "eval_",
) -> dict[str, float]:
    """The figures of `prompts` (prepared prompt examples), `micro` prompts per generate
    call: draw(examples, seeds or None) gives their completions (`each` per example, in
    order; seeds None: greedy), score(examples, completions) their rewards
    ([completions, len(labels)], or raises RewardError: every process then raises it,
    after every process has made its generate calls). Keys: prefix + 'reward',
    'reward_<label>', 'pass@<k>' and 'pass@<k>_<label>' (a completion passes a function
    at `threshold` or more)."""
    n, rank, world = len(prompts), accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, n, world))
    calls = math.ceil(math.ceil(n / world) / micro)
    table, failure = [], ""
    for c in range(calls):
        beat(f"evaluating: generating for evaluation prompts, batch {c + 1} of {calls}")
        part = mine[c * micro : (c + 1) * micro]
        examples = [prompts[i] for i in part] or [prompts[0]]  # a process with none still generates
        seeds = None  # greedy
        if each > 1:
            seeds = [sample_seed(seed, EVAL_PASS, i, j) for i in (part or [0]) for j in range(each)]
        completions = draw(examples, seeds)
        if part and not failure:
            try:
                table.append(score(examples, completions))
            except RewardError as e:  # raised on every process together, below
                failure = str(e)
    if any(failures := gather_object([failure])):
        raise RewardError(f"{next(f for f in failures if f)} (on the evaluation prompts)")
    k = len(labels)
    local = torch.cat(table) if table else torch.zeros(0, k)
    sums = torch.stack([local.nan_to_num(0).sum(0), (~local.isnan()).sum(0).float()])
    total = (local * weights).nansum(1)
    weighted = torch.tensor([[float(total.sum()), float(len(total))]])
    ks = reported_ks(each)
    passes = pass_sums(local, each, ks, threshold)
    both = torch.cat([sums.reshape(1, -1), weighted, passes.reshape(1, -1)], 1).to(accelerator.device)
    summed = accelerator.reduce(both, reduction="sum").cpu()[0]
    out = {f"{prefix}reward": float(summed[2 * k] / summed[2 * k + 1])}
    for i, name in enumerate(labels):
        if summed[k + i] > 0:
            out[f"{prefix}reward_{name}"] = float(summed[i] / summed[k + i])
    estimates = summed[2 * k + 2 :].reshape(len(ks), k + 1) / n
    for j, size in enumerate(ks):
        out[f"{prefix}pass@{size}"] = float(estimates[j, k])
        for i, name in enumerate(labels):
            out[f"{prefix}pass@{size}_{name}"] = float(estimates[j, i])
    return out

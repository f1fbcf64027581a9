"""The optimizer and the learning-rate schedule.

There is no LR scheduler object: the rate is a pure function of the optimizer step, set
before each step (under DeepSpeed the optimizer steps inside backward, and ZeRO regroups
the parameters), and the step is in every checkpoint, so a resumed run has the same rates.
"""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig


def build_optimizer(model, t: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; no weight decay on biases and norm weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        # PyTorch's fused kernel on CPUs too (since 2.4), as Hugging Face's Trainer uses by default:
        # for 9.5M CPU weights a step took 0.2 s against 1.6 s for the per-tensor loop.
        fused=device.type in ("cuda", "cpu") or None,
    )


def learning_rate(step: int, total: int, t: TrainConfig) -> float:
    """The rate of optimizer step `step` (0-based) of `total`: linear warm-up to train.lr,
    then constant or a cosine or linear decay to train.lr x train.min_lr_ratio."""
    if step < t.warmup_steps:
        factor = (step + 1) / t.warmup_steps
    elif t.schedule == "constant":
        factor = 1.0
    else:
        progress = min(1.0, (step - t.warmup_steps) / max(1, total - t.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1 - progress
        factor = t.min_lr_ratio + (1 - t.min_lr_ratio) * shape
    return t.lr * factor

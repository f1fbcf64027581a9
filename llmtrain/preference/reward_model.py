"""Reward models: a causal LM's body with a one-number score head
(AutoModelForSequenceClassification, one label) trained on chosen/rejected pairs with the
Bradley-Terry loss (Ouyang et al. 2022), as an objective whose unit is the pair.

A sequence's score is the head's output at its last token that is not the pad token,
which is where transformers' own sequence-classification models read it
(`config.pad_token_id`), so final/ scores text in plain transformers exactly as training
scored it. Packed pairs are scored the same way, each answer sequence a sample of its own.

Per pair, with r the scores and m the pair's optional `margin` column (0 without):
    loss = -log sigmoid(r_chosen - r_rejected - m) + center_coefficient * (r_chosen + r_rejected)^2
summed over the pairs of a micro-batch; the step divides by the pairs of the whole global
batch, so the loss is the mean over every pair whatever the layout. The metrics are the
mean scores, their margin, and accuracy: how often the chosen answer scores higher.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..attention import transformers_model
from ..config import DataConfig
from ..core.objective import Loss, model_inputs
from ..errors import ModelError
from ..model import SCORE_HEADS
from .pairs import PAIRS, pair_margin

METRICS = ("accuracy", "rewards_chosen", "rewards_rejected", "rewards_margin")


def score_head(model) -> torch.nn.Module:
    """The sequence-classification head of a model loaded with model.head=score."""
    inner = transformers_model(model)
    for name in SCORE_HEADS:
        if isinstance(getattr(inner, name, None), torch.nn.Module):
            return getattr(inner, name)
    raise ModelError(
        f"model.name_or_path: {type(inner).__name__} has no score head ({', '.join(SCORE_HEADS)}); a reward model "
        "needs a model whose transformers sequence-classification class has one"
    )


@contextmanager
def head_outputs(head: torch.nn.Module):
    """Inside, `head`'s outputs (every position's score) are appended to the list yielded.
    A forward hook rather than the model's own pooled output: that holds one score per
    row, and packed rows hold several sequences."""
    outputs: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        yield outputs
    finally:
        handle.remove()


def last_positions(batch: dict, n: int, pad_id: int) -> torch.Tensor:
    """Per answer (0..n-1, `batch['answers']` numbers each position's): the flat index of its
    last token that is not `pad_id`, as transformers' sequence classifiers pool."""
    answers = batch["answers"].flatten()
    real = (answers >= 0) & (batch["input_ids"].flatten() != pad_id)
    index = torch.arange(answers.numel(), device=answers.device)
    last = torch.full((n,), -1, dtype=torch.long, device=answers.device)
    return last.scatter_reduce(0, answers[real], index[real], "amax")


def sequence_scores(
    model, batch: dict, head: torch.nn.Module, n: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each answer's score [n], every position's [rows, T]) of a pair batch."""
    with head_outputs(head) as outputs:
        model(**model_inputs(model, batch))
    every = outputs[-1].squeeze(-1).float()
    return every.flatten()[last_positions(batch, n, pad_id)], every


class RewardLoss:
    """The objective: the Bradley-Terry loss summed over the pairs of a micro-batch, and
    the METRICS as sums over them, with each pair's `margin` where the batch has them;
    `score` is the model's score head (`score_head`)."""

    unit = "pairs"
    metric_names = METRICS
    progress_metrics = {"accuracy": "acc"}
    head = None  # no output layer over the vocabulary

    def __init__(self, score: torch.nn.Module, pad_id: int, center: float = 0.0):
        self.score, self.pad_id, self.center = score, pad_id, center

    def count(self, batch: dict) -> int:
        return int(batch["pair_index"].numel())

    def __call__(self, model, batch: dict) -> Loss:
        k = self.count(batch)
        scores, every = sequence_scores(model, batch, self.score, 2 * k, self.pad_id)
        if k == 0:  # an empty batch: no pair, but the head and every weight in the graph
            return Loss(every.sum() * 0, {name: every.new_zeros(()) for name in METRICS})
        chosen, rejected = scores[:k], scores[k:]
        margin = batch["margin"].to(chosen) if "margin" in batch else 0.0
        loss = -F.logsigmoid(chosen - rejected - margin)
        if self.center:
            loss = loss + self.center * (chosen + rejected) ** 2
        c, r = chosen.detach(), rejected.detach()
        metrics = {
            "accuracy": (c > r).float().sum(),
            "rewards_chosen": c.sum(),
            "rewards_rejected": r.sum(),
            "rewards_margin": (c - r).sum(),
        }
        return Loss(loss.sum(), metrics)


def reward_pair(row: dict, tokenizer, cfg: DataConfig) -> dict:
    """A pair's example (PAIRS.process) with its `margin` (pair_margin), which is checked
    first (REWARD_PAIRS.make)."""
    margin = pair_margin(row)
    out = PAIRS.process(row, tokenizer, cfg)
    status = out.pop("status")
    return out | {"margin": margin, "status": status}


# Preference pairs with their `margin` column, packed as DPO packs them; text only, as
# reward models are (model.auto_class refuses a vision-language model's score head).
REWARD_PAIRS = dataclasses.replace(
    PAIRS, version="pairs-v4-margins-v2", make=reward_pair, empty=PAIRS.empty | {"margin": 0.0}, images=None
)

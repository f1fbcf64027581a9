"""Distillation's objective: at every trained position, a divergence between the student's
next-token distribution and the frozen teacher's, both at distill.temperature, summed over
the global batch's trained tokens and divided by their count (the shared step), so the loss
is the same on any layout.

With s and t the student's and teacher's log-probs over the vocabulary at a position
(log_softmax(logits / T), over the tokens both embed: a longer vocabulary is padding):

    jsd          beta KL(t || m) + (1 - beta) KL(s || m),  m = log((1 - beta) e^s + beta e^t)
                 beta = 0: KL(t || s), the forward KL of classic distillation
                 beta = 1: KL(s || t), the reverse KL
    reverse_kl   at the sampled token x (the student's own sample), with k1 = s(x) - t(x):
                 k1 estimator   sg(k1) s(x): the policy gradient with the per-token reward -k1,
                                in expectation each position's reverse KL gradient given its prefix
                 k3 estimator   exp(-k1) + k1 - 1, minimised directly (low variance, biased)
                 plus, with forward_top_k, KL(t_k || s) over the teacher's top k tokens

as TRL's GKDTrainer.generalized_jsd_loss defines jsd (tests/distill/test_loss.py compares
them), with t cut to its top_k tokens and renormalised where distill.top_k is set. sg is the
stop-gradient. The teacher runs inside the objective, under no_grad, on the same inputs
(padded or packed) as the student.
"""

from __future__ import annotations

import math

import torch

from ..core.objective import Loss, model_inputs
from ..data.rows import IGNORE

LOSSES = ("jsd", "reverse_kl")
ESTIMATORS = ("k1", "k3")


def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row, from log-probs; a's impossible tokens (-inf) add nothing."""
    return torch.where(a > -math.inf, a.exp() * (a - b), torch.zeros_like(a)).sum(-1)


def generalized_jsd(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """The generalized JSD per row of student and teacher log-probs (module docstring)."""
    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


def top_k_only(logp: torch.Tensor, k: int) -> torch.Tensor:
    """Log-probs cut to each row's k most likely tokens and renormalised (-inf elsewhere)."""
    if not k or k >= logp.shape[-1]:
        return logp
    values, where = logp.topk(k, dim=-1)
    return torch.full_like(logp, -math.inf).scatter(-1, where, values - values.logsumexp(-1, keepdim=True))


class DistillLoss:
    """The objective of recipes/distill.py (module docstring). `teacher` is the frozen model;
    `metric_names` adds the share of trained tokens the student sampled itself (`on_policy`,
    with on-policy rows in the run) and, for reverse_kl, the mean k1 (`reverse_kl`)."""

    unit = "tokens"
    head = None  # whole logits: the divergence needs the vocabulary at every trained position

    def __init__(
        self,
        teacher,
        loss: str = "jsd",
        beta: float = 0.5,
        temperature: float = 1.0,
        top_k: int = 0,
        estimator: str = "k1",
        forward_top_k: int = 0,
        on_policy: bool = False,
    ):
        if loss not in LOSSES or estimator not in ESTIMATORS:
            raise ValueError(f"unknown distillation loss {loss!r} or estimator {estimator!r}")
        self.teacher, self.loss, self.beta, self.temperature = teacher, loss, beta, temperature
        self.top_k, self.estimator, self.forward_top_k = top_k, estimator, forward_top_k
        names = (("on_policy",) if on_policy else ()) + (("reverse_kl",) if loss == "reverse_kl" else ())
        self.metric_names = names
        self.progress_metrics = {"reverse_kl": "kl"} if loss == "reverse_kl" else {}

    def count(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE).sum())

    def log_probs(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        return (logits[:, :vocab].float() / self.temperature).log_softmax(-1)

    def __call__(self, model, batch: dict) -> Loss:
        mask = batch["labels"] != IGNORE
        student = model(**model_inputs(model, batch)).logits[mask]
        with torch.no_grad():
            teacher = self.teacher(**model_inputs(self.teacher, batch)).logits[mask]
        vocab = min(student.shape[-1], teacher.shape[-1])
        s, t = self.log_probs(student, vocab), self.log_probs(teacher, vocab)
        metrics = {}
        if self.loss == "jsd":
            per_token = generalized_jsd(s, top_k_only(t, self.top_k), self.beta)
        else:
            sampled = batch["labels"][mask][:, None]
            own, theirs = s.gather(1, sampled).squeeze(1), t.gather(1, sampled).squeeze(1)
            k1 = own - theirs
            per_token = k1.detach() * own if self.estimator == "k1" else torch.exp(-k1) + k1 - 1
            if self.forward_top_k:
                per_token = per_token + kl(top_k_only(t, self.forward_top_k), s)
            metrics["reverse_kl"] = k1.detach().sum()
        if "on_policy" in self.metric_names:
            rows = batch.get("on_policy", torch.zeros(mask.shape[0], device=mask.device))
            metrics["on_policy"] = (mask.sum(1) * rows).sum().float()
        return Loss(per_token.sum(), metrics)

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
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..core.objective import Loss, loss_head, model_inputs, trained_head
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
    with on-policy rows in the run) and, for reverse_kl, the mean k1 (`reverse_kl`).

    With `head` and `teacher_head` (both models' output layers, where the chunked loss can
    stand in for them: model.chunkable_head) and `chunk_tokens`, the logits exist for at most
    that many trained positions at a time (objective.trained_head): the teacher's hidden
    states at the trained positions are taken from inside its output layer's forward, and
    each chunk's divergence computes both models' logits for its positions only (recomputed
    in backward). Both models' whole float32 logits would otherwise take 2 x positions x
    vocabulary x 4 bytes; a 128k vocabulary makes that gigabytes per micro-batch."""

    unit = "tokens"

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
        head=None,
        chunk_tokens: int = 0,
        teacher_head=None,
    ):
        if loss not in LOSSES or estimator not in ESTIMATORS:
            raise ValueError(f"unknown distillation loss {loss!r} or estimator {estimator!r}")
        self.teacher, self.loss, self.beta, self.temperature = teacher, loss, beta, temperature
        self.top_k, self.estimator, self.forward_top_k = top_k, estimator, forward_top_k
        names = (("on_policy",) if on_policy else ()) + (("reverse_kl",) if loss == "reverse_kl" else ())
        self.metric_names = names
        self.progress_metrics = {"reverse_kl": "kl"} if loss == "reverse_kl" else {}
        self.teacher_head = teacher_head
        self.head, self.chunk = loss_head(head, chunk_tokens) if teacher_head is not None else (None, 0)

    def count(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE).sum())

    def log_probs(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        return (logits[:, :vocab].float() / self.temperature).log_softmax(-1)

    def divergence(self, student: torch.Tensor, teacher: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """[the summed loss, the summed k1 (detached; 0 for jsd)] of positions whose logits
        are `student` and `teacher` ([positions, vocabulary]) and whose labels are `sampled`."""
        vocab = min(student.shape[-1], teacher.shape[-1])
        s, t = self.log_probs(student, vocab), self.log_probs(teacher, vocab)
        if self.loss == "jsd":
            return torch.stack([generalized_jsd(s, top_k_only(t, self.top_k), self.beta).sum(), s.new_zeros(())])
        own, theirs = s.gather(1, sampled[:, None]).squeeze(1), t.gather(1, sampled[:, None]).squeeze(1)
        k1 = own - theirs
        per_token = k1.detach() * own if self.estimator == "k1" else torch.exp(-k1) + k1 - 1
        if self.forward_top_k:
            per_token = per_token + kl(top_k_only(t, self.forward_top_k), s)
        return torch.stack([per_token.sum(), k1.detach().sum()])

    def __call__(self, model, batch: dict) -> Loss:
        labels = batch["labels"]
        mask = labels != IGNORE
        if self.head is None:
            student = model(**model_inputs(model, batch)).logits[mask]
            with torch.no_grad():
                teacher = self.teacher(**model_inputs(self.teacher, batch)).logits[mask]
            sums = self.divergence(student, teacher, labels[mask])
        else:
            sums = self.chunked(model, batch, mask)
        metrics = {}
        if self.loss == "reverse_kl":
            metrics["reverse_kl"] = sums[1].detach()
        if "on_policy" in self.metric_names:
            rows = batch.get("on_policy", torch.zeros(mask.shape[0], device=mask.device))
            metrics["on_policy"] = (mask.sum(1) * rows).sum().float()
        return Loss(sums[0], metrics)

    def chunked(self, model, batch: dict, mask: torch.Tensor) -> torch.Tensor:
        """The divergence's sums, `self.chunk` trained positions at a time (class docstring)."""
        with torch.no_grad(), hidden_at(self.teacher_head, mask) as taken:
            self.teacher(**model_inputs(self.teacher, batch))
        teacher_hidden, sampled = taken[0], batch["labels"][mask]
        weight, bias = self.teacher_head.weight, self.teacher_head.bias
        # Each trained position's number in row-major order, where trained_head passes labels:
        # a chunk's numbers pick its teacher hidden states and sampled tokens.
        order = torch.full_like(batch["labels"], IGNORE)
        order[mask] = torch.arange(int(mask.sum()), device=mask.device)

        def per_chunk(hidden, w, b, at):
            with torch.no_grad():
                teacher = F.linear(teacher_hidden[at], weight, bias)
            return self.divergence(F.linear(hidden, w, b), teacher, sampled[at])

        with trained_head(self.head, order, self.chunk, per_chunk, _sums):
            return model(**model_inputs(model, batch)).logits


def _sums(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(parts).sum(0)


@contextmanager
def hidden_at(head: torch.nn.Linear, mask: torch.Tensor):
    """Inside, `head`'s forward records (in the list yielded) the hidden states it is given at
    the positions of `mask`, [positions, hidden] in row-major order, and returns no logits:
    a model's forward then computes none."""
    taken = []

    def forward(hidden):
        taken.append(hidden[mask])
        return hidden.new_zeros(())

    head.forward = forward
    try:
        yield taken
    finally:
        del head.forward

"""Preference tuning: the DPO, IPO, SimPO and ORPO losses over chosen/rejected pairs, as an
objective (see `objective`) whose unit is the pair.

A pair micro-batch (pairs.PairCollator) holds k pairs as 2k answer sequences, each with
its prompt: answers 0..k-1 are the chosen ones, k..2k-1 the rejected ones in the same
order. Padded, answer i is row i; packed, several sit in one row, each a sample of its
own under the packed mask, and `answers` says which position belongs to which. `labels` mark the answer tokens (end
of turn included) and are already shifted, as for SFT; `pair_index` numbers each pair in
the data (for the reference log-probs computed before training). The loss needs,
per answer, the sum of its tokens' log-probabilities (and their number, for the
length-normalised losses), under the policy and, except for SimPO, under the reference
model: the policy's starting weights. Summed over the pairs of a micro-batch; the step
divides by the pairs of the whole global batch, so the loss is the mean over every pair
whatever the batch layout.

The losses, with logratio(answer) = logp_policy(answer) - logp_reference(answer):
- sigmoid (DPO, Rafailov et al. 2023): -log sigmoid(beta * (logratio(chosen) - logratio(rejected)))
- ipo (Azar et al. 2023): (h - 1 / (2 beta))^2 with h the same difference of log-ratios
  taken per token (each answer's log-probs divided by its length)
- simpo (Meng et al. 2024): -log sigmoid(beta * (mean logp(chosen) - mean logp(rejected)) - gamma),
  per-token means under the policy alone (no reference)
- orpo (Hong et al. 2024): -mean logp(chosen) - beta * log sigmoid(log odds(chosen) - log odds(rejected)),
  odds(answer) = p / (1 - p) with p = exp(mean logp(answer)): the chosen answer's per-token
  NLL (SFT) plus the odds-ratio term, under the policy alone (no reference, no SFT stage).
  TRL's ORPOTrainer takes the NLL over every chosen token of its micro-batch; here it is each
  pair's own per-token mean, so the loss does not depend on how pairs are batched (the two
  agree pair by pair)
`sft_weight` adds that much of the chosen answer's per-token negative log-likelihood
(RPO, Pang et al. 2024). The reward of an answer is beta times its log-ratio (beta times
its per-token log-prob for SimPO, its per-token log-ratio for IPO): the metrics report
their means over the pairs and how often the chosen one scores higher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.logps import label_logps
from ..core.objective import Loss, loss_head, model_inputs
from ..data.rows import IGNORE

LOSSES = ("sigmoid", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")  # the losses of the policy alone
METRICS = (
    "rewards_chosen",
    "rewards_rejected",
    "rewards_margin",
    "rewards_accuracy",
    "logps_chosen",
    "logps_rejected",
)


@dataclass(frozen=True)
class AnswerLogps:
    """Per pair: each answer's summed token log-probability and its number of tokens."""

    chosen: torch.Tensor  # [pairs]
    rejected: torch.Tensor  # [pairs]
    chosen_tokens: torch.Tensor  # [pairs]
    rejected_tokens: torch.Tensor  # [pairs]

    @classmethod
    def from_rows(cls, logps: torch.Tensor, tokens: torch.Tensor) -> AnswerLogps:
        """From per-row sums and counts of a pair batch (chosen rows first)."""
        k = logps.shape[0] // 2
        return cls(logps[:k], logps[k:], tokens[:k], tokens[k:])

    def per_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chosen / self.chosen_tokens, self.rejected / self.rejected_tokens


def pair_losses(
    kind: str,
    beta: float,
    policy: AnswerLogps,
    reference: AnswerLogps | None,
    simpo_gamma: float = 0.5,
    sft_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) per pair; rewards carry no gradient."""
    if kind == "simpo":
        chosen, rejected = policy.per_token()
        loss = -F.logsigmoid(beta * (chosen - rejected) - simpo_gamma)
    elif kind == "sigmoid":
        chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        loss = -F.logsigmoid(beta * (chosen - rejected))
    elif kind == "ipo":
        (pc, pr), (rc, rr) = policy.per_token(), reference.per_token()
        chosen, rejected = pc - rc, pr - rr
        loss = (chosen - rejected - 1 / (2 * beta)) ** 2
    elif kind == "orpo":
        chosen, rejected = policy.per_token()
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        loss = -chosen - beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"unknown preference loss {kind!r}; one of {LOSSES}")
    if sft_weight:
        loss = loss + sft_weight * -(policy.chosen / policy.chosen_tokens)
    return loss, beta * chosen.detach(), beta * rejected.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012). A mean log-prob of
    0 (a probability that rounds to 1) is taken as -1e-6, where the log odds stay finite."""
    x = x.clamp(max=-1e-6)
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def row_logps(
    token_logps: torch.Tensor, labels: torch.Tensor, answers: torch.Tensor | None = None, n: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per answer: the sum of `token_logps` (one per trained position of `labels`
    [rows, T], in row-major order) and the number of trained positions. An answer is a
    row, or with `answers` ([rows, T], the answer of each position) one of `n` answers."""
    trained = labels != IGNORE
    if answers is None:
        which, n = trained.nonzero()[:, 0], labels.shape[0]
    else:
        which = answers[trained]
    sums = torch.zeros(n, dtype=token_logps.dtype, device=token_logps.device)
    counts = torch.zeros(n, dtype=torch.long, device=labels.device)
    return sums.index_add(0, which, token_logps), counts.index_add(0, which, torch.ones_like(which))


def answer_logps(
    model, inputs: dict, labels: torch.Tensor, head, chunk: int, answers: torch.Tensor | None = None, n=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per answer (`row_logps`): the summed log-prob of its trained tokens and their number,
    from the model's forward on `inputs` (core/logps.label_logps: inside the output layer
    `head`, `chunk` positions at a time, or from whole logits without a head)."""
    return row_logps(label_logps(model, inputs, labels, head, chunk), labels, answers, n)


class PreferenceLoss:
    """The objective: `kind` (one of LOSSES) summed over the pairs of a micro-batch, and
    the METRICS as sums over them. The reference log-probs come from `reference` (a
    [pairs, 2] table of each pair's chosen and rejected log-probs, looked up by the batch's
    `pair_index`; computed before training, see `reference`), from the same model with
    its LoRA adapters disabled (`adapters_off`), or are not needed (SimPO). With a `head`
    (the model's `chunkable_head`) and `chunk_tokens` > 0, the log-probs are computed
    inside the output layer, `chunk_tokens` positions at a time, so the full logits never
    exist."""

    unit = "pairs"
    metric_names = METRICS
    progress_metrics = {"rewards_accuracy": "acc"}  # shown on the progress bar

    def __init__(
        self,
        kind: str,
        beta: float,
        simpo_gamma: float = 0.5,
        sft_weight: float = 0.0,
        chunk_tokens: int = 0,
        head: torch.nn.Linear | None = None,
        adapters_off=None,
    ):
        if kind not in LOSSES:
            raise ValueError(f"unknown preference loss {kind!r}; one of {LOSSES}")
        self.kind, self.beta, self.simpo_gamma, self.sft_weight = kind, beta, simpo_gamma, sft_weight
        self.head, self.chunk = loss_head(head, chunk_tokens)
        self.adapters_off = adapters_off  # model -> context manager with the LoRA adapters disabled
        self.reference: torch.Tensor | None = None  # [pairs, 2], set before training

    @property
    def needs_reference_pass(self) -> bool:
        return self.kind not in REFERENCE_FREE and self.adapters_off is None

    def count(self, batch: dict) -> int:
        return int(batch["pair_index"].numel())

    def logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per answer (chosen ones first): the summed log-prob of its trained tokens, and
        their number."""
        inputs, n = model_inputs(model, batch), 2 * self.count(batch)
        return answer_logps(model, inputs, batch["labels"], self.head, self.chunk, batch["answers"], n)

    def reference_logps(self, model, batch: dict) -> torch.Tensor:
        """Per answer, under the reference model."""
        if self.reference is not None:
            ref = self.reference[batch["pair_index"]]
            return torch.cat([ref[:, 0], ref[:, 1]])
        if self.adapters_off is None:
            raise RuntimeError("PreferenceLoss: no reference log-probs; run the reference pass before training")
        with torch.no_grad(), self.adapters_off(model):
            return self.logps(model, batch)[0]

    def __call__(self, model, batch: dict) -> Loss:
        sums, tokens = self.logps(model, batch)
        # Also for an empty batch: with adapters off the reference is a forward pass, which
        # under DDP, ZeRO-3 and FSDP every process must make as often as the others.
        ref = self.reference_logps(model, batch) if self.kind not in REFERENCE_FREE else None
        if self.count(batch) == 0:  # an empty batch: no pair, but every weight in the graph
            return Loss(sums.sum() * 0, {name: sums.new_zeros(()) for name in METRICS})
        policy = AnswerLogps.from_rows(sums, tokens)
        reference = AnswerLogps.from_rows(ref.to(sums.dtype), tokens) if ref is not None else None
        loss, chosen, rejected = pair_losses(self.kind, self.beta, policy, reference, self.simpo_gamma, self.sft_weight)
        metrics = {
            "rewards_chosen": chosen.sum(),
            "rewards_rejected": rejected.sum(),
            "rewards_margin": (chosen - rejected).sum(),
            "rewards_accuracy": (chosen > rejected).float().sum(),
            "logps_chosen": policy.chosen.detach().sum(),
            "logps_rejected": policy.rejected.detach().sum(),
        }
        return Loss(loss.sum(), metrics)

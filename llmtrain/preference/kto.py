"""KTO (Ethayarajh et al. 2024) as an objective (see `objective`) whose unit is the row: one
completion with its label (desirable or undesirable) and its KL sequence (unpaired.py).

Per row, with logratio = logp_policy(completion) - logp_reference(completion), summed over
the completion's tokens:
- desirable: desirable_weight * (1 - sigmoid(beta * (logratio - z0)))
- undesirable: undesirable_weight * (1 - sigmoid(beta * (z0 - logratio)))
z0, the reference point, estimates the policy's KL divergence from the reference: the mean
over the KL sequences (each row's prompt with another row's completion) of
logp_policy - logp_reference, floored at 0 and carrying no gradient. It is taken over the
whole global batch, every micro-batch on every process, before the window's forward and
backward passes (`before_window`, which the step calls once per window), so it is one
number per step whatever the batch layout: 8 x 1, 2 x 4 and 2 processes x 2 x 2 give the
same update. (TRL's KTOTrainer takes the mean on each process's micro-batch, then the mean
of those over processes: an estimate that changes with the layout.) Evaluation takes it
over the whole evaluation set.

The loss is summed over the rows of a micro-batch and the step divides by the rows of the
global batch: the mean over every row, as TRL's. The reward of a row is beta x its
logratio.
"""

from __future__ import annotations

import torch

from ..core.objective import Loss, loss_head, model_inputs
from ..processor import MODEL_INPUTS
from .loss import answer_logps

METRICS = (
    "kl",
    "rewards_desirable",
    "rewards_undesirable",
    "desirable",
    "undesirable",
    "logps_desirable",
    "logps_undesirable",
)


def kto_losses(
    beta: float,
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    z0: torch.Tensor | float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, reward) per row from its completion's summed log-probs under the policy and
    the reference, its label (`desirable`, booleans) and the reference point `z0`; the
    rewards carry no gradient."""
    logratio = policy - reference
    loss = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (logratio - z0))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratio))),
    )
    return loss, beta * logratio.detach()


class KTOLoss:
    """The objective: KTO's loss summed over the rows of a micro-batch, and the METRICS as
    sums over them (`kl` is z0 for every row; `desirable` and `undesirable` count the rows
    of each kind, so `rewards_desirable / desirable` is the desirable rows' mean reward).
    The reference log-probs come from `reference` (a [rows, 2] table of each row's
    completion and KL completion log-probs, looked up by the batch's `row_index`; computed
    before training, see `reference`) or from the same model with its LoRA adapters
    disabled (`adapters_off`). `head` and `chunk_tokens` as for PreferenceLoss."""

    unit = "completions"
    metric_names = METRICS
    progress_metrics = {"kl": "kl"}  # shown on the progress bar

    def __init__(
        self,
        beta: float,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        chunk_tokens: int = 0,
        head: torch.nn.Linear | None = None,
        adapters_off=None,
    ):
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight
        self.head, self.chunk = loss_head(head, chunk_tokens)
        self.adapters_off = adapters_off  # model -> context manager with the LoRA adapters disabled
        self.reference: torch.Tensor | None = None  # [rows, 2], set before training
        self.z0: float | None = None  # the reference point of the window (or evaluation) under way

    @property
    def needs_reference_pass(self) -> bool:
        return self.adapters_off is None

    def count(self, batch: dict) -> int:
        return int(batch["row_index"].numel())

    def sequence_logps(self, model, batch: dict, kl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of the batch's completions (or, with `kl`, its KL sequences): the summed
        log-prob of its trained tokens, and their number."""
        prefix = "kl_" if kl else ""
        seqs = {key: batch[prefix + key] for key in ("input_ids", "attention_mask", "labels")}
        seqs |= {key: batch[prefix + key] for key in MODEL_INPUTS if prefix + key in batch}  # images
        return answer_logps(model, model_inputs(model, seqs), seqs["labels"], self.head, self.chunk)

    def logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The completions' log-probs and token counts, then the KL sequences': what the
        reference pass tabulates (reference.compute: a [rows, 2] table)."""
        sums, tokens = self.sequence_logps(model, batch)
        kl_sums, kl_tokens = self.sequence_logps(model, batch, kl=True)
        return torch.cat([sums, kl_sums]), torch.cat([tokens, kl_tokens])

    def reference_logps(self, model, batch: dict, kl: bool = False) -> torch.Tensor:
        """Per row (completion, or KL sequence with `kl`), under the reference model."""
        if self.reference is not None:
            return self.reference[batch["row_index"], int(kl)]
        if self.adapters_off is None:
            raise RuntimeError("KTOLoss: no reference log-probs; run the reference pass before training")
        with torch.no_grad(), self.adapters_off(model):
            return self.sequence_logps(model, batch, kl)[0]

    @torch.no_grad()
    def before_window(self, model, micro_batches, sum_over_processes) -> None:
        """z0 for the window: the KL sequences of every micro-batch (empty ones too, so that
        every process runs the same forward passes), summed here and over the processes
        (`sum_over_processes`, one collective), divided by their number, floored at 0.
        Evaluation passes every batch of its set at once (core.evaluate)."""
        total = None
        for batch in micro_batches:
            k = self.count(batch)
            policy = self.sequence_logps(model, batch, kl=True)[0][:k]
            ref = self.reference_logps(model, batch, kl=True)[:k]
            part = torch.stack([(policy.double() - ref.double()).sum(), policy.new_tensor(k, dtype=torch.float64)])
            total = part if total is None else total + part
        if total is None:  # no micro-batch at all: nothing to estimate from
            self.z0 = 0.0
            return
        kl_sum, rows = sum_over_processes(total).tolist()
        self.z0 = max(0.0, kl_sum / rows) if rows else 0.0

    def __call__(self, model, batch: dict) -> Loss:
        if self.z0 is None:
            raise RuntimeError("KTOLoss: no reference point; before_window must run before the window's batches")
        sums, _ = self.sequence_logps(model, batch)
        # Also for an empty batch: with adapters off the reference is a forward pass, which
        # under DDP, ZeRO-3 and FSDP every process must make as often as the others.
        ref = self.reference_logps(model, batch)
        k = self.count(batch)
        if k == 0:  # an empty batch: no row, but every weight in the graph
            return Loss(sums.sum() * 0, {name: sums.new_zeros(()) for name in METRICS})
        policy, desirable = sums[:k], batch["desirable"]
        loss, rewards = kto_losses(
            self.beta,
            policy,
            ref[:k].to(policy.dtype),
            desirable,
            self.z0,
            self.desirable_weight,
            self.undesirable_weight,
        )
        logps, undesirable = policy.detach(), ~desirable
        metrics = {
            "kl": policy.new_tensor(self.z0 * k),
            "rewards_desirable": rewards[desirable].sum(),
            "rewards_undesirable": rewards[undesirable].sum(),
            "desirable": desirable.sum().to(policy.dtype),
            "undesirable": undesirable.sum().to(policy.dtype),
            "logps_desirable": logps[desirable].sum(),
            "logps_undesirable": logps[undesirable].sum(),
        }
        return Loss(loss.sum(), metrics)

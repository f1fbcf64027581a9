"""Objectives: what an optimizer step minimises.

An objective turns one micro-batch into a loss summed over its units (trained tokens for
SFT), and counts those units from the batch alone. The step (`step.train_step`) adds the
summed losses of every micro-batch on every process and divides by the units of the whole
global batch, which every process learns before the forward passes (`window.draw_window`
sums the objective's `count` of each micro-batch over all processes). So the step's loss is the mean over the global
batch whatever its layout: 8 x 1, 2 x 4 and 2 processes x 2 x 2 give the same update.

How to add an objective (say, a preference loss over chosen/rejected pairs):

1. Write a class with
   - `unit`: what it counts, e.g. "pairs"; the step's metrics row logs the global count
     under this name;
   - `count(batch) -> int`: the units in a micro-batch, from the batch alone (no forward);
   - `__call__(model, batch) -> Loss`: the loss summed over those units, and any metrics
     of its own as sums over the units (`Loss.metrics`, e.g. how many pairs were ranked
     right); the step adds them over the global batch, divides by the global count and
     logs them beside the loss;
   - `metric_names`: the names of those metrics, every one of them, in a fixed order.
     They travel in the step's one reduce, which must have the same length on every
     process, so a metric a batch does not give counts 0 (names of the metrics row's own
     fields, like "loss", are refused by `train.setup`);
   - `progress_metrics`: those of its metrics the progress bar shows, by a short name
     (the eval line prints them too);
   - `head`: the output layer it runs only at counted positions, or None (for MFU);
   - optionally `before_window(model, micro_batches, sum_over_processes)`: what it must
     know of the whole global batch before any of its losses (KTO's reference point, a
     mean over every row of the window). `step.train_step` calls it once per window,
     before the forward and backward passes, with this process's micro-batches (`empty`
     ones included, so every process runs the same forward passes under DDP, ZeRO-3 and
     FSDP; run them under no_grad) and a function summing a tensor over all processes
     (one call, the same on every process). `evaluate.evaluate` calls it once with every
     batch of the evaluation set. Objectives without it are run as before.
2. An empty batch (the collator's `empty_batch`, e.g. `batches.Collator.empty_batch`)
   must count 0 and give a zero loss that still uses every trainable weight, and run the
   same forward passes as any other batch: processes with no data left run one so that
   every process joins the same collectives.
3. Return it from its method's `parts` (core/method.Parts, with the data source that makes
   its micro-batches: source.loader_source with a collator for prepared data;
   preference/loss.PreferenceLoss and preference/method.py are an example); everything else
   (windows, accumulation, skips, checkpoints, resume, logging) is shared.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..attention import packed_mask, padding_needs_mask, transformers_model
from ..data.rows import IGNORE
from ..model import chunkable_head
from ..processor import MODEL_INPUTS, image_blocks, packed_positions
from .router import RouterBalance


@dataclass(frozen=True)
class Loss:
    """One micro-batch's contribution."""

    total: torch.Tensor  # the loss summed over the micro-batch's units (differentiable)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # sums over the units, by metric_names


class Objective(Protocol):
    unit: str
    metric_names: tuple[str, ...]
    progress_metrics: dict[str, str]  # metric name -> its short name on the progress bar
    head: torch.nn.Module | None

    def count(self, batch: dict) -> int: ...

    def __call__(self, model, batch: dict) -> Loss: ...

    # Optional (see the module docstring): before_window(model, micro_batches, sum_over_processes) -> None


class TokenLoss:
    """Supervised fine-tuning: the summed cross-entropy of the trained tokens (labels are
    already shifted: labels[t] is the target of position t, or -100 for none).

    Packed batches get each layer's own mask within each sample (attention.packed_mask).
    With `chunk_tokens` > 0 and a `head` (the model's `chunkable_head`), the loss is
    computed inside the output layer's forward, `chunk_tokens` at a time and only at
    trained positions, so the full [tokens, vocab] fp32 logits never exist; it runs inside
    the model's forward, so DDP, FSDP and ZeRO-3 see the layer used as usual."""

    unit = "tokens"
    metric_names = ()
    progress_metrics: dict[str, str] = {}

    def __init__(self, chunk_tokens: int = 0, head: torch.nn.Linear | None = None, router: RouterBalance | None = None):
        self.head, self.chunk = loss_head(head, chunk_tokens)
        self.router = router
        if router is not None:  # mixture of experts: the router's balance, trained or only logged
            self.metric_names, self.progress_metrics = ("router_aux",), {"router_aux": "aux"}

    @classmethod
    def for_model(cls, model, chunk_logits: int, router_aux: str = "model") -> TokenLoss:
        """Built once, before accelerator.prepare: finds the output layer the chunked loss
        can stand in for (none for some architectures and LoRA-adapted heads), and the
        router loss of a mixture-of-experts model (router.RouterBalance)."""
        head = chunkable_head(model) if chunk_logits else None
        return cls(chunk_positions(head, chunk_logits), head, RouterBalance.for_model(model, router_aux))

    def count(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE).sum())

    def __call__(self, model, batch: dict) -> Loss:
        kwargs = model_inputs(model, batch)
        labels = batch["labels"]
        with self.router.recording() if self.router else nullcontext() as router_logits:
            if self.head is None:
                flat = model(**kwargs).logits.float().flatten(0, 1)
                total = F.cross_entropy(flat, labels.flatten(), ignore_index=IGNORE, reduction="sum")
            else:
                with trained_head(self.head, labels, self.chunk, _chunk_loss, _total):
                    total = model(**kwargs).logits
        if self.router is None:
            return Loss(total)
        aux = self.router.weighted_sum(router_logits, batch)
        return Loss(total + self.router.coef * aux, {"router_aux": aux.detach()})


def loss_head(head: torch.nn.Linear | None, chunk_tokens: int) -> tuple[torch.nn.Linear | None, int]:
    """(the output layer a loss runs chunk by chunk, positions per chunk), or (None, 0) for
    whole logits: without a chunk budget, or without a head that can be chunked."""
    return (head, chunk_tokens) if head is not None and chunk_tokens > 0 else (None, 0)


def chunk_positions(head: torch.nn.Linear | None, chunk_logits: int) -> int:
    """Positions per chunk of the chunked loss: train.loss_chunk_logits over the head's
    vocabulary, at least one; 0 (whole logits) without a head or a budget. Sized by logits,
    not positions, so that a small vocabulary is not chunked for memory it does not use."""
    if head is None or chunk_logits <= 0:
        return 0
    return max(1, chunk_logits // head.out_features)


def model_inputs(model, batch: dict) -> dict:
    """The model's keyword arguments for a padded batch (attention_mask where the backend
    needs it: attention.padding_needs_mask; batches.Collator pads on the right) or a packed
    one (position_ids restarting at 0 for each sample, and the model's own attention pattern
    within each sample, in the form of the backend the model was loaded with:
    attention.packed_mask)."""
    kwargs = {"input_ids": batch["input_ids"], "use_cache": False}
    kwargs |= {k: batch[k] for k in MODEL_INPUTS if k in batch}  # a vision-language model's images
    if getattr(transformers_model(model).config, "output_router_logits", False):
        # A mixture-of-experts config that asks for router logits makes the model take its
        # own load-balancing loss over the batch, reading the attention mask as a 2-D
        # padding mask: a packed mask fails there, and the loss is not used. The router
        # term is RouterBalance's, from hooks, per sample.
        kwargs["output_router_logits"] = False
    if "doc_ids" not in batch:
        if padding_needs_mask(model):
            kwargs["attention_mask"] = batch["attention_mask"]
        return kwargs
    # The parameters' dtype after prepare (DeepSpeed may have cast them): a cheap lookup.
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    kwargs["position_ids"] = batch["position_ids"]
    if "mm_token_type_ids" in batch:  # Qwen-VL: image tokens positioned in three dimensions
        kwargs["position_ids"] = packed_positions(transformers_model(model), batch)
    blocks = image_blocks(batch["token_type_ids"]) if "token_type_ids" in batch else None  # Gemma 3's images
    kwargs["attention_mask"] = packed_mask(transformers_model(model).config, batch["position_ids"], dtype, blocks)
    return kwargs


def _chunk_loss(hidden, weight, bias, labels):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, reduction="sum")


def _total(parts: list[torch.Tensor]) -> torch.Tensor:
    return sum(parts, parts[0].new_zeros((), dtype=torch.float32))


@contextmanager
def trained_head(head: torch.nn.Linear, labels: torch.Tensor, chunk: int, per_chunk, combine):
    """Inside, `head`'s forward returns, instead of logits, `combine` of
    `per_chunk(hidden, weight, bias, labels)` over the trained positions (labels not
    IGNORE, in row-major order), `chunk` positions at a time: logits exist for at most
    `chunk` tokens, and with more than one chunk each is recomputed in backward rather
    than kept. It runs inside the model's forward, so DDP, FSDP and ZeRO-3 see the layer
    used as usual. Afterwards the class's forward is back (generation, export)."""

    def forward(hidden):
        flat = labels.flatten()
        where = (flat != IGNORE).nonzero().squeeze(1)
        h, y = hidden.flatten(0, -2).index_select(0, where), flat.index_select(0, where)
        n = h.shape[0]
        parts = []
        for s in range(0, max(n, 1), chunk):  # one (empty) chunk keeps the head in the graph
            args = (h[s : s + chunk], head.weight, head.bias, y[s : s + chunk])
            parts.append(checkpoint(per_chunk, *args, use_reentrant=False) if n > chunk else per_chunk(*args))
        return combine(parts)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward

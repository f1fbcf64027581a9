"""The router load-balancing loss of mixture-of-experts models, per sample.

transformers' MoE models (Mixtral, Qwen-MoE, gpt-oss, ...) define an auxiliary loss that
pushes the router to spread tokens over the experts (`load_balancing_loss_func` in each
model's module, Switch Transformer's E * sum_e f_e * P_e), added to the loss times
`router_aux_loss_coef` when the config's `output_router_logits` is true. The model takes
it over whatever batch it is given, so its value (a product of two means over the batch's
tokens) would change with the micro-batch size and the number of processes. llmtrain
takes the model's own function over each sample's tokens alone (a packed sample, or an
unpadded row), and weights each sample by its trained tokens, like the main loss: the
step's sum over the global batch divided by its trained tokens is then the same for any
layout (8 x 1, 2 x 4, 2 processes).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from ..attention import transformers_model
from ..data.rows import IGNORE
from ..model import router_recorder


class RouterBalance:
    """One MoE model's load-balancing loss. Inside `recording()` the model's forward
    collects its routers' logits (hooks on the router modules that transformers records
    for output_router_logits; asking the model for them instead would also have it take
    its own loss over the batch, which fails on packed masks); `weighted_sum(logits,
    batch)` is then the sum over samples of (trained tokens x the model's loss over the
    sample's tokens)."""

    def __init__(self, loss_fn, num_experts: int, top_k: int, coef: float, routers: list, index: int):
        self.loss_fn, self.num_experts, self.top_k, self.coef, self.index = loss_fn, num_experts, top_k, coef, index
        self._logits: list | None = None
        for router in routers:  # kept for the model's life; they record only inside recording()
            router.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        if self._logits is not None:  # not in a checkpointed block's recomputation
            self._logits.append(output[self.index] if isinstance(output, tuple) else output)

    @contextmanager
    def recording(self):
        self._logits = []
        try:
            yield self._logits
        finally:
            self._logits = None

    @classmethod
    def for_model(cls, model, setting: str) -> RouterBalance | None:
        """None for a model without a router loss. `setting` (model.router_aux_loss): 'model'
        trains it as the config says (output_router_logits), 'train' always, 'log' never;
        it is computed and logged in each case."""
        base = transformers_model(model)
        loss_fn = getattr(sys.modules[type(base).__module__], "load_balancing_loss_func", None)
        coef = getattr(base.config, "router_aux_loss_coef", None)
        experts, top_k = getattr(base, "num_experts", None), getattr(base, "num_experts_per_tok", None)
        recorder = router_recorder(base)
        if loss_fn is None or coef is None or not experts or not top_k or recorder is None:
            return None
        routers = [m for m in model.modules() if isinstance(m, recorder.target_class)]
        trained = setting == "train" or (
            setting == "model" and bool(getattr(base.config, "output_router_logits", False))
        )
        return cls(loss_fn, experts, top_k, float(coef) if trained else 0.0, routers, recorder.index)

    def weighted_sum(self, router_logits: list[torch.Tensor], batch: dict) -> torch.Tensor:
        labels = batch["labels"]
        B, L = labels.shape
        if "doc_ids" in batch:  # a sample per (row, document); padding (-1) is none
            docs = batch["doc_ids"]
            samples = torch.where(docs >= 0, docs + L * torch.arange(B, device=docs.device)[:, None], -1)
        else:  # a sample per row, its padding excluded
            samples = torch.where(batch["attention_mask"].bool(), torch.arange(B, device=labels.device)[:, None], -1)
        samples, trained = samples.flatten(), (labels != IGNORE).flatten()
        total = router_logits[0].new_zeros((), dtype=torch.float32)
        for s in torch.unique(samples[samples >= 0]).tolist():
            rows = (samples == s).nonzero().squeeze(1)
            n = int(trained.index_select(0, rows).sum())
            if n:  # a sample with nothing trained weighs nothing
                gates = tuple(layer.index_select(0, rows) for layer in router_logits)
                total = total + n * self.loss_fn(gates, self.num_experts, self.top_k).float()
        return total

"""What differs between DDP, DeepSpeed, FSDP2 and the fp16 loss scaler within one
optimizer step, kept in one place so that the step (`step.train_step`) never asks which
backend it runs on. Everything goes through the Accelerator's public API.

The step's contract with every backend: the gradient the optimizer sees is
sum(losses of the global batch) / (its count), a partial last window included. Each
backend averages gradients over processes, so each micro-batch's summed loss is scaled by
processes / count (`loss_scale`); DeepSpeed also divides every backward by its
accumulation count, which the scale undoes.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager, nullcontext

from ..model import is_quantized
from ..processor import encodes_ahead
from .topology import Topology


class Backend:
    def __init__(self, accelerator, grad_accum_steps: int):
        self.accelerator = accelerator
        self.topology = Topology.of(accelerator)
        self.accum_divisor = grad_accum_steps if self.topology.deepspeed else 1
        self.overflowed = False  # the last optimizer_step's update was skipped by the fp16 scaler

    def place(self, model):
        """The model on the process's device, unless the backend places it in `prepare`
        or it was loaded quantized, straight onto the device (model.quantization)."""
        return model if self.topology.places_weights or is_quantized(model) else model.to(self.accelerator.device)

    def loss_scale(self, count: int) -> float:
        """The factor for each micro-batch's summed loss (see the module docstring)."""
        return self.accelerator.num_processes * self.accum_divisor / count

    @contextmanager
    def micro_batch(self, model, last: bool):
        """Around a micro-batch's forward and backward. Gradients are reduced across
        processes only on the last micro-batch of the step, and DeepSpeed takes its
        optimizer step inside that backward (the accumulation boundary it reads from
        `sync_gradients`)."""
        self.accelerator.sync_gradients = last
        with nullcontext() if last else self.accelerator.no_sync(model):
            yield

    def backward(self, loss) -> None:
        self.accelerator.backward(loss)

    def sum_over_processes(self, tensor):
        return self.accelerator.reduce(tensor, reduction="sum")

    def clip_grad_norm(self, model, max_norm: float) -> float:
        """The global gradient norm before clipping (clipped to `max_norm`, 0 for none);
        nan where the backend gives none."""
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm or float("inf"))
        return float(norm) if norm is not None else math.nan

    def engine_skipped(self) -> bool:
        """Before our optimizer.step(): DeepSpeed has already stepped, inside backward,
        and skips (and clears) a step whose gradient norm is not finite; in bf16 or fp32
        that is the same fault our non-finite check looks for."""
        return self.topology.deepspeed and not self.topology.fp16 and self.accelerator.optimizer_step_was_skipped

    def grad_norm_is_ours(self) -> bool:
        """Whether a non-finite gradient norm is ours to skip: in fp16 it is the loss
        scaler's overflow, which the scaler skips (`scaler_skipped`) and handles."""
        return not self.topology.fp16

    def nonfinite_weights(self, model) -> int:
        """Non-finite values in the trainable weights, counted over all processes: under
        ZeRO-3 and FSDP each process counts the shard it holds, and the counts are summed
        (one all-reduce); elsewhere every process holds the same whole weights."""
        total = nonfinite_count([_local(p) for p in model.parameters() if p.requires_grad])
        if self.topology.sharded:
            total = self.accelerator.reduce(total.to(self.accelerator.device), reduction="sum")
        return int(total)

    def optimizer_step(self, optimizer) -> None:
        """optimizer.step(), noting whether the fp16 loss scaler skipped it (`scaler_skipped`).
        Accelerate tells a skip by whether the scaler called the optimizer's own step, which
        it always does for a fused optimizer (the kernel skips an overflowed update itself),
        so a fused AdamW's overflows would count as steps taken. The scaler lowers its scale
        exactly when it finds an overflow, so that is what is read here."""
        scaler = self.accelerator.scaler
        before = scaler.get_scale() if scaler is not None else None
        optimizer.step()
        self.overflowed = scaler is not None and scaler.get_scale() < before

    def skip_update(self, optimizer) -> None:
        """Leave weights and optimizer as they were (our own skip: a non-finite loss, a
        spike). `clip_grad_norm` has already unscaled the gradients for the fp16 loss
        scaler, which then refuses every later unscale until its update(): without one the
        next step fails ("unscale_() has already been called"). The update closes the step
        as the scaler's own skip would, lowering the scale where the gradients overflowed."""
        optimizer.zero_grad(set_to_none=True)
        if self.accelerator.scaler is not None:
            self.accelerator.scaler.update()

    def shard_frozen(self, model):
        """A frozen model (a distillation teacher) sharded across the processes as the trained
        one is, for one too large to hold whole on each: under ZeRO-3 a DeepSpeed engine of
        its own, without optimizer (each forward gathers its partitions), under FSDP2 its
        layers and then the whole model fully_shard-ed; with neither, `model` itself. Its
        forward passes are then collectives: every process must run the same ones. Not given
        to the Accelerator (whose prepare would save it with the run's state). Written by hand:
        Accelerate prepares only models it trains."""
        if not self.topology.sharded or self.accelerator.num_processes == 1:
            return model
        if self.topology.zero3:
            import deepspeed  # only under DeepSpeed: its import is slow and sets up its accelerator

            config = copy.deepcopy(self.accelerator.state.deepspeed_plugin.deepspeed_config)
            for key in ("optimizer", "scheduler"):  # training-only: no optimizer is given
                config.pop(key, None)
            config["zero_optimization"].pop("offload_optimizer", None)
            engine, *_ = deepspeed.initialize(model=model, config=config)
            engine.eval()  # DeepSpeed's eval() returns nothing
            return engine
        from torch.distributed.fsdp import fully_shard

        layers = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layers:
                fully_shard(module)
        fully_shard(model)
        return model.eval()

    def scaler_skipped(self) -> bool:
        """After `optimizer_step`: the fp16 loss scaler (or DeepSpeed's) found an overflow,
        skipped the update and lowered its scale."""
        return self.overflowed or self.accelerator.optimizer_step_was_skipped


def nonfinite_count(tensors: list):
    """The number of non-finite values in `tensors`, as a tensor. Checked after every update,
    so the usual answer, none, is proved cheaply: one fused norm per device and dtype (a
    non-finite value makes its tensor's norm non-finite), which reads each weight once.
    Counting value by value (isfinite, negate, sum per tensor) took 200 ms a step against
    6 ms for 9.5M float32 weights on 2 CPU cores. Only when a norm is not finite (a
    non-finite value, or weights so large that their squares overflow) are values counted."""
    import torch

    groups: dict = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    # torch._foreach_norm: the fused per-tensor norms clip_grad_norm_ itself uses.
    if all(bool(torch.isfinite(torch.stack(torch._foreach_norm(g))).all()) for g in groups.values()):
        return torch.zeros((), dtype=torch.long)
    return torch.stack([(~torch.isfinite(t)).sum().cpu() for g in groups.values() for t in g]).sum()


def _local(p):
    """The part of a parameter this process holds: ZeRO-3's partition, FSDP2's local shard,
    or the parameter itself."""
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor
    return p.to_local() if hasattr(p, "to_local") else p


@contextmanager
def root_unsharded(model):
    """`model` (the prepared root module) with FSDP2's root set up and its own weights
    gathered, for calls that do not pass through its forward. FSDP2 does both in the root's
    forward: it decides there which module is the root, and all-gathers the weights held by
    no sharded block (embeddings, output layer, final norm). peft's generate calls the inner
    model's generate, whose forwards start below the root (the PeftModel), and a
    vision-language model's generate encodes the images before its first forward
    (processor.encodes_ahead), so without this the first generation fails ("FSDP requires a
    single root module") or mixes sharded and whole tensors (the vision tower's patch
    embedding). Elsewhere, nothing to do."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule) or not (hasattr(model, "peft_config") or encodes_ahead(model)):
        yield
        return
    model._get_fsdp_state()._lazy_init()  # no public call; a no-op once a forward has run
    model.unshard()
    try:
        yield
    finally:
        model.reshard()

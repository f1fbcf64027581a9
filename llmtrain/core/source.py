"""The loop's source of training micro-batches: the `Batches` protocol that train.train
draws from, and `LoaderBatches`, the source of every method that trains on prepared data
(SFT rows, preference pairs, KTO rows). rl/rollout.Rollouts is the other: it generates its
micro-batches from the policy as the loop draws them.

A method's `Parts.source` (a `MakeBatches`) builds its Batches once the model is prepared
for the distributed backend: source(prepared model, backend, beat) -> Batches
(`loader_source` makes one for prepared data).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from itertools import islice
from typing import Protocol

import torch
from accelerate.utils import send_to_device

from ..data.batches import make_loader
from ..data.stream import StreamedRows
from .evaluate import evaluate


class Batches(Protocol):
    """What the loop uses of its data: passes of micro-batches from any position, what a
    checkpoint keeps beyond the position, held-out measures, and what to log."""

    items: str  # what a micro-batch of train.micro_batch_size holds ("sequences", "pairs", "prompts")
    steps_per_epoch: int | None  # optimizer steps per pass; None where a pass's length is not known (a stream)
    metrics: dict[str, float]  # logged with each step's row (an RL round's rewards); {} for none
    evaluates: bool  # whether there is held-out data to evaluate on

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[dict]:
        """Pass `epoch`'s micro-batches on this process, after its first `skip` micro-batches
        (a whole number of steps: where a resumed run continues)."""
        ...

    def empty_batch(self) -> dict:
        """A micro-batch with nothing to train (the objective counts 0) that runs the same
        forward passes as any other: what a process with no data left runs."""
        ...

    def saved(self, batches_in_epoch: int) -> dict[str, torch.Tensor] | None:
        """What a checkpoint at this position must keep beyond the position itself, or None.
        Called on every process (it may be a collective)."""
        ...

    def restore(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """Take up a checkpoint's `saved` tensors (None: it had none) before `epoch`."""
        ...

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out measures at `step` ({"eval_loss": ...}), on every process."""
        ...

    def shown(self) -> list[str]:
        """Lines to print with the next logged row (an RL round's completions), once."""
        ...


class MakeBatches(Protocol):
    """A method's data source (core/method.Parts.source), built once the model is prepared."""

    def __call__(self, model, backend, beat) -> Batches: ...


class LoaderBatches:
    """This process's micro-batches of prepared data, pass by pass, from any position in a
    pass (where a resumed run continues), and the objective's loss on the evaluation set.

    Map-style data goes through a loader Accelerate prepares, which deals the batches out to
    the processes. A stream (stream.StreamedRows) keeps its own loader, not prepared: each
    process already reads only its share, and Accelerate would shard it again and repeat rows
    to even up the last batch. Its order depends only on (seed, pass, processes), so reading
    it again up to a saved position gives a resumed run exactly the rows that come next."""

    def __init__(self, cfg, accelerator, objective, train_set, eval_set, collator, model, backend=None, beat=None):
        # (model, backend, beat): a MakeBatches' arguments; prepared data needs no backend fact.
        t, data = cfg.train, cfg.data
        self.accelerator, self.objective, self.model, self.beat = accelerator, objective, model, beat
        self.items = collator.items
        self.metrics: dict[str, float] = {}
        self.empty = collator.empty_batch(data.packing)
        loader = make_loader(train_set, t.micro_batch_size, collator, t.seed, data.shuffle, data.num_workers)
        if isinstance(train_set, StreamedRows):  # each process reads only its part
            self.loader, self.sampler, self.steps_per_epoch = loader, None, None
        else:
            self.sampler = loader.sampler  # kept: prepare() wraps it, and we set its epoch
            self.loader = accelerator.prepare(loader)
            self.steps_per_epoch = t.steps_per_epoch(len(self.sampler), accelerator.num_processes)
        self.eval_loader = None
        if eval_set is not None:
            micro = cfg.eval.micro_batch_size or t.micro_batch_size
            self.eval_loader = accelerator.prepare(
                make_loader(eval_set, micro, collator, t.seed, False, data.num_workers)
            )
        self.evaluates = self.eval_loader is not None

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[dict]:
        if self.sampler is None:  # a stream
            self.loader.dataset.set_epoch(epoch)
            device = self.accelerator.device
            return (send_to_device(b, device, non_blocking=True) for b in islice(self.loader, skip, None))
        loader = self.accelerator.skip_first_batches(self.loader, skip) if skip else self.loader
        # Accelerate's loader re-applies its own epoch counter to the sampler on every
        # iter(), and a loader made by skip_first_batches starts that counter at 0: set both,
        # or the epoch after a mid-epoch resume would repeat epoch 0's order.
        self.sampler.set_epoch(epoch)
        loader.set_epoch(epoch)
        return iter(loader)

    def empty_batch(self) -> dict:
        return self.empty

    def saved(self, batches_in_epoch: int) -> None:
        """Nothing beyond the position: the data is read again up to it on resume."""
        return None

    def restore(self, tensors) -> None:
        pass

    def evaluate(self, step: int) -> dict[str, float]:
        empty = send_to_device(self.empty, self.accelerator.device)
        loss, metrics = evaluate(self.model, self.eval_loader, self.objective, self.accelerator, empty, self.beat)
        return {"eval_loss": loss} | {f"eval_{k}": v for k, v in metrics.items()}

    def shown(self) -> list[str]:
        return []


def loader_source(cfg, accelerator, objective, train_set, eval_set, collator) -> MakeBatches:
    """The data source of a method that trains on prepared data: LoaderBatches over `train_set`
    (and `eval_set`, or None) with `collator` making its micro-batches."""
    return partial(LoaderBatches, cfg, accelerator, objective, train_set, eval_set, collator)

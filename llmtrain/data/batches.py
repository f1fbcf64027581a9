"""Batching: a seeded per-epoch order, padding collation, and data loaders.

The order of examples depends only on (seed, epoch), never on the number of processes
or the micro-batch size, so one global batch holds the same rows whether it is taken as
8 x 1, 2 x 4, or 2 processes x 2 x 2.
"""

from __future__ import annotations

import torch

from .mixture import Mixture
from .rows import IGNORE


class EpochSampler(torch.utils.data.Sampler):
    """The examples of one epoch, drawn from (seed, epoch): a permutation of range(n), or
    sequential if shuffle is off. With a `mixture.Mix` whose sources have fractions, the
    epoch is the mix's draw for (seed, epoch), then shuffled the same way."""

    def __init__(self, n: int, seed: int, shuffle: bool = True, mix=None):
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0
        self.mix = mix if mix is not None and mix.mixed else None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return sum(self.mix.counts()) if self.mix else self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.mix is None:
            order = torch.randperm(self.n, generator=g).tolist() if self.shuffle else range(self.n)
            return iter(order)
        order = self.mix.epoch(g)
        if self.shuffle:
            order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
        return iter(order)


class Collator:
    """Pads a list of examples to the longest (right padding, labels IGNORE; on which
    objective.model_inputs relies where it leaves the padding mask out).

    Packed examples (with position_ids and doc_ids) keep them; padding gets doc id -1 so
    it forms its own block and never joins a real sample. With `pack_width`, packed batches
    are padded to that width: every batch has one shape, so compiled kernels (FlexAttention,
    train.compile) are built once; best-fit packing leaves little to pad."""

    columns = ("input_ids", "labels")  # the fields of an example it reads
    items = "sequences"  # what a micro-batch of train.micro_batch_size holds

    def __init__(self, pad_id: int, pack_width: int = 0):
        self.pad_id, self.pack_width = pad_id, pack_width

    def __call__(self, examples: list[dict]) -> dict:
        packed = "doc_ids" in examples[0]
        width = max(len(e["input_ids"]) for e in examples)
        if packed:
            width = max(width, self.pack_width)

        def pad(key, value):
            return torch.tensor([e[key] + [value] * (width - len(e[key])) for e in examples], dtype=torch.long)

        batch = {"input_ids": pad("input_ids", self.pad_id), "labels": pad("labels", IGNORE)}
        if packed:
            batch["doc_ids"] = pad("doc_ids", -1)
            batch["position_ids"] = torch.tensor(
                [e["position_ids"] + list(range(width - len(e["position_ids"]))) for e in examples], dtype=torch.long
            )
        else:
            batch["attention_mask"] = torch.tensor(
                [[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in examples], dtype=torch.long
            )
        return batch

    def empty_batch(self, packed: bool) -> dict:
        """A one-token batch with nothing to train: what a process runs when it has no
        data left in a window, so every process still joins the same collectives."""
        example = {"input_ids": [self.pad_id], "labels": [IGNORE]}
        if packed:
            example |= {"position_ids": [0], "doc_ids": [0]}
        return self([example])


def make_loader(dataset, batch_size: int, collator, seed: int, shuffle: bool, num_workers: int):
    """A DataLoader over `dataset`: a datasets.Dataset of the collator's columns or a
    PackedDataset (ordered by an EpochSampler), either in a mixture.Mixture (whose epochs
    the sampler draws), or a stream.StreamedRows (which orders itself)."""
    # Each iter() of a DataLoader draws its workers' base seed from `generator`, or from
    # torch's global generator when it has none. That one draws dropout's masks and is
    # restored on resume, and a resumed run starts its pass's iterator after restoring it:
    # the extra draw would shift every mask after a resume. A generator of its own keeps the
    # loader off it (the rows' order comes from the seeded sampler or stream either way).
    generator = torch.Generator().manual_seed(seed)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        # No persistent workers: each pass must start workers with the pass's shuffle seed.
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size,
            collate_fn=collator,
            num_workers=num_workers,
            pin_memory=torch.cuda.is_available(),
            generator=generator,
        )
    mix = None
    if isinstance(dataset, Mixture):
        dataset, mix = dataset.examples, dataset.mix
    if hasattr(dataset, "select_columns"):
        dataset = dataset.select_columns(list(collator.columns))
    sampler = EpochSampler(len(dataset), seed, shuffle, mix)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collator,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        drop_last=False,
        generator=generator,
    )

"""Packing rows into fixed-length sequences with no attention across samples.

Positions restart at 0 for every sample, and each sequence carries `doc_ids` (which
sample a token belongs to, -1 for padding). From the positions, `attention.packed_mask`
builds each layer's own mask within each sample. Position ids alone are not enough: a
model given them but no mask would let a sample attend to the ones packed before it.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import torch


def pack_lengths(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing: indices of rows grouped so each group's total
    length is at most `capacity`. Deterministic; each group lists indices in order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    space: list[tuple[int, int]] = []  # sorted (room left, bin index)
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"row {i} has {n} tokens, more than the pack capacity {capacity}")
        k = bisect_left(space, (n, -1))
        if k < len(space):
            room, b = space.pop(k)
            bins[b].append(i)
        else:
            b, room = len(bins), capacity
            bins.append([i])
        if room - n > 0:
            insort(space, (room - n, b))
    return [sorted(b) for b in bins]


def pack_in_order(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows grouped in their order (next fit): each row joins the sequence before it while
    it fits, else starts the next one. Fills less than `pack_lengths`, which groups rows by
    length from anywhere in the set, but the sequences read the rows in the files' order
    (data.shuffle=false: a curriculum)."""
    bins: list[list[int]] = []
    room = 0
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"row {i} has {n} tokens, more than the pack capacity {capacity}")
        if bins and n <= room:
            bins[-1].append(i)
            room -= n
        else:
            bins.append([i])
            room = capacity - n
    return bins


def pack_sources(
    lengths: list[int], capacity: int, sizes: list[int] | None, ordered: bool = False
) -> tuple[list[list[int]], list[int]]:
    """`pack_lengths` (`pack_in_order` if `ordered`) over all rows, or with `sizes` (rows of
    each source, in order) over each source's rows alone, so a packed sequence holds one
    source's rows (mixture.Mix takes sources by their sequences). Returns (bins, sequences
    per source)."""
    pack = pack_in_order if ordered else pack_lengths
    if sizes is None:
        bins = pack(lengths, capacity)
        return bins, [len(bins)]
    bins, counts, start = [], [], 0
    for n in sizes:
        part = pack(lengths[start : start + n], capacity)
        bins += [[start + i for i in b] for b in part]
        counts.append(len(part))
        start += n
    return bins, counts


class PackedDataset(torch.utils.data.Dataset):
    """A view of a tokenized data set (input_ids, labels, length) as packed sequences,
    packed source by source when given `sizes` and in the rows' order if `ordered` (see
    `pack_sources`)."""

    def __init__(self, rows, capacity: int, sizes: list[int] | None = None, ordered: bool = False):
        self.rows = rows
        self.capacity = capacity
        self.bins, self.sizes = pack_sources(rows["length"], capacity, sizes, ordered)

    def __len__(self) -> int:
        return len(self.bins)

    def efficiency(self) -> float:
        """Share of packed positions that hold real tokens."""
        return sum(self.rows["length"]) / (len(self.bins) * self.capacity)

    def documents(self, j: int) -> list[dict]:
        """Packed sequence j's samples in order, each as an unpacked example: what each must
        compute alone, packed with the others or not (`llmtrain verify` checks it)."""
        rows = self.rows[self.bins[j]]
        return [{"input_ids": ids, "labels": lab} for ids, lab in zip(rows["input_ids"], rows["labels"])]

    def __getitem__(self, j: int) -> dict:
        return join_rows(self.documents(j))


def join_rows(rows: list[dict]) -> dict:
    """One packed sequence from rows of input_ids and (shifted) labels: positions restart
    at 0 for every row, and doc_ids say which row each token belongs to."""
    input_ids, labels, position_ids, doc_ids = [], [], [], []
    for d, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids += row["input_ids"]
        labels += row["labels"]
        position_ids += range(n)
        doc_ids += [d] * n
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "doc_ids": doc_ids}

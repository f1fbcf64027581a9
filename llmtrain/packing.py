"""Packing rows into fixed-length sequences with no attention across samples.

Positions restart at 0 for every sample, and each sequence carries `doc_ids` (which
sample a token belongs to, -1 for padding). `document_mask` turns them into a
block-diagonal causal mask in the form each attention backend takes. Position ids alone
are not enough: with the SDPA and eager backends a plain causal mask would still let a
sample attend to the ones packed before it.
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


def pack_sources(lengths: list[int], capacity: int, sizes: list[int] | None) -> tuple[list[list[int]], list[int]]:
    """`pack_lengths` over all rows, or with `sizes` (rows of each source, in order) over
    each source's rows alone, so a packed sequence holds one source's rows (mixture.Mix
    takes sources by their sequences). Returns (bins, sequences per source)."""
    if sizes is None:
        bins = pack_lengths(lengths, capacity)
        return bins, [len(bins)]
    bins, counts, start = [], [], 0
    for n in sizes:
        part = pack_lengths(lengths[start : start + n], capacity)
        bins += [[start + i for i in b] for b in part]
        counts.append(len(part))
        start += n
    return bins, counts


class PackedDataset(torch.utils.data.Dataset):
    """A view of a tokenized data set (input_ids, labels, length) as packed sequences,
    packed source by source when given `sizes` (see `pack_sources`)."""

    def __init__(self, rows, capacity: int, sizes: list[int] | None = None):
        self.rows = rows
        self.capacity = capacity
        self.bins, self.sizes = pack_sources(rows["length"], capacity, sizes)

    def __len__(self) -> int:
        return len(self.bins)

    def efficiency(self) -> float:
        """Share of packed positions that hold real tokens."""
        return sum(self.rows["length"]) / (len(self.bins) * self.capacity)

    def __getitem__(self, j: int) -> dict:
        rows = self.rows[self.bins[j]]
        return join_rows([{"input_ids": ids, "labels": lab} for ids, lab in zip(rows["input_ids"], rows["labels"])])


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


def document_mask(doc_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype):
    """The attention mask that only lets a token see earlier tokens of its own sample, in
    the form the attention backend wants:

    - flash_attention_*: None; transformers finds the samples from position_ids (each
      restarts at 0) and runs the varlen kernel over them.
    - flex_attention: a block-sparse BlockMask; blocks that hold no allowed pair are
      skipped by the kernel, so the cost follows the samples' own lengths.
    - sdpa: a dense [B, 1, L, L] boolean mask (True = attend).
    - eager: the same as an additive float mask, which its kernel adds to the scores."""
    if attn_implementation.startswith("flash"):
        return None
    if attn_implementation == "flex_attention":
        return document_block_mask(doc_ids)
    L = doc_ids.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=doc_ids.device).tril()
    allowed = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal
    allowed = allowed[:, None]
    if attn_implementation == "sdpa":
        return allowed
    mask = torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def document_block_mask(doc_ids: torch.Tensor):
    """FlexAttention's BlockMask for causal attention within each sample of `doc_ids`
    (padding, -1, forms a block of its own)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_sample_causal(b, h, q, kv):
        return (doc_ids[b, q] == doc_ids[b, kv]) & (q >= kv)

    B, L = doc_ids.shape
    return create_block_mask(same_sample_causal, B, None, L, L, device=doc_ids.device)

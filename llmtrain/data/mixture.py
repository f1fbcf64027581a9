"""Several training sources in one run: each source's share of an epoch (a data.train
entry's `fraction`) and the rows held out for evaluation (data.eval_fraction).

A source of n examples with fraction f gives int(f) whole copies plus a seeded subset of
round((f - int(f)) * n) examples to every epoch, drawn again each epoch from (seed, epoch)
alone: an epoch always has the same number of examples, so the step count is known ahead,
and a resumed run draws exactly the epoch it was in. With data.packing each source is
packed on its own and the fraction applies to its packed sequences (so to its tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import DataConfig, DataSource
from ..errors import DataError, warn


@dataclass(frozen=True)
class Mix:
    sizes: tuple[int, ...]  # examples of each source, in order, in the training set
    fractions: tuple[float, ...]

    @property
    def mixed(self) -> bool:
        return any(f != 1 for f in self.fractions)

    def counts(self) -> list[int]:
        """Examples each source gives one epoch."""
        return [int(f) * n + round((f - int(f)) * n) for n, f in zip(self.sizes, self.fractions)]

    def epoch(self, generator: torch.Generator) -> list[int]:
        """One epoch's example indices, source by source: whole copies in order, then a
        seeded subset (in order) for the fractional part."""
        out, start = [], 0
        for n, f, count in zip(self.sizes, self.fractions, self.counts()):
            out += list(range(start, start + n)) * int(f)
            rest = count - int(f) * n
            if rest:
                out += (torch.randperm(n, generator=generator)[:rest].sort().values + start).tolist()
            start += n
        return out


class Mixture(torch.utils.data.Dataset):
    """A training set whose epochs take each source by its fraction (`batches.EpochSampler`
    draws them). Indexing and every other attribute are the examples' own, so code that
    wants all examples (the reference pass of a preference run) sees them unchanged."""

    def __init__(self, examples, mix: Mix):
        self.examples, self.mix = examples, mix

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]

    def __getattr__(self, name):
        if name in ("examples", "mix"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.examples, name)


def hold_out(rows, sizes: list[int], fraction: float, seed: int):
    """data.eval_fraction: from each source's examples, a seeded round(fraction * n) (never
    all of them) held out. Returns (training rows, their sizes per source, held-out rows)."""
    g = torch.Generator().manual_seed(seed)
    kept, held, kept_sizes, start = [], [], [], 0
    for n in sizes:
        k = min(round(fraction * n), n - 1) if n else 0
        order = torch.randperm(n, generator=g) + start
        held += order[:k].sort().values.tolist()
        kept += order[k:].sort().values.tolist()
        kept_sizes.append(n - k)
        start += n
    if not held:
        raise DataError(
            f"data.eval_fraction: {fraction:g} of data.train's {sum(sizes)} usable rows holds out none; raise it, "
            "or give data.eval"
        )
    return rows.select(kept), kept_sizes, rows.select(held)


def split_and_mix(cfg, rows, stats, tokenizer, prepare, what: str = "rows"):
    """What the training and evaluation sets are made of, given data.train's prepared
    `rows` and `stats` (from `prepare`, the kind's: kind.DataKind.prepare):
    data.eval prepared too, or data.eval_fraction held out of the rows. Returns (training
    rows, Mix, evaluation rows or None, lines describing it all)."""
    entries = cfg.data.sources()
    sizes = [kept for _, kept, _ in stats.per_source]
    lines = [stats.summary("data.train")]
    eval_rows = None
    if cfg.data.eval_fraction:
        rows, sizes, eval_rows = hold_out(rows, sizes, cfg.data.eval_fraction, cfg.train.seed)
        lines.append(
            f"data.eval: {len(eval_rows)} {what} held out of data.train (data.eval_fraction="
            f"{cfg.data.eval_fraction:g}, seeded by train.seed), {sum(eval_rows['n_trained'])} trained tokens; "
            f"{len(rows)} {what} left in data.train"
        )
    elif cfg.data.names("eval"):
        eval_rows, eval_stats = prepare("data.eval", cfg.data.names("eval"), tokenizer, cfg.data)
        lines.append(eval_stats.summary("data.eval"))
    mix = Mix(tuple(sizes), tuple(e.fraction for e in entries))
    if len(entries) > 1 or mix.mixed:
        lines += describe(rows, mix, entries, what, cfg.data)
    return rows, mix, eval_rows, lines


def describe(rows, mix: Mix, entries: list[DataSource], what: str, cfg: DataConfig) -> list[str]:
    """One line per source: its examples and trained tokens, and what one epoch takes."""
    tokens, start, lines = list(rows["n_trained"]), 0, []
    for entry, n, count in zip(entries, mix.sizes, mix.counts()):
        trained = sum(tokens[start : start + n])
        start += n
        line = f"  {entry.path}: {n} {what}, {trained} trained tokens"
        if entry.fraction != 1:
            taken = f"about {count}" if cfg.packing else str(count)  # packed, the fraction takes sequences
            line += (
                f"; fraction {entry.fraction:g}: {taken} {what}, about {round(entry.fraction * trained)} trained "
                "tokens per epoch"
            )
        lines.append(line)
    return lines


def training_set(rows, mix: Mix, pack=None, what: str = "rows"):
    """The training set: `rows`, packed by `pack(rows, sizes)` if given (a packed set with
    `.sizes`, its sequences per source; `sizes` None packs all rows together), and in a
    Mixture when sources have fractions. Warns about a source that gives an epoch nothing."""
    examples = rows
    if pack is not None:
        examples = pack(rows, list(mix.sizes) if mix.mixed else None)
        what = "packed sequences"
    if not mix.mixed:
        return examples
    mix = Mix(tuple(examples.sizes), mix.fractions) if pack is not None else mix
    counts = mix.counts()
    if not sum(counts):
        raise DataError("data.train: the fractions take no row from any source in an epoch; raise them")
    for i, (f, n, count) in enumerate(zip(mix.fractions, mix.sizes, counts)):
        if n and not count:
            warn(f"data.train[{i}].fraction: {f:g} of {n} {what} is none per epoch; raise it or remove the source")
    return Mixture(examples, mix)


def packer(make, width: int, key: str, what: str, say, ordered: bool = False):
    """(rows, sizes) -> make(rows, width, sizes, ordered), a packed set (packing.PackedDataset
    or pairs.PackedPairs; `ordered`: in the rows' order), saying through `say` how full its
    sequences are."""

    def pack(rows, sizes):
        packed = make(rows, width, sizes, ordered)
        say(
            f"{key}: packed {len(rows)} {what} into {len(packed)} sequences of {width} tokens "
            f"({packed.efficiency():.1%} filled)" + (", each source on its own" if sizes else "")
        )
        return packed

    return pack

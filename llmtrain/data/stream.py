"""Streamed training data (data.streaming): rows are read, tokenized and packed while
training runs, so a corpus never has to be prepared, cached or held whole.

Each process reads its own part of every source (datasets' `split_dataset_by_node`: whole
shards when a source has a multiple of the process count, else every N-th row), so ranks
can run out at different times; the training loop's windows then run empty micro-batches
on the ranks that are done until all are (see `window.draw_window`). Sources are read in turn,
a row from each (or, when data.train entries have fractions, each next row from a source
drawn with probability proportional to its fraction among those not yet run out), and
shuffled through a buffer of data.shuffle_buffer rows, reseeded every pass. The order depends
only on (seed, pass, process count, shuffle buffer, loader workers), which a checkpoint
records (`checkpoint.position_settings`), so a resumed run reads the stream again up to its
saved position and continues with exactly the rows it would have had.

Bad rows stop the run as they do for prepared data, but mid-run: the error names the
file and line and rides the per-step agreement, so every process stops after the same
step with a complete checkpoint (see `train.train`).
"""

from __future__ import annotations

import random
import sys

import torch

from ..config import DataConfig
from ..errors import DataError, describe, warn
from ..files import user_cause
from ..template import TemplateLimit
from .packing import join_rows
from .prepare import DataStats, check_source, template_error
from .rows import KEPT, process_row, row_problem, several_formats
from .sources import Source, load_source

CHECK_BAD_AFTER = 1000  # rows read by a process before it holds them to data.max_bad_fraction


class StreamedRows(torch.utils.data.IterableDataset):
    """This process's share of data.train as tokenized examples (input_ids, labels), or
    packed sequences with data.packing."""

    def __init__(
        self,
        key: str,
        tokenizer,
        cfg: DataConfig,
        seed: int,
        rank: int,
        world: int,
        report: bool = True,  # print each pass's counts at its end (llmtrain plan, reading a sample, does not)
    ):
        from datasets.distributed import split_dataset_by_node

        self.key, self.tokenizer, self.cfg, self.rank = key, tokenizer, cfg, rank
        self.report = report
        self.seed, self.epoch = seed, 0
        self.several_warned: set[tuple[str, str]] = set()  # (source, formats) said once (rows)
        self.entries = entries = cfg.sources()  # data.train's
        self.streams: list[tuple[Source, object]] = []
        for entry in entries:
            src = load_source(entry.path, key, streaming=True)
            src.columns = src.columns or list(self._first_row(src))  # a hub stream may not know its columns
            check_source(src, tokenizer, cfg)
            # A local text file's rows carry their line; others get their index in the source,
            # taken before shuffling and splitting, to name them in errors.
            ds = src.dataset if src.raw else src.dataset.map(lambda row, i: {"__row": i}, with_indices=True)
            if cfg.shuffle:
                ds = ds.shuffle(seed=seed, buffer_size=cfg.shuffle_buffer)
            self.streams.append((src, split_dataset_by_node(ds, rank=rank, world_size=world)))

    def _first_row(self, src: Source) -> dict:
        try:
            return next(iter(src.dataset))
        except StopIteration:
            raise DataError(f"{self.key}: {src.name} has no rows; give a source with at least one row") from None
        except Exception as e:
            raise self._read_error(src, e) from None

    def set_epoch(self, epoch: int) -> None:
        """Reseed the shuffle buffer (and the draw of sources) for pass `epoch`."""
        self.epoch = epoch
        for _, ds in self.streams:
            ds.set_epoch(epoch)

    def _read_error(self, src: Source, e: Exception) -> DataError:
        """What reading failed on: the file reader's own error (with its line), else the gist."""
        return user_cause(e) or DataError(f"{self.key}: could not read {src.name} ({describe(e)})")

    def _where(self, src: Source, row: dict) -> str:
        if src.raw:
            return src.where(row, 0)
        if src.dataset.n_shards == 1:  # one shard is split row by row, so the index is the source's own
            return src.where(row, row["__row"])
        return f"{src.name} (row {row['__row']} of a shard read by process {self.rank})"

    def _read(self, src: Source, ds):
        it = iter(ds)
        while True:
            try:
                row = next(it)
            except StopIteration:
                return
            except Exception as e:  # a malformed line, a truncated file, a network failure
                raise self._read_error(src, e) from None
            yield row

    def rows(self):
        """Tokenized rows (input_ids, labels), from the sources in turn (`_turns`)."""
        cfg, stats = self.cfg, DataStats()
        self.stats = stats  # counts so far, for a reader that stops early (llmtrain plan)
        self.per_source = [[0, 0, 0] for _ in self.streams]  # rows read, kept, trained tokens
        for i, src, row in self._turns():
            try:
                fields = row if src.raw else {k: v for k, v in row.items() if k != "__row"}  # ours, not the user's
                out = process_row(src.parse(fields), src.format, self.tokenizer, cfg)
            except TemplateLimit as e:
                raise template_error(self.key, self._where(src, row), e, cfg, self.tokenizer) from None
            if out["fits"] and (src.name, out["fits"]) not in self.several_warned:  # once per source and kind
                self.several_warned.add((src.name, out["fits"]))
                warn(f"{self.key}: {src.name}: rows like {self._where(src, row)} {several_formats(out['fits'])}")
            if problem := row_problem(out["status"], cfg):
                raise DataError(f"{self.key}: {self._where(src, row)}: {problem}")
            if out["status"].startswith("error"):
                stats.skip_bad(self._where(src, row), out["status"])
            stats.count([out["status"]])
            if stats.rows >= CHECK_BAD_AFTER:  # the fraction of a handful of rows means little
                stats.check_bad(self.key, cfg)
            counts = self.per_source[i]
            counts[0] += 1
            if out["status"] not in KEPT:
                continue
            stats.trained_tokens += out["n_trained"]
            counts[1] += 1
            counts[2] += out["n_trained"]
            yield {"input_ids": out["input_ids"], "labels": out["labels"]}
        stats.check_bad(self.key, cfg)
        if self.report and (stats.dropped or stats.truncated or len(self.streams) > 1):
            lines = [f"process {self.rank}, end of pass {self.epoch}: {stats.summary(self.key)}", *self.source_lines()]
            print("\n".join(lines), file=sys.stderr, flush=True)

    def source_lines(self) -> list[str]:
        """One line per source for the rows read so far (by `rows`): read, kept, trained
        tokens, and its share of the kept rows. Empty with a single source."""
        if len(self.streams) == 1:
            return []
        kept = sum(k for _, k, _ in self.per_source) or 1
        lines = []
        for entry, (read, k, tokens) in zip(self.entries, self.per_source):
            fraction = f" (fraction {entry.fraction:g})" if entry.fraction != 1 else ""
            lines.append(
                f"  {entry.path}{fraction}: {k}/{read} rows kept, {tokens} trained tokens, {k / kept:.1%} of the rows"
            )
        return lines

    def _turns(self):
        """(source index, source, row) until every source has run out: a row from each in
        turn, or with fractions, from a source drawn in proportion to its fraction (seeded by
        seed, pass and process, so a resumed run draws the same)."""
        readers = [(i, src, self._read(src, ds)) for i, (src, ds) in enumerate(self.streams)]
        if all(e.fraction == 1 for e in self.entries):
            while readers:
                for reader in list(readers):
                    row = next(reader[2], None)
                    if row is None:
                        readers.remove(reader)
                    else:
                        yield reader[0], reader[1], row
            return
        draw = random.Random(f"{self.seed}/{self.epoch}/{self.rank}")
        while readers:
            reader = draw.choices(readers, weights=[self.entries[i].fraction for i, _, _ in readers])[0]
            row = next(reader[2], None)
            if row is None:
                readers.remove(reader)
            else:
                yield reader[0], reader[1], row

    def __iter__(self):
        rows = self.rows()
        return pack_stream(rows, self.cfg.max_seq_len) if self.cfg.packing else rows


def pack_stream(rows, capacity: int, open_bins: int = 8):
    """Pack a stream of rows into sequences of at most `capacity` tokens: each row goes into
    the open sequence it fills best; when none has room, the fullest one is emitted to
    make room. Deterministic, and holds at most `open_bins` sequences."""
    bins: list[list[dict]] = []
    used: list[int] = []
    for row in rows:
        n = len(row["input_ids"])
        fits = [b for b in range(len(bins)) if used[b] + n <= capacity]
        if fits:
            b = max(fits, key=lambda k: used[k])
        else:
            if len(bins) == open_bins:
                full = max(range(len(bins)), key=lambda k: used[k])
                yield join_rows(bins.pop(full))
                used.pop(full)
            bins.append([])
            used.append(0)
            b = len(bins) - 1
        bins[b].append(row)
        used[b] += n
    for b in bins:
        yield join_rows(b)

"""The one training-set builder: a recipe's training and evaluation sets from data.train
and data.eval, for any kind of example (`DataKind`: SFT rows, preference pairs).

Each split is tokenized once (the main process first; the others read its cache), then
data.eval_fraction is held out and sources are taken by their fractions (mixture), and
the examples are packed if data.packing is set. With data.streaming the training set is a
StreamedRows, tokenized and packed as it is read. `llmtrain plan` describes a run's data
with the same kinds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..distributed.launch import main_first
from .mixture import names, packer, sources, split_and_mix, training_set
from .packing import PackedDataset
from .prepare import prepare_split
from .stream import StreamedRows


@dataclass(frozen=True)
class DataKind:
    """What a recipe's examples are, as far as building its data sets goes."""

    prepare: Callable  # (key, names, tokenizer, DataConfig) -> (datasets.Dataset, DataStats) for one split
    # The packed view of its examples: (rows, width, sizes per source or None) -> a Dataset;
    # None for a kind that is never packed (its recipe refuses data.packing).
    packed: type | None
    width: int = 1  # a packed sequence's length, in data.max_seq_len
    unit: str = "rows"  # what one example is called in the lines the builder prints
    batched: tuple[str, str] = ("sequences", "sequences")  # what a batch holds, unpacked and packed
    index: str = ""  # a column numbering the examples (training 0..n-1, evaluation after), or none
    # What each split's examples become once held out and numbered, before any mixture:
    # (rows, data.max_seq_len) -> a Dataset whose example i may read other rows of its split
    # (preference/unpaired.KLCompletions), or None to keep the rows.
    view: Callable | None = None


ROWS = DataKind(prepare_split, PackedDataset)


def build_datasets(cfg, accelerator, tokenizer, kind: DataKind = ROWS):
    """Returns (training set, evaluation set or None)."""
    data = cfg.data

    def pack(key: str):
        return packer(kind.packed, kind.width * data.max_seq_len, key, kind.unit, accelerator.print)

    with main_first(accelerator):
        if data.streaming:
            entries = sources(data.train)
            train_set = StreamedRows(
                "data.train",
                entries,
                tokenizer,
                data,
                cfg.train.seed,
                accelerator.process_index,
                accelerator.num_processes,
            )
            accelerator.print(
                f"data.train: streaming {len(entries)} source(s); rows are tokenized"
                f"{' and packed' if data.packing else ''} as they are read"
            )
            eval_set = None
            if names(data.eval):
                eval_set, stats = kind.prepare("data.eval", names(data.eval), tokenizer, data)
                accelerator.print(stats.summary("data.eval"))
        else:
            rows, stats = kind.prepare("data.train", names(data.train), tokenizer, data)
            rows, mix, eval_set, lines = split_and_mix(cfg, rows, stats, tokenizer, kind.prepare, kind.unit)
            for line in lines:
                accelerator.print(line)
            if kind.index:
                rows = rows.add_column(kind.index, list(range(len(rows))))
                if eval_set is not None:
                    eval_set = eval_set.add_column(kind.index, list(range(len(rows), len(rows) + len(eval_set))))
            if kind.view is not None:
                rows = kind.view(rows, data.max_seq_len)
                eval_set = kind.view(eval_set, data.max_seq_len) if eval_set is not None else None
            train_set = training_set(rows, mix, pack("data.train") if data.packing else None, kind.unit)
        if eval_set is not None and data.packing:
            eval_set = pack("data.eval")(eval_set, None)
    return train_set, eval_set

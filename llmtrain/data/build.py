"""The one training-set builder: a recipe's training and evaluation sets from data.train
and data.eval, for any kind of example (kind.DataKind: SFT rows, `ROWS` here, preference
pairs, KTO rows, prompts).

Each split is tokenized once (the main process first; the others read its cache), then
data.eval_fraction is held out and sources are taken by their fractions (mixture), and
the examples are packed if data.packing is set. With data.streaming the training set is a
StreamedRows, tokenized and packed as it is read. `llmtrain plan` describes a run's data
with the same kinds.
"""

from __future__ import annotations

from ..config import DataConfig
from ..distributed.launch import main_first
from .kind import DataKind
from .mixture import packer, split_and_mix, training_set
from .packing import PackedDataset
from .prepare import check_source
from .rows import EMPTY, process_row
from .stream import StreamedRows


def sft_example(row: dict, tokenizer, cfg: DataConfig) -> dict:
    """An SFT row's example, read as data.format says (each row's own format under auto)."""
    return process_row(row, cfg.format, tokenizer, cfg)


# SFT rows (recipes/finetune.py): process_row's, packed into sequences of data.max_seq_len.
ROWS = DataKind(check_source, "", sft_example, EMPTY, PackedDataset)


def build_datasets(cfg, accelerator, tokenizer, kind: DataKind = ROWS):
    """Returns (training set, evaluation set or None)."""
    data = cfg.data

    def pack(key: str, ordered: bool = False):
        return packer(kind.packed, kind.width * data.max_seq_len, key, kind.unit, accelerator.print, ordered)

    with main_first(accelerator):
        if data.streaming:
            train_set = StreamedRows(
                "data.train",
                tokenizer,
                data,
                cfg.train.seed,
                accelerator.process_index,
                accelerator.num_processes,
            )
            accelerator.print(
                f"data.train: streaming {len(data.sources())} source(s); rows are tokenized"
                f"{' and packed' if data.packing else ''} as they are read"
            )
            eval_set = None
            if data.names("eval"):
                eval_set, stats = kind.prepare("data.eval", data.names("eval"), tokenizer, data)
                accelerator.print(stats.summary("data.eval"))
        else:
            rows, stats = kind.prepare("data.train", data.names(), tokenizer, data)
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
            packs = pack("data.train", ordered=not data.shuffle) if data.packing else None
            train_set = training_set(rows, mix, packs, kind.unit)
        if eval_set is not None and data.packing:
            eval_set = pack("data.eval")(eval_set, None)
    return train_set, eval_set

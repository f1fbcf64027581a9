"""A data source (a local file or a hub data set) loaded as a datasets.Dataset, and the row
format its columns allow. Local .jsonl, .json and .csv files are read by llmtrain/files.py, so
every row keeps its file line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from ..errors import DataError, describe
from ..files import LINE, RAW, TEXT_FILES, content_hash, first_rows, is_path, no_such_file, row_dataset
from .rows import REQUIRED, FileRow, TextRow

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class Source:
    key: str  # the config key it came from: data.train or data.eval
    name: str  # path or hub name as the user wrote it
    dataset: object  # datasets.Dataset (or IterableDataset when streamed)
    columns: list[str]  # the fields its rows fill (for a local text file: those of its first rows)
    format: str = ""
    raw: bool = False  # rows are files.RAW JSON text with their files.LINE (local .jsonl/.json/.csv)
    text: bool = False  # every field is text (CSV): parsed rows are rows.TextRow
    root: Path | None = None  # a local file's folder, which relative image paths in its rows start from

    def where(self, row: dict, index: int) -> str:
        """'file.jsonl line 12' for a row of a local text file, else 'name row 12'."""
        return f"{self.name} line {row[LINE]}" if self.raw else f"{self.name} row {index}"

    def parse(self, row: dict) -> dict:
        """The row as the user wrote it; a local file's row as a rows.FileRow that knows the
        file's folder."""
        parsed = json.loads(row[RAW]) if self.raw else row
        if self.root is None or not isinstance(parsed, dict):
            return parsed
        out = TextRow(parsed) if self.text else FileRow(parsed)
        out.root = self.root
        return out


def load_source(name: str, key: str, streaming: bool = False) -> Source:
    """A file or hub data set as a datasets.Dataset, or with `streaming` as an
    IterableDataset read while it is iterated. Local .jsonl/.json/.csv files are read by
    `files.read_rows`, so every row keeps its file line."""
    import datasets

    path = Path(name)
    suffix = path.suffix.lower()
    if suffix in FILE_BUILDERS:
        if not path.exists():
            several = f"; several files go in a list: {key}=[{', '.join(n.strip() for n in name.split(','))}]"
            raise DataError(f"{key}: {no_such_file(name)}{several if ',' in name else ''}")
        if not path.is_file():
            raise DataError(f"{key}: {name} is not a regular file; give a data file")
        if suffix in TEXT_FILES:
            first = first_rows(path, key)  # a file that cannot be read fails here, with its line
            if not first:
                raise DataError(f"{key}: {name} has no rows; give a file with at least one row")
            ds = row_dataset(path, key, streaming)
            columns = sorted({k for row in first for k in row})
            return Source(key, name, ds, columns, raw=True, text=suffix == ".csv", root=path.resolve().parent)
        if suffix == ".parquet" and parquet_rows(path, key, name) == 0:  # datasets: "BatchSize must be > 0"
            raise DataError(f"{key}: {name} has no rows; give a file with at least one row")
        try:
            # datasets keys a local file's cache on its modification time only; the config
            # name, part of the cache's directory, keys it on the content instead.
            ds = datasets.load_dataset(
                FILE_BUILDERS[suffix],
                name=f"llmtrain-{content_hash(path)[:32]}",
                data_files=str(path),
                split="train",
                streaming=streaming,
            )
        except Exception as e:  # Arrow schema errors and the like
            if isinstance(e, datasets.exceptions.DatasetGenerationError) and e.__cause__ is not None:
                e = e.__cause__  # "An error occurred while generating the dataset" says nothing
            raise DataError(f"{key}: could not read {name} ({no_rows(e) or describe(e)})") from None
        return Source(key, name, ds, list(ds.column_names or []), root=path.resolve().parent)
    if path.is_dir():
        saved = (path / "state.json").is_file() and (path / "dataset_info.json").is_file()  # a Dataset
        if saved or (path / "dataset_dict.json").is_file():  # or a DatasetDict, a folder per split
            raise DataError(
                f"{key}: {name} is a data set saved with datasets' save_to_disk, which is not read here; write it "
                "out as a file (Dataset.to_parquet('train.parquet'), or to_json('train.jsonl')) and give that"
            )
        found = sorted(f.name for f in islice(path.iterdir(), 10_000) if f.suffix.lower() in FILE_BUILDERS)
        files = ", ".join(str(path / f) for f in found[:3])
        raise DataError(
            f"{key}: {name} is a directory; give its data files (.jsonl, .json, .parquet or .csv): "
            + (f"e.g. {key}=[{files}]" if found else "it holds none")
        )
    if path.exists():
        raise DataError(f"{key}: {name}: unsupported file type; use .jsonl, .json, .parquet or .csv")
    if is_path(name):
        raise DataError(f"{key}: {no_such_file(name)}; give a .jsonl, .json, .parquet or .csv file")
    hub, _, split = name.partition(":")
    try:
        ds = datasets.load_dataset(hub, split=split or "train", streaming=streaming)
    except Exception as e:
        raise DataError(
            f"{key}: could not load '{name}' as a file or hub data set ({no_rows(e) or describe(e)}); no such "
            "local file, so it was looked up on the hub: give a .jsonl, .json, .parquet or .csv path, or a hub "
            "name 'owner/name' (or 'owner/name:split')"
        ) from None
    return Source(key, name, ds, list(ds.column_names or []))


def parquet_rows(path: Path, key: str, name: str) -> int:
    """The row count a Parquet file's footer gives. One that is no readable Parquet is an
    error here: datasets would log its own line about it before failing."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception as e:
        raise DataError(f"{key}: could not read {name} ({describe(e)}); give a Parquet file") from None


def no_rows(e: Exception) -> str | None:
    """datasets' words for a source with no rows ("Instruction 'train' corresponds to no
    data!"), in the user's."""
    return "it has no rows" if "corresponds to no data" in str(e) else None


def detect_format(columns: list[str], wanted: str, source: str, key: str) -> str:
    """Check that a source's columns fit data.format; for 'auto', that some format fits
    (each row's own format is then taken from the fields it fills, see `row_format`)."""
    cols = set(columns)
    if wanted != "auto":
        if not set(REQUIRED[wanted]) <= cols:
            raise DataError(
                f"{key}: {source}: data.format={wanted} needs columns {sorted(REQUIRED[wanted])}, found "
                f"{sorted(cols)}; set data.format=auto to take each row's format from its fields"
            )
        return wanted
    if not any(set(need) <= cols for need in REQUIRED.values()):
        raise DataError(
            f"{key}: {source}: cannot tell the row format from columns {sorted(cols)}; expected 'text', "
            "'prompt'+'completion', 'instruction'+'output', 'messages' or 'conversations' "
            "(or set data.format)"
        )
    return "auto"

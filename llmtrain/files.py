"""Local data files (.jsonl, .json, .csv) read row by row, each row with the line of the
file it starts on.

Written by hand because datasets' readers lose what an error must name: they locate a
row by its index at best (a CSV field may span lines), stop with a message that names no
line for text that is not UTF-8, and unify each column's type across the whole file
(adding missing keys as None, widening types), so a check of the unified row can blame a
row that is valid as written. Here every row reaches the data pipeline as the user wrote
it, as JSON text (column RAW) with its file line (column LINE); the tokenizing `map` and
the stream parse it back, and every error names the line.

A JSON Lines file's lines stand alone, so a line that cannot be read as a row (invalid
JSON, not an object, not UTF-8, a lone surrogate) does not stop the reading: it becomes a
row that carries only its fault (`BadLine`), and the data pipeline treats it as any
malformed row (an error naming the line, or dropped and counted under
data.bad_rows=skip). In a .json array or a CSV file such a fault leaves the rest of the
file unreadable, and stops the run.

Every read is bounded, so a file that is not what it claims (a .jsonl with no line
breaks, a .json array of many gigabytes) stops the run with a line naming it instead of
filling memory: a row (a line of JSON Lines, a CSV row, an object of a .json array) has
at most MAX_ROW_BYTES, and a .json array, read whole, at most MAX_JSON_BYTES. No real
data set comes near either; a larger one belongs in JSON Lines, split into rows.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from .errors import DataError, UserError, describe

TEXT_FILES = (".jsonl", ".json", ".csv")
MAX_ROW_BYTES = 64 << 20  # one row: a line of JSON Lines, a CSV row, an object of a .json array
MAX_JSON_BYTES = 1 << 30  # a .json array, which is read whole (JSON Lines is read a line at a time)
TOO_DEEP = "JSON nested too deeply to read; flatten the row"
RAW, LINE = "__raw", "__line"
BAD = "__bad_line"  # the key of a parsed row that is a line's fault, not a row (see data/sources.Source.parse)


class BadLine(str):
    """What is wrong with a line of a JSON Lines file that is not a row."""


def read_rows(path: Path, key: str) -> Iterator[tuple[int, dict]]:
    """(line the row starts on, row) for every row of a .jsonl, .json or .csv file. JSON
    Lines and CSV are read a line at a time (a stream of any size); a .json array is one
    document and is read whole."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            rows = _json_array(_decode(_read_whole(path, key), path, key), path, key)
        elif suffix == ".jsonl":
            rows = _jsonl(path, key)
        else:
            rows = _csv(_lines(path, key), path, key)
        yield from rows
    except OSError as e:
        raise DataError(
            f"{key}: cannot read {path} ({e.strerror or describe(e)}); check the file and its permissions"
        ) from None


def as_text(row: dict) -> str | BadLine:
    """The row as JSON text, or what is wrong if some of its text cannot be written as
    UTF-8: JSON's \\uXXXX escapes can spell a lone UTF-16 surrogate, which no tokenizer or
    Arrow table takes."""
    text = json.dumps(row, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return BadLine(
            f"text with a lone UTF-16 surrogate ({ascii(e.object[e.start : e.end])}), which is not a character; "
            "fix the \\u escape (a surrogate pair needs both halves)"
        )
    return text


def is_path(name: str) -> bool:
    """Whether a data or model name is written as a local path (./x, /x, ~/x, a/b/c), which no
    hub name ('owner/name') is."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def no_such_file(name: str) -> str:
    """'no such file: NAME', saying where a relative name was looked for (a launch from
    another directory is the usual cause)."""
    return f"no such file: {name}" + ("" if Path(name).is_absolute() else f" (in the working directory {Path.cwd()})")


def size_text(n: int) -> str:
    """A bound in words: '64 MiB', '1 GiB', '1000 bytes'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _too_long(path: Path, key: str, line: int, fix: str) -> DataError:
    return DataError(
        f"{key}: {path} line {line}: a row longer than {size_text(MAX_ROW_BYTES)}, the most a row may have; {fix}"
    )


def _read_lines(f, path: Path, key: str, fix: str) -> Iterator[bytes]:
    """A binary file's lines, each read with a limit: a longer line (or a file with no
    line breaks) stops with its line instead of being read whole into memory."""
    number = 0
    while data := f.readline(MAX_ROW_BYTES + 1):
        number += 1
        if len(data) > MAX_ROW_BYTES:
            raise _too_long(path, key, number, fix)
        yield data


def _read_whole(path: Path, key: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise DataError(
            f"{key}: {path} is larger than {size_text(MAX_JSON_BYTES)}, and a .json array is read whole; "
            "write it as JSON Lines (.jsonl, one row a line), which is read a line at a time"
        )
    return data


def _not_utf8(data: bytes, error: UnicodeDecodeError | None = None) -> str | None:
    """What is wrong with a line's (or a file's) bytes as UTF-8 text, with the fix; None if
    nothing. UTF-16 is named: its byte-order mark, or the NUL byte each ASCII character
    carries there (half the bytes; it decodes as UTF-8, into text no JSON reader takes). A
    stray NUL is left to the reader (CSV keeps it in its field)."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or 3 * data.count(b"\x00") >= len(data) > 0:
        return "looks like UTF-16 text (a UTF-16 byte-order mark, or NUL bytes); save the file as UTF-8"
    if error is not None:
        return f"not UTF-8 text (byte {data[error.start]:#04x}); save the file as UTF-8"
    return None


def _lines(path: Path, key: str) -> Iterator[str]:
    """The file's lines as text (line ends kept), each checked to be UTF-8."""
    with open(path, "rb") as f:
        for number, data in enumerate(_read_lines(f, path, key, "check the quoting, or split it into several rows"), 1):
            try:
                text = data.decode("utf-8")
                problem = _not_utf8(data)
            except UnicodeDecodeError as e:
                problem = _not_utf8(data, e)
            if problem:
                raise DataError(f"{key}: {path} line {number}: {problem}")
            yield text.removeprefix("\ufeff") if number == 1 else text  # a byte-order mark is not data


def _decode(data: bytes, path: Path, key: str) -> str:
    try:
        text = data.decode("utf-8-sig")
        at = data.find(b"\x00")
        problem = _not_utf8(data)
    except UnicodeDecodeError as e:
        at, problem = e.start, _not_utf8(data, e)
    if problem:
        line = data[:at].count(b"\n") + 1
        raise DataError(f"{key}: {path} line {line}: {problem}")
    return text


def _jsonl(path: Path, key: str):
    """(line, row or BadLine) for every line of a JSON Lines file that is not blank."""
    with open(path, "rb") as f:
        for number, data in enumerate(_read_lines(f, path, key, "each line must be one row: split it into several"), 1):
            try:
                line = data.decode("utf-8")
                problem = _not_utf8(data)
            except UnicodeDecodeError as e:
                problem = _not_utf8(data, e)
            if problem:
                yield number, BadLine(problem)
                continue
            if number == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark is not data
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # a column past the end says where the line stopped
            except json.JSONDecodeError as e:
                row = BadLine(f"invalid JSON ({e.msg} at column {e.colno}); each line must be one JSON object")
            except RecursionError:
                row = BadLine(TOO_DEEP)
            if not isinstance(row, (dict, BadLine)):
                row = BadLine(f"expected a JSON object, got {type(row).__name__}")
            yield number, row


def _json_array(text: str, path: Path, key: str):
    """The objects of a JSON array, each with the line it starts on."""
    decoder, at, line, seen = json.JSONDecoder(), 0, 1, 0

    def skip(at: int) -> int:
        while at < len(text) and text[at] in " \t\r\n":
            at += 1
        return at

    def fail(message: str, at: int):
        raise DataError(
            f"{key}: {path} line {text.count(chr(10), 0, at) + 1}: {message}; "
            "use a JSON array of objects, or JSON Lines (.jsonl)"
        )

    at = skip(at)
    if at == len(text) or text[at] != "[":
        fail("the top level is not an array", at)
    at = skip(at + 1)
    while at < len(text) and text[at] != "]":
        line += text.count("\n", seen, at)
        try:
            row, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError as e:
            fail(f"invalid JSON ({e.msg})", e.pos)
        except RecursionError:
            fail(TOO_DEEP, at)
        if end - at > MAX_ROW_BYTES:  # characters, not bytes: a near enough bound, checked after the fact
            raise _too_long(path, key, line, "split it into several rows")
        if not isinstance(row, dict):
            fail(f"expected a JSON object, got {type(row).__name__}", at)
        yield line, row
        seen, at = at, skip(end)
        if at < len(text) and text[at] == ",":
            at = skip(at + 1)
        elif at < len(text) and text[at] != "]":
            fail("expected ',' or ']' after an object", at)
    if at == len(text):
        fail("the array is not closed", at)
    if skip(at + 1) != len(text):
        fail("text after the array", skip(at + 1))


def _csv(lines: Iterator[str], path: Path, key: str):
    """Rows as {header: value}; an empty field is None (a missing value, as pandas reads it)."""
    # Python's csv module refuses fields over 128 KiB by default; a long document is data.
    csv.field_size_limit(MAX_ROW_BYTES)
    size, ended = 0, 0  # characters of the row being read (a quoted field may span lines), its first line - 1

    def bounded(lines):
        nonlocal size
        for text in lines:
            size += len(text)
            if size > MAX_ROW_BYTES:
                raise _too_long(path, key, ended + 1, "check the quoting, or split it into several rows")
            yield text

    # strict: an unclosed quote is an error, not a field that swallows the rest of the file.
    reader = csv.reader(bounded(lines), strict=True)
    header = None
    try:
        for values in reader:
            start, ended, size = ended + 1, reader.line_num, 0
            if not values:
                continue
            if header is None:
                if repeated := sorted(v for v, n in Counter(values).items() if n > 1):
                    raise DataError(
                        f"{key}: {path} line {start}: the header names {repeated} more than once, so their fields "
                        "would overwrite each other; give each column its own name"
                    )
                header = values
                continue
            if len(values) > len(header):
                raise DataError(
                    f"{key}: {path} line {start}: {len(values)} fields but the header has {len(header)}; "
                    "quote fields that contain commas"
                )
            yield start, {name: (value if value != "" else None) for name, value in zip(header, values)}
    except csv.Error as e:
        why = "a quoted field is not closed" if "unexpected end of data" in str(e) else str(e)
        if "field larger than field limit" in str(e):
            raise _too_long(path, key, ended + 1, "check the quoting, or split it into several rows") from None
        raise DataError(f"{key}: {path} line {ended + 1}: not valid CSV ({why}); check the quoting") from None


MAX_OWN_BYTES = 64 << 20  # a file a run wrote for a later one to read: train_state.json, config.yaml


def read_own(path: Path, limit: int = MAX_OWN_BYTES) -> str:
    """The text of a file llmtrain wrote and reads back (a checkpoint's train_state.json,
    a run's config.yaml): read with a limit, since it may have been edited or replaced.
    ValueError when it is larger or not UTF-8; OSError when it cannot be read."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {size_text(limit)}, which llmtrain never writes")
    return data.decode("utf-8")


def load_json(path: Path) -> object:
    """`read_own` parsed as JSON; ValueError for anything that is not JSON llmtrain could
    have written (too large, nested too deeply for the parser)."""
    try:
        return json.loads(read_own(path))
    except RecursionError:
        raise ValueError(TOO_DEEP) from None


def first_rows(path: Path, key: str, n: int = 100) -> list[dict]:
    """The first `n` rows (lines that are not rows left out); if the file has lines but
    none of them is a row, the first line's fault, as an error."""
    rows, first_bad = [], None
    for line, row in read_rows(path, key):
        if isinstance(row, BadLine):
            first_bad = first_bad or (line, row)
            continue
        rows.append(row)
        if len(rows) == n:
            break
    if not rows and first_bad is not None:
        raise DataError(f"{key}: {path} line {first_bad[0]}: {first_bad[1]}; no line of the file is a row")
    return rows


def _generate(path: str, key: str, stamp: str):
    for line, row in read_rows(Path(path), key):
        text = row if isinstance(row, BadLine) else as_text(row)
        yield {LINE: line, RAW: json.dumps({BAD: str(text)}) if isinstance(text, BadLine) else text}


_HASHES: dict[tuple, str] = {}  # (path, device, inode, size, mtime, ctime) -> content_hash, for this process


def content_hash(path: Path) -> str:
    """The sha256 of the file's bytes (hex), read in 1 MiB blocks.

    What every cache of llmtrain and every run's data fingerprint is keyed on: a file's
    size and modification time do not identify its content (`cp -p` and `rsync -t` give
    a replaced file the old one's mtime, and a fixed row can keep the size). Reading costs
    about a second per GB; the result is kept for the life of the process, keyed on the
    file's identity and times (its ctime changes with any write or utime, and cannot be
    set), so a run reads each file once."""
    stat = path.stat()
    ident = (str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if ident not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        _HASHES[ident] = h.hexdigest()
    return _HASHES[ident]


HASHED_BYTES = 64 << 20  # files up to this size are known by content (`fingerprint`), larger ones by size and time


def fingerprint(path: Path) -> str:
    """What identifies a file a run reads beside its training data (a model's config,
    tokenizer and weights, a chat template, a reward function), for the run's record: the
    file's `content_hash` up to HASHED_BYTES, which covers configs, tokenizers (tens of MB at
    most), templates and code, however they were copied; a larger file (a weight shard: a
    model's are tens of GB in all, too much to read at every start) by its size and
    modification time, which a file written anew (a model retrained into its directory)
    changes."""
    stat = path.stat()
    if stat.st_size <= HASHED_BYTES:
        return content_hash(path)
    return f"size {stat.st_size}, modified {stat.st_mtime_ns}"


def tree_fingerprint(path: Path) -> dict[str, str]:
    """{name: fingerprint} of the files directly in a directory, as a model directory holds
    its weights, config and tokenizer. Subdirectories (a merged export's adapter/) and
    hidden files (.gitattributes) are not what a model is loaded from."""
    return {p.name: fingerprint(p) for p in sorted(path.iterdir()) if not p.name.startswith(".") and p.is_file()}


def row_dataset(path: Path, key: str, streaming: bool = False):
    """The file's rows as a datasets.Dataset (cached; written once by the main process and
    read by the others) or, with `streaming`, an IterableDataset read as it is iterated,
    both with columns LINE and RAW. The cache key is the file's content (`content_hash`),
    so an edited or replaced file is read again; a stream is not cached, and a corpus
    streamed because it is too large to prepare is not read once more to hash it."""
    import datasets

    kwargs = {"path": str(path.resolve()), "key": key, "stamp": ""}
    features = datasets.Features({LINE: datasets.Value("int64"), RAW: datasets.Value("string")})
    if streaming:
        return datasets.IterableDataset.from_generator(_generate, features=features, gen_kwargs=kwargs)
    kwargs["stamp"] = f"v3-{content_hash(path)}"
    try:
        return datasets.Dataset.from_generator(_generate, features=features, gen_kwargs=kwargs)
    except Exception as e:  # datasets wraps what the reader raised
        cause = user_cause(e)
        if cause is None:
            raise
        raise cause from None


def user_cause(e: BaseException | None) -> UserError | None:
    """The UserError a library exception wraps (as its cause or context), if any."""
    while e is not None:
        if isinstance(e, UserError):
            return e
        e = e.__cause__ or e.__context__
    return None

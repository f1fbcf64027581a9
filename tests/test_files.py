"""Local data files read row by row (llmtrain/files.py): every row keeps the file line it
starts on, comes back exactly as written (no type unification across rows), and every
unreadable file is one error naming the file and line."""

import json
from pathlib import Path

import pytest

from llmtrain.config import DataConfig
from llmtrain.data.build import ROWS
from llmtrain.data.sources import load_source
from llmtrain.errors import DataError
from llmtrain.files import read_rows
from tests.support.data import templated


def rows_of(path, text):
    path.write_text(text, encoding="utf-8")
    return list(read_rows(path, "data.train"))


def test_jsonl_rows_keep_their_lines_across_blank_lines(tmp_path):
    got = rows_of(tmp_path / "a.jsonl", '\ufeff{"text": "a"}\n\n{"text": "b"}\n   \n{"text": "c"}\n')
    assert got == [(1, {"text": "a"}), (3, {"text": "b"}), (5, {"text": "c"})]  # a byte-order mark is no data


def test_json_array_objects_keep_the_line_they_start_on(tmp_path):
    text = '[\n  {"text": "a"},\n  {"text":\n   "b"}, {"text": "c"},\n\n  {"text": "d"}\n]\n'
    assert rows_of(tmp_path / "a.json", text) == [
        (2, {"text": "a"}),
        (3, {"text": "b"}),
        (4, {"text": "c"}),
        (6, {"text": "d"}),
    ]


def test_csv_rows_start_where_they_start_even_when_a_field_spans_lines(tmp_path):
    text = 'prompt,completion\n"two\nlines",ok\n\nplain,\n"x, y","a ""quoted"" b"\n'
    assert rows_of(tmp_path / "a.csv", text) == [
        (2, {"prompt": "two\nlines", "completion": "ok"}),
        (5, {"prompt": "plain", "completion": None}),  # an empty field is a missing value
        (6, {"prompt": "x, y", "completion": 'a "quoted" b'}),
    ]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("latin1.csv", "prompt,completion\na,b\nx,caf\xe9\n".encode("latin-1"), r"latin1.csv line 3: not UTF-8 text"),
        ("utf16.csv", "prompt,completion\na,b\n".encode("utf-16-le"), r"utf16.csv line 1: looks like UTF-16 text"),
        ("utf16.json", '[{"text": "a"}]'.encode("utf-16"), r"utf16.json line 1: looks like UTF-16 text \(a UTF-16"),
        # Without a byte-order mark UTF-16 decodes as UTF-8 (ASCII and NUL bytes), which JSON then refuses.
        ("utf16.jsonl", '{"text": "a"}\n'.encode("utf-16-le"), r"utf16.jsonl line 1: looks like UTF-16 text"),
        ("wide.csv", b"prompt,completion\na,b\nx,y,z\n", r"wide.csv line 3: 3 fields but the header has 2"),
        ("twice.csv", b"text,text\na,b\n", r"twice.csv line 1: the header names \['text'\] more than once"),
        ("bad.json", b'[\n {"text": "a"},\n {"text": }\n]', r"bad.json line 3: invalid JSON \(Expecting value\)"),
        ("object.json", b'{"text": "a"}', r"object.json line 1: the top level is not an array"),
        ("open.json", b'[\n {"text": "a"},\n', r"open.json line 3: the array is not closed"),
        ("tail.json", b'[{"text": "a"}]\nextra', r"tail.json line 2: text after the array"),
        ("lead.json", b'\n\n[\n {"text": "a"},\n {"text": }\n]', r"lead.json line 5: invalid JSON \(Expecting value\)"),
        ("open.csv", b'prompt,completion\na,b\n"x,y\nz,w\n', r"open.csv line 3: not valid CSV \(a quoted field is not"),
        ("quote.csv", b'prompt,completion\na,"b"c\n', r"quote.csv line 2: not valid CSV \(',' expected after"),
        ("deep.json", b'[\n{"x": ' + b"[" * 10**5 + b"]" * 10**5 + b"}]", r"deep.json line 2: JSON nested too deeply"),
    ],
)
def test_an_unreadable_file_is_one_error_naming_its_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"^data.train: {tmp_path}/{message}"):
        load_source(str(path), "data.train")


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "bad.jsonl",
            b'{"text": "a"}\n{"text": oops}\n',
            r"bad.jsonl line 2: invalid JSON \(Expecting value at column 10\)",
        ),
        (  # cut short: the column is the line's end, not its newline's column 1
            "cut.jsonl",
            b'{"text": "a"}\n{"text": "b"\n',
            r"cut.jsonl line 2: invalid JSON \(Expecting ',' delimiter at column 13\)",
        ),
        ("list.jsonl", b'{"text": "a"}\n\n[1, 2]\n', r"list.jsonl line 3: expected a JSON object, got list"),
        ("latin1.jsonl", '{"text": "a"}\n{"text": "caf\xe9"}\n'.encode("latin-1"), r"latin1.jsonl line 2: not UTF-8 "),
        (
            "lone.jsonl",
            b'{"text": "a"}\n{"text": "\\ud800 b"}\n',
            r"lone.jsonl line 2: text with a lone UTF-16 surrogate \('\\ud800'\), which is not a character",
        ),
        (
            "deep.jsonl",
            b'{"text": "a"}\n{"x": ' + b"[" * 10**5 + b"]" * 10**5 + b"}\n",
            r"deep.jsonl line 2: JSON nested",
        ),
    ],
)
def test_a_jsonl_line_that_is_not_a_row_is_a_malformed_row(tmp_path, tokenizer, name, content, message):
    """Its lines stand alone, so the rest of the file is read: the line stops the run as
    a malformed row does, or is dropped and counted under data.bad_rows=skip."""
    path = tmp_path / name
    path.write_bytes(content)
    config = DataConfig(train=str(path))
    with pytest.raises(DataError, match=rf"^data.train: {tmp_path}/{message}.*data.bad_rows=skip would drop"):
        ROWS.prepare("data.train", [str(path)], tokenizer, config)
    config = DataConfig(train=str(path), bad_rows="skip", max_bad_fraction=0.5)
    ds, stats = ROWS.prepare("data.train", [str(path)], tokenizer, config)
    assert len(ds) == stats.kept == 1 and stats.rows == 2
    assert f"1 dropped (malformed, data.bad_rows=skip: {path} line {message.split(' line ')[1].split(':')[0]}" in (
        stats.summary("data.train")
    )


def test_a_jsonl_file_with_no_row_is_an_error_naming_its_first_line(tmp_path):
    path = tmp_path / "none.jsonl"
    path.write_bytes(b"\n{oops\n[1]\n")
    with pytest.raises(DataError, match=rf"^data.train: {path} line 2: invalid JSON .*; no line of the file is a row"):
        load_source(str(path), "data.train")


def test_a_path_that_is_no_readable_file_says_so(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DataError, match=rf"^data.train: {tmp_path}/dir.jsonl is not a regular file; give a data file$"):
        load_source(str(tmp_path / "dir.jsonl"), "data.train")
    with pytest.raises(DataError, match=rf"^data.train: cannot read {tmp_path}/dir.jsonl \(Is a directory\); check"):
        list(read_rows(tmp_path / "dir.jsonl", "data.train"))  # any OSError while reading, with its reason


def test_extensions_are_matched_whatever_their_case(tmp_path):
    path = tmp_path / "TRAIN.JSONL"
    path.write_text('{"text": "a"}\n')
    assert [load_source(str(path), "data.train").parse(r) for r in load_source(str(path), "data.train").dataset] == [
        {"text": "a"}
    ]


def test_a_csv_field_may_be_long(tmp_path):
    long = "x" * 300_000  # above the csv module's default field limit of 128 KiB
    assert rows_of(tmp_path / "long.csv", f"text\n{long}\n") == [(2, {"text": long})]


@pytest.mark.parametrize("name, content", [("e.jsonl", ""), ("b.jsonl", "\n \n"), ("e.csv", ""), ("h.csv", "a,b\n"),
                                           ("e.json", "[]")])  # fmt: skip
def test_a_file_with_no_rows_says_so(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=rf"^data.train: {path} has no rows; give a file with at least one row$"):
        load_source(str(path), "data.train")


def test_rows_come_back_as_written_not_unified_across_the_file(tmp_path):
    """datasets unifies a column across rows (adding missing keys as None); each row here
    is exactly what its line holds."""
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"}]},
        {"text": "plain", "weight": 0},
        {"text": "plain", "weight": 0.5},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = load_source(str(path), "data.train")
    assert src.columns == ["messages", "text", "weight"]
    assert [src.parse(r) for r in src.dataset] == rows
    assert [src.where(r, i) for i, r in enumerate(src.dataset)] == [f"{path} line {n}" for n in (1, 2, 3, 4)]


def test_an_edited_file_is_read_again(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "first"}\n')
    assert [load_source(str(path), "data.train").parse(r) for r in load_source(str(path), "data.train").dataset]
    path.write_text('{"text": "second version"}\n{"text": "and more"}\n')
    src = load_source(str(path), "data.train")
    assert [src.parse(r)["text"] for r in src.dataset] == ["second version", "and more"]


@pytest.mark.parametrize("name", ["a.jsonl", "a.parquet"])
def test_a_file_replaced_under_the_same_size_and_mtime_is_read_again(tmp_path, name):
    """`cp -p` or `rsync -t` gives a new file the old one's modification time; with the
    same size, only the content tells it apart (the cache is keyed on it, datasets' own
    included, which keys a local parquet file on its mtime)."""
    import os

    import pandas as pd

    path = tmp_path / name

    def write(texts):
        if name.endswith(".parquet"):
            pd.DataFrame({"text": texts}).to_parquet(path)
        else:
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    def texts():
        src = load_source(str(path), "data.train")
        return [src.parse(r)["text"] for r in src.dataset]

    write(["first", "second"])
    assert texts() == ["first", "second"]
    stat = path.stat()
    write(["fir5t", "secon6"])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert texts() == ["fir5t", "secon6"]


def test_a_bad_row_in_a_csv_names_its_file_line(tmp_path, tokenizer):
    path = tmp_path / "pc.csv"
    path.write_text('prompt,completion\n"spans\ntwo lines",ok\n"fine",\n')
    with pytest.raises(DataError, match=rf"^data.train: {path} line 4: no known format fits this row's fields"):
        ROWS.prepare("data.train", [str(path)], tokenizer, DataConfig(max_seq_len=256))


def test_a_conversation_the_chat_template_refuses_is_an_error_naming_its_line(tmp_path, tokenizer):
    """E.g. Llama-2/Mistral-style templates refuse two user turns in a row."""
    template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    rows = [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "user", "content": "b"},
                {"role": "assistant", "content": "c"},
            ]
        },
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        ROWS.prepare("data.train", [str(path)], templated(tokenizer, template), DataConfig(max_seq_len=256))
    assert str(e.value) == (
        f"data.train: {path} line 2: the chat template failed on this conversation (TemplateError: Conversation "
        "roles must alternate user/assistant); fix the row or set data.chat_template; data.bad_rows=skip would "
        "drop malformed rows instead"
    )


def test_a_streamed_file_names_the_line_of_a_row_it_cannot_read(tmp_path, tokenizer):
    """The same reader feeds data.streaming: a file that goes bad far into the stream
    stops the run naming the line (not a byte position)."""
    from llmtrain.data.stream import StreamedRows

    path = tmp_path / "late.csv"
    good = "".join(f'"question {i}\nspans two lines",answer {i}\n' for i in range(150))
    path.write_bytes(f"prompt,completion\n{good}".encode() + b"bad,caf\xe9\n")
    stream = StreamedRows("data.train", tokenizer, DataConfig(train=str(path), shuffle=False), 0, 0, 1)
    with pytest.raises(DataError, match=rf"^data.train: {path} line 302: not UTF-8 text \(byte 0xe9\)"):
        list(stream)


def test_a_stray_nul_byte_in_a_csv_field_is_kept_not_taken_for_utf16(tmp_path):
    got = rows_of(tmp_path / "nul.csv", "prompt,completion\na,b\x00c\n")
    assert got == [(2, {"prompt": "a", "completion": "b\x00c"})]


def test_a_save_to_disk_directory_and_a_file_that_is_no_parquet_are_one_line(tmp_path, capfd):
    """datasets' save_to_disk writes dataset_info.json and state.json beside its Arrow
    files: named as data files, those are not the data. An unreadable Parquet file gets one
    line, without datasets' own log line before it."""
    import datasets

    from llmtrain.data.sources import load_source
    from llmtrain.errors import DataError

    rows = datasets.Dataset.from_list([{"text": "a"}])
    for saved, data in ((tmp_path / "saved", rows), (tmp_path / "dict", datasets.DatasetDict(train=rows))):
        data.save_to_disk(str(saved))
        with pytest.raises(DataError, match=rf"^data.train: {saved} is a data set saved with datasets' save_to_disk"):
            load_source(str(saved), "data.train")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"12345")
    capfd.readouterr()
    with pytest.raises(DataError, match=rf"^data.train: could not read {bad} \(.*\); give a Parquet file$"):
        load_source(str(bad), "data.train")
    assert capfd.readouterr() == ("", "")


def test_a_directory_given_as_data_names_the_data_files_in_it(tmp_path):
    from llmtrain.data.sources import load_source
    from llmtrain.errors import DataError

    (tmp_path / "b.jsonl").write_text("")
    (tmp_path / "a.parquet").write_text("")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(DataError) as e:
        load_source(str(tmp_path), "data.train")
    assert str(e.value) == (
        f"data.train: {tmp_path} is a directory; give its data files (.jsonl, .json, .parquet or .csv): "
        f"e.g. data.train=[{tmp_path}/a.parquet, {tmp_path}/b.jsonl]"
    )
    for path in ("./nothere", f"{tmp_path}/nothere.txt", "a/b/c"):  # paths, never hub names: not looked up
        where = "" if path.startswith("/") else f" (in the working directory {Path.cwd()})"  # a relative one says so
        with pytest.raises(DataError) as e:
            load_source(path, "data.train")
        assert str(e.value) == f"data.train: no such file: {path}{where}; give a .jsonl, .json, .parquet or .csv file"


def test_a_model_directory_is_known_by_its_files_small_ones_by_content(tmp_path, monkeypatch):
    """files.fingerprint: the content of a file up to HASHED_BYTES, the size and time of a
    larger one; tree_fingerprint: the files directly in a directory, not its subdirectories
    or hidden files (what a run's record keeps of a model directory, rundir.inputs)."""
    import os

    from llmtrain import files

    monkeypatch.setattr(files, "HASHED_BYTES", 8)
    model = tmp_path / "model"
    (model / "adapter").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"w" * 100)
    (model / ".gitattributes").write_text("x")
    (model / "adapter" / "adapter_config.json").write_text("{}")
    stat = (model / "model.safetensors").stat()
    assert files.tree_fingerprint(model) == {
        "config.json": files.content_hash(model / "config.json"),
        "model.safetensors": f"size 100, modified {stat.st_mtime_ns}",
    }
    (model / "config.json").write_text("[]")  # same size: known by its content
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # written anew
    changed = files.tree_fingerprint(model)
    assert changed["config.json"] != files.content_hash(model / "adapter" / "adapter_config.json")  # "{}" before
    assert changed["model.safetensors"] == f"size 100, modified {stat.st_mtime_ns + 1}"

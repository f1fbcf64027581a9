"""Every input has a bound (size, depth, time) and one error line past it: the config
YAML and its overrides, data files, chat templates, and the files a run reads back.

Cases that would hang or fill memory without their bound run with the bound lowered
(monkeypatched) and a bomb small enough to be harmless were the bound missing."""

import copy
import json
import time

import pytest

from llmtrain import files
from llmtrain.config import DataConfig, load_config
from llmtrain.config import load as config_load
from llmtrain.config.load import parse_override
from llmtrain.data.build import ROWS
from llmtrain.data.rows import process_row
from llmtrain.errors import ConfigError, DataError
from tests.support.data import templated


def one_line(e: pytest.ExceptionInfo, longest: int = 600) -> str:
    text = str(e.value)
    assert "\n" not in text and len(text) < longest, text[:2000]
    return text


def laughs(levels: int) -> list[str]:
    """A "billion laughs" YAML document: each anchor holds nine aliases of the one before."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return lines


# --- the config YAML -------------------------------------------------------------------------


def test_yaml_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    path = tmp_path / "bomb.yaml"  # 9**7 = 4.8 million strings once expanded (9**9 is a billion)
    path.write_text("\n".join([*laughs(7), "data:", "  train: *a7"]) + "\n")
    started = time.process_time()  # work done, which other processes on the machine do not stretch
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert time.process_time() - started < 5
    assert one_line(e).startswith(f"{path}:7: the document is larger than 4194304 nodes and characters once its")


def test_a_quoted_value_is_cut_short(tmp_path):
    path = tmp_path / "long.yaml"  # within the bounds (59049 strings), but not a number
    path.write_text("\n".join([*laughs(4), "train:", "  lr: *a4"]) + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["model.name_or_path=m", "data.train=a.jsonl", "output_dir=o"])
    *anchors, lr = e.value.problems  # the anchors' keys a0 to a4 are unknown keys, each a line of its own
    assert len(anchors) == 5 and lr.startswith("train.lr: expected a number, got [[[") and len(lr) < 400


@pytest.mark.parametrize("where", ["file", "override"])
def test_deep_yaml_nesting_is_one_error_line(tmp_path, where):
    deep = "[" * 5000 + "]" * 5000
    if where == "file":
        path = tmp_path / "deep.yaml"
        path.write_text(f"data:\n  train: {deep}\n")
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert one_line(e) == f"{path}:2: the document is nested more than 32 levels deep; flatten it"
    else:
        with pytest.raises(ConfigError) as e:
            parse_override(f"data.train={deep}")
        assert one_line(e) == (
            "data.train: the value given on the command line is nested more than 32 levels deep; flatten it"
        )


def test_override_alias_bomb_is_refused():
    bomb = "[" + ", ".join(f"&a{i} [" + ", ".join([f"*a{i - 1}" if i else "lol"] * 9) + "]" for i in range(8)) + "]"
    with pytest.raises(ConfigError) as e:
        parse_override(f"data.train={bomb}")
    assert "once its aliases (*name) are expanded" in one_line(e)


def test_an_alias_inside_its_own_value_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("data:\n  train: &a [x, *a]\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert one_line(e) == f"{path}:2: the document holds an alias (*name) inside the value it names; write it out"


def test_an_oversized_config_file_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(config_load, "MAX_CONFIG_BYTES", 1000)
    path = tmp_path / "big.yaml"
    path.write_text("output_dir: o\n" + "# padding\n" * 200)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert one_line(e).startswith(f"--config: {path} is larger than 1000 bytes, more than any config needs")


@pytest.mark.parametrize("key", ["data.train", "model.name_or_path", "data.chat_template", "output_dir"])
def test_a_name_too_long_for_a_path_is_one_error_line(key):
    base = ["model.name_or_path=m", "data.train=a.jsonl", "output_dir=o"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, f"{key}={'x' * 5000}"])
    assert one_line(e).startswith(f"{key}: a name of 5000 characters ('xxxx")
    assert str(e.value).endswith("), longer than a path may be; give a shorter path or name")
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, f'{key}="a\\0b"'])
    assert one_line(e) == f"{key}: 'a\\x00b' holds a null character, which no path may; remove it"


def test_a_config_path_too_long_is_one_error_line():
    with pytest.raises(ConfigError) as e:
        load_config("x" * 5000)
    assert one_line(e).startswith("--config: 'xxx") and str(e.value).endswith(
        "cannot be a path; give the path of a YAML file"
    )


# --- data files ------------------------------------------------------------------------------


def rows(n: int) -> str:
    return "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(n))


@pytest.mark.parametrize("kind", ["jsonl", "jsonl-no-breaks", "csv", "csv-quoted", "json"])
def test_a_row_past_the_bound_is_one_error_line(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(files, "MAX_ROW_BYTES", 1000)  # 64 MiB in earnest
    long = "x" * 3000
    path, line = tmp_path / f"rows.{kind.split('-')[0]}", 2
    if kind == "jsonl":
        path.write_text(rows(1) + json.dumps({"text": long}) + "\n" + rows(1))
    elif kind == "jsonl-no-breaks":
        path.write_text(json.dumps({"text": long}) * 3)
        line = 1
    elif kind == "csv":
        path.write_text(f"text\n{long}\nshort\n")
    elif kind == "csv-quoted":  # one field over many short lines
        path.write_text('text\n"' + "x\n" * 1500 + '"\n')
    else:
        path.write_text(f'[\n{{"text": "{long}"}}\n]')
    with pytest.raises(DataError) as e:
        list(files.read_rows(path, "data.train"))
    fix = "split it into several" if kind.startswith("json") else "check the quoting, or split it into several rows"
    assert one_line(e).startswith(f"data.train: {path} line {line}: a row longer than 1000 bytes, the most a row may")
    assert fix in str(e.value)


def test_a_long_row_far_into_a_file_stops_the_run_naming_it(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setattr(files, "MAX_ROW_BYTES", 1000)
    path = tmp_path / "rows.jsonl"  # past the rows read up front: found by datasets' reader
    path.write_text(rows(150) + json.dumps({"text": "x" * 3000}) + "\n")
    with pytest.raises(DataError) as e:
        ROWS.prepare("data.train", [str(path)], tokenizer, DataConfig(train=str(path)))
    assert one_line(e).startswith(f"data.train: {path} line 151: a row longer than 1000 bytes")


def test_a_json_array_past_its_bound_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_JSON_BYTES", 1000)
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"text": f"row {i}"} for i in range(200)]))
    with pytest.raises(DataError) as e:
        list(files.read_rows(path, "data.train"))
    assert one_line(e) == (
        f"data.train: {path} is larger than 1000 bytes, and a .json array is read whole; write it as JSON Lines "
        "(.jsonl, one row a line), which is read a line at a time"
    )


def test_a_malformed_row_is_quoted_short(tokenizer):
    out = process_row({"messages": [{"role": "x" * 1_000_000}]}, "chat", tokenizer, DataConfig())
    assert out["status"].startswith("error: messages[0]: needs a 'role'") and len(out["status"]) < 600


# --- chat templates --------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def chat_rows(tmp_path, n: int = 3) -> str:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(CHAT) + "\n" for _ in range(n)))
    return str(path)


@pytest.mark.parametrize(
    "body, why",
    [
        ("{{ 'x' * 10**7 }}", r"builds a text of more than 1000000 characters \(repeating a text or list\)"),
        ("{{ 'x'.ljust(10**7) }}", "passes the number 10000000"),
        ("{{ '%10000000s' % 'x' }}", r"\(a format field that wide\)"),
        ("{{ 'x'|center(10**7) }}", "passes the number 10000000"),
        ("{% set ns = namespace(s='x') %}{% for i in range(24) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "joining"),
        ("{% set s = 'x' %}" + "{% set s = s ~ s %}" * 24, r"\(joining texts\)"),
        ("{% for i in range(2000) %}{{ 'y' * 1000 }}{% endfor %}", r"\(joining texts\)"),
        # refused before the text is built (the size check after it came once 3 GB were taken)
        ("{% set s = 'x' * 900000 %}{{ ([s] * 30) | join }}", r"\(joining a list\)"),
        ("{% set s = 'x' * 900000 %}{{ ([s] * 30) | join(',') }}", r"\(joining a list\)"),
        ("{% set s = 'x' * 900000 %}{{ ''.join([s] * 30) }}", r"\(calling join\)"),
        ("{% set s = 'x' * 900000 %}{{ s.replace('x', 'yy') }}", r"\(calling replace\)"),
    ],
)
def test_a_template_building_a_huge_text_stops_the_run(tmp_path, monkeypatch, tokenizer, body, why):
    monkeypatch.setattr("llmtrain.template.MAX_RENDERED", 1_000_000)  # 128 Mi characters in earnest
    path = chat_rows(tmp_path)
    cfg = DataConfig(train=path, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}" + body)
    cfg.bad_rows = "skip"  # the template is at fault, not the row: it stops the run anyway
    with pytest.raises(DataError, match=why) as e:
        ROWS.prepare("data.train", [path], templated(tokenizer, cfg.chat_template_text()), cfg)
    assert one_line(e).startswith(f"data.train: {path} line 1: data.chat_template ")
    assert str(e.value).endswith(
        "on this row, past the bounds on rendering; fix the template, or set data.chat_template to another"
    )


def test_a_template_nested_too_deeply_for_jinja_is_one_line(tmp_path, tokenizer):
    """Jinja's lexer and parser recurse with the nesting: as data.chat_template it is a
    config error, as the model's own template the run stops blaming the template, not the row."""
    from llmtrain.config.validate import chat_template_problem

    deep = "{{ " + "(" * 50_000 + "1" + ")" * 50_000 + " }}"
    (tmp_path / "deep.jinja").write_text(deep)
    assert chat_template_problem(str(tmp_path / "deep.jinja")) == (
        f"data.chat_template: {tmp_path / 'deep.jinja'} is nested too deeply for Jinja to compile; simplify the "
        "template"
    )
    path = chat_rows(tmp_path)
    cfg = DataConfig(train=path, bad_rows="skip")
    with pytest.raises(DataError) as e:
        ROWS.prepare("data.train", [path], templated(tokenizer, deep), cfg)
    assert one_line(e).startswith(f"data.train: {path} line 1: ") and "is nested too deeply to compile" in one_line(e)
    assert "fix the template" in one_line(e)


def test_a_model_template_that_loops_long_is_stopped_in_time(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setattr("llmtrain.template.MAX_RENDER_SECONDS", 0.3)  # 10 s in earnest
    own = copy.deepcopy(tokenizer)  # the model directory's template
    own.chat_template = "{% for i in range(4000) %}{% for j in range(4000) %}{% endfor %}{% endfor %}{{ 'x' }}"
    path = chat_rows(tmp_path)
    started = time.process_time()
    with pytest.raises(DataError) as e:
        ROWS.prepare("data.train", [path], own, DataConfig(train=path))
    assert time.process_time() - started < 5
    assert one_line(e) == (
        f"data.train: {path} line 1: the chat template of {tokenizer.name_or_path} (its tokenizer_config.json or "
        "chat_template.jinja) ran longer than 0.3 s on this row, past the bounds on rendering; fix the template, or "
        "set data.chat_template to another"
    )


def test_a_streamed_row_past_a_template_bound_stops_the_stream_naming_it(tmp_path, monkeypatch, tokenizer):
    from llmtrain.data.stream import StreamedRows

    monkeypatch.setattr("llmtrain.template.MAX_RENDERED", 1_000_000)
    path = chat_rows(tmp_path)
    body = "{% for m in messages %}{{ m.content * 10**6 }}{% endfor %}"  # 'hi' a million times: 2 million characters
    cfg = DataConfig(train=path, chat_template=body, shuffle=False, bad_rows="skip")
    with pytest.raises(DataError) as e:
        list(StreamedRows("data.train", templated(tokenizer, body), cfg, seed=7, rank=0, world=1))
    assert one_line(e).startswith(f"data.train: {path} line 1: data.chat_template builds a text of more than 1000000")


def test_a_huge_constant_is_not_folded_while_the_template_compiles():
    from llmtrain.config.validate import chat_template_problem
    from llmtrain.template import MAX_RENDERED

    started = time.process_time()  # Jinja folds constants at compile time, in the start-up check
    huge = f"{{{{ 'x' * {MAX_RENDERED * 1000} }}}}{{{{ 2 ** 1000000000 }}}}"
    assert chat_template_problem(huge) is None
    assert time.process_time() - started < 5


def test_bounded_templates_render_as_before():
    from transformers.utils.chat_template_utils import render_jinja_template

    from llmtrain import template

    template.install()

    body = "{% for m in messages %}{{ '%s: %-3s|' % (m.role, m.content) }}{{ m|tojson }}{% endfor %}{{ 2 ** 10 }}"
    rendered = render_jinja_template([CHAT["messages"]], chat_template=body)[0][0]
    assert rendered.startswith('user: hi |{"role": "user", "content": "hi"}assistant: hello|') and rendered.endswith(
        "1024"
    )


# --- files a run reads back ------------------------------------------------------------------


def test_a_deeply_nested_train_state_is_unreadable_not_a_traceback(tmp_path):
    from llmtrain.output.checkpoint import STATE_FILE, damage
    from llmtrain.output.rundir import finished_state

    (tmp_path / "final").mkdir()
    for d in (tmp_path, tmp_path / "final"):
        (d / STATE_FILE).write_text("[" * 100_000 + "]" * 100_000)
    assert damage(tmp_path) == (f"{STATE_FILE} is unreadable (ValueError)", [])
    assert finished_state(str(tmp_path)) == {"step": None}


def test_metrics_lines_are_read_with_a_bound(tmp_path, monkeypatch):
    from llmtrain.observe import metrics

    monkeypatch.setattr(metrics, "MAX_ROW_BYTES", 200_000)  # 1 MiB in earnest
    path = tmp_path / "metrics.jsonl"  # a line past the bound, a step that is not a count, a deep line
    path.write_text('{"step": 1}\n' + "x" * 500_000 + '\n{"step": "2"}\n' + "[" * 100_000 + "\n" + '{"step": 3}\n')
    lines = list(metrics._lines(path))
    assert len(lines[1]) < 100 and [metrics._step(line) for line in lines] == [1, None, None, None, 3]

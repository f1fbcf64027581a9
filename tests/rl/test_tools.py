"""Tools (rl/tools.py): loaded and described as TRL's `tools=` takes them, and called so that
nothing a tool does stops the run or reaches it: an exception, an exit, a hang, megabytes of
output and edited arguments are each a result the model sees or nothing at all."""

import io
import json
import os
import sys
import threading
import time

import pytest

from llmtrain.errors import ToolError
from llmtrain.rl import tools as tools_module
from llmtrain.rl.tools import ToolBox, load_tools

TOOLS = '''
import os
import sys
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def lookup(key: str) -> dict:
    """Look a key up.

    Args:
        key: What to look up.
    """
    return {"key": key, "values": [1, 2]}


def fails(x: int) -> int:
    """Fail.

    Args:
        x: Anything.
    """
    raise ValueError(f"no good: {x}")


def exits(x: int) -> int:
    """Exit.

    Args:
        x: Anything.
    """
    sys.exit(3)


def wanders(x: int) -> int:
    """Change the working directory.

    Args:
        x: Anything.
    """
    os.chdir("/")
    return x


def sleeps(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def floods(n: int) -> str:
    """Return n characters.

    Args:
        n: How many.
    """
    return "x" * n


def edits(items: list) -> int:
    """Edit its argument.

    Args:
        items: A list.
    """
    items.append(99)
    return len(items)


def undocumented(a, b):
    return a + b
'''


@pytest.fixture
def spec(tmp_path):
    (tmp_path / "my_tools.py").write_text(TOOLS)
    return lambda name: f"{tmp_path / 'my_tools.py'}:{name}"


def box(spec, *names, timeout_s=5.0, max_chars=1000):
    return ToolBox(load_tools([spec(n) for n in names]), timeout_s, max_chars)


def test_a_trl_style_function_is_a_tool_with_the_schema_transformers_reads(spec):
    from transformers.utils import get_json_schema

    (add,) = load_tools([spec("add")])
    assert add.name == "add" and add.schema == get_json_schema(add.fn)
    assert add.schema["function"]["parameters"]["required"] == ["a", "b"]
    tools = box(spec, "add", "lookup")
    assert tools.schemas() == [t.schema for t in load_tools([spec("add"), spec("lookup")])]
    call = tools.call("add", {"a": 2, "b": 3})
    assert (call.content, call.error) == ("5", False)
    assert call.message() == {"role": "tool", "name": "add", "content": "5"}
    assert json.loads(tools.call("lookup", {"key": "k"}).content) == {"key": "k", "values": [1, 2]}


def test_a_function_transformers_cannot_describe_is_one_line(spec):
    with pytest.raises(ToolError, match=r"^grpo.tools: .*:undocumented: transformers cannot read its schema"):
        load_tools([spec("undocumented")])
    with pytest.raises(ToolError, match=r"are both named 'add'; the model calls a tool by its name"):
        load_tools([spec("add"), spec("add")])
    with pytest.raises(ToolError, match=r"^grpo.tools: .*my_tools.py has no function 'missing'"):
        load_tools([spec("missing")])


def test_what_goes_wrong_in_a_call_is_a_result_the_model_sees(spec, capsys):
    tools = box(spec, "add", "fails", "exits", "wanders")
    cwd = os.getcwd()
    failed = tools.call("fails", {"x": 7})
    assert failed.error and json.loads(failed.content) == {"error": "ValueError: no good: 7"}
    exited = tools.call("exits", {"x": 1})
    assert exited.error and json.loads(exited.content) == {"error": "SystemExit: 3"}
    wrong = tools.call("add", {"a": 1})  # a missing argument
    assert wrong.error and "TypeError" in json.loads(wrong.content)["error"]
    unknown = tools.call("subtract", {"a": 1, "b": 2})
    assert unknown.error and "unknown tool 'subtract' (the tools: add, exits, fails, wanders)" in unknown.content
    assert tools.call("add", [1, 2]).error
    wandered = tools.call("wanders", {"x": 4})
    assert (wandered.content, wandered.error) == ("4", False)
    assert os.getcwd() == cwd  # put back, with a warning naming the tool
    assert "my_tools.py:wanders changed the working directory" in capsys.readouterr().err


def test_a_call_gets_copies_of_its_arguments(spec):
    tools = box(spec, "edits")
    items = [1, 2]
    assert tools.call("edits", {"items": items}).content == "3"
    assert items == [1, 2]


def test_megabytes_of_output_are_cut(spec):
    tools = box(spec, "floods", max_chars=100)
    call = tools.call("floods", {"n": 5_000_000})
    assert call.cut and not call.error
    assert call.content == "x" * 100 + "... [4999900 more characters cut]"
    assert not tools.call("floods", {"n": 100}).cut


def test_a_hanging_call_times_out_and_too_many_stop_the_run(spec, monkeypatch):
    monkeypatch.setattr(tools_module, "MAX_HUNG", 2)
    tools = box(spec, "sleeps", timeout_s=0.2)
    start = time.monotonic()
    call = tools.call("sleeps", {"seconds": 3})
    assert time.monotonic() - start < 2
    assert call.error and call.timed_out and json.loads(call.content) == {"error": "timed out after 0.2 s"}
    assert tools.call("sleeps", {"seconds": 0}).content == "woke"  # one still running: calls go on
    tools.call("sleeps", {"seconds": 3})
    with pytest.raises(ToolError, match=r"^grpo.tools: 2 calls of .*my_tools.py:sleeps timed out and still run"):
        tools.call("sleeps", {"seconds": 0})
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("tool "))


def test_a_call_that_timed_out_puts_nothing_back_when_it_ends(spec):
    """The state a timed-out call saw at its start is stale when it ends: its end must not
    put that back over what the run set meanwhile (here: sys.stderr, as pytest's capture of
    the next test sets it)."""
    tools = box(spec, "sleeps", timeout_s=0.1)
    before = sys.stderr
    assert tools.call("sleeps", {"seconds": 0.4}).timed_out
    meanwhile = sys.stderr = io.StringIO()
    try:
        for _, thread in tools.hung:
            thread.join()
        assert sys.stderr is meanwhile
    finally:
        sys.stderr = before

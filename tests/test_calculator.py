"""The calculator demo's tools (llmtrain/calculator.py) load as grpo.tools names them, with the
schemas a chat template renders, and compute what they say."""

from llmtrain.demo import CALC_TOOLS
from llmtrain.rl.tools import ToolBox, load_tools


def test_the_calculator_tools_load_and_compute():
    tools = load_tools(CALC_TOOLS)
    assert [t.name for t in tools] == ["add", "multiply"]
    assert tools[0].schema["function"]["parameters"]["required"] == ["a", "b"]
    box = ToolBox(tools, 5.0, 100)
    assert box.call("add", {"a": 123, "b": 989}).content == "1112"
    assert box.call("multiply", {"a": 874, "b": 404}).content == "353096"

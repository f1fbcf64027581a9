"""The episode loop (rl/episodes.py) with the policy's turns scripted: tool calls are made and
their results appended as the template's tokens, marked as not sampled; episodes end on an
answer, a cut turn, the token budget or the turn limit; each turn's seed is its own; and a
process whose episodes ended keeps generating while another process does."""

import pytest

from llmtrain.rl.episodes import play, turn_seed
from llmtrain.rl.sampling import Completions
from llmtrain.rl.tools import ToolBox, load_tools
from llmtrain.rl.turns import check_parser
from tests.rl.test_tools import TOOLS
from tests.rl.test_turns import CHATML_TOOLS, render


def call(a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


class Scripted:
    """A Generator whose turns are written out: script[prompt][turn] is the text of that turn
    (ending with the stop token unless it is marked cut: ('text', False))."""

    def __init__(self, tok, prompts, script):
        self.tok, self.prompts, self.script = tok, prompts, script
        self.turns = [0] * len(prompts)
        self.seeds, self.stand_ins = [], 0

    def generate(self, model, contexts, seeds, limits=None):
        ids, ended = [], []
        if len(contexts) == 1 and len(contexts[0]) == 1:  # the stand-in of a process with nothing left
            self.stand_ins += 1
            return Completions([[0]], [True])
        self.seeds.append(seeds)
        stop = self.tok.convert_tokens_to_ids("<|im_end|>")
        for context in contexts:
            i = next(k for k, p in enumerate(self.prompts) if context[: len(p)] == p)
            text, end = self.script[i][self.turns[i]]
            self.turns[i] += 1
            ids.append(self.tok(text, add_special_tokens=False)["input_ids"] + ([stop] if end else []))
            ended.append(end)
        return Completions(ids, ended)


@pytest.fixture
def setup(tok, tmp_path):
    (tmp_path / "my_tools.py").write_text(TOOLS)
    check_parser(tok, CHATML_TOOLS)
    tools = load_tools([f"{tmp_path / 'my_tools.py'}:add"])
    questions = ["What is 2 + 3?", "What is 9 + 0?", "What is 1 + 1 + 1?"]
    prompts = [
        render(tok, [{"role": "user", "content": q}], CHATML_TOOLS, prompt=True)[: -0 or None] for q in questions
    ]
    stop = tok.convert_tokens_to_ids("<|im_end|>")

    def run(script, max_turns=4, max_tokens=400, keep_going=lambda mine: mine, seeds=(11, 12, 13)):
        gen = Scripted(tok, prompts, script)
        boxes = [ToolBox(tools, 5.0, 1000) for _ in prompts]
        out = play(gen, None, tok, prompts, list(seeds), boxes, max_turns, max_tokens, [stop], CHATML_TOOLS, keep_going)
        return gen, out

    return tok, prompts, run


def test_calls_are_made_and_their_results_are_context_not_samples(setup):
    tok, prompts, run = setup
    script = [[(call(2, 3), True), ("5", True)], [("9", True)], [(call(1, 1), True), (call(2, 1), True), ("3", True)]]
    gen, (a, b, c) = run(script)
    assert (a.turns, a.calls, a.errors, b.turns, c.turns, c.calls) == (2, 1, 0, 1, 3, 2)
    assert not any(e.truncated or e.out_of_turns or e.malformed for e in (a, b, c))
    assert [m["role"] for m in a.messages] == ["assistant", "tool", "assistant"]
    assert a.messages[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert a.messages[1] == {"role": "tool", "name": "add", "content": "5"} and a.messages[2]["content"] == "5"
    # The tokens: the sampled turn, the template's tool turn (not sampled), the next sampled turn,
    # and the whole is what the template renders for the conversation.
    text = tok.decode([t for t, s in zip(a.ids, a.sampled) if not s])
    assert text == "\n<|im_start|>user<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    whole = render(tok, [{"role": "user", "content": "What is 2 + 3?"}, *a.messages], CHATML_TOOLS, prompt=False)
    assert prompts[0] + a.ids == whole[: len(prompts[0]) + len(a.ids)]
    assert b.ids and all(b.sampled)
    # Seeds: turn 0 the completion's own, later turns their own, whoever else was still going.
    assert gen.seeds == [[11, 12, 13], [turn_seed(11, 1), turn_seed(13, 1)], [turn_seed(13, 2)]]
    assert len({11, turn_seed(11, 1), turn_seed(11, 2)}) == 3


def test_episodes_end_at_the_turn_limit_the_budget_or_a_cut_turn(setup):
    tok, prompts, run = setup
    script = [[(call(2, 3), True), (call(5, 0), True)], [("9 and more", False)], [(call(1, 1), True), ("3", True)]]
    _, (a, b, c) = run(script, max_turns=2)
    assert a.out_of_turns and a.turns == 2 and a.calls == 1  # the last turn's call is not made
    assert "tool_calls" in a.messages[-1]
    assert b.truncated and b.turns == 1
    _, (a, b, c) = run(script, max_turns=4, max_tokens=len(tok(call(2, 3))["input_ids"]) + 5)
    assert a.truncated and a.calls == 1 and all(a.sampled)  # the result would not fit: not appended
    _, (a, _, _) = run([[('<tool_call>\n{"name": "add", "arg', True)], [("9", True)], [("3", True)]])
    assert a.malformed and a.calls == 0 and a.turns == 1


def test_a_process_whose_episodes_ended_generates_while_others_do(setup):
    tok, prompts, run = setup
    script = [[("5", True)], [("9", True)], [("3", True)]]
    others = iter([True, True, False])  # another process still has episodes for two more turns
    gen, out = run(script, keep_going=lambda mine: mine or next(others))
    assert all(e.turns == 1 for e in out)
    assert gen.stand_ins == 2

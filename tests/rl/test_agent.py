"""A multi-turn run's tools and environments (rl/agent.py): loaded from the config and checked
at start, each in one line; prompts rendered with the tools their episodes may call; an
episode's environment reset with its row, its text added to the prompt, which is rendered
again (and cut or refused when too long); models with learned positions checked for the
positions a turn may reach."""

import copy
import json

import pytest

from llmtrain.config import DataConfig
from llmtrain.demo import TOOL_CHAT_TEMPLATE
from llmtrain.errors import ToolError
from llmtrain.rl.agent import Agent, AgentSettings, check_positions
from llmtrain.rl.config import GRPOConfig
from llmtrain.rl.prompts import prompt_kind
from tests.rl.test_environments import GAMES
from tests.rl.test_tools import TOOLS


@pytest.fixture
def files(tmp_path):
    (tmp_path / "my_tools.py").write_text(TOOLS)
    (tmp_path / "games.py").write_text(GAMES)
    return tmp_path


@pytest.fixture
def tok(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


def grpo_problems(cfg) -> list[str]:
    return [p for p in cfg.problems() if p.startswith("grpo.")]


def config(**grpo) -> GRPOConfig:
    cfg = GRPOConfig()
    for k, v in grpo.items():
        setattr(cfg.grpo, k, v)
    return cfg


def test_a_run_without_tools_has_no_agent_and_keeps_its_settings():
    cfg = config()
    assert not cfg.agentic() and Agent.load(cfg) is None
    assert grpo_problems(cfg) == []


def test_tools_and_environments_load_and_are_checked_in_one_line(files):
    tools, game, counter = f"{files}/my_tools.py:add", f"{files}/games.py:GuessingGame", f"{files}/games.py:Counter"
    agent = Agent.load(config(tools=[tools], environment=[game, counter], rewards=[]))
    assert [t.name for t in agent.tools] == ["add"] and set(agent.kinds) == {"GuessingGame", "Counter"}
    assert agent.env_reward and agent.schemas({"environment": "Counter"})[1]["function"]["name"] == "bump"
    with pytest.raises(ToolError, match=r"^grpo.rewards: no reward function and no get_reward"):
        Agent.load(config(environment=counter, rewards=[]))
    with pytest.raises(ToolError, match=r"^grpo.reward_weights: 2 weights for 0 reward functions and the environment"):
        Agent.load(config(environment=game, rewards=[], reward_weights=[1.0, 2.0]))
    (files / "clash.py").write_text(GAMES.replace("def guess(", "def add("))
    with pytest.raises(
        ToolError, match=r"^grpo.environment: .*clash.py:GuessingGame has a method 'add', as grpo.tools"
    ):
        Agent.load(config(tools=[tools], environment=f"{files}/clash.py:GuessingGame"))
    with pytest.raises(ToolError, match=r"^grpo.environment: .* are both named 'GuessingGame'"):
        Agent.load(config(environment=[game, f"{files}/clash.py:GuessingGame"]))
    assert grpo_problems(config(environment=game, rewards=[], reward_weights=[2.0])) == []
    assert any(p.startswith("grpo.reward_weights: 3 weights") for p in grpo_problems(config(reward_weights=[1.0] * 3)))


def test_prompts_render_their_tools_and_an_environments_reset_is_added(files, tok):
    game, counter = f"{files}/games.py:GuessingGame", f"{files}/games.py:Counter"
    agent = Agent.load(config(tools=[f"{files}/my_tools.py:add"], environment=[game, counter]))
    kind, cfg = prompt_kind(32, agent=agent), DataConfig(max_seq_len=400)
    row = {"prompt": "Play.", "environment": "GuessingGame", "secret": 4}
    ex = kind.process(row, tok, cfg)
    assert "Tools: add(a, b) guess(n)<|im_end|>" in tok.decode(ex["prompt_ids"])
    assert json.loads(ex["prompt"]) == [{"role": "user", "content": "Play."}]  # messages: episodes are
    assert "prompts-v2-32-tools-" in kind.version and kind.version != prompt_kind(32).version
    start = agent.start(ex, tok)
    assert tok.decode(start.prompt_ids).endswith(
        "Play.Guess my number from 1 to 10.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        start.box.call("guess", {"n": 9}).content == "lower" and start.box.call("add", {"a": 1, "b": 2}).content == "3"
    )
    plain = agent.start(kind.process({**row, "environment": "Counter"}, tok, cfg), tok)
    assert plain.environment.observation is None and "Tools: add(a, b) bump(by)" in tok.decode(plain.prompt_ids)
    bad = kind.process({**row, "environment": "Chess"}, tok, cfg)["status"]
    assert bad.startswith("error: grpo.environment: a row's 'environment' column is 'Chess'")
    listed = kind.process({**row, "tools": []}, tok, cfg)["status"]
    assert listed.startswith("error: a row's 'tools' column describes tools that grpo.tools")


def test_a_reset_text_too_long_is_cut_or_refused(files, tok):
    agent = Agent.load(config(environment=f"{files}/games.py:GuessingGame"))
    ex = prompt_kind(32, agent=agent).process({"prompt": "Play.", "secret": 4}, tok, DataConfig(max_seq_len=400))
    agent.settings = AgentSettings(5, 5.0, 100, prompt_budget=40, truncate=True)
    assert len(agent.start(ex, tok).prompt_ids) == 40
    agent.settings = AgentSettings(5, 5.0, 100, prompt_budget=40, truncate=False)
    with pytest.raises(ToolError, match=r"^grpo.environment: .*GuessingGame.reset's text makes a prompt \d+ tokens"):
        agent.start(ex, tok)


def test_a_template_that_cannot_render_tools_is_refused_at_start(files, tokenizer, tok):
    agent = Agent.load(config(tools=[f"{files}/my_tools.py:add"]))
    agent.check_template(tok, [tok.convert_tokens_to_ids("<|im_end|>")])
    with pytest.raises(ToolError, match=r"^grpo.tools: the tokenizer has no response_template"):
        agent.check_template(copy.deepcopy(tokenizer), [tok.convert_tokens_to_ids("<|im_end|>")])


def test_learned_positions_must_cover_what_a_turn_may_reach():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_positions=128, n_embd=16, n_layer=1, n_head=2, vocab_size=64))
    cfg = config(max_completion_length=64)
    cfg.data.max_seq_len = 64
    check_positions(gpt2, cfg)
    cfg.data.max_seq_len = 96
    with pytest.raises(
        ToolError, match=r"^data.max_seq_len: .* 128 learned positions .*set data.max_seq_len=64 or less"
    ):
        check_positions(gpt2, cfg)
    llama = LlamaForCausalLM(
        LlamaConfig(
            max_position_embeddings=128,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
        )
    )
    check_positions(llama, cfg)  # rotary positions: nothing learned to run out of


def test_the_docs_guessing_game_plays_as_the_page_says(tmp_path, tok):
    """docs/agents.md's stateful example, as written there: reset adds its text to the prompt,
    guess answers higher or lower, get_reward scores the finished episode, and two episodes
    never share a game."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "class GuessingGame" in b)
    (tmp_path / "games.py").write_text(code)
    agent = Agent.load(config(environment=f"{tmp_path}/games.py:GuessingGame", rewards=[]))
    kind = prompt_kind(32, agent=agent)
    ex = kind.process({"prompt": "Let's play.", "secret": 7}, tok, DataConfig(max_seq_len=400))
    one, two = agent.start(ex, tok), agent.start(ex, tok)
    assert tok.decode(one.prompt_ids).endswith(
        "Let's play. Guess my number from 1 to 10.<|im_end|>\n<|im_start|>assistant\n"
    )
    said = [one.box.call("guess", {"n": n}).content for n in (3, 9, 7)]
    assert said == ["higher", "lower", "right"]
    assert one.environment.outcome() == 1.0 and two.environment.outcome() == 0.0


def test_the_plan_shows_turns_budget_and_tools(files):
    from llmtrain.rl.method import agent_lines

    assert agent_lines(config()) == []
    lines = agent_lines(config(tools=["llmtrain.calculator:add"], environment=f"{files}/games.py:Counter", max_turns=4))
    text = "\n".join(lines)
    assert "at most 4 turns, sharing 256 completion tokens" in text and "30 s each" in text
    assert "tools: llmtrain.calculator:add" in text and "games.py:Counter (one instance per episode)" in text

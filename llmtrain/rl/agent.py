"""The tools and environments of a multi-turn GRPO run (grpo.tools, grpo.environment), loaded
and checked once at start, and the start of each episode: its prompt, its tools and its
environment instance.

A prompt is rendered with the schemas of the tools its episode may call (the run's tools,
and its environment's methods), so the model sees them as it was trained to
(prompts.prompt_example, through `schemas`). An episode (`start`) gets an instance of its
row's environment, whose reset(**row) text is added to the prompt's last user message, as
TRL does: the prompt is then rendered again with it, cut from the left or refused by
data.overlong like any prompt too long for data.max_seq_len. A vision-language model's
prompt keeps its images (`Start.shown`): rendered again, it has them inserted again by the
processor, and is cut from the left only where every image token stays.

What is checked at start (`Agent.load`), each in one line: every tool and environment loads
and has a schema; no two tools share a name; the tokenizer's template renders tools, tool
calls and tool results, keeping earlier turns as they are (turns.tool_suffix_ids, tried on
the first tool), and its tool calls can be read (turns.check_parser); rewards exist (a
reward function or an environment's get_reward); grpo.reward_weights count the
environment's reward when there is one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..config import DataConfig
from ..errors import ToolError
from ..vision import IMAGE_COLUMNS, decode, kept_whole
from .environments import COLUMN, Environment, Episode, load_environments, pick
from .prompts import prompt_tokens
from .tools import Tool, ToolBox, load_tools
from .turns import check_parser, tool_suffix_ids

ENV_REWARD = "environment"  # the environment's get_reward, in the metrics (reward_environment)


@dataclass(frozen=True)
class AgentSettings:
    max_turns: int  # grpo.max_turns
    timeout_s: float  # grpo.tool_timeout_s
    max_chars: int  # grpo.max_tool_output_chars
    prompt_budget: int  # data.max_seq_len - grpo.max_completion_length: a prompt's tokens at most
    truncate: bool  # data.overlong == "truncate": a prompt too long is cut from the left
    max_image_pixels: int = DataConfig.max_image_pixels  # a prompt's images decoded again to render it again

    @classmethod
    def from_config(cls, cfg) -> AgentSettings:
        g = cfg.grpo
        return cls(
            g.max_turns,
            g.tool_timeout_s,
            g.max_tool_output_chars,
            cfg.data.max_seq_len - g.max_completion_length,
            cfg.data.overlong == "truncate",
            cfg.data.max_image_pixels,
        )


@dataclass
class Start:
    """An episode's beginning: the prompt's tokens, the tools it may call, its environment."""

    prompt_ids: list[int]
    box: ToolBox
    environment: Episode | None = None
    # A vision-language model's prompt: its images (bytes) and the processor's per-token
    # inputs of prompt_ids (vision.IMAGE_COLUMNS); None for a text prompt.
    shown: dict | None = None


@dataclass
class Agent:
    tools: list[Tool]
    kinds: dict[str | None, Environment]
    settings: AgentSettings
    hung: list = field(default_factory=list)  # the run's timed-out tool calls (tools.ToolBox)

    @classmethod
    def load(cls, cfg) -> Agent | None:
        """The run's tools and environments (None when it has neither), checked."""
        if not cfg.agentic():
            return None
        tools = load_tools(cfg.grpo.tools)
        kinds = environment_kinds(cfg.environment_names())
        for kind in kinds.values():
            for name in kind.schemas:
                if any(t.name == name for t in tools):
                    where = "grpo.environment" if kind.name is None else f"grpo.environment.{kind.name}"
                    raise ToolError(
                        f"{where}: {kind.spec} has a method {name!r}, as grpo.tools has a tool; the model calls a "
                        "tool by its name, so rename one"
                    )
        agent = cls(tools, kinds, AgentSettings.from_config(cfg))
        weights, names = cfg.grpo.reward_weights, cfg.reward_names()
        if not names and not agent.env_reward:
            raise ToolError(
                "grpo.rewards: no reward function and no get_reward in grpo.environment, so nothing scores an "
                "episode; give a reward function, or a get_reward method"
            )
        if weights and len(weights) != len(names) + agent.env_reward:
            have = f"{len(names)} reward functions" + (" and the environment's get_reward" if agent.env_reward else "")
            raise ToolError(f"grpo.reward_weights: {len(weights)} weights for {have}; give one each, or none")
        return agent

    @property
    def env_reward(self) -> bool:
        """Whether an environment scores its episodes (a reward column of its own)."""
        return any(k.rewards for k in self.kinds.values())

    def schemas(self, row: dict) -> list[dict]:
        """The tools a row's episodes may call, for the chat template's `tools`."""
        out = [t.schema for t in self.tools]
        if self.kinds:
            out += list(pick(self.kinds, row).schemas.values())
        return out

    def described(self) -> dict:
        """What the prompts render of the tools: the run's, and each environment's."""
        kinds = {str(k.name): list(k.schemas.values()) for k in self.kinds.values()}
        return {"tools": [t.schema for t in self.tools], "environments": kinds}

    def all_schemas(self) -> list[dict]:
        out = [t.schema for t in self.tools]
        for kind in self.kinds.values():
            out += [s for s in kind.schemas.values() if s not in out]
        return out

    def check_template(self, tokenizer, stops: list[int]) -> None:
        """The template renders tool results after a turn keeping it as sampled, and the
        model's tool calls can be read (turns.py), or one line saying why not."""
        check_parser(tokenizer)
        schemas = self.all_schemas()
        if schemas:
            name = schemas[0]["function"]["name"]
            tool_suffix_ids(tokenizer, [{"role": "tool", "name": name, "content": "42"}], stops, schemas)

    def start(self, example: dict, tokenizer) -> Start:
        """An episode of the prepared prompt `example` (prompts.prompt_example)."""
        columns = json.loads(example["columns"])
        s = self.settings
        shown = {k: list(example[k]) for k in IMAGE_COLUMNS} if "images" in example else None
        if not self.kinds:
            box = ToolBox(self.tools, s.timeout_s, s.max_chars, hung=self.hung)
            return Start(list(example["prompt_ids"]), box, shown=shown)
        kind = pick(self.kinds, columns)
        env = Episode(kind, columns, s.timeout_s, s.max_chars, also=tuple(self.tools), hung=self.hung)
        ids = list(example["prompt_ids"])
        if env.observation:
            ids, shown = self.observed_prompt(json.loads(example["prompt"]), env, kind, tokenizer, columns, shown)
        return Start(ids, env.tools, env, shown)

    def observed_prompt(
        self, messages, env: Episode, kind: Environment, tokenizer, columns: dict, shown: dict | None
    ) -> tuple[list[int], dict | None]:
        """The prompt with reset()'s text added to its last user message, rendered again (a
        vision-language model's with its images `shown`, whose per-token inputs it returns
        anew)."""
        messages = [dict(m) for m in messages]
        last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), None)
        if last is None:
            messages.append({"role": "user", "content": env.observation})
        elif isinstance(messages[last]["content"], list):  # content parts (a message with images)
            messages[last]["content"] = [*messages[last]["content"], {"type": "text", "text": env.observation}]
        else:
            messages[last]["content"] = f"{messages[last]['content']}{env.observation}"
        pictures = [decode(b, self.settings.max_image_pixels) for b in shown["images"]] if shown else []
        ids, inputs, at = prompt_tokens(messages, tokenizer, self.schemas(columns), pictures)
        if shown is not None:  # a vision-language model's prompt: its per-token inputs anew
            shown = {"images": shown["images"]} | inputs
        budget = self.settings.prompt_budget
        if len(ids) <= budget:
            return ids, shown
        cut = len(ids) - budget  # the end of a prompt is what it asks
        if not self.settings.truncate:
            fix = "return less text, raise data.max_seq_len, or set data.overlong=truncate"
        elif not kept_whole(at, cut, budget):
            fix = "cutting it would split an image's tokens; return less text, or raise data.max_seq_len"
        else:
            fix = None
        if fix:
            raise ToolError(
                f"{env.key}: {kind.spec}.reset's text makes a prompt {len(ids)} tokens, above the {budget} that "
                f"data.max_seq_len leaves beside grpo.max_completion_length; {fix}"
            )
        if shown is not None:
            shown = {k: v if k == "images" else v[cut:] for k, v in shown.items()}
        ids = ids[cut:]
        return ids, shown


def environment_kinds(specs: list[str]) -> dict[str | None, Environment]:
    """grpo.environment's kinds: one, or several named by their factories' names (what each
    row's `environment` column gives)."""
    if not specs:
        return {}
    if len(specs) == 1:
        return load_environments(specs[0])
    named: dict[str, str] = {}
    for spec in specs:
        name = spec.rpartition(":")[2]
        if name in named:
            raise ToolError(
                f"grpo.environment: {named[name]} and {spec} are both named {name!r}, the name a row's {COLUMN!r} "
                "column gives; rename one"
            )
        named[name] = spec
    return load_environments(named)


def check_positions(model, cfg) -> None:
    """A model with learned absolute positions (GPT-2's) must have a position for every token
    an episode's generate call may reach: a later turn of a batch is generated for the
    longest budget left among its episodes, so an episode that has used most of its own may be
    fed, past its end (its tokens discarded), up to data.max_seq_len + grpo.max_completion_length
    positions."""
    import torch

    limit = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    words = model.get_input_embeddings()
    learned = any(
        isinstance(m, torch.nn.Embedding) and m is not words and m.num_embeddings == limit for m in model.modules()
    )
    reach = cfg.data.max_seq_len + cfg.grpo.max_completion_length
    if learned and reach > limit:
        raise ToolError(
            f"data.max_seq_len: with grpo.tools or grpo.environment, a model with {limit} learned positions needs "
            f"data.max_seq_len + grpo.max_completion_length ({reach}) within them; set data.max_seq_len="
            f"{limit - cfg.grpo.max_completion_length} or less"
        )

"""The episode loop of multi-turn GRPO: a completion becomes the policy's turns with the tool
results between them, generated turn by turn, token in and token out (rl/turns.py).

For a batch of prompts, each with its seed and its tools (a tools.ToolBox, an environment's
or the run's), `play` generates a turn for every episode still going, reads the turn's tool
calls, calls them, and appends the results' tokens, until each episode ends:
- a turn that calls no tool (its answer), or whose calls cannot be read (`malformed`);
- a turn cut by the token budget (`truncated`): `max_tokens` counts every completion token,
  sampled or not, and tool results that would not fit end the episode before them;
- `max_turns` turns: the last one's calls are not made (`out_of_turns`).

Invariants:
- `ids` holds the completion's tokens in order; `sampled` marks the ones the policy drew (1)
  against the tool results and template tokens between turns (0), which are context only:
  the loss, its normalisations and the log-probs' use take the marked ones alone.
- A turn's draw is seeded by (the completion's seed, the turn) alone (`turn_seed`; turn 0 by
  the completion's seed itself, as a single-turn completion is), so an episode never depends on
  the batch it shared, the process it ran on, or how many turns the others took.
- A vision-language model's prompt shows its images (`shown[i]`, vision.IMAGE_COLUMNS) in every
  turn: its per-token inputs are the prompt's, then text (0) for the completion so far.
- `keep_going(any of mine still going)` tells whether any process still generates (an
  all-reduce under ZeRO-3 and FSDP2, whose generate is a collective): a process whose episodes
  have all ended keeps calling the generator, on a stand-in, until none has, so none hangs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

from ..vision import extended
from .sampling import sample_seed
from .tools import ToolBox
from .turns import parse_turn, tool_suffix_ids


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a completion's turn: its own for the first turn, then one per turn."""
    return seed if turn == 0 else sample_seed(seed, turn, 0, 0)


@dataclass
class Trajectory:
    """One episode: its completion tokens and what the metrics and rewards need of it."""

    ids: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # 1: drawn by the policy; 0: a tool's or the template's
    logps: list[float] = field(default_factory=list)  # the sampler's log-prob of each drawn token (sampled turns)
    messages: list[dict] = field(default_factory=list)  # assistant and tool messages, as rewards get them (TRL)
    turns: int = 0
    calls: int = 0
    errors: int = 0  # calls that failed (raised, timed out, unknown tool, bad arguments)
    malformed: bool = False
    truncated: bool = False
    out_of_turns: bool = False
    done: bool = False


def play(
    generator,
    model,
    tokenizer,
    prompts: list[list[int]],
    seeds: list[int] | None,
    boxes: list[ToolBox],
    max_turns: int,
    max_tokens: int,
    stops: list[int],
    template: str | None = None,
    keep_going: Callable[[bool], bool] = lambda mine: mine,
    shown: list[dict] | None = None,
) -> list[Trajectory]:
    """The episodes of `prompts` (see the module docstring); `boxes[i]` holds prompt i's tools,
    `seeds` None for greedy turns, `shown[i]` prompt i's images (None: text prompts)."""
    episodes = [Trajectory() for _ in prompts]
    # A generator that can keep a turn's KV cache for the next turn (sampling.HFGenerator.multi_turn).
    with getattr(generator, "multi_turn", nullcontext)():
        for turn in range(max_turns):
            going = [i for i, e in enumerate(episodes) if not e.done]
            if not keep_going(bool(going)):
                break
            if not going:  # every episode here has ended, but another process still generates
                generator.generate(model, [prompts[0][-1:]], None if seeds is None else [0], [1])
                continue
            contexts = [prompts[i] + episodes[i].ids for i in going]
            turn_seeds = None if seeds is None else [turn_seed(seeds[i], turn) for i in going]
            # Each episode's turn may take what its budget has left (one more token, so that
            # reaching the budget without a stop token shows as a cut turn).
            limits = [max_tokens - len(episodes[i].ids) for i in going]
            images = {} if shown is None else {"shown": [extended(shown[i], len(episodes[i].ids)) for i in going]}
            drawn = generator.generate(model, contexts, turn_seeds, limits, **images)
            for k, i in enumerate(going):
                episode, box = episodes[i], boxes[i]
                last = turn == max_turns - 1
                logps = drawn.logps[k] if drawn.logps is not None else []
                results = take(
                    episode, drawn.ids[k], drawn.ended[k], contexts[k], tokenizer, box, stops, max_tokens, last, logps
                )
                if not results:
                    continue
                suffix = tool_suffix_ids(tokenizer, results, stops, box.schemas(), template)
                if len(episode.ids) + len(suffix) >= max_tokens:  # no room for the results and a turn after them
                    episode.truncated = episode.done = True
                    continue
                episode.ids += suffix
                episode.sampled += [0] * len(suffix)
    return episodes


def take(
    episode: Trajectory,
    ids: list[int],
    ended: bool,
    context: list[int],
    tokenizer,
    box: ToolBox,
    stops: list[int],
    max_tokens: int,
    last: bool,
    logps: list[float] = (),
) -> list[dict]:
    """Add a drawn turn (sampled after `context`, its tokens' sampler log-probs `logps` if
    any) to `episode`, cut to what is left of the token budget, and make its calls unless it
    is the `last` turn allowed. Returns the tool messages made; none when the episode ends
    with this turn."""
    room = max_tokens - len(episode.ids)
    if len(ids) > room:
        ids, ended = ids[:room], False
    episode.ids += ids
    episode.sampled += [1] * len(ids)
    episode.logps += list(logps[: len(ids)])
    episode.turns += 1
    read = parse_turn(tokenizer, ids, context, stops, tools=box.schemas())
    message = {"role": "assistant", "content": read.content}
    episode.malformed |= read.malformed
    if read.calls and ended:
        message["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in read.calls]
    episode.messages.append(message)
    if not ended:
        episode.truncated = episode.done = True
        return []
    if not read.calls:
        episode.done = True
        return []
    if last:
        episode.out_of_turns = episode.done = True
        return []
    results = []
    for name, arguments in read.calls:
        call = box.call(name, arguments)
        episode.calls += 1
        episode.errors += call.error
        results.append(call.message())
    episode.messages += results
    return results

"""Environments (rl/environments.py), as TRL's environment_factory takes them: one instance per
episode, reset with the row's columns, public methods called as tools, get_reward scoring the
episode; a broken environment is one line at start or when it fails, never a traceback."""

import json

import pytest

from llmtrain.errors import ToolError
from llmtrain.rl.environments import Environment, Episode, load_environments, pick
from llmtrain.usercode import load_function

GAMES = '''
class GuessingGame:
    """Guess a secret number; the tool answers higher or lower."""

    def __init__(self):
        self.secret, self.done = None, False

    def reset(self, secret, **row):
        self.secret = secret
        return "Guess my number from 1 to 10."

    def guess(self, n: int) -> str:
        """Guess the number.

        Args:
            n: Your guess.
        """
        if n == self.secret:
            self.done = True
            return "right"
        return "higher" if n < self.secret else "lower"

    def get_reward(self) -> float:
        return 1.0 if self.done else 0.0

    @property
    def costly(self):
        raise RuntimeError("a property is never evaluated")


class Counter:
    """No reset: it starts as made."""

    def __init__(self):
        self.count = 0

    def bump(self, by: int) -> int:
        """Add to the count.

        Args:
            by: How much.
        """
        self.count += by
        return self.count


class Undescribed:
    def reset(self, **row):
        return None

    def act(self, x):
        return x


class BadReset:
    def reset(self, **row):
        return 42

    def get_reward(self):
        return float("nan")


class Inert:
    def reset(self, **row):
        return None


class BrokenReset:
    def reset(self, **row):
        raise KeyError("secret")

    def get_reward(self):
        return 1.0
'''


@pytest.fixture
def spec(tmp_path):
    (tmp_path / "games.py").write_text(GAMES)
    return lambda name: f"{tmp_path / 'games.py'}:{name}"


def test_an_episode_resets_plays_and_scores_with_state_of_its_own(spec):
    kinds = load_environments(spec("GuessingGame"))
    game = pick(kinds, {"secret": 7})
    assert list(game.schemas) == ["guess"] and game.resets and game.rewards
    row = {"prompt": "p", "secret": 7}
    one, two = Episode(game, row, 5.0, 1000), Episode(game, row, 5.0, 1000)
    assert one.observation == "Guess my number from 1 to 10."
    assert [one.tools.call("guess", {"n": n}).content for n in (3, 9, 7)] == ["higher", "lower", "right"]
    assert (one.outcome(), two.outcome()) == (1.0, 0.0)  # instances never share state
    failed = one.tools.call("guess", {"n": "x"})
    assert failed.error and "TypeError" in json.loads(failed.content)["error"]


def test_an_environment_without_reset_starts_as_made(spec):
    (kind,) = load_environments(spec("Counter")).values()
    episode = Episode(kind, {"prompt": "p"}, 5.0, 1000)
    assert episode.observation is None and episode.outcome() is None
    assert [episode.tools.call("bump", {"by": b}).content for b in (2, 3)] == ["2", "5"]


def test_several_environments_are_picked_by_the_rows_column(spec):
    kinds = load_environments({"game": spec("GuessingGame"), "count": spec("Counter")})
    assert pick(kinds, {"environment": "count"}).spec.endswith(":Counter")
    with pytest.raises(ToolError, match=r"^grpo.environment: a row's 'environment' column is 'chess', not one of"):
        pick(kinds, {"environment": "chess"})
    episode = Episode(kinds["game"], {"environment": "game", "secret": 2}, 5.0, 1000)  # the column is not passed
    assert episode.observation.startswith("Guess")


def test_a_broken_environment_is_one_line_naming_it(spec):
    with pytest.raises(ToolError, match=r"^grpo.environment: .*games.py:Undescribed.act: transformers cannot read"):
        load_environments(spec("Undescribed"))
    with pytest.raises(ToolError, match=r"^grpo.environment.inert: .*:Inert has no public method"):
        load_environments({"inert": spec("Inert")})

    def kind(name, resets=True, rewards=True):  # as load_environments would describe it, probe left out
        factory = load_function(spec(name), "grpo.environment", ToolError)[0]
        return Environment(None, factory, spec(name), None, {}, resets, rewards)

    with pytest.raises(ToolError, match=r"BadReset.reset returned 42; return the text to add to the prompt, or None"):
        Episode(kind("BadReset"), {}, 5.0, 1000)
    with pytest.raises(ToolError, match=r"^grpo.environment: .*BrokenReset.reset raised KeyError: 'secret'"):
        Episode(kind("BrokenReset"), {}, 5.0, 1000)
    with pytest.raises(ToolError, match=r"BadReset.get_reward returned nan; return a finite number, or None"):
        Episode(kind("BadReset", resets=False), {}, 5.0, 1000).outcome()

"""Rollouts (llmtrain/rl/rollout.py) on one process with a stand-in generator: the loop's
data-source members, steps per pass from its settings alone (what `llmtrain plan` reads),
advantages from the objective's estimator, the completions shown once, and evaluation on
the set given at construction."""

import pytest
import torch

from llmtrain.config import DataConfig
from llmtrain.rl.loss import GRPOLoss
from llmtrain.rl.prompts import prompt_kind
from llmtrain.rl.rewards import Reward
from llmtrain.rl.rollout import Rollouts, RolloutSettings
from llmtrain.rl.sampling import Completions


class OneProcess:
    device = torch.device("cpu")
    num_processes = 1
    process_index = 0

    @staticmethod
    def gather(x):
        return x

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def unwrap_model(model):
        return model


class Digits:
    """Each completion: the seed's last digits as text tokens (greedy: '7'), ended."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, model, prompts, seeds):
        texts = [str(s % 1000) for s in seeds] if seeds is not None else ["7"] * len(prompts)
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return Completions(ids, [True] * len(ids))


def value(completions, **kwargs):
    return [float(c) / 100 for c in completions]


def prompts(tokenizer, n: int):
    import datasets

    kind, cfg = prompt_kind(8), DataConfig(max_seq_len=64)
    rows = [kind.process({"prompt": f"Say {i}", "id": i}, tokenizer, cfg) for i in range(n)]
    return datasets.Dataset.from_list(rows)


def settings(**kw) -> RolloutSettings:
    base = dict(group=3, iterations=2, micro=2, accum=2, seed=5, total_steps=lambda per_epoch: 2 * per_epoch)
    return RolloutSettings(**(base | kw))


def rollouts(model, tokenizer, estimator="group", eval_set=None, **kw) -> Rollouts:
    rewards = [Reward("value", value, None)]
    objective = GRPOLoss("dapo", estimator=estimator)
    data, generator, beat = prompts(tokenizer, 9), Digits(tokenizer), lambda what: None
    return Rollouts(
        settings(**kw), OneProcess(), model, tokenizer, data, objective, generator, rewards, None, beat, eval_set
    )


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def test_steps_per_pass_are_whole_rounds_times_iterations():
    s = settings()
    assert s.per_round(world=2) == 8 and s.rounds(17, 2) == 2 and s.steps_per_epoch(17, 2) == 4
    assert s.steps_per_epoch(7, 2) == 0 and settings(iterations=1).steps_per_epoch(9, 1) == 2


def test_the_settings_are_read_from_the_config():
    from llmtrain.rl.config import GRPOConfig

    cfg = GRPOConfig()
    cfg.grpo.num_generations, cfg.grpo.num_iterations, cfg.grpo.reward_weights = 4, 3, [1.0, 0.5]
    cfg.train.micro_batch_size, cfg.train.grad_accum_steps, cfg.train.seed, cfg.data.shuffle = 2, 5, 11, False
    s = RolloutSettings.from_config(cfg)
    assert (s.group, s.iterations, s.micro, s.accum, s.seed, s.shuffle) == (4, 3, 2, 5, 11, False)
    assert s.reward_weights == (1.0, 0.5) and s.log_completions == cfg.grpo.log_completions
    assert s.total_steps(7) == cfg.train.total_steps(7)


def test_the_loop_sees_a_data_source_with_state_of_its_own(model, tokenizer):
    """9 prompts, 4 per round: 2 rounds of 2 steps each; two sources share no state."""
    one, other = rollouts(model, tokenizer), rollouts(model, tokenizer)
    assert one.items == "prompts" and one.steps_per_epoch == 4 and not one.evaluates
    assert one.metrics is not other.metrics and one.metrics == {}
    batches = list(one.epoch(0))
    assert len(batches) == 2 * 2 * 2  # rounds x iterations x accumulation
    assert batches[0]["labels"].shape[0] == 2 * 3  # micro prompts x group
    assert other.metrics == {} and set(one.metrics) >= {"reward", "reward_std", "reward_value", "generation_s"}
    empty = one.empty_batch()
    assert all(v.device.type == "cpu" for v in empty.values())


def test_advantages_come_from_the_objectives_estimator(model, tokenizer):
    """The same completions and rewards: each estimator's advantages, as its objective gives them."""
    found = {}
    for estimator in ("group", "none"):
        source = rollouts(model, tokenizer, estimator)
        first = next(iter(source.epoch(0)))
        found[estimator] = first["advantages"]
    samples = source.current[2]
    rewards = torch.tensor([[int(tokenizer.decode(s.completion_ids)) / 100] for s in samples])
    for estimator, got in found.items():
        want, _, _ = GRPOLoss(estimator=estimator).advantages(rewards, torch.ones(1), 3)
        assert torch.equal(got, want[:6]), estimator
    assert not torch.equal(found["group"], found["none"])


def test_a_rounds_completions_are_shown_once(model, tokenizer):
    source = rollouts(model, tokenizer, log_completions=2)
    assert source.shown() == []
    next(iter(source.epoch(0)))
    lines = source.shown()
    assert len(lines) == 2 and all(line.startswith("completion> 'Say ") for line in lines)
    assert source.shown() == []


def test_evaluation_reads_the_set_given_at_construction(model, tokenizer):
    source = rollouts(model, tokenizer, eval_set=prompts(tokenizer, 3))
    assert source.evaluates
    out = source.evaluate(step=1)
    assert out == {"eval_reward": pytest.approx(0.07), "eval_reward_value": pytest.approx(0.07)}

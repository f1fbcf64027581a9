"""Rollouts (llmtrain/rl/rollout.py) on one process with a stand-in generator: the loop's
data-source members, steps per pass from its settings alone (what `llmtrain plan` reads),
advantages from the objective's estimator, the completions shown once, and evaluation on
the set given at construction."""

import json

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
    """Each completion: the seed's last digits as text tokens (greedy: '7'), ended; sampled
    ones with the log-probs `logps` for their tokens in turn, as a sampler off the trainer
    would give (the tiny model's are near log(1/261) = -5.6)."""

    def __init__(self, tokenizer, logps: tuple | None = (-5.0, -6.5)):
        self.tokenizer, self.logps = tokenizer, logps

    def generate(self, model, prompts, seeds, limits=None):
        texts = [str(s % 1000) for s in seeds] if seeds is not None else ["7"] * len(prompts)
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        q = self.logps
        logps = None if seeds is None or q is None else [[q[i % len(q)] for i in range(len(c))] for c in ids]
        return Completions(ids, [True] * len(ids), logps)


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


def rollouts(model, tokenizer, estimator="group", eval_set=None, sampler_logps=(-5.0, -6.5), **kw) -> Rollouts:
    rewards = [Reward("value", value, None)]
    objective = GRPOLoss("dapo", estimator=estimator)
    data, generator, beat = prompts(tokenizer, 9), Digits(tokenizer, sampler_logps), lambda what: None
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


@pytest.mark.parametrize("kind", ["tis", "mis"])
def test_the_sampler_correction_weighs_each_token_by_trainer_over_sampler(model, tokenizer, kind):
    """A sampler whose log-probs are off the trainer's on purpose (-5.0, -6.5, ...): each
    trained token's weight is exp(trainer - sampler) capped (tis) or zeroed above the cap
    (mis), the trainer's being the policy's before the round's updates; the micro-batches
    carry them aligned with the labels, a checkpoint within the round keeps them, and the
    round reports the mismatch."""
    from llmtrain.data.rows import IGNORE
    from llmtrain.rl.rollout import pack_samples, unpack_samples

    source = rollouts(model, tokenizer, iterations=1, correction=kind, correction_cap=1.5)
    batch = next(iter(source.epoch(0)))
    samples = source.current[2]
    for s in samples:
        sampler = torch.tensor([(-5.0, -6.5)[i % 2] for i in range(s.trained())], dtype=torch.float64)
        rho = (torch.tensor(s.old_logps).double() - sampler).exp()
        want = rho.clamp(max=1.5) if kind == "tis" else rho.masked_fill(rho > 1.5, 0.0)
        torch.testing.assert_close(torch.tensor(s.correction), want.float())
    mask = batch["labels"] != IGNORE
    flat = [w for s in samples[: batch["labels"].shape[0]] for w in s.correction]
    assert batch["correction"][mask].tolist() == pytest.approx(flat)
    assert (batch["correction"][~mask] == 0).all()
    assert {"sampler_kl", "sampler_ratio_p50", "sampler_corrected"} <= set(source.metrics)
    assert 0 < source.metrics["sampler_corrected"] < 1 and source.metrics["sampler_kl"] > 0
    assert unpack_samples(pack_samples(samples, 0, 0))[2] == samples


def test_the_sampler_correction_needs_the_samplers_log_probs(model, tokenizer):
    from llmtrain.errors import ConfigError

    source = rollouts(model, tokenizer, sampler_logps=None, correction="tis")
    with pytest.raises(ConfigError, match=r"^grpo.importance_correction: the generator did not return the log-p"):
        next(iter(source.epoch(0)))


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
    assert out == {  # one greedy completion ('7') each, which passes no function
        "eval_reward": pytest.approx(0.07),
        "eval_reward_value": pytest.approx(0.07),
        "eval_pass@1": 0.0,
        "eval_pass@1_value": 0.0,
    }


def test_sampled_evaluation_reports_the_mean_reward_and_pass_at_k_of_seeded_completions(model, tokenizer):
    """grpo.eval_samples=4: four completions per prompt, each drawn from its own seed of
    (train.seed, prompt, sample), the same at every evaluation; the reward is their mean and
    pass@k the unbiased estimate from how many passed grpo.eval_pass_threshold."""
    from math import comb

    from llmtrain.rl.heldout import EVAL_PASS
    from llmtrain.rl.sampling import sample_seed

    source = rollouts(model, tokenizer, eval_set=prompts(tokenizer, 3), eval_samples=4, eval_pass_threshold=5.0)
    out = source.evaluate(step=1)
    scores = [[(sample_seed(5, EVAL_PASS, i, j) % 1000) / 100 for j in range(4)] for i in range(3)]
    passed = [sum(s >= 5.0 for s in row) for row in scores]
    assert 0 < sum(passed) < 12  # the seeds give both
    want = {"eval_reward": sum(map(sum, scores)) / 12, "eval_reward_value": sum(map(sum, scores)) / 12}
    for k in (1, 2, 4):
        estimate = sum(1 - comb(4 - c, k) / comb(4, k) for c in passed) / 3
        want |= {f"eval_pass@{k}": estimate, f"eval_pass@{k}_value": estimate}
    assert out == pytest.approx(want)
    assert source.evaluate(step=2) == out  # the same draws at every evaluation


# --- multi-turn rounds: episodes with tool calls --------------------------------------


class Caller:
    """A Generator whose first turn calls `add` (a = the seed's last digit, b = 1) and whose
    second answers 'done', each ended with the stop token."""

    max_new_tokens = 300

    def __init__(self, tokenizer, call=lambda a: ("add", {"a": a, "b": 1})):
        self.tokenizer, self.call = tokenizer, call
        self.stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.calls = []

    def generate(self, model, prompts, seeds, limits=None):
        self.calls.append(len(prompts))
        out = []
        for i, context in enumerate(prompts):
            answered = "</tool_response>" in self.tokenizer.decode(context[-40:])
            name, arguments = self.call((seeds[i] if seeds is not None else 7) % 10)
            call = f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
            said = "done" if answered else call
            out.append(self.tokenizer(said, add_special_tokens=False)["input_ids"] + [self.stop])
        return Completions(out, [True] * len(out))


@pytest.fixture
def agentic(model, tokenizer, tmp_path):
    import copy

    import datasets

    from llmtrain.demo import TOOL_CHAT_TEMPLATE
    from llmtrain.rl.agent import Agent, AgentSettings
    from llmtrain.rl.tools import load_tools
    from llmtrain.rl.turns import check_parser
    from tests.rl.test_tools import TOOLS

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    check_parser(tok)
    (tmp_path / "my_tools.py").write_text(TOOLS)
    tools = load_tools([f"{tmp_path / 'my_tools.py'}:{n}" for n in ("add", "fails", "sleeps", "floods")])
    agent = Agent(tools, {}, AgentSettings(3, 0.5, 100, 100, True))
    kind, cfg = prompt_kind(300, agent=agent), DataConfig(max_seq_len=400)
    data = datasets.Dataset.from_list([kind.process({"prompt": f"Add {i}", "id": i}, tok, cfg) for i in range(9)])
    seen = []

    def sums(prompts, completions, **kwargs):  # the tool's result, as the reward sees the episode
        seen.extend(completions)
        return [float(c[1]["content"]) if len(c) > 1 and c[1]["content"].isdigit() else 0.0 for c in completions]

    def make(caller=None, **kw):
        objective = GRPOLoss("dapo")
        return Rollouts(
            settings(**kw),
            OneProcess(),
            model,
            tok,
            data,
            objective,
            caller or Caller(tok),
            [Reward("sums", sums, None)],
            None,
            lambda what: None,
            data.select(range(2)),
            agent,
        )

    return make, tok, seen


def test_an_episodes_tool_results_are_context_never_trained(agentic, model):
    """Each completion is a call, the tool's result and an answer: the result's tokens are in
    the batch but carry no label, so the step counts only sampled tokens and their positions
    get exactly zero gradient, and the rewards see the episode's messages."""
    from llmtrain.data.rows import IGNORE

    make, tok, seen = agentic
    source = make(iterations=1)
    batch = next(iter(source.epoch(0)))
    samples = source.current[2]
    s = samples[0]
    assert s.sampled is not None and 0 in s.sampled and s.sampled[-1] == 1
    context = [t for t, m in zip(s.completion_ids, s.sampled) if not m]
    assert "<tool_response>" in tok.decode(context) and "<tool_call>" not in tok.decode(context)
    assert tok.decode([t for t, m in zip(s.completion_ids, s.sampled) if m]).endswith("done<|im_end|>")
    assert seen[0][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": s_a(s, tok), "b": 1}}
    assert seen[0][1] == {"role": "tool", "name": "add", "content": str(s_a(s, tok) + 1)}
    m = source.metrics
    assert (m["turns"], m["tool_calls"], m["tool_errors"], m["out_of_turns"]) == (2.0, 1.0, 0.0, 0.0)
    assert m["context_tokens"] > 0
    assert m["sampled_tokens"] + m["context_tokens"] == pytest.approx(m["completion_len"])
    assert m["reward_sums"] == pytest.approx(sum(s_a(x, tok) + 1 for x in samples) / len(samples))

    trained = batch["labels"] != IGNORE
    assert int(trained.sum()) == sum(x.trained() for x in samples[:6]) == source.objective.count(batch)
    logits = []

    def keep(module, inputs, out):
        out.retain_grad()
        logits.append(out)

    hook = model.lm_head.register_forward_hook(keep)
    try:
        batch = batch | {"advantages": torch.linspace(-1, 1, batch["labels"].shape[0])}
        source.objective(model, batch).total.backward()
    finally:
        hook.remove()
        model.zero_grad()
    grad = logits[0].grad
    assert grad.abs().sum() > 0
    assert torch.equal(grad[~trained], torch.zeros_like(grad[~trained]))  # tool tokens and padding: exactly zero


def s_a(sample, tok) -> int:
    import json

    text = tok.decode(sample.completion_ids)
    return json.loads(text.split("<tool_call>\n")[1].split("\n</tool_call>")[0])["arguments"]["a"]


def test_a_multi_turn_round_survives_a_checkpoint_whole(agentic):
    """A round's samples, with which tokens were sampled and their old log-probs, come back
    from rollout.safetensors as they were."""
    from llmtrain.rl.rollout import pack_samples, unpack_samples

    make, _, _ = agentic
    source = make(iterations=2)
    batches = iter(source.epoch(0))
    next(batches), next(batches)  # the round's first step (two micro-batches)
    samples = source.current[2]
    assert all(len(s.old_logps) == s.trained() < len(s.completion_ids) for s in samples)
    _, _, back = unpack_samples(pack_samples(samples, 0, 0))
    assert back == samples
    restored = make(iterations=2)
    restored.restore(source.saved(2))
    batch = next(iter(restored.epoch(0, skip=2)))  # skip counts micro-batches
    want = next(batches)  # the round's second step, as the uninterrupted source trains it
    assert batch.keys() == want.keys()
    for k in want:
        assert torch.equal(batch[k], want[k]), (k, batch[k], want[k])


def test_multi_turn_evaluation_plays_greedy_episodes(agentic):
    make, _, _ = agentic
    out = make().evaluate(step=0)
    assert out["eval_reward"] == pytest.approx(8.0)  # greedy: add(7, 1)


def test_sampled_multi_turn_evaluation_plays_each_prompts_episodes_from_their_seeds(agentic):
    from llmtrain.rl.heldout import EVAL_PASS
    from llmtrain.rl.sampling import sample_seed

    make, tok, _ = agentic
    caller = Caller(tok)
    out = make(caller, eval_samples=3, eval_pass_threshold=6.0).evaluate(step=0)
    assert caller.calls == [6, 6]  # two prompts x three episodes, of two turns each
    sums = [[sample_seed(5, EVAL_PASS, i, j) % 10 + 1 for j in range(3)] for i in range(2)]  # add(seed % 10, 1)
    assert out["eval_reward"] == pytest.approx(sum(map(sum, sums)) / 6)
    assert out["eval_pass@3"] == sum(any(v >= 6 for v in row) for row in sums) / 2


def test_a_raising_hanging_or_flooding_tool_is_a_result_the_episode_goes_on_after(agentic):
    """Calls that raise, run past grpo.tool_timeout_s, or return megabytes: each is a result the
    model sees (an error, or the output cut), counted, and the episode takes its next turn."""
    make, tok, seen = agentic
    bad = [("fails", {"x": 1}), ("sleeps", {"seconds": 3}), ("floods", {"n": 5_000_000}), ("add", {"a": 1, "b": 2})]
    source = make(Caller(tok, call=lambda a: bad[a % 4]), iterations=1)
    next(iter(source.epoch(0)))
    m = source.metrics
    assert m["turns"] == 2.0 and m["tool_calls"] == 1.0
    results = {c[1]["name"]: c[1]["content"] for c in seen}
    assert results["fails"].startswith('{"error": ') and results["sleeps"] == '{"error": "timed out after 0.5 s"}'
    assert results["floods"].startswith("x" * 100) and results["floods"].endswith("[4999900 more characters cut]")
    calls = [c[1]["name"] for c in seen]
    assert m["tool_errors"] == pytest.approx(sum(n in ("fails", "sleeps") for n in calls) / len(calls))


def test_an_environments_reward_is_a_column_of_its_own_weighted_like_a_function(model, tokenizer, tmp_path):
    """Each episode gets its own game, reset with its row (the secret) and its text added to the
    prompt; get_reward is reward_environment, weighted last by grpo.reward_weights."""
    import copy

    import datasets

    from llmtrain.demo import TOOL_CHAT_TEMPLATE
    from llmtrain.rl.agent import Agent
    from llmtrain.rl.config import GRPOConfig
    from llmtrain.rl.turns import check_parser
    from tests.rl.test_environments import GAMES

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    check_parser(tok)
    (tmp_path / "games.py").write_text(GAMES)
    cfg = GRPOConfig()
    cfg.grpo.environment, cfg.grpo.rewards, cfg.grpo.reward_weights = f"{tmp_path}/games.py:GuessingGame", [], [2.0]
    cfg.grpo.max_completion_length, cfg.data.max_seq_len, cfg.grpo.max_turns = 300, 400, 2
    agent = Agent.load(cfg)
    kind = prompt_kind(300, agent=agent)
    rows = [{"prompt": f"Play {i}", "secret": i % 10} for i in range(9)]
    data = datasets.Dataset.from_list([kind.process(r, tok, cfg.data) for r in rows])
    source = Rollouts(
        settings(iterations=1, reward_weights=(2.0,)),
        OneProcess(),
        model,
        tok,
        data,
        GRPOLoss("dapo"),
        Caller(tok, call=lambda a: ("guess", {"n": a})),  # guesses the seed's last digit
        [],
        None,
        lambda what: None,
        None,
        agent,
    )
    next(iter(source.epoch(0)))
    samples, m = source.current[2], source.metrics
    assert "Guess my number from 1 to 10." in tok.decode(samples[0].prompt_ids)
    won = []
    for s in samples:
        text = tok.decode(s.completion_ids)
        guess = json.loads(text.split("<tool_call>\n")[1].split("\n</tool_call>")[0])["arguments"]["n"]
        secret = int(tok.decode(s.prompt_ids).split("Play ")[1][0]) % 10
        won.append(float(guess == secret))
        assert ("right" if guess == secret else "higher" if guess < secret else "lower") in text
    assert source.labels == ["environment"] and m["reward_environment"] == pytest.approx(sum(won) / len(won))
    assert m["reward"] == pytest.approx(2 * sum(won) / len(won))

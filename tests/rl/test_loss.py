"""The GRPO loss (llmtrain/rl/loss.py) and its advantage estimators (rl/advantages.py):
every row of LOSS_TYPES against a plain per-token implementation on a real model's logits
and against TRL's GRPOTrainer code on the same log-probs (the step's normalisation is a sum
over units divided by the global count); every estimator against a plain computation."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from llmtrain.data.rows import IGNORE
from llmtrain.errors import RewardError
from llmtrain.rl.advantages import ESTIMATORS, estimate, nanstd
from llmtrain.rl.loss import LOSS_TYPES, GRPOLoss
from tests.support.data import answered_batch


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def rollout_batch(vocab: int, rows: int = 6, width: int = 14, seed: int = 3) -> dict:
    """Prompts of 3 to 5 tokens, completions of 1 to 8, right-padded; labels shifted (the
    position before each completion token predicts it); advantages of both signs; old and
    reference log-probs near the policy's, so some ratios clip."""
    lengths = [(3 + r % 3, 1 + (r * 5) % 8) for r in range(rows)]
    return answered_batch(vocab, lengths, width, seed) | {"advantages": torch.linspace(-1.5, 2.0, rows)}


def plain_token_logps(model, batch, temperature):
    """[rows, width] log-probs of each label from whole logits (0 where there is none)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float() / temperature
    logps = logits.log_softmax(-1).gather(2, batch["labels"].clamp(min=0)[..., None]).squeeze(2)
    return logps * (batch["labels"] != IGNORE)


def plain_loss(logp, batch, loss_type, eps_low, eps_high, beta, max_len, cispo_cap=5.0):
    """The step's loss as written in the GRPO, Dr. GRPO, DAPO, GSPO and CISPO (MiniMax-M1)
    papers, per token [rows, width], with the sampler correction's weights where given."""
    mask = (batch["labels"] != IGNORE).float()
    old = batch.get("old_logps", logp.detach())
    adv = batch["advantages"][:, None]
    if loss_type.startswith("gspo"):
        s = torch.exp(((logp - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True))
        ratio = s if loss_type == "gspo" else s.detach() * torch.exp(logp - logp.detach())
    else:
        ratio = torch.exp(logp - old)
    if loss_type == "cispo":
        per_token = -(torch.clamp(ratio, max=cispo_cap).detach() * adv * logp)
    else:
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
    per_token = per_token * batch.get("correction", 1.0)
    if beta:
        ref = batch["ref_logps"]
        per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type in ("grpo", "gspo", "gspo_token"):
        return ((per_token * mask).sum(1) / mask.sum(1)).mean()
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (mask.shape[0] * max_len)
    if loss_type in ("dapo", "cispo"):
        return (per_token * mask).sum() / mask.sum()
    raise AssertionError(f"no plain formula for the loss type {loss_type!r}: write one here")


def with_old_and_ref(model, batch, temperature):
    with torch.no_grad():
        logp = plain_token_logps(model, batch, temperature)
    g = torch.Generator().manual_seed(9)
    mask = batch["labels"] != IGNORE
    batch = dict(batch)
    batch["old_logps"] = (logp + 0.3 * torch.randn(logp.shape, generator=g)) * mask
    batch["ref_logps"] = (logp + 0.5 * torch.randn(logp.shape, generator=g)) * mask
    return batch


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.parametrize("corrected", [False, True])
def test_the_objective_is_the_papers_loss_summed_over_its_units(model, loss_type, chunk, corrected):
    """On a tiny Llama's real logits, with importance ratios that clip on both sides (and
    past CISPO's cap) and a KL term: the objective's sum / its count is the plain loss, and
    so are its gradients, whole logits or the output layer run 3 positions at a time, with
    the sampler correction's weights or without."""
    from llmtrain.model import chunkable_head

    temperature, beta, max_len, cispo = 0.7, 0.04, 8, 0.1
    batch = with_old_and_ref(model, rollout_batch(model.config.vocab_size), temperature)
    if corrected:  # weights as tis and mis give them: some capped, some 0
        g = torch.Generator().manual_seed(4)
        batch["correction"] = torch.rand(batch["labels"].shape, generator=g) * 2 * (torch.rand(1, generator=g) > 0.2)
    head = chunkable_head(model) if chunk else None
    objective = GRPOLoss(loss_type, 0.2, 0.28, beta, temperature, max_len, chunk, head, cispo_epsilon_high=cispo)
    model.zero_grad()
    out = objective(model, batch)
    count = objective.count(batch)
    (out.total / count).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logp = plain_token_logps(model, batch, temperature)
    want = plain_loss(logp, batch, loss_type, 0.2, 0.28, beta, max_len, 1 + cispo)
    want.backward()
    assert float(out.total.detach()) / count == pytest.approx(float(want.detach()), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    mask = batch["labels"] != IGNORE
    assert count == (int(mask.sum()) if objective.unit == "tokens" else 6)
    assert 0 < float(out.metrics["clip_ratio"]) < count and float(out.metrics["kl"]) > 0


def test_gspo_and_gspo_token_agree_with_one_advantage_per_completion(model):
    """GSPO-token's ratio has GSPO's value and, with the advantage the same on every token of
    a completion, GSPO's gradient too (Zheng et al. 2025, section 4.3): its tokens' own
    gradients are what per-token advantages would weight. At GSPO's own small epsilons."""
    batch = with_old_and_ref(model, rollout_batch(model.config.vocab_size), 1.0)
    grads = []
    for loss_type in ("gspo", "gspo_token"):
        model.zero_grad()
        out = GRPOLoss(loss_type, 3e-4, 4e-4)(model, batch)
        out.total.backward()
        grads.append(
            (float(out.total.detach()), float(out.metrics["clip_ratio"]), [p.grad.clone() for p in model.parameters()])
        )
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6) and grads[0][1] == grads[1][1] > 0
    for a, b in zip(grads[0][2], grads[1][2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_an_unknown_loss_type_or_estimator_is_refused():
    with pytest.raises(ValueError, match=r"unknown GRPO loss type 'ppo'; one of \['cispo', 'dapo', 'dr_grpo', 'gr"):
        GRPOLoss("ppo")
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gae'; one of \['batch', 'group', 'none', 'r"):
        GRPOLoss("dapo", estimator="gae")


def test_micro_batches_add_up_to_the_whole_batch(model):
    """Split in two, the units' sums add up to the whole batch's, for every loss type: the
    shared step divides the sum by the global count, so any split gives one loss."""
    batch = with_old_and_ref(model, rollout_batch(model.config.vocab_size), 1.0)
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    for loss_type in sorted(LOSS_TYPES):
        objective = GRPOLoss(loss_type, 0.2, 0.0, 0.1, 1.0, 8)
        with torch.no_grad():
            whole = objective(model, batch)
            parts = [objective(model, h) for h in halves]
        assert sum(objective.count(h) for h in halves) == objective.count(batch)
        assert float(sum(p.total for p in parts)) == pytest.approx(float(whole.total), rel=1e-5), loss_type


def test_an_empty_batch_counts_nothing_and_reaches_every_weight(model):
    from llmtrain.data.batches import Collator

    batch = Collator(0).empty_batch(False) | {"advantages": torch.zeros(1)}
    objective = GRPOLoss("dapo")
    model.zero_grad()
    out = objective(model, batch)
    out.total.backward()
    assert objective.count(batch) == 0 and float(out.total) == 0.0
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


# --- advantages ----------------------------------------------------------------------------


def plain_advantages(rewards, weights, group: int, estimator: str) -> list[float]:
    """Each completion's advantage in float64 scalar arithmetic: its weighted reward (NaN
    terms left out; unscored: advantage 0) minus its group's mean, over the spread of its
    group (group), of the batch (batch) or 1 (none), + 1e-4 where divided; or (rloo) minus
    the mean of the rest of its group."""

    def std(xs):
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else float("nan")

    totals = []
    for row in rewards.tolist():
        terms = [r * w for r, w in zip(row, weights.tolist()) if not math.isnan(r)]
        totals.append(sum(terms) if terms else float("nan"))
    scored = [t for t in totals if not math.isnan(t)]
    out = []
    for i, t in enumerate(totals):
        mine = [x for x in totals[i - i % group : i - i % group + group] if not math.isnan(x)]
        if math.isnan(t):
            out.append(0.0)
            continue
        centred = t - sum(mine) / len(mine)
        if estimator == "rloo":  # REINFORCE leave-one-out: less the mean of the others scored in its group
            others = list(mine)
            others.remove(t)
            out.append(t - sum(others) / len(others) if others else 0.0)
            continue
        if estimator == "none":
            out.append(centred)
        else:
            spread = std(mine) if estimator == "group" else std(scored)
            out.append(0.0 if math.isnan(spread) else centred / (spread + 1e-4))
    return out


def test_every_estimator_matches_a_plain_computation():
    """Weighted sums with unscored terms and an unscored completion; a group with no spread."""
    nan = float("nan")
    g = torch.Generator().manual_seed(2)
    rewards = torch.rand(12, 3, generator=g) * 4 - 1
    rewards[1, 2] = rewards[6, 0] = nan
    rewards[4] = nan  # no function scored it
    rewards[8:12] = 0.5  # one group of equal rewards
    weights = torch.tensor([1.0, 0.5, 2.0])
    assert sorted(ESTIMATORS) == ["batch", "group", "none", "rloo"]  # a new one: give plain_advantages its formula
    for name in ESTIMATORS:
        adv, total, zero = estimate(rewards, weights, 4, name)
        assert adv.tolist() == pytest.approx(plain_advantages(rewards, weights, 4, name), rel=1e-5, abs=1e-6), name
        assert zero.tolist() == [False, False, True] and total[4].isnan()
        same, _, _ = GRPOLoss(estimator=name).advantages(rewards, weights, 4)  # the objective supplies its own
        assert torch.equal(same, adv)


def test_advantages_compare_each_completion_with_its_group():
    rewards = torch.tensor([[1.0, 0.5], [0.0, 0.5], [1.0, float("nan")], [0.0, 0.0], [2.0, 1.0], [2.0, 1.0]])
    weights = torch.tensor([1.0, 2.0])
    adv, total, zero = estimate(rewards, weights, group=2, estimator="group")
    assert total.tolist() == [2.0, 1.0, 1.0, 0.0, 4.0, 4.0]  # NaN terms left out of the weighted sum
    std = torch.tensor([2.0, 1.0]).std()  # sample std of a group of two
    torch.testing.assert_close(adv[:2], torch.tensor([0.5, -0.5]) / (std + 1e-4))
    assert zero.tolist() == [False, False, True] and adv[4:].tolist() == [0.0, 0.0]
    none, _, _ = estimate(rewards, weights, group=2, estimator="none")
    assert none[:4].tolist() == [0.5, -0.5, 0.5, -0.5]
    batch, _, _ = estimate(rewards, weights, group=2, estimator="batch")
    torch.testing.assert_close(batch[:2], torch.tensor([0.5, -0.5]) / (total.std() + 1e-4))


def test_rloo_compares_each_completion_with_the_rest_of_its_group():
    """REINFORCE leave-one-out (TRL's RLOOTrainer): the baseline leaves the completion out,
    and the completions nothing scored; a completion alone in being scored gets 0."""
    nan = float("nan")
    rewards = torch.tensor([[1.0], [0.0], [1.0], [nan], [nan], [nan], [1.0], [nan]])
    adv, total, zero = estimate(rewards, torch.ones(1), group=4, estimator="rloo")
    assert adv.tolist() == [0.5, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert zero.tolist() == [False, True]


def test_unscored_completions_get_no_advantage_and_stay_out_of_their_group():
    nan = float("nan")
    rewards = torch.tensor([[nan], [1.0], [0.0], [1.0]])
    adv, total, zero = estimate(rewards, torch.ones(1), group=4, estimator="none")
    assert adv[0] == 0.0 and total[0].isnan()
    torch.testing.assert_close(adv[1:], torch.tensor([1 / 3, -2 / 3, 1 / 3]))
    assert not zero.any()
    lone, _, zero = estimate(torch.tensor([[nan], [nan], [1.0], [nan]]), torch.ones(1), 2, "group")
    assert lone.tolist() == [0.0, 0.0, 0.0, 0.0] and zero.tolist() == [True, True]  # one score: no spread


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_rewards_that_overflow_the_advantages_are_one_error_not_a_step_that_learns_nothing(estimator):
    """Rewards of 1e20 sum fine in float32 but their spread squares past its range: the
    advantages come out NaN, then 0 (a step with no gradient), or with scale=none finite but
    beside a reward_std of inf."""
    rewards = torch.tensor([[1e20], [0.0], [1.0], [0.0]])
    with pytest.raises(RewardError, match=r"^grpo.rewards: rewards as large as 1e\+20 \(times grpo.reward_weights\)"):
        estimate(rewards, torch.ones(1), group=2, estimator=estimator)
    estimate(rewards / 1e10, torch.ones(1), group=2, estimator=estimator)  # 1e10 is fine


def test_a_batch_spread_that_overflows_is_refused_where_every_group_is_even():
    """Groups of equal rewards have no spread, but the batch's spread squares 1e20: the
    batch estimator's own divisor is checked too."""
    rewards = torch.tensor([[1e20], [1e20], [0.0], [0.0]])
    with pytest.raises(RewardError, match=r"^grpo.rewards: rewards as large as 1e\+20"):
        estimate(rewards, torch.ones(1), group=2, estimator="batch")
    estimate(rewards, torch.ones(1), group=2, estimator="group")


def test_nanstd_is_the_sample_standard_deviation_without_nans():
    x = torch.tensor([[1.0, 2.0, float("nan"), 4.0], [3.0, float("nan"), float("nan"), float("nan")]])
    torch.testing.assert_close(
        nanstd(x, 1), torch.tensor([torch.tensor([1.0, 2.0, 4.0]).std(), float("nan")]), equal_nan=True
    )


# --- against TRL's own loss code -----------------------------------------------------------


class OneProcess:
    device = torch.device("cpu")
    num_processes = 1
    is_main_process = True
    sync_gradients = True

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def autocast():
        import contextlib

        return contextlib.nullcontext()


class FusedLogps(torch.nn.Module):
    """Stands in for a model with TRL's fused LM head: each position's log-prob of the next
    token, from a fixed table."""

    def __init__(self, token_logps):
        super().__init__()
        self.token_logps = token_logps

    def forward(self, input_ids, attention_mask, labels, fused_lm_head):
        from trl.trainer.utils import FusedCausalLMOutput

        logps = self.token_logps.masked_fill(labels[:, 1:] == -100, 0.0)
        zeros = torch.zeros_like(logps)
        return FusedCausalLMOutput(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def trl_grpo_trainer(loss_type, eps_low, eps_high, beta, max_len, level="token", corrected=False):
    """A GRPOTrainer with only what `_compute_loss` reads; its __init__ would load models,
    tokenize a data set and build an Accelerator. `corrected`: its vLLM importance sampling
    correction on (the ratios come in the inputs)."""
    from trl import GRPOTrainer

    trainer = object.__new__(GRPOTrainer)
    vars(trainer).update(
        accelerator=OneProcess(),
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        beta=beta,
        max_completion_length=max_len,
        importance_sampling_level=level,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=corrected,
        vllm_importance_sampling_correction=corrected,
        aux_loss_enabled=False,
        current_gradient_accumulation_steps=1,
        temperature=1.0,
        model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _entropy_bonus_enabled=False,
        use_adaptive_entropy=False,
        entropy_coef=0.0,
    )
    return trainer


# Each loss type as TRL 1.16's GRPOTrainer spells it: (its loss_type, importance_sampling_level);
# CISPO's cap is TRL's epsilon_high under cispo. GSPO-token has no TRL counterpart: its plain
# formula and its agreement with GSPO are tested above.
AS_TRL = {
    "grpo": ("grpo", "token"),
    "dr_grpo": ("dr_grpo", "token"),
    "dapo": ("dapo", "token"),
    "gspo": ("grpo", "sequence"),
    "cispo": ("cispo", "token"),
}


def test_every_loss_type_is_compared_with_trl_or_said_why_not():
    assert set(LOSS_TYPES) - set(AS_TRL) == {"gspo_token"}


@pytest.mark.parametrize("corrected", [False, True])
@pytest.mark.parametrize("loss_type", sorted(AS_TRL))
def test_losses_match_trl(loss_type, corrected):
    """The same per-token log-probs (float64), old and reference log-probs and advantages
    (and the sampler correction's weights, TRL's importance_sampling_ratio) through TRL's
    GRPOTrainer._compute_loss and through GRPOLoss; TRL's layout (left-padded prompts,
    completions after them) built from ours."""
    pytest.importorskip("trl")
    rows, prompt_w, completion_w, vocab, max_len = 6, 4, 7, 11, 9
    g = torch.Generator().manual_seed(5)
    completion_mask = torch.zeros(rows, completion_w, dtype=torch.long)
    for r in range(rows):
        completion_mask[r, : 1 + (r * 3) % completion_w] = 1
    prompt_ids = torch.randint(0, vocab, (rows, prompt_w), generator=g)
    completion_ids = torch.randint(0, vocab, (rows, completion_w), generator=g)
    width = prompt_w + completion_w
    token_logps = -torch.rand(rows, width - 1, generator=g, dtype=torch.float64) * 3  # position t -> token t + 1
    policy = token_logps[:, -completion_w:]
    old = policy + 0.3 * torch.randn(policy.shape, generator=g, dtype=torch.float64)
    ref = policy + 0.5 * torch.randn(policy.shape, generator=g, dtype=torch.float64)
    adv = torch.linspace(-1.2, 1.7, rows, dtype=torch.float64)
    weights = torch.rand(policy.shape, generator=g, dtype=torch.float64) * 2
    beta, eps_low, eps_high, cispo = 0.05, 0.2, 0.28, 0.15
    name, level = AS_TRL[loss_type]

    trl_high = 1 + cispo if loss_type == "cispo" else eps_high
    trainer = trl_grpo_trainer(name, eps_low, trl_high, beta, max_len, level, corrected)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": completion_mask.sum(),
        "importance_sampling_ratio": weights,
    }
    trl_loss = trainer._compute_loss(FusedLogps(token_logps), inputs)

    # Ours: labels on the completion tokens at the positions that predict them.
    labels = torch.full((rows, width), IGNORE)
    labels[:, prompt_w - 1 : width - 1] = completion_ids.masked_fill(completion_mask == 0, IGNORE)
    mask = labels != IGNORE
    aligned = torch.zeros(rows, width, dtype=torch.float64)
    batch = {"labels": labels, "advantages": adv}
    both = [("old_logps", old), ("ref_logps", ref)] + [("correction", weights)] * corrected
    for key, values in both:
        batch[key] = aligned.clone()
        batch[key][:, prompt_w - 1 : width - 1] = values
    objective = GRPOLoss(loss_type, eps_low, eps_high, beta, 1.0, max_len, cispo_epsilon_high=cispo)
    flat = token_logps[mask[:, :-1]]  # position t's log-prob of token t + 1, where labelled
    objective.logps = lambda model, b: flat
    out = objective(None, batch)
    assert float(trl_loss) == pytest.approx(float(out.total) / objective.count(batch), rel=1e-9)
    logged = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    if loss_type == "dapo" and not corrected:  # token means, as TRL logs them (the others' are per completion)
        count = objective.count(batch)
        assert logged["clip_ratio/region_mean"] == pytest.approx(float(out.metrics["clip_ratio"]) / count, rel=1e-6)
        assert logged["kl"] == pytest.approx(float(out.metrics["kl"]) / count, rel=1e-6)
        assert 0 < logged["clip_ratio/region_mean"] < 1

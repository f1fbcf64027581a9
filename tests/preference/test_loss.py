"""The preference losses (llmtrain/preference/loss.py) against a plain reference
implementation (whole logits, each answer's log-probability summed token by token in a
loop, the formulas written out in scalar math) and against TRL's own loss code."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from llmtrain.core.logps import label_logps
from llmtrain.data.rows import IGNORE
from llmtrain.preference.loss import AnswerLogps, pair_losses, row_logps


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def pair_batch(vocab: int, pairs: int = 3, width: int = 12, seed: int = 1) -> dict:
    """`pairs` chosen rows then as many rejected ones: a prompt, then an answer of its own
    length (trained), then padding; labels already shifted."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2 * pairs, width), generator=g)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for row in range(2 * pairs):
        prompt, answer = 3 + row % 2, 2 + (row * 5) % 6
        end = prompt + answer
        mask[row, :end] = 1
        labels[row, prompt - 1 : end - 1] = ids[row, prompt:end]  # position t predicts token t+1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def plain_answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> list[tuple[float, int]]:
    out = []
    for row in range(labels.shape[0]):
        total, n = 0.0, 0
        for t in range(labels.shape[1]):
            if labels[row, t] != IGNORE:
                total += float(torch.log_softmax(logits[row, t].double(), -1)[labels[row, t]])
                n += 1
        out.append((total, n))
    return out


def plain_loss(kind, beta, gamma, sft, policy, reference, i, pairs):
    (pc, lc), (pr, lr) = policy[i], policy[i + pairs]
    (rc, _), (rr, _) = reference[i], reference[i + pairs]

    def logsig(x):
        return -math.log1p(math.exp(-x))

    if kind == "sigmoid":
        loss = -logsig(beta * ((pc - rc) - (pr - rr)))
    elif kind == "ipo":
        loss = ((pc / lc - rc / lc) - (pr / lr - rr / lr) - 1 / (2 * beta)) ** 2
    elif kind == "orpo":  # Hong et al. 2024, eq. 6-7: odds(y|x) = P / (1 - P), P the per-token mean
        a, b = pc / lc, pr / lr
        log_odds = (a - math.log(1 - math.exp(a))) - (b - math.log(1 - math.exp(b)))
        loss = -a - beta * logsig(log_odds)
    else:
        loss = -logsig(beta * (pc / lc - pr / lr) - gamma)
    return loss + sft * (-pc / lc)


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "simpo", "orpo"])
@pytest.mark.parametrize("sft", [0.0, 0.5])
def test_losses_match_a_plain_implementation(model, kind, sft):
    pairs, beta, gamma = 3, 0.3, 0.4
    batch = pair_batch(model.config.vocab_size, pairs)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        logits = model(**inputs).logits
        sums, tokens = row_logps(label_logps(model, inputs, batch["labels"]), batch["labels"])
    policy_plain = plain_answer_logps(logits, batch["labels"])
    reference_plain = [(lp - 0.1 * (i + 1), n) for i, (lp, n) in enumerate(policy_plain)]  # any other model's

    policy = AnswerLogps.from_rows(sums, tokens)
    reference = AnswerLogps.from_rows(
        torch.tensor([lp for lp, _ in reference_plain]), torch.tensor([n for _, n in reference_plain])
    )
    loss, rewards_chosen, rewards_rejected = pair_losses(kind, beta, policy, reference, gamma, sft)
    expected = [plain_loss(kind, beta, gamma, sft, policy_plain, reference_plain, i, pairs) for i in range(pairs)]
    assert loss.tolist() == pytest.approx(expected, rel=1e-5)
    assert [int(n) for n in tokens] == [n for _, n in policy_plain]
    if kind == "sigmoid":  # the reward is beta times the answer's log-ratio
        assert rewards_chosen.tolist() == pytest.approx(
            [beta * (policy_plain[i][0] - reference_plain[i][0]) for i in range(pairs)], rel=1e-5
        )
        assert rewards_rejected.tolist() == pytest.approx(
            [beta * (policy_plain[i + pairs][0] - reference_plain[i + pairs][0]) for i in range(pairs)], rel=1e-5
        )


@pytest.mark.parametrize("chunk", [4, 1000])
def test_the_chunked_head_gives_the_log_probs_and_gradients_of_whole_logits(model, chunk):
    batch = pair_batch(model.config.vocab_size, pairs=2, seed=5)
    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def loss_of(logps):
        sums, tokens = row_logps(logps, batch["labels"])
        policy = AnswerLogps.from_rows(sums, tokens)
        return pair_losses("simpo", 2.0, policy, None, 0.5, 0.2)[0].sum()

    model.zero_grad()
    whole = label_logps(model, kwargs, batch["labels"])
    loss_of(whole).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    chunked = label_logps(model, kwargs, batch["labels"], model.get_output_embeddings(), chunk)
    loss_of(chunked).backward()
    assert torch.allclose(chunked, whole.detach(), atol=1e-5)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[name], atol=1e-5), name


def test_the_objective_sums_its_pairs_with_their_reference_log_probs(model):
    from llmtrain.preference.loss import PreferenceLoss

    batch = pair_batch(model.config.vocab_size, pairs=3, seed=7)
    batch["answers"] = torch.arange(6)[:, None].expand_as(batch["input_ids"])  # padded: answer i is row i
    batch["pair_index"] = torch.tensor([2, 0, 1])  # the pairs' rows in the reference table
    ref = torch.linspace(-30, -10, 6)  # per answer of the batch: chosen ones, then rejected
    objective = PreferenceLoss("sigmoid", 0.2)
    objective.reference = torch.zeros(3, 2)
    objective.reference[batch["pair_index"]] = torch.stack([ref[:3], ref[3:]], 1)
    out = objective(model, batch)
    assert objective.count(batch) == 3
    with torch.no_grad():
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        sums, tokens = row_logps(label_logps(model, inputs, batch["labels"]), batch["labels"])
    loss, chosen, rejected = pair_losses(
        "sigmoid", 0.2, AnswerLogps.from_rows(sums, tokens), AnswerLogps.from_rows(ref, tokens)
    )
    assert float(out.total.detach()) == pytest.approx(float(loss.sum()), rel=1e-5)
    assert float(out.metrics["rewards_accuracy"]) == float((chosen > rejected).sum())
    assert float(out.metrics["rewards_margin"]) == pytest.approx(float((chosen - rejected).sum()), rel=1e-5)


# --- against TRL's own loss code ----------------------------------------------------------


class OneProcess:
    """What TRL's loss code asks of its Accelerator: a device, and gathers, which in one
    process return their input."""

    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


class FusedHead(torch.nn.Module):
    """Stands in for a model patched with TRL's fused LM head (`add_fused_lm_head`): given
    `labels`, it returns each position's log-probability of the next label, zero where that
    label is -100, as the head does; here from fixed per-token log-probs."""

    def __init__(self, token_logps: torch.Tensor):
        super().__init__()
        self.token_logps = token_logps

    def forward(self, input_ids, attention_mask, use_cache, labels, fused_lm_head):
        from trl.trainer.utils import FusedCausalLMOutput

        logps = self.token_logps.masked_fill(labels[:, 1:] == -100, 0.0)
        zeros = torch.zeros_like(logps)
        return FusedCausalLMOutput(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


class FixedLogits(torch.nn.Module):
    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask, use_cache):
        return SimpleNamespace(logits=self.logits)


def trl_pair_batch(pairs: int = 3, vocab: int = 13, width: int = 14, seed: int = 11):
    """A pair batch in TRL's layout (DataCollatorForPreference: chosen rows first, then the
    rejected ones; `completion_mask` on the answer tokens, not shifted), float64 logits for
    every position, and the same batch's labels in ours (shifted, IGNORE elsewhere).
    Answers of 1 to 9 tokens, so the two answers of a pair differ in length."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2 * pairs, width), generator=g)
    completion, attention = torch.zeros_like(ids), torch.zeros_like(ids)
    for row in range(2 * pairs):
        prompt, answer = 2 + row % 3, 1 + (row * 7) % 9
        completion[row, prompt : prompt + answer] = 1
        attention[row, : prompt + answer] = 1
    logits = 3 * torch.randn(2 * pairs, width, vocab, generator=g, dtype=torch.float64)
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORE)
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}, logits, labels


def trl_dpo_trainer(model, loss_types: list[str], loss_weights: list[float], beta: float):
    """A DPOTrainer with only what its loss (`_compute_loss`: log-probs -> log-ratios ->
    loss and the logged rewards) reads. Its __init__ would tokenize a dataset, load a
    reference model and build an Accelerator (a process-wide singleton other tests set up
    their own way): seconds of work the loss does not depend on."""
    from trl import DPOTrainer

    trainer = object.__new__(DPOTrainer)
    vars(trainer).update(
        model=model,
        accelerator=OneProcess(),
        beta=beta,
        loss_types=loss_types,
        loss_weights=loss_weights,
        precompute_ref_logps=True,  # the reference log-probs come with the batch, as after TRL's precompute
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        label_smoothing=0.0,
        use_weighting=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    return trainer


def trl_cpo_trainer(beta: float, gamma: float, cpo_alpha: float):
    """A CPOTrainer (TRL's home of SimPO) with only what `get_batch_loss_metrics` reads;
    its __init__ would tokenize a dataset, as above."""
    from trl.experimental.cpo import CPOTrainer

    trainer = object.__new__(CPOTrainer)
    vars(trainer).update(
        loss_type="simpo",
        beta=beta,
        simpo_gamma=gamma,
        cpo_alpha=cpo_alpha,  # CPO's NLL term on the chosen answers (0 for plain SimPO)
        alpha=0.0,  # no AlphaPO reward shaping
        label_smoothing=0.0,
        is_encoder_decoder=False,
        pad_token_id=0,
        aux_loss_enabled=False,
        accelerator=OneProcess(),
    )
    return trainer


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "simpo"])
@pytest.mark.parametrize("sft", [0.0, 0.5])
def test_losses_and_rewards_match_trl(kind, sft):
    """pair_losses against TRL's code on the same log-probs, in float64: DPO and IPO
    through DPOTrainer._compute_loss (the loss is written inline there; there is no
    separate dpo_loss in TRL 1.x), SimPO through CPOTrainer.get_batch_loss_metrics, which
    takes per-token mean log-probs (TRL's DPOTrainer has no SimPO). sft_weight is TRL's
    'sft' loss term for DPO and IPO (RPO) and CPO's cpo_alpha for SimPO.

    Each pair on its own, then (without the NLL term) the whole micro-batch, whose loss TRL
    averages over the pairs as llmtrain's step does. TRL's NLL term averages over every
    chosen token of the micro-batch, llmtrain's per pair first (the RPO paper's per-pair
    length-normalised NLL): the two agree for one pair, not for a batch whose chosen
    answers differ in length, so that term is compared pair by pair."""
    pytest.importorskip("trl")
    pairs, beta, gamma = 3, 0.3, 0.4
    inputs, logits, labels = trl_pair_batch(pairs)
    # Per position t, the log-prob of token t + 1: what both sides sum over an answer.
    token_logps = logits[:, :-1].log_softmax(-1).gather(2, inputs["input_ids"][:, 1:, None]).squeeze(2)
    sums, tokens = row_logps(token_logps[labels[:, :-1] != IGNORE], labels)
    ref_sums = sums + torch.linspace(-2.0, 3.0, 2 * pairs, dtype=torch.float64)  # any other model's
    policy, reference = AnswerLogps.from_rows(sums, tokens), AnswerLogps.from_rows(ref_sums, tokens)
    loss, chosen, rejected = pair_losses(kind, beta, policy, reference, gamma, sft)
    if kind == "ipo":
        # TRL logs IPO's rewards from the summed log-ratios, llmtrain from the per-token ones its loss uses.
        chosen, rejected = chosen * policy.chosen_tokens, rejected * policy.rejected_tokens

    groups = [[i, pairs + i] for i in range(pairs)] + ([list(range(2 * pairs))] if not sft else [])
    for rows in groups:
        k = len(rows) // 2
        picked = [i for i in range(pairs) if i in rows]
        if kind == "simpo":
            trainer = trl_cpo_trainer(beta, gamma, cpo_alpha=sft)
            trl_labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
            batch = {}
            for side, half in (("chosen", rows[:k]), ("rejected", rows[k:])):
                batch |= {
                    f"{side}_input_ids": inputs["input_ids"][half],
                    f"{side}_attention_mask": inputs["attention_mask"][half],
                    f"{side}_labels": trl_labels[half],
                }
            trl_loss, logged = trainer.get_batch_loss_metrics(FixedLogits(logits[rows]), batch)
        else:
            loss_types, weights = [kind, "sft"] if sft else [kind], [1.0, sft] if sft else [1.0]
            trainer = trl_dpo_trainer(FusedHead(token_logps[rows]), loss_types, weights, beta)
            batch = {key: value[rows] for key, value in inputs.items()}
            batch |= {"ref_chosen_logps": ref_sums[rows[:k]], "ref_rejected_logps": ref_sums[rows[k:]]}
            trl_loss = trainer.compute_loss(trainer.model, batch)
            logged = {key: values[-1] for key, values in trainer._metrics["train"].items()}
        assert float(trl_loss) == pytest.approx(float(loss[picked].mean()), rel=1e-6, abs=1e-12)
        assert logged["rewards/chosen"] == pytest.approx(float(chosen[picked].mean()), rel=1e-6, abs=1e-12)
        assert logged["rewards/rejected"] == pytest.approx(float(rejected[picked].mean()), rel=1e-6, abs=1e-12)
        if kind != "simpo":  # CPO logs the per-token means as logps
            assert logged["logps/chosen"] == pytest.approx(float(policy.chosen[picked].mean()), rel=1e-6)
            assert logged["logps/rejected"] == pytest.approx(float(policy.rejected[picked].mean()), rel=1e-6)


def test_orpo_odds_ratio_term_matches_trl():
    """ORPO's odds-ratio term and rewards against TRL's ORPOTrainer.odds_ratio_loss on the
    same per-token mean log-probs, near 0 and far from it. TRL adds the NLL of the
    chosen sequences' every token, prompt included, averaged over its micro-batch; llmtrain
    that of each chosen answer's tokens: the odds-ratio terms are compared."""
    pytest.importorskip("trl")
    from trl.experimental.orpo import ORPOTrainer

    beta = 0.25
    trainer = object.__new__(ORPOTrainer)
    vars(trainer).update(beta=beta, accelerator=OneProcess())
    chosen_mean = torch.tensor([-0.01, -0.7, -2.5, -9.0], dtype=torch.float64)
    rejected_mean = torch.tensor([-0.02, -0.3, -4.0, -0.5], dtype=torch.float64)
    tokens = torch.tensor([3, 5, 7, 2])
    policy = AnswerLogps(chosen_mean * tokens, rejected_mean * tokens, tokens, tokens)
    loss, chosen, rejected = pair_losses("orpo", beta, policy, None)
    terms, trl_chosen, trl_rejected, _, _ = trainer.odds_ratio_loss(chosen_mean, rejected_mean)
    # TRL computes in float32 (odds_ratio_loss casts its inputs).
    torch.testing.assert_close(loss - (-chosen_mean), -terms.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(chosen, trl_chosen.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(rejected, trl_rejected.double(), rtol=1e-6, atol=1e-7)

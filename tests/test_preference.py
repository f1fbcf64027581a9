"""The preference losses against a plain reference implementation: whole logits, each
answer's log-probability summed token by token in a loop, the formulas written out in
scalar math."""

import math

import pytest
import torch

from llmtrain.data import IGNORE
from llmtrain.preference import AnswerLogps, label_logps_head, pair_losses, row_logps, whole_logits_logps


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
    else:
        loss = -logsig(beta * (pc / lc - pr / lr) - gamma)
    return loss + sft * (-pc / lc)


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "simpo"])
@pytest.mark.parametrize("sft", [0.0, 0.5])
def test_losses_match_a_plain_implementation(model, kind, sft):
    pairs, beta, gamma = 3, 0.3, 0.4
    batch = pair_batch(model.config.vocab_size, pairs)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    policy_plain = plain_answer_logps(logits, batch["labels"])
    reference_plain = [(lp - 0.1 * (i + 1), n) for i, (lp, n) in enumerate(policy_plain)]  # any other model's

    sums, tokens = row_logps(whole_logits_logps(logits, batch["labels"]), batch["labels"])
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
    whole = whole_logits_logps(model(**kwargs).logits, batch["labels"])
    loss_of(whole).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with label_logps_head(model.get_output_embeddings(), batch["labels"], chunk):
        chunked = model(**kwargs).logits
    loss_of(chunked).backward()
    assert torch.allclose(chunked, whole.detach(), atol=1e-5)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[name], atol=1e-5), name


def test_the_objective_sums_its_pairs_and_an_empty_batch_counts_none(model):
    from llmtrain.preference import PreferenceLoss

    batch = pair_batch(model.config.vocab_size, pairs=3, seed=7)
    ref = torch.linspace(-30, -10, 6)
    objective = PreferenceLoss("sigmoid", 0.2)
    out = objective(model, batch | {"ref_logps": ref})
    assert objective.count(batch) == 3
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    sums, tokens = row_logps(whole_logits_logps(logits, batch["labels"]), batch["labels"])
    loss, chosen, rejected = pair_losses(
        "sigmoid", 0.2, AnswerLogps.from_rows(sums, tokens), AnswerLogps.from_rows(ref, tokens)
    )
    assert float(out.total) == pytest.approx(float(loss.sum()), rel=1e-5)
    assert float(out.metrics["rewards_accuracy"]) == float((chosen > rejected).sum())
    assert float(out.metrics["rewards_margin"]) == pytest.approx(float((chosen - rejected).sum()), rel=1e-5)

    empty = {
        "input_ids": torch.tensor([[0]]),
        "attention_mask": torch.tensor([[1]]),
        "labels": torch.tensor([[IGNORE]]),
    }
    model.zero_grad()
    out = objective(model, empty)
    out.total.backward()
    assert objective.count(empty) == 0 and float(out.total) == 0.0
    assert all(p.grad is not None for p in model.parameters())  # every weight joins the collectives

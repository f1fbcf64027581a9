"""Distillation's objective (llmtrain/distill/loss.py): the generalized JSD against TRL 1.16's
GKDTrainer.generalized_jsd_loss on two real models' logits, values and gradients; the
teacher cut to its top k; the sampled-token reverse KL (k1, k3) and the forward top-k term
against plain formulas; micro-batches that add up to the whole batch; the empty batch."""

import math

import pytest
import torch

from llmtrain.data.rows import IGNORE
from llmtrain.distill.loss import DistillLoss, generalized_jsd, top_k_only
from tests.support.data import answered_batch


@pytest.fixture(scope="module")
def models(tiny_model):
    """The tiny model as student, and a teacher of the same tokenizer with other weights."""
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return student, teacher.eval()


def rows_batch(vocab: int, rows: int = 5, width: int = 12) -> dict:
    """Right-padded rows with prompts of 2 to 4 tokens and answers of 1 to 7 (labels shifted)."""
    return answered_batch(vocab, [(2 + r % 3, 1 + (r * 3) % 7) for r in range(rows)], width, seed=1)


def logits_of(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_jsd_is_trls_gkd_loss_in_value_and_gradient(models, beta):
    """TRL's loss is a token mean (its batchmean over labelled positions); ours is the sum the
    shared step divides by the global token count."""
    pytest.importorskip("trl")
    from trl.experimental.gkd import GKDTrainer

    student, teacher = models
    batch = rows_batch(student.config.vocab_size)
    objective = DistillLoss(teacher, "jsd", beta)
    student.zero_grad()
    out = objective(student, batch)
    (out.total / objective.count(batch)).backward()
    ours = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    with torch.no_grad():
        t = logits_of(teacher, batch)
    # TRL's layout: logits at position i against the label of token i + 1, labels unshifted.
    unshifted = torch.cat([torch.full_like(batch["labels"][:, :1], IGNORE), batch["labels"][:, :-1]], 1)
    want = GKDTrainer.generalized_jsd_loss(logits_of(student, batch)[:, :-1], t[:, :-1], unshifted[:, 1:], beta=beta)
    want.backward()
    assert float(out.total.detach()) / objective.count(batch) == pytest.approx(float(want.detach()), rel=1e-5)
    for a, p in zip(ours, student.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-8)


def plain_kl(p_log, q_log):
    """KL(p || q) per row, written out over the vocabulary (p's zero tokens add nothing)."""
    rows = zip(p_log.tolist(), q_log.tolist())
    return torch.tensor(
        [sum(math.exp(a) * (a - b) for a, b in zip(p, q) if a > -math.inf) for p, q in rows], dtype=torch.float64
    )


def test_the_divergences_are_their_formulas():
    g = torch.Generator().manual_seed(0)
    s = (torch.randn(4, 9, generator=g, dtype=torch.float64) * 2).log_softmax(-1)
    t = (torch.randn(4, 9, generator=g, dtype=torch.float64) * 2).log_softmax(-1)
    torch.testing.assert_close(generalized_jsd(s, t, 0.0), plain_kl(t, s))
    torch.testing.assert_close(generalized_jsd(s, t, 1.0), plain_kl(s, t))
    beta = 0.3
    m = ((1 - beta) * s.exp() + beta * t.exp()).log()
    torch.testing.assert_close(generalized_jsd(s, t, beta), beta * plain_kl(t, m) + (1 - beta) * plain_kl(s, m))
    cut = top_k_only(t, 3)
    assert ((cut > -math.inf).sum(1) == 3).all()
    torch.testing.assert_close(cut.exp().sum(1), torch.ones(4, dtype=torch.float64))
    kept = t.topk(3).indices
    torch.testing.assert_close(cut.gather(1, kept), t.gather(1, kept) - t.gather(1, kept).logsumexp(1, keepdim=True))
    torch.testing.assert_close(generalized_jsd(s, cut, 0.0), plain_kl(cut, s))  # finite: the cut tokens add nothing


@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("forward_top_k", [0, 4])
def test_the_sampled_token_reverse_kl_is_its_formula(models, estimator, forward_top_k):
    """At each sampled token x, k1 = log p_s(x) - log p_t(x) at the temperature: k1 as the
    per-token reward of a policy gradient (sg(k1) log p_s(x)) or k3 = exp(-k1) + k1 - 1
    minimised; plus the forward KL over the teacher's top k. Values and gradients."""
    student, teacher = models
    batch = rows_batch(student.config.vocab_size)
    temperature = 0.8
    objective = DistillLoss(
        teacher, "reverse_kl", temperature=temperature, estimator=estimator, forward_top_k=forward_top_k
    )
    student.zero_grad()
    out = objective(student, batch)
    out.total.backward()
    ours = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    mask = batch["labels"] != IGNORE
    s = (logits_of(student, batch)[mask] / temperature).log_softmax(-1)
    with torch.no_grad():
        t = (logits_of(teacher, batch)[mask] / temperature).log_softmax(-1)
    x = batch["labels"][mask][:, None]
    k1 = (s.gather(1, x) - t.gather(1, x)).squeeze(1)
    per_token = k1.detach() * s.gather(1, x).squeeze(1) if estimator == "k1" else torch.exp(-k1) + k1 - 1
    if forward_top_k:
        cut = top_k_only(t, forward_top_k)
        per_token = per_token + torch.where(cut > -math.inf, cut.exp() * (cut - s), torch.zeros_like(s)).sum(1)
    want = per_token.sum()
    want.backward()
    assert float(out.total.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert float(out.metrics["reverse_kl"]) == pytest.approx(float(k1.detach().sum()), rel=1e-5)
    for a, p in zip(ours, student.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-8)


def test_micro_batches_add_up_to_the_whole_batch(models):
    student, teacher = models
    batch = rows_batch(student.config.vocab_size)
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    for objective in (DistillLoss(teacher, "jsd", 0.5), DistillLoss(teacher, "reverse_kl", estimator="k3")):
        with torch.no_grad():
            whole, parts = objective(student, batch), [objective(student, h) for h in halves]
        assert (
            sum(objective.count(h) for h in halves) == objective.count(batch) == int((batch["labels"] != IGNORE).sum())
        )
        assert float(sum(p.total for p in parts)) == pytest.approx(float(whole.total), rel=1e-5)


def test_a_teachers_padded_vocabulary_is_compared_on_the_tokens_both_embed(models):
    """A teacher whose output layer has extra (padding) rows: the divergence is over the
    student's vocabulary, as if the teacher's padding logits were not there."""
    student, teacher = models

    class Padded(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, **kw):
            out = self.inner(**kw)
            out.logits = torch.cat([out.logits, torch.full_like(out.logits[..., :5], 9.0)], -1)
            return out

    batch = rows_batch(student.config.vocab_size)
    with torch.no_grad():
        plain = DistillLoss(teacher, "jsd", 0.5)(student, batch).total
        padded = DistillLoss(Padded(teacher), "jsd", 0.5)(student, batch).total
    assert float(padded) == pytest.approx(float(plain), rel=1e-6)


def test_an_empty_batch_counts_nothing_and_reaches_every_weight(models):
    from llmtrain.data.batches import Collator

    student, teacher = models
    batch = Collator(0).empty_batch(False)
    objective = DistillLoss(teacher, "jsd", 0.5)
    student.zero_grad()
    out = objective(student, batch)
    out.total.backward()
    assert objective.count(batch) == 0 and float(out.total) == 0.0
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "kw", [dict(loss="jsd", beta=0.3, top_k=5), dict(loss="reverse_kl", estimator="k3", forward_top_k=4)], ids=str
)
def test_both_output_layers_in_chunks_give_the_whole_logits_loss(models, kw):
    """Three trained positions at a time, the teacher's hidden states taken from inside its
    output layer and both models' logits computed per chunk (recomputed in backward): the
    loss, its k1 and its gradients are those of whole logits; the heads are back afterwards."""
    from llmtrain.model import chunkable_head

    student, teacher = models
    batch = rows_batch(student.config.vocab_size)
    results = []
    for chunk in (0, 3):
        heads = (
            dict(head=chunkable_head(student), chunk_tokens=3, teacher_head=chunkable_head(teacher)) if chunk else {}
        )
        objective = DistillLoss(teacher, temperature=0.9, **kw, **heads)
        assert (objective.head is not None) == bool(chunk)
        student.zero_grad()
        out = objective(student, batch)
        out.total.backward()
        results.append((out, [p.grad.clone() for p in student.parameters()]))
    (whole, whole_grads), (chunked, chunked_grads) = results
    assert float(chunked.total.detach()) == pytest.approx(float(whole.total.detach()), rel=1e-5)
    for key in whole.metrics:
        assert float(chunked.metrics[key]) == pytest.approx(float(whole.metrics[key]), rel=1e-5)
    scale = max(float(g.abs().max()) for g in whole_grads)
    for a, b in zip(chunked_grads, whole_grads):  # rows' logits computed apart round apart: 1e-5 of the largest
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)
    assert "forward" not in vars(chunkable_head(student)) and "forward" not in vars(chunkable_head(teacher))
    assert logits_of(teacher, batch).shape[-1] == teacher.config.vocab_size  # the teacher's head is its own again

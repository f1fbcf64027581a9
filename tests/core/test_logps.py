"""core/logps.label_logps: the log-prob of each trained label, from whole logits or inside
the output layer chunk by chunk, against a plain log-softmax over a real model's logits,
at temperature 1 and another, with their gradients."""

import pytest
import torch

from llmtrain.core.logps import label_logps
from llmtrain.data.rows import IGNORE


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def labelled_batch(vocab: int, rows: int = 4, width: int = 11) -> tuple[dict, torch.Tensor]:
    """Right-padded rows with trained spans of different lengths (one with none), labels
    shifted as the collator's."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for r in range(rows):
        prompt, answer = 2 + r % 3, (0, 3, 6, 1)[r % 4]
        mask[r, : prompt + answer] = 1
        labels[r, prompt - 1 : prompt + answer - 1] = ids[r, prompt : prompt + answer]
    return {"input_ids": ids, "attention_mask": mask}, labels


def plain_logps(model, inputs: dict, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """Position by position, row by row: log_softmax(logits / temperature) at the label."""
    logits = model(**inputs).logits.double() / temperature
    out = []
    for r in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[r, t] != IGNORE:
                out.append(logits[r, t].log_softmax(-1)[labels[r, t]])
    return torch.stack(out)


def grads(model, logps: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    (logps * torch.linspace(0.5, 1.5, logps.numel(), dtype=logps.dtype)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [0, 1, 4, 1000])
def test_label_logps_are_the_plain_log_softmax_at_each_label(model, temperature, chunk):
    """Whole logits (chunk 0) or the output layer 1, 4 or all positions at a time (1 and 4:
    recomputed in backward): the values, their order and their gradients are the plain ones."""
    inputs, labels = labelled_batch(model.config.vocab_size)
    head = model.get_output_embeddings() if chunk else None
    ours = label_logps(model, inputs, labels, head, chunk, temperature)
    assert ours.dtype == torch.float32 and ours.shape == (int((labels != IGNORE).sum()),)
    got = grads(model, ours)
    plain = plain_logps(model, inputs, labels, temperature)
    torch.testing.assert_close(ours.detach().double(), plain.detach(), rtol=1e-5, atol=1e-5)
    want = grads(model, plain)
    for name, g in got.items():
        torch.testing.assert_close(g, want[name].float(), rtol=1e-4, atol=1e-6, msg=name)


def test_temperature_one_divides_nothing_and_other_temperatures_scale_the_logits(model):
    """At temperature 1 the values are exactly the untempered log-softmax (x / 1 is exact,
    and nothing divides); at 2 they are those of the halved logits."""
    inputs, labels = labelled_batch(model.config.vocab_size)
    trained = labels != IGNORE
    with torch.no_grad():
        logits = model(**inputs).logits[trained].float()
        for temperature, scaled in ((1.0, logits), (2.0, logits / 2.0)):
            want = scaled.log_softmax(-1).gather(1, labels[trained][:, None]).squeeze(1)
            assert torch.equal(label_logps(model, inputs, labels, temperature=temperature), want)


def test_no_trained_label_gives_no_log_prob_but_keeps_the_head_in_the_graph(model):
    inputs, labels = labelled_batch(model.config.vocab_size)
    none = torch.full_like(labels, IGNORE)
    head = model.get_output_embeddings()
    out = label_logps(model, inputs, none, head, 4)
    assert out.shape == (0,)
    model.zero_grad()
    out.sum().backward()
    assert head.weight.grad is not None

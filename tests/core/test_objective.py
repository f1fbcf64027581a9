"""The SFT objective: the summed token cross-entropy, whole or in chunks inside the
output layer, and the count the step averages it over."""

import pytest
import torch

from llmtrain.core.objective import TokenLoss


def _batch(tokenizer, packed: bool):
    """Three chat rows with different trained spans, packed into one sequence or padded."""
    from llmtrain.config import DataConfig
    from llmtrain.data.batches import Collator
    from llmtrain.data.rows import process_row
    from llmtrain.demo import make_rows

    rows = [process_row(r, "chat", tokenizer, DataConfig()) for r in make_rows(3, seed=11)]
    collate = Collator(tokenizer.pad_token_id)
    if not packed:
        return collate(rows)
    pack = {"input_ids": [], "labels": [], "position_ids": [], "doc_ids": []}
    for d, r in enumerate(rows):
        pack["input_ids"] += r["input_ids"]
        pack["labels"] += r["labels"]
        pack["position_ids"] += range(len(r["input_ids"]))
        pack["doc_ids"] += [d] * len(r["input_ids"])
    return collate([pack])


def _loss_and_grads(model, batch, chunk):
    model.zero_grad(set_to_none=True)
    objective = TokenLoss.for_model(model, chunk)
    out = objective(model, batch)
    out.total.backward()
    return (
        out.total.detach(),
        objective.count(batch),
        {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None},
    )


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_loss_equals_whole_logits_loss_and_gradients(tiny_model, tokenizer, packed):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    batch = _batch(tokenizer, packed)
    whole, n, g_whole = _loss_and_grads(model, batch, 0)
    assert 10 < n < batch["labels"].numel()  # some positions are not trained
    for chunk in (5, 10**6):  # many chunks (recomputed in backward), and one
        loss, n_chunked, grads = _loss_and_grads(model, batch, chunk)
        assert n_chunked == n
        torch.testing.assert_close(loss, whole, rtol=1e-6, atol=1e-5)
        for name, g in g_whole.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_chunked_loss_makes_logits_only_for_trained_positions_a_chunk_at_a_time(tiny_model, tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    import llmtrain.core.objective as lo

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    batch = _batch(tokenizer, packed=False)
    trained = int((batch["labels"] != -100).sum())
    rows = []
    real = lo._chunk_loss
    monkeypatch.setattr(lo, "_chunk_loss", lambda h, *a: rows.append(h.shape[0]) or real(h, *a))
    loss = TokenLoss.for_model(model, 8)(model, batch).total
    forward_rows = list(rows)
    assert max(forward_rows) <= 8 and sum(forward_rows) == trained
    loss.backward()
    assert rows[len(forward_rows) :] == forward_rows[::-1]  # each chunk recomputed once, in backward
    # The output layer is itself again afterwards: generation and export see logits.
    with torch.no_grad():
        assert model(input_ids=batch["input_ids"][:1, :5]).logits.shape[-1] == model.config.vocab_size


def test_chunked_loss_keeps_the_output_layer_in_the_graph_for_an_empty_batch(tiny_model, tokenizer, monkeypatch):
    """A process with no data left runs a batch with nothing to train; DDP still needs a
    gradient (zero) for every weight, the output layer's included."""
    from transformers import AutoModelForCausalLM

    import llmtrain.core.objective as lo
    from llmtrain.data.batches import Collator

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    rows = []
    real = lo._chunk_loss
    monkeypatch.setattr(lo, "_chunk_loss", lambda h, *a: rows.append(h.shape[0]) or real(h, *a))
    loss, n, grads = _loss_and_grads(model, Collator(tokenizer.pad_token_id).empty_batch(packed=False), 4)
    assert n == 0 and loss == 0 and rows == [0]  # the head ran, on no rows
    assert set(grads) == {name for name, _ in model.named_parameters()}
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_the_count_is_the_trained_tokens_and_the_objective_matches_it(tiny_model, tokenizer):
    """count(batch), which the window agreement sums before any forward pass, is the
    number the loss is summed over; a head the chunked loss cannot stand in for (or
    chunking off) gives whole logits and no head for MFU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    batch = _batch(tokenizer, packed=False)
    objective = TokenLoss.for_model(model, 16)
    assert objective.head is model.lm_head and objective.unit == "tokens" and objective.metric_names == ()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        mean = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        count = objective.count(batch)
        assert count == int((batch["labels"] != -100).sum())
        assert float(objective(model, batch).total) == pytest.approx(float(mean) * count, rel=1e-5)
    assert TokenLoss.for_model(model, 0).head is None
    model.config.model_type = "granite"  # scales logits after the output layer
    assert TokenLoss.for_model(model, 16).head is None

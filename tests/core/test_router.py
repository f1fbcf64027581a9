"""The router load-balancing loss of mixture-of-experts models (llmtrain/core/router.py):
the model's own function over each sample, weighted by trained tokens, so the same for any
batch layout; trained as the model's config says or as model.router_aux_loss sets. A real
run under three splits of the global batch: tests/launch/test_router.py."""

import pytest
import torch

from llmtrain.config import DataConfig
from llmtrain.core.objective import TokenLoss
from llmtrain.data.batches import Collator
from llmtrain.data.packing import PackedDataset
from llmtrain.data.rows import IGNORE, process_row
from llmtrain.demo import make_rows
from tests.support.architectures import MOE


@pytest.fixture(scope="module")
def examples(tokenizer):
    return [process_row(r, "chat", tokenizer, DataConfig()) for r in make_rows(6, seed=21)]


def load(zoo, name, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(zoo(name), attn_implementation="eager", **kwargs).eval()


@pytest.mark.parametrize("asked", [False, True])  # the config's output_router_logits
@pytest.mark.parametrize("name", MOE)
def test_each_sample_gets_the_models_own_loss_weighted_by_its_trained_tokens(zoo, tokenizer, examples, name, asked):
    """Padded rows, packed rows and one row at a time give the same sum, and it is
    sum(trained tokens x the aux_loss the model itself returns for that row run alone),
    also where the config asks for router logits (the model would then take its own loss
    over the batch with the packed mask, and fail)."""
    model = load(zoo, name, output_router_logits=asked)
    objective = TokenLoss.for_model(model, 0, "train")
    collate = Collator(tokenizer.pad_token_id)
    rows = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
    with torch.no_grad():
        expected = sum(
            sum(x != IGNORE for x in e["labels"])
            * model(input_ids=torch.tensor([e["input_ids"]]), output_router_logits=True).aux_loss
            for e in examples
        )
        padded = objective(model, collate(rows)).metrics["router_aux"]
        packed_set = PackedDataset(__import__("datasets").Dataset.from_list(examples), capacity=512)
        packed = objective(model, collate([packed_set[j] for j in range(len(packed_set))])).metrics["router_aux"]
        one_by_one = sum(objective(model, collate([r])).metrics["router_aux"] for r in rows)
    assert len(packed_set) < len(rows)
    for got in (padded, packed, one_by_one):
        torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-5)


def test_the_loss_trains_the_router_term_as_the_setting_says(zoo, tokenizer, examples):
    model = load(zoo, "qwen3_moe")
    coef = model.config.router_aux_loss_coef
    batch = Collator(tokenizer.pad_token_id)([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples])
    with torch.no_grad():
        losses = {s: TokenLoss.for_model(model, 0, s)(model, batch) for s in ("model", "train", "log")}
    assert not model.config.output_router_logits  # so "model" trains no router term
    aux = losses["log"].metrics["router_aux"]
    assert aux > 0 and torch.equal(losses["model"].total, losses["log"].total)
    torch.testing.assert_close(losses["train"].total, losses["log"].total + coef * aux)
    on_by_config = load(zoo, "qwen3_moe", output_router_logits=True)
    assert TokenLoss.for_model(on_by_config, 0, "model").router.coef == coef
    dense = load(zoo, "llama")
    assert TokenLoss.for_model(dense, 0, "train").router is None
    assert TokenLoss.for_model(dense, 0, "train").metric_names == ()

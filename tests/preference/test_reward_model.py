"""Reward models (preference/reward_model.py): a sequence is scored where transformers' own
sequence classifiers read it, padded or packed, on every kind of architecture; the loss is
the Bradley-Terry loss with margins and centring; margins are checked per row."""

import json

import pytest
import torch
import torch.nn.functional as F

from llmtrain.config import DataConfig
from llmtrain.demo import make_pairs
from llmtrain.errors import DataError
from llmtrain.model import pad_id
from llmtrain.preference.pairs import PAIRS, PackedPairs, PairCollator
from llmtrain.preference.reward_model import REWARD_PAIRS, RewardLoss, score_head
from tests.support.architectures import ARCHITECTURES
from tests.support.data import rows_dataset


def reward_model(path, tokenizer, attn="sdpa"):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, attn_implementation=attn)
    model.config.pad_token_id = pad_id(tokenizer)
    return model.eval()


def pairs(tokenizer, n=5, margins=None):
    rows = [PAIRS.process(p, tokenizer, DataConfig(max_seq_len=96)) for p in make_pairs(n, seed=3)]
    rows = [r for r in rows if r["status"] == "ok"]
    for i, r in enumerate(rows):
        r["pair_index"] = i
        r["margin"] = margins[i] if margins else 0.0
    return rows


def alone(model, ids) -> torch.Tensor:
    """transformers' own score of one sequence (its pooling, its pad token)."""
    return model(input_ids=torch.tensor([ids])).logits[0, 0]


def with_score_heads() -> list[str]:
    """The zoo's architectures that transformers gives a sequence-classification class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    return [name for name in ARCHITECTURES if name in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES]


@pytest.mark.parametrize("name", with_score_heads())
def test_scores_are_read_where_transformers_reads_them_padded_and_packed(zoo, tokenizer, name):
    """Each answer's score in a padded and in a packed pair batch equals the score
    transformers gives the sequence alone: the last token that is not padding, absolute
    positions, sliding windows and experts included."""
    model = reward_model(zoo(name), tokenizer, "eager" if name in ("gemma2", "gpt_oss") else "sdpa")  # gpt-oss: no SDPA
    rows = pairs(tokenizer)
    objective = RewardLoss(score_head(model), pad_id(tokenizer))
    want = [alone(model, r[f"{side}_input_ids"]) for side in ("chosen", "rejected") for r in rows]
    padded = PairCollator(pad_id(tokenizer))(rows)
    packed_set = PackedPairs(rows_dataset(rows, f"reward-{name}"), capacity=256)
    packed = PairCollator(pad_id(tokenizer), 256, margins=True)([packed_set[j] for j in range(len(packed_set))])
    from llmtrain.preference.reward_model import sequence_scores

    with torch.no_grad():
        got_padded = sequence_scores(model, padded, objective.score, 2 * len(rows), objective.pad_id)[0]
        got_packed = sequence_scores(model, packed, objective.score, 2 * len(rows), objective.pad_id)[0]
    torch.testing.assert_close(got_padded, torch.stack(want), rtol=1e-4, atol=1e-5)
    # packed: answers numbered by the packed collator's order (pairs in bin order)
    order = packed["pair_index"].tolist()
    k = len(rows)
    want_packed = [want[i] for i in order] + [want[k + i] for i in order]
    torch.testing.assert_close(got_packed, torch.stack(want_packed), rtol=1e-4, atol=1e-5)


def test_the_loss_is_bradley_terry_with_margins_and_centring(zoo, tokenizer):
    """Loss (summed over pairs) and gradients against a plain implementation on the
    scores transformers gives each sequence alone."""
    margins = [0.0, 0.5, -1.0, 2.0, 0.25]
    rows = pairs(tokenizer, margins=margins)
    model = reward_model(zoo("llama"), tokenizer)
    objective = RewardLoss(score_head(model), pad_id(tokenizer), center=0.01)
    out = objective(model, PairCollator(pad_id(tokenizer), margins=True)(rows))
    got_grads = torch.autograd.grad(out.total, [model.score.weight])[0]

    k = len(rows)
    chosen = torch.stack([alone(model, r["chosen_input_ids"]) for r in rows])
    rejected = torch.stack([alone(model, r["rejected_input_ids"]) for r in rows])
    m = torch.tensor(margins[:k])
    plain = (-F.logsigmoid(chosen - rejected - m) + 0.01 * (chosen + rejected) ** 2).sum()
    want_grads = torch.autograd.grad(plain, [model.score.weight])[0]
    torch.testing.assert_close(out.total, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grads, want_grads, rtol=1e-4, atol=1e-6)
    assert float(out.metrics["accuracy"]) == float((chosen > rejected).sum())
    assert float(out.metrics["rewards_margin"]) == pytest.approx(float((chosen - rejected).sum()), abs=1e-6)


def test_an_empty_batch_counts_nothing_and_still_uses_every_weight(zoo, tokenizer):
    model = reward_model(zoo("llama"), tokenizer).train()
    collator = PairCollator(pad_id(tokenizer), margins=True)
    batch = collator.empty_batch()
    objective = RewardLoss(score_head(model), pad_id(tokenizer))
    out = objective(model, batch)
    assert objective.count(batch) == 0 and float(out.total) == 0.0
    out.total.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_bad_margin_is_one_error_naming_the_line(tokenizer, tmp_path):
    rows = make_pairs(3, seed=5)
    rows[1]["margin"] = "large"
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"pairs.jsonl line 2: 'margin' must be a finite number, got 'large'"):
        REWARD_PAIRS.prepare("data.train", [str(path)], tokenizer, DataConfig(max_seq_len=96, bad_rows="error"))
    rows[1]["margin"] = 1.5
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds, _ = REWARD_PAIRS.prepare("data.train", [str(path)], tokenizer, DataConfig(max_seq_len=96))
    assert ds["margin"][1] == 1.5 and ds["margin"][0] == 0.0


def test_csv_margins_are_read_from_their_text(tokenizer, tmp_path):
    """CSV has no types: a margin's text is the number it spells, an empty field none."""
    import csv

    rows = [r for r in make_pairs(12, seed=5) if isinstance(r.get("chosen"), str)][:4]  # the string shape
    path = tmp_path / "pairs.csv"

    def write(margins):
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, ["prompt", "chosen", "rejected", "margin"])
            writer.writeheader()
            writer.writerows(r | {"margin": m} for r, m in zip(rows, margins, strict=True))

    cfg = DataConfig(max_seq_len=96, bad_rows="error")
    write(["1.5", "", "-2", " 3 "])
    ds, _ = REWARD_PAIRS.prepare("data.train", [str(path)], tokenizer, cfg)
    assert ds["margin"] == [1.5, 0.0, -2.0, 3.0]
    for bad in ("large", "nan"):
        write(["1.5", bad, "-2", "3"])
        with pytest.raises(DataError, match=rf"pairs.csv line 3: 'margin' must be a finite number, got '{bad}'"):
            REWARD_PAIRS.prepare("data.train", [str(path)], tokenizer, cfg)

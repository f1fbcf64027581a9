"""KTO (dpo.loss=kto): unpaired rows and their KL sequences, the loss against a plain
implementation (losses and gradients of a tiny model, the reference point over the whole
global batch) and against TRL's KTOTrainer on the same log-probs."""

import json
import math
from collections import defaultdict

import pytest
import torch

from llmtrain.config import DataConfig
from llmtrain.data.rows import IGNORE
from llmtrain.preference.kto import KTOLoss, kto_losses
from llmtrain.preference.unpaired import UNPAIRED, KLCompletions, UnpairedCollator
from tests.support.data import rows_dataset

CFG = DataConfig(max_seq_len=256)
ROWS = [
    {"prompt": "What is 2 + 2?", "completion": "4", "label": True},
    {"prompt": [{"role": "user", "content": "Uppercase: cat"}], "completion": "cat", "label": False},
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse the word: sun"}],
        "completion": [{"role": "assistant", "content": "nus"}],
        "label": True,
    },
    {"prompt": "What number comes after 9?", "completion": "11", "label": False},
    {"prompt": "What is the opposite of hot?", "completion": "cold", "label": True},
]


def trained_text(tokenizer, labels) -> str:
    return tokenizer.decode([t for t in labels if t != IGNORE])


def numbered(tokenizer, rows, cfg=CFG):
    """The rows tokenized as UNPAIRED.prepare keeps them, numbered as build_datasets numbers them."""
    out = [UNPAIRED.process(r, tokenizer, cfg) for r in rows]
    assert all(o["status"] in ("ok", "truncated") for o in out), [o["status"] for o in out]
    return rows_dataset([o | {"row_index": i} for i, o in enumerate(out)], f"kto-test-{len(rows)}-{cfg.max_seq_len}")


# --- rows ----------------------------------------------------------------------------------


def test_a_row_is_tokenized_as_a_pairs_answer_with_its_label(tokenizer):
    from llmtrain.preference.pairs import PAIRS

    out = UNPAIRED.process(ROWS[0], tokenizer, CFG)
    pair = PAIRS.process({"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}, tokenizer, CFG)
    assert out["input_ids"] == pair["chosen_input_ids"] and out["labels"] == pair["chosen_labels"]
    assert out["desirable"] is True and out["status"] == "ok"
    assert trained_text(tokenizer, out["labels"]).startswith("4")
    p = out["prompt_tokens"]
    assert out["labels"][p - 1] == out["input_ids"][p] and all(t == IGNORE for t in out["labels"][: p - 1])
    # The three prompt shapes give the same tokens for the same row.
    same = [
        {"prompt": "Uppercase: cat", "completion": "cat", "label": False},
        {"prompt": [{"role": "user", "content": "Uppercase: cat"}], "completion": "cat", "label": False},
        {
            "prompt": [{"role": "user", "content": "Uppercase: cat"}],
            "completion": {"role": "assistant", "content": "cat"},
            "label": False,
        },
    ]
    same.append(  # the whole conversation as the completion, beside the prompt it repeats
        {
            "prompt": "Uppercase: cat",
            "completion": [{"role": "user", "content": "Uppercase: cat"}, {"role": "assistant", "content": "cat"}],
            "label": False,
        }
    )
    outs = [UNPAIRED.process(r, tokenizer, CFG) for r in same]
    assert outs[0] == outs[1] == outs[2] == outs[3]


@pytest.mark.parametrize(
    ("row", "status"),
    [
        ({"prompt": "hi", "completion": "yo"}, "error: a KTO row needs 'prompt', 'completion' and 'label'; this row "
         "has no value for ['label']"),
        ({"prompt": "hi", "completion": "yo", "label": 1}, "error: 'label' must be true (a desirable completion) or "
         "false (an undesirable one), got 1"),
        ({"prompt": "hi", "completion": "yo", "label": "true"}, "error: 'label' must be true"),
        ({"prompt": "hi", "completion": [{"role": "bot", "content": "yo"}], "label": True}, "error: completion[0]: "),
        ({"prompt": "hi", "completion": [{"role": "user", "content": "yo"}], "label": True},
         "error: 'completion' holds no assistant message (roles ['user'])"),
        ({"prompt": "hi", "completion": "", "label": True}, "empty answer"),
    ],
)  # fmt: skip
def test_malformed_and_empty_rows_are_reported(tokenizer, row, status):
    assert UNPAIRED.process(row, tokenizer, CFG)["status"].startswith(status)


def test_a_malformed_row_stops_the_run_naming_its_file_and_line(tokenizer, tmp_path):
    from llmtrain.errors import DataError

    path = tmp_path / "kto.jsonl"
    rows = [ROWS[0], {"prompt": "a", "completion": "b", "label": None}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        UNPAIRED.prepare("data.train", [str(path)], tokenizer, CFG)
    assert str(e.value).startswith(f"data.train: {path} line 2: a KTO row needs 'prompt', 'completion' and 'label'")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    with pytest.raises(DataError) as e:
        UNPAIRED.prepare("data.train", [str(pairs)], tokenizer, CFG)
    assert "dpo.loss=kto reads unpaired rows with 'prompt', 'completion' and 'label'" in str(e.value)
    assert "turn each pair into two rows" in str(e.value)


def test_unpaired_rows_given_as_pairs_point_to_kto(tokenizer, tmp_path):
    from llmtrain.errors import DataError
    from llmtrain.preference.pairs import PAIRS

    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(DataError, match=r"train on these rows with recipes/dpo.py with dpo.loss=kto \(they are"):
        PAIRS.prepare("data.train", [str(path)], tokenizer, CFG)


def test_csv_labels_are_read_from_their_text(tokenizer, tmp_path):
    """CSV has no types: 'true' and 'false' in any case are the labels they spell, so a CSV
    file trains the same rows as the JSON Lines file; other text stays an error."""
    import csv

    from llmtrain.errors import DataError

    plain = [r for r in ROWS if isinstance(r["prompt"], str) and isinstance(r["completion"], str)]
    jsonl, table = tmp_path / "kto.jsonl", tmp_path / "kto.csv"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in plain))
    with table.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "completion", "label"])
        for r, text in zip(plain, ["true", "False", " TRUE "], strict=True):
            assert (text.strip().lower() == "true") == r["label"]
            writer.writerow([r["prompt"], r["completion"], text])
    columns = ["input_ids", "labels", "desirable"]
    read = [UNPAIRED.prepare("data.train", [str(p)], tokenizer, CFG)[0] for p in (jsonl, table)]
    assert [read[0][c] for c in columns] == [read[1][c] for c in columns]
    assert read[1]["desirable"] == [True, False, True]
    table.write_text(table.read_text().replace("False", "yes"))
    with pytest.raises(DataError, match=r"kto.csv line 3: 'label' must be true .* got 'yes'"):
        UNPAIRED.prepare("data.train", [str(table)], tokenizer, CFG)


def test_an_overlong_row_loses_its_prompt_from_the_left(tokenizer):
    row = {"prompt": "x" * 60 + "What is 2 + 2?", "completion": "4", "label": True}
    whole = UNPAIRED.process(row, tokenizer, CFG)
    cut = UNPAIRED.process(row, tokenizer, DataConfig(max_seq_len=30, overlong="truncate"))
    assert cut["status"] == "truncated" and len(cut["input_ids"]) == 30
    assert cut["input_ids"] == whole["input_ids"][-30:] and cut["labels"] == whole["labels"][-30:]
    assert cut["prompt_tokens"] == whole["prompt_tokens"] - (len(whole["input_ids"]) - 30)
    assert UNPAIRED.process(row, tokenizer, DataConfig(max_seq_len=30, overlong="drop"))["status"].startswith(
        "too long"
    )


def test_a_rows_kl_sequence_is_its_prompt_with_the_next_rows_completion(tokenizer):
    """The same tokens and labels as the row {prompt i, completion i + 1} tokenized on its
    own (the demo's tokenizer has one token per character, so joining token ids equals
    tokenizing the joined text); the last row takes the first row's completion."""
    view = KLCompletions(numbered(tokenizer, ROWS), 256)
    assert len(view) == len(ROWS)
    for i in range(len(ROWS)):
        item = view[i]
        alone = UNPAIRED.process(ROWS[i], tokenizer, CFG)
        assert (item["input_ids"], item["labels"], item["row_index"]) == (alone["input_ids"], alone["labels"], i)
        assert item["desirable"] == ROWS[i]["label"]
        mixed = dict(ROWS[i], completion=ROWS[(i + 1) % len(ROWS)]["completion"])
        if isinstance(mixed["prompt"], str) and not isinstance(mixed["completion"], str):
            mixed["prompt"] = [{"role": "user", "content": mixed["prompt"]}]
        expected = UNPAIRED.process(mixed, tokenizer, CFG)
        assert item["kl_input_ids"] == expected["input_ids"], i
        assert item["kl_labels"] == expected["labels"], i


def test_kl_sequences_are_cut_to_max_seq_len(tokenizer):
    rows = [
        {"prompt": "What is 2 + 2?" * 2, "completion": "4", "label": True},
        {"prompt": "Hi", "completion": "a long completion " * 2, "label": False},
    ]
    cfg = DataConfig(max_seq_len=60)
    view = KLCompletions(numbered(tokenizer, rows, cfg), 60)
    first = view[0]
    assert len(first["kl_input_ids"]) == 60 and len(first["kl_labels"]) == 60
    assert first["kl_labels"][-1] == IGNORE and any(t != IGNORE for t in first["kl_labels"])
    labels, ids = first["kl_labels"], first["kl_input_ids"]
    assert all(lab in (nxt, IGNORE) for lab, nxt in zip(labels, ids[1:] + [IGNORE]))


def test_notes_warn_about_imbalance_and_neighbours_sharing_a_prompt(tokenizer):
    line, warnings = KLCompletions(numbered(tokenizer, ROWS), 256).notes(1.0, 1.0)
    assert line == "dpo.loss=kto: 3 desirable and 2 undesirable completions; weighted 1.50 : 1"
    assert len(warnings) == 1 and "advises between 1 and 4/3" in warnings[0]
    assert KLCompletions(numbered(tokenizer, ROWS), 256).notes(1.0, 1.2)[1] == []  # 3 / 2.4 = 1.25
    same = [dict(r, prompt="Same?") for r in ROWS[:4]]
    _, warnings = KLCompletions(numbered(tokenizer, same), 256).notes(1.0, 1.0)
    assert any("4 of 4 rows have the same prompt as the next row" in w for w in warnings)


def test_the_collator_pads_completions_and_kl_sequences_apart(tokenizer):
    view = KLCompletions(numbered(tokenizer, ROWS), 256)
    batch = UnpairedCollator(tokenizer.pad_token_id)([view[i] for i in (3, 0, 2)])
    assert batch["row_index"].tolist() == [3, 0, 2] and batch["desirable"].tolist() == [False, True, True]
    for prefix in ("", "kl_"):
        ids, mask, labels = (batch[prefix + k] for k in ("input_ids", "attention_mask", "labels"))
        assert ids.shape == mask.shape == labels.shape
        for row, i in enumerate((3, 0, 2)):
            n = len(view[i][prefix + "input_ids"])
            assert ids[row, :n].tolist() == view[i][prefix + "input_ids"] and mask[row].sum() == n
            assert (labels[row, n:] == IGNORE).all()
    empty = UnpairedCollator(0).empty_batch()
    assert empty["row_index"].numel() == 0 and empty["kl_input_ids"].shape == (1, 1)


# --- the loss against a plain implementation ------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def plain_logp(model, ids: list[int], labels: list[int]) -> torch.Tensor:
    """One sequence alone, no padding: the sum, token by token, of the log-probability of
    each trained label."""
    logits = model(input_ids=torch.tensor([ids])).logits[0]
    total = logits.new_zeros(())
    for t, label in enumerate(labels):
        if label != IGNORE:
            total = total + torch.log_softmax(logits[t].double(), -1)[label].float()
    return total


def plain_kto(model, items, reference, beta, wd, wu) -> tuple[torch.Tensor, float]:
    """The KTO paper's loss, written out: the mean over the rows, with z0 the mean KL
    log-ratio over every row's KL sequence, floored at 0."""
    with torch.no_grad():
        kl = [float(plain_logp(model, it["kl_input_ids"], it["kl_labels"])) - float(reference[it["row_index"], 1])
              for it in items]  # fmt: skip
    z0 = max(0.0, sum(kl) / len(kl))
    losses = []
    for it in items:
        r = plain_logp(model, it["input_ids"], it["labels"]) - float(reference[it["row_index"], 0])
        if it["desirable"]:
            losses.append(wd * (1 - torch.sigmoid(beta * (r - z0))))
        else:
            losses.append(wu * (1 - torch.sigmoid(beta * (z0 - r))))
    return torch.stack(losses).mean(), z0


def one_process(tensor):
    return tensor


@pytest.mark.parametrize("chunk", [0, 5])
def test_loss_and_gradients_match_a_plain_implementation_whatever_the_micro_batches(model, tokenizer, chunk):
    """Rows 0..4 as one micro-batch or as micro-batches of 2, 2 and 1: the same z0 (over the
    whole window), the same mean loss and the same gradients as the plain implementation;
    whole logits and the chunked output layer alike."""
    view = KLCompletions(numbered(tokenizer, ROWS), 256)
    items = [view[i] for i in range(len(view))]
    reference = torch.tensor([[-9.0, -30.0], [-4.0, -41.0], [-7.5, -33.0], [-5.0, -26.0], [-8.0, -35.0]])
    beta, wd, wu = 0.5, 1.3, 0.8

    model.zero_grad()
    expected, z0 = plain_kto(model, items, reference, beta, wd, wu)
    expected.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert z0 > 0  # the table's KL log-probs sit below the model's: a reference point above 0

    collate = UnpairedCollator(tokenizer.pad_token_id)
    head = model.get_output_embeddings() if chunk else None
    for layout in ([[0, 1, 2, 3, 4]], [[0, 1], [2, 3], [4]]):
        objective = KTOLoss(beta, wd, wu, chunk_tokens=chunk, head=head)
        objective.reference = reference
        micro = [collate([items[i] for i in rows]) for rows in layout]
        model.zero_grad()
        with torch.no_grad():
            objective.before_window(model, micro, one_process)
        assert objective.z0 == pytest.approx(z0, rel=1e-5)
        total = sum(objective(model, b).total for b in micro) / len(items)
        total.backward()
        assert float(total.detach()) == pytest.approx(float(expected), rel=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_reference_point_is_floored_at_zero_and_metrics_are_sums(model, tokenizer):
    view = KLCompletions(numbered(tokenizer, ROWS), 256)
    batch = UnpairedCollator(tokenizer.pad_token_id)([view[i] for i in range(5)])
    objective = KTOLoss(0.1)
    objective.reference = torch.zeros(5, 2)  # log-probs above every real one: a negative KL estimate
    with torch.no_grad():
        objective.before_window(model, [batch], one_process)
        out = objective(model, batch)
        sums, _ = objective.sequence_logps(model, batch)
    assert objective.z0 == 0.0
    m = {k: float(v) for k, v in out.metrics.items()}
    desirable = batch["desirable"]
    assert m["kl"] == 0.0 and m["desirable"] == 3 and m["undesirable"] == 2
    assert m["rewards_desirable"] == pytest.approx(float(0.1 * sums[desirable].sum()), rel=1e-5)
    assert m["logps_undesirable"] == pytest.approx(float(sums[~desirable].sum()), rel=1e-5)
    assert float(out.total) == pytest.approx(float(kto_losses(0.1, sums, torch.zeros(5), desirable, 0.0)[0].sum()))


def test_an_empty_batch_counts_nothing_and_keeps_every_weight_in_the_graph(model):
    objective = KTOLoss(0.1)
    objective.reference = torch.zeros(3, 2)
    empty = UnpairedCollator(0).empty_batch()
    objective.before_window(model, [empty], one_process)
    assert objective.z0 == 0.0 and objective.count(empty) == 0
    out = objective(model, empty)
    assert float(out.total) == 0.0 and set(out.metrics) == set(objective.metric_names)
    model.zero_grad()
    out.total.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_lora_takes_the_reference_from_the_model_with_its_adapters_off(tiny_model, tokenizer):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    view = KLCompletions(numbered(tokenizer, ROWS), 256)
    batch = UnpairedCollator(tokenizer.pad_token_id)([view[i] for i in range(5)])
    objective = KTOLoss(0.1, adapters_off=lambda m: m.disable_adapter())
    assert not objective.needs_reference_pass
    with torch.no_grad():
        with peft.disable_adapter():
            want = objective.sequence_logps(peft, batch, kl=True)[0]
        policy = objective.sequence_logps(peft, batch, kl=True)[0]
        objective.before_window(peft, [batch], one_process)
    assert not torch.allclose(policy, want)
    torch.testing.assert_close(objective.reference_logps(peft, batch, kl=True), want)
    assert objective.z0 == pytest.approx(max(0.0, float((policy - want).mean())), rel=1e-5, abs=1e-7)


def test_the_reference_pass_tabulates_completions_and_kl_sequences(model, tokenizer):
    from accelerate import Accelerator

    from llmtrain.preference.reference import compute

    view = KLCompletions(numbered(tokenizer, ROWS), 256)
    collate = UnpairedCollator(tokenizer.pad_token_id)
    table = compute(model, KTOLoss(0.1), [view], collate, 2, Accelerator(cpu=True), collate.empty_batch(), None,
                    "row_index")  # fmt: skip
    assert table.shape == (5, 2)
    with torch.no_grad():
        for i in range(5):
            item = view[i]
            alone = [plain_logp(model, item[f"{p}input_ids"], item[f"{p}labels"]) for p in ("", "kl_")]
            assert table[i].tolist() == pytest.approx([float(a) for a in alone], rel=1e-5)


# --- against TRL's own loss code -----------------------------------------------------------


class KTOHeads(torch.nn.Module):
    """Stands in for a model patched with TRL's fused LM head: given `labels`, each
    position's log-probability of the next label (zero where it is -100), from fixed
    per-token log-probs, those of the completions or, for the KL sequences' input ids, of
    those."""

    def __init__(self, batch: dict, token_logps: torch.Tensor, kl_token_logps: torch.Tensor):
        super().__init__()
        self.kl_ids, self.token_logps, self.kl_token_logps = batch["KL_input_ids"], token_logps, kl_token_logps

    def forward(self, input_ids, attention_mask, use_cache, labels, fused_lm_head):
        from trl.trainer.utils import FusedCausalLMOutput

        logps = self.kl_token_logps if input_ids is self.kl_ids else self.token_logps
        logps = logps.masked_fill(labels[:, 1:] == -100, 0.0)
        zeros = torch.zeros_like(logps)
        return FusedCausalLMOutput(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def trl_kto_trainer(model, beta: float, wd: float, wu: float):
    """A KTOTrainer with only what its loss (`_compute_loss`) reads; its __init__ would
    tokenize a dataset and build an Accelerator (see test_loss.trl_dpo_trainer)."""
    from trl import KTOTrainer

    from tests.preference.test_loss import OneProcess

    trainer = object.__new__(KTOTrainer)
    vars(trainer).update(
        model=model,
        accelerator=OneProcess(),
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
        loss_type="kto",
        calculate_KL=True,
        precompute_ref_logps=True,  # the reference log-probs come with the batch
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    return trainer


def trl_batch(rows: int, width: int, seed: int):
    """A batch in TRL's layout (completion masks on the completion tokens, not shifted) and
    float64 per-token log-probs (position t: token t + 1) for it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 13, (rows, width), generator=g)
    completion, attention = torch.zeros_like(ids), torch.zeros_like(ids)
    for row in range(rows):
        prompt, answer = 2 + (row * 5 + seed) % 3, 1 + (row * 7 + seed) % 9
        completion[row, prompt : prompt + answer] = 1
        attention[row, : prompt + answer] = 1
    token_logps = -3 * torch.rand(rows, width - 1, generator=g, dtype=torch.float64)
    return ids, attention, completion, token_logps


@pytest.mark.parametrize(("shift", "wd", "wu"), [(-1.5, 1.0, 1.0), (2.0, 1.33, 0.7), (0.3, 0.5, 2.0)])
def test_losses_rewards_and_kl_match_trl(shift, wd, wu):
    """kto_losses with z0 = max(0, mean KL log-ratio) against KTOTrainer._compute_loss on the
    same log-probs (one micro-batch on one process, where TRL's reference point is the
    same mean), in float64: the mean loss, the logged kl and the rewards and log-probs of
    each kind. `shift` moves the reference's KL log-probs: a negative estimate (floored
    at 0) or a positive one."""
    pytest.importorskip("trl")
    rows, beta = 6, 0.3
    ids, attention, completion, token_logps = trl_batch(rows, 14, seed=3)
    kl_ids, kl_attention, kl_completion, kl_token_logps = trl_batch(rows, 15, seed=4)
    label = torch.tensor([True, False, True, True, False, False])
    # Each sequence's summed log-prob over its completion, as both sides sum it.
    sums = (token_logps * completion[:, 1:]).sum(1)
    kl_sums = (kl_token_logps * kl_completion[:, 1:]).sum(1)
    ref = sums + torch.linspace(-2.0, 3.0, rows, dtype=torch.float64)
    ref_kl = kl_sums + shift + torch.linspace(-0.5, 0.5, rows, dtype=torch.float64)
    batch = {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": kl_attention,
        "KL_completion_mask": kl_completion,
        "label": label,
        "ref_logps": ref,
        "ref_KL_logps": ref_kl,
    }
    trainer = trl_kto_trainer(KTOHeads(batch, token_logps, kl_token_logps), beta, wd, wu)
    trl_loss = trainer.compute_loss(trainer.model, batch)
    logged = {key: values[-1] for key, values in trainer._metrics["train"].items()}

    z0 = max(0.0, float((kl_sums - ref_kl).mean()))
    loss, rewards = kto_losses(beta, sums, ref, label, z0, wd, wu)
    assert (z0 == 0.0) == (shift > 0)
    assert float(trl_loss) == pytest.approx(float(loss.mean()), rel=1e-9, abs=1e-12)
    assert logged["kl"] == pytest.approx(z0, rel=1e-9, abs=1e-12)
    assert logged["rewards/chosen"] == pytest.approx(float(rewards[label].mean()), rel=1e-9)
    assert logged["rewards/rejected"] == pytest.approx(float(rewards[~label].mean()), rel=1e-9)
    assert logged["logps/chosen"] == pytest.approx(float(sums[label].mean()), rel=1e-9)
    assert math.isfinite(float(loss.sum()))

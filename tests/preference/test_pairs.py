"""Preference pairs in their three shapes: both answers share the prompt's tokens, only
answer tokens (end of turn included) are trained, and pairs with nothing to compare are
dropped and counted."""

import pytest

from llmtrain.config import DataConfig
from llmtrain.data.rows import IGNORE
from llmtrain.preference.pairs import PAIRS, pair_messages
from tests.support.data import TOOLS_TEMPLATE, templated

CFG = DataConfig(max_seq_len=256)


def trained_text(tokenizer, ids, labels):
    """The text of the trained tokens (labels are shifted: labels[t] is token t+1)."""
    return tokenizer.decode([t for t in labels if t != IGNORE])


def check_pair(tokenizer, out, chosen: str, rejected: str):
    assert out["status"] == "ok", out["status"]
    ci, ri = out["chosen_input_ids"], out["rejected_input_ids"]
    cl, rl = out["chosen_labels"], out["rejected_labels"]
    for ids, labels in ((ci, cl), (ri, rl)):  # each label is the next token, or not trained
        assert all(label in (nxt, IGNORE) for label, nxt in zip(labels, ids[1:] + [IGNORE]))
    first = min(next(i for i, t in enumerate(cl) if t != IGNORE), next(i for i, t in enumerate(rl) if t != IGNORE))
    assert ci[: first + 1] == ri[: first + 1]  # the same prompt tokens before either answer
    assert trained_text(tokenizer, ci, cl).startswith(chosen)
    assert trained_text(tokenizer, ri, rl).startswith(rejected)


def test_string_pairs_go_through_the_chat_template_with_the_end_of_turn_trained(tokenizer):
    out = PAIRS.process({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, tokenizer, CFG)
    check_pair(tokenizer, out, "4", "5")
    chosen_trained = [t for t in out["chosen_labels"] if t != IGNORE]
    assert len(chosen_trained) > 1  # the answer and the template's end of turn
    assert trained_text(tokenizer, out["chosen_input_ids"], out["chosen_labels"]) != "4"


def test_conversational_pairs_train_only_what_follows_the_prompt(tokenizer):
    prompt = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},  # an earlier turn: context, not trained
        {"role": "user", "content": "2+2="},
    ]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"}
    out = PAIRS.process(row, tokenizer, CFG)
    check_pair(tokenizer, out, "4", "5")
    assert "2" not in trained_text(tokenizer, out["chosen_input_ids"], out["chosen_labels"])


def test_whole_conversations_share_their_longest_common_prefix_as_the_prompt():
    user = {"role": "user", "content": "hi"}
    row = {
        "chosen": [user, {"role": "assistant", "content": "hello"}],
        "rejected": [user, {"role": "assistant", "content": "go away"}],
    }
    prompt, chosen, rejected = pair_messages(row)
    assert prompt == [user]
    assert chosen == [{"role": "assistant", "content": "hello"}]
    assert rejected == [{"role": "assistant", "content": "go away"}]


def test_the_three_shapes_give_the_same_tokens_for_the_same_pair(tokenizer):
    user, good, bad = "3+4=", "7", "8"
    shapes = [
        {"prompt": user, "chosen": good, "rejected": bad},
        {"prompt": [{"role": "user", "content": user}], "chosen": [{"role": "assistant", "content": good}],
         "rejected": [{"role": "assistant", "content": bad}]},
        {"chosen": [{"role": "user", "content": user}, {"role": "assistant", "content": good}],
         "rejected": [{"role": "user", "content": user}, {"role": "assistant", "content": bad}]},
    ]  # fmt: skip
    # UltraFeedback as HuggingFaceH4 publishes it: a prompt beside whole conversations, which
    # repeat it (taken off, as TRL does, not rendered twice).
    shapes.append({**shapes[2], "prompt": user})
    outs = [PAIRS.process(row, tokenizer, CFG) for row in shapes]
    assert outs[0] == outs[1] == outs[2] == outs[3]


@pytest.mark.parametrize(
    ("row", "status"),
    [
        ({"prompt": "a", "chosen": "same", "rejected": "same"}, "identical answers"),
        ({"prompt": "a", "chosen": "", "rejected": "x"}, "an empty answer"),
        ({"prompt": "a", "chosen": "x"}, "error: a preference pair needs 'chosen' and 'rejected'; this row has no"),
        ({"prompt": "a", "chosen": 5, "rejected": "x"}, "error: 'chosen' must be a string or a non-empty list"),
        ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
         "error: 'chosen' and 'rejected' share no prompt"),
        ({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
         "error: 'chosen' holds no assistant message (roles ['user']); an answer is the assistant's turn"),
        ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
          "rejected": [{"role": "user", "content": "q"}, {"role": "user", "content": "b"}]},
         "error: 'rejected' holds no assistant message (roles ['user'])"),
        ({"prompt": "hi", "chosen": [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "a"}],
          "rejected": "b"},
         "error: 'chosen' starts with ['user'] messages that are not the prompt's; give the answer alone beside"),
        ({"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}],
          "rejected": "b"},
         "error: 'chosen' ends with a user message (roles ['assistant', 'user']); an answer ends with the assistant"),
        ({"prompt": "q", "chosen": "x" * 300 + "a", "rejected": "x" * 300 + "b"}, "identical answers after truncation"),
    ],
)  # fmt: skip
def test_pairs_with_nothing_to_compare_are_dropped_and_malformed_ones_are_errors(tokenizer, row, status):
    assert PAIRS.process(row, tokenizer, CFG)["status"].startswith(status)


def test_pair_messages_are_read_as_chat_rows_are(tokenizer):
    """Content parts, tool calls with a tools column, roles checked with the pair's own
    field named, and data.system_prompt before a prompt without a system message."""
    parts = {
        "prompt": [{"role": "user", "content": [{"type": "text", "text": "3+4="}]}],
        "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "7"}]}],
        "rejected": [{"role": "assistant", "content": "8"}],
    }
    plain = {"prompt": "3+4=", "chosen": "7", "rejected": "8"}
    assert PAIRS.process(parts, tokenizer, CFG) == PAIRS.process(plain, tokenizer, CFG)

    call = {"type": "function", "function": {"name": "add", "arguments": "3,4"}}
    row = {
        "prompt": [{"role": "user", "content": "3+4?"}],
        "chosen": [{"role": "assistant", "content": None, "tool_calls": [call]}],
        "rejected": [{"role": "assistant", "content": "8"}],
        "tools": [{"name": "add"}],
    }
    out = PAIRS.process(row, templated(tokenizer, TOOLS_TEMPLATE), CFG)
    assert out["status"] == "ok", out["status"]
    assert trained_text(tokenizer, out["chosen_input_ids"], out["chosen_labels"]) == "<call>add(3,4)</call><|im_end|>\n"
    assert tokenizer.decode(out["chosen_input_ids"]).startswith("<|im_start|>system\ntools: add<|im_end|>")

    bad = dict(plain, chosen=[{"role": "bot", "content": "7"}])
    assert PAIRS.process(bad, tokenizer, CFG)["status"].startswith("error: chosen[0]: needs a 'role' of system")

    system = DataConfig(max_seq_len=256, system_prompt="be brief")
    out = PAIRS.process(plain, tokenizer, system)
    assert tokenizer.decode(out["chosen_input_ids"]).startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert PAIRS.process(plain, tokenizer, CFG)["chosen_input_ids"] != out["chosen_input_ids"]


def test_an_over_long_pair_loses_its_prompt_from_the_left_first(tokenizer):
    row = {"prompt": "x" * 80, "chosen": "good answer", "rejected": "bad"}
    full = PAIRS.process(row, tokenizer, CFG)
    width = max(len(full["chosen_input_ids"]), len(full["rejected_input_ids"])) - 30
    out = PAIRS.process(row, tokenizer, DataConfig(max_seq_len=width))
    assert out["status"] == "truncated"
    assert max(len(out["chosen_input_ids"]), len(out["rejected_input_ids"])) <= width
    for side in ("chosen", "rejected"):  # the answers are whole
        assert [t for t in out[f"{side}_labels"] if t != IGNORE] == [t for t in full[f"{side}_labels"] if t != IGNORE]
    assert PAIRS.process(row, tokenizer, DataConfig(max_seq_len=width, overlong="drop"))["status"].startswith(
        "too long"
    )


def test_a_file_of_pairs_is_prepared_with_lines_in_its_errors_and_counts(tmp_path, tokenizer):
    import json

    from llmtrain.errors import DataError

    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "4"},  # identical: dropped
        {"prompt": "3+3=", "chosen": "6", "rejected": "5"},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds, stats = PAIRS.prepare("data.train", [str(path)], tokenizer, CFG)
    assert len(ds) == 2 and stats.summary("data.train").startswith("data.train: 2/3 rows kept")
    assert "1 dropped (identical answers)" in stats.summary("data.train")
    path.write_text(path.read_text() + '{"prompt": "x", "chosen": 1, "rejected": "y"}\n')
    with pytest.raises(DataError, match=rf"^data.train: {path} line 4: 'chosen' must be a string"):
        PAIRS.prepare("data.train", [str(path)], tokenizer, CFG)
    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match=r"preference pairs need 'chosen' and 'rejected'"):
        PAIRS.prepare("data.train", [str(sft)], tokenizer, CFG)


def test_the_collator_keeps_each_pair_in_one_batch_chosen_rows_first(tokenizer):
    from llmtrain.preference.pairs import PairCollator

    pairs = [
        PAIRS.process({"prompt": p, "chosen": c, "rejected": r}, tokenizer, CFG) | {"pair_index": i}
        for i, (p, c, r) in enumerate((("1+1=", "2", "three"), ("2+2=", "four", "5")))
    ]
    batch = PairCollator(0)(pairs)
    assert batch["pair_index"].tolist() == [0, 1] and batch["answers"][:, 0].tolist() == [0, 1, 2, 3]
    assert batch["input_ids"].shape[0] == 4
    for row, (side, i) in enumerate([("chosen", 0), ("chosen", 1), ("rejected", 0), ("rejected", 1)]):
        n = len(pairs[i][f"{side}_input_ids"])
        assert batch["input_ids"][row, :n].tolist() == pairs[i][f"{side}_input_ids"]
        assert batch["labels"][row, :n].tolist() == pairs[i][f"{side}_labels"]
        assert batch["attention_mask"][row].sum() == n and (batch["labels"][row, n:] == IGNORE).all()


@pytest.fixture(scope="module")
def demo_pairs(tmp_path_factory, tokenizer):
    """12 of the demo's pairs (all three shapes), tokenized and numbered."""
    from llmtrain.demo import make_pairs, write_jsonl

    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    write_jsonl(make_pairs(12, seed=5), path)
    ds, _ = PAIRS.prepare("data.train", [str(path)], tokenizer, CFG)
    return ds.add_column("pair_index", list(range(len(ds))))


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])
def test_packed_pairs_give_each_answer_the_log_probs_it_has_alone(tiny_model, zoo, tokenizer, demo_pairs, name):
    """Whole pairs packed several to a row under the packed mask: every answer's summed
    log-prob and token count equal those of its pair run alone, unpadded, so no answer
    sees another (nor its own pair's other answer), also with sliding windows shorter
    than the answers; the same padded."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmtrain.preference.loss import PreferenceLoss
    from llmtrain.preference.pairs import PackedPairs, PairCollator

    path = tiny_model if name == "llama" else zoo(name)  # windows of 8 on every (Mistral) or every other layer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    packed = PackedPairs(demo_pairs, capacity=2 * CFG.max_seq_len)
    assert len(packed) < len(demo_pairs) / 2, "several pairs share a row"
    collate = PairCollator(0, pack_width=2 * CFG.max_seq_len)
    expected = {}
    with torch.no_grad():
        for i in range(len(demo_pairs)):
            sums, tokens = PreferenceLoss("sigmoid", 0.1).logps(model, collate([demo_pairs[i]]))
            expected[i] = (sums.tolist(), tokens.tolist())
        for attn in ("sdpa", "eager"):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()
            objective = PreferenceLoss("sigmoid", 0.1)
            seen = []
            for start in range(0, len(packed), 3):
                batch = collate([packed[j] for j in range(start, min(start + 3, len(packed)))])
                assert batch["input_ids"].shape[1] == 2 * CFG.max_seq_len
                sums, tokens = objective.logps(model, batch)
                k = objective.count(batch)
                for n, i in enumerate(batch["pair_index"].tolist()):
                    got = ([float(sums[n]), float(sums[k + n])], [int(tokens[n]), int(tokens[k + n])])
                    assert got[1] == expected[i][1], (attn, i)
                    assert got[0] == pytest.approx(expected[i][0], abs=1e-4), (attn, i)
                seen += batch["pair_index"].tolist()
            assert sorted(seen) == list(range(len(demo_pairs)))
        padded = collate([demo_pairs[i] for i in range(5)])
        sums, tokens = PreferenceLoss("sigmoid", 0.1).logps(model, padded)
        for i in range(5):
            assert [float(sums[i]), float(sums[5 + i])] == pytest.approx(expected[i][0], abs=1e-4)


def test_an_empty_pair_batch_counts_no_pair_and_keeps_every_weight_in_the_graph(tiny_model):
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    from llmtrain.preference.loss import PreferenceLoss
    from llmtrain.preference.pairs import PairCollator

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    for packed, chunk in ((False, 0), (True, 4)):
        head = model.get_output_embeddings() if chunk else None
        objective = PreferenceLoss(
            "sigmoid", 0.1, chunk_tokens=chunk, head=head, adapters_off=lambda m: contextlib.nullcontext()
        )
        batch = PairCollator(0, pack_width=16).empty_batch(packed)
        assert objective.count(batch) == 0
        model.zero_grad(set_to_none=True)
        out = objective(model, batch)
        out.total.backward()
        assert float(out.total.detach()) == 0
        assert all(p.grad is not None for p in model.parameters()), packed

"""The student's own answers (llmtrain/distill/onpolicy.py): each row's draw and answer seeded
by (seed, pass, row), so a row gets the same answer in any micro-batch; the prompt is what
precedes the row's last trained span; only the student's answer is trained."""

import torch

from llmtrain.data.rows import IGNORE, shift
from llmtrain.distill.onpolicy import DistillCollator, OnPolicyBatches, on_policy_row, prompt_length
from llmtrain.rl.sampling import Completions


def test_the_draw_is_seeded_per_row_and_takes_its_share():
    draws = [on_policy_row(3, 1, i, 0.3) for i in range(4000)]
    assert abs(sum(draws) / 4000 - 0.3) < 0.03
    assert draws == [on_policy_row(3, 1, i, 0.3) for i in range(4000)]  # the same rows every time
    assert draws != [on_policy_row(3, 2, i, 0.3) for i in range(4000)]  # another pass, other rows
    assert all(on_policy_row(3, 1, i, 1.0) for i in range(50)) and not any(
        on_policy_row(3, 1, i, 0.0) for i in range(50)
    )


def test_the_prompt_is_what_precedes_the_last_trained_span():
    ids = list(range(10, 22))
    trained = [0] * 3 + [1] * 2 + [0] * 3 + [1] * 3 + [0]  # two answers: tokens 3-4 and 8-10
    labels = shift([t if m else IGNORE for t, m in zip(ids, trained)])
    assert prompt_length(ids, labels) == 8
    assert prompt_length(ids, [IGNORE] * len(ids)) is None


class Echo:
    """Answers each prompt with its seed's last digit and the prompt's length, then 3 (the
    end-of-turn token); records the calls."""

    def __init__(self):
        self.calls = []

    def generate(self, model, prompts, seeds, limits=None):
        self.calls.append(len(prompts))
        return Completions([[5 + s % 10, len(p), 3] for p, s in zip(prompts, seeds)], [True] * len(prompts))


class Rows:
    """A LoaderBatches stand-in: the given micro-batches for any pass."""

    items, steps_per_epoch, metrics, evaluates = "sequences", 1, {}, False

    def __init__(self, batches):
        self.batches = batches

    def epoch(self, epoch, skip=0):
        return iter(self.batches[skip:])


def examples(n: int) -> list[dict]:
    out = []
    for i in range(n):
        ids = [2, 40 + i, 41, 42 + i % 3, 9, 9, 3]  # a prompt of 4 tokens, an answer of 3
        out.append({"input_ids": ids, "labels": shift([IGNORE] * 4 + ids[4:]), "index": i})
    return out


def test_a_row_gets_the_same_answer_in_any_micro_batch_and_only_it_is_trained():
    collator = DistillCollator(0)
    rows = examples(6)
    whole = OnPolicyBatches(Rows([collator(rows)]), Echo(), None, collator, seed=7, fraction=0.5, max_len=64)
    parts = OnPolicyBatches(
        Rows([collator(rows[:2]), collator(rows[2:])]), Echo(), None, collator, seed=7, fraction=0.5, max_len=64
    )
    one = next(whole.epoch(0))
    split = list(parts.epoch(0))
    chosen = [i for i in range(6) if on_policy_row(7, 0, i, 0.5)]
    assert 0 < len(chosen) < 6
    for r in range(6):
        part, k = (split[0], r) if r < 2 else (split[1], r - 2)
        n = int(one["attention_mask"][r].sum())
        assert one["input_ids"][r, :n].tolist() == part["input_ids"][k, : int(part["attention_mask"][k].sum())].tolist()
        ids, labels = one["input_ids"][r, :n].tolist(), one["labels"][r, :n].tolist()
        assert one["on_policy"][r] == float(r in chosen) and one["index"][r] == r
        if r in chosen:  # the prompt, then the student's answer: [seed digit, prompt length, 3]
            assert ids[:4] == rows[r]["input_ids"][:4] and ids[5:] == [4, 3] and len(ids) == 7
            assert [t for t in labels if t != IGNORE] == ids[4:]  # only the answer is trained
        else:
            assert ids == rows[r]["input_ids"] and labels == rows[r]["labels"]
    assert whole.generator.calls == [len(chosen)]  # one call per micro-batch with on-policy rows


def test_an_answer_never_runs_past_the_longest_row():
    """A prompt of 4 in rows of at most 6 tokens: the answer is cut to 2."""
    collator = DistillCollator(0)
    source = OnPolicyBatches(Rows([collator(examples(2))]), Echo(), None, collator, seed=7, fraction=1.0, max_len=6)
    batch = next(source.epoch(0))
    assert batch["input_ids"].shape[1] == 6 and bool((batch["on_policy"] == 1).all())
    assert torch.equal(batch["labels"][:, 3:5] != IGNORE, torch.ones(2, 2, dtype=torch.bool))

"""The student's own answers (llmtrain/distill/onpolicy.py): each step's draw seeded by (seed,
pass, step) and each answer by (seed, pass, row), so a row gets the same answer in any
micro-batch split; the prompt is what precedes the row's last trained span; only the
student's answer is trained."""

import pytest
import torch

from llmtrain.data.rows import IGNORE, shift
from llmtrain.distill.onpolicy import DistillCollator, OnPolicyBatches, on_policy_step, prompt_length
from llmtrain.rl.sampling import Completions


def test_the_draw_is_seeded_per_step_and_takes_its_share():
    draws = [on_policy_step(3, 1, i, 0.3) for i in range(4000)]
    assert abs(sum(draws) / 4000 - 0.3) < 0.03
    assert draws == [on_policy_step(3, 1, i, 0.3) for i in range(4000)]  # the same steps every time
    assert draws != [on_policy_step(3, 2, i, 0.3) for i in range(4000)]  # another pass, other steps
    assert all(on_policy_step(3, 1, i, 1.0) for i in range(50)) and not any(
        on_policy_step(3, 1, i, 0.0) for i in range(50)
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


def test_a_step_gets_the_same_answers_in_any_micro_batch_split_and_only_they_are_trained():
    """Six steps of 4 rows, as one micro-batch a step or two accumulated: the same steps are
    on-policy, each row gets the same answer, and only the answers are trained."""
    collator = DistillCollator(0)
    rows = examples(24)

    def source(per_micro: int, accum: int) -> OnPolicyBatches:
        micro = [collator(rows[i : i + per_micro]) for i in range(0, 24, per_micro)]
        return OnPolicyBatches(Rows(micro), Echo(), None, collator, 7, 0.5, 64, accum=accum, steps=6)

    whole, split = source(4, 1), source(2, 2)
    one, two = list(whole.epoch(0)), list(split.epoch(0))
    on = [on_policy_step(7, 0, s, 0.5) for s in range(6)]
    assert 0 < sum(on) < 6
    for step in range(6):
        halves = two[2 * step : 2 * step + 2]
        for r in range(4):
            part, k = halves[r // 2], r % 2
            n, m = int(one[step]["attention_mask"][r].sum()), int(part["attention_mask"][k].sum())
            assert one[step]["input_ids"][r, :n].tolist() == part["input_ids"][k, :m].tolist()
            ids, labels = one[step]["input_ids"][r, :n].tolist(), one[step]["labels"][r, :n].tolist()
            row = rows[4 * step + r]
            assert one[step]["on_policy"][r] == float(on[step]) and one[step]["index"][r] == 4 * step + r
            if on[step]:  # the prompt, then the student's answer: [seed digit, prompt length, 3]
                assert ids[:4] == row["input_ids"][:4] and ids[5:] == [4, 3] and len(ids) == 7
                assert [t for t in labels if t != IGNORE] == ids[4:]  # only the answer is trained
            else:
                assert ids == row["input_ids"] and labels == row["labels"]
    assert whole.generator.calls == [4] * sum(on) and split.generator.calls == [2] * 2 * sum(on)


def test_a_resumed_pass_draws_its_steps_as_the_uninterrupted_one():
    """Skipping the first micro-batches (a resume) keeps each micro-batch's step number."""
    collator = DistillCollator(0)
    micro = [collator(examples(24)[i : i + 2]) for i in range(0, 24, 2)]
    make = lambda: OnPolicyBatches(Rows(micro), Echo(), None, collator, 7, 0.5, 64, accum=2, steps=6)  # noqa: E731
    full, resumed = list(make().epoch(0)), list(make().epoch(0, skip=4))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(full[4:], resumed))


def test_an_answer_never_runs_past_the_longest_row():
    """A prompt of 4 in rows of at most 6 tokens: the answer is cut to 2."""
    collator = DistillCollator(0)
    source = OnPolicyBatches(Rows([collator(examples(2))]), Echo(), None, collator, 7, 1.0, 6, accum=1, steps=1)
    batch = next(source.epoch(0))
    assert batch["input_ids"].shape[1] == 6 and bool((batch["on_policy"] == 1).all())
    assert torch.equal(batch["labels"][:, 3:5] != IGNORE, torch.ones(2, 2, dtype=torch.bool))


def test_only_whole_steps_are_trained():
    """25 rows, 2 a micro-batch, 2 micro-batches a step, one process: 6 whole steps; the 13th
    micro-batch (and its last row) is left out of the pass, on every layout alike."""
    from llmtrain.distill.onpolicy import whole_steps
    from llmtrain.errors import DataError

    assert whole_steps(25, 2, 2, 1) == 6 and whole_steps(25, 1, 2, 2) == 6 and whole_steps(25, 4, 1, 1) == 6
    collator = DistillCollator(0)
    rows = examples(25)
    micro = [collator(rows[i : i + 2]) for i in range(0, 25, 2)]
    source = OnPolicyBatches(Rows(micro), Echo(), None, collator, 7, 0.0, 64, accum=2, steps=whole_steps(25, 2, 2, 1))
    assert source.steps_per_epoch == 6 and len(list(source.epoch(0))) == 12
    with pytest.raises(DataError, match=r"^data.train: fewer rows than one step's global batch"):
        OnPolicyBatches(Rows(micro), Echo(), None, collator, 7, 0.5, 64, accum=2, steps=0)


class Shown(Echo):
    """Echo that also records the images and per-token inputs each prompt is answered with."""

    def generate(self, model, prompts, seeds, limits=None, shown=None):
        self.shown = shown
        return super().generate(model, prompts, seeds, limits)


def test_a_vision_language_models_rows_are_answered_and_trained_with_their_images(tmp_path):
    """Each prompt is answered with its row's images and its per-token inputs cut to the
    prompt; the answered batch carries the images for both models' forwards, with the
    per-token inputs marking the image tokens where they are."""
    from llmtrain.config import DataConfig
    from llmtrain.data.rows import FileRow
    from llmtrain.distill.method import INDEXED_ROWS
    from llmtrain.processor import processor_of
    from tests.support.vision_models import build, loaded, pictures

    _, tok = loaded(build("qwen2_5_vl", tmp_path / "qwen2_5_vl"))
    (tmp_path / "images").mkdir()
    images = pictures(tmp_path / "images")
    rows = []
    for i, colour in enumerate(["red", "green"]):
        part = [{"type": "image", "image": f"{colour}.png"}] if i == 0 else []  # the second row: text alone
        row = FileRow({"messages": [{"role": "user", "content": [*part, {"type": "text", "text": "colour?"}]}]})
        row["messages"].append({"role": "assistant", "content": colour})
        row.root = images
        rows.append(INDEXED_ROWS.images.process(row, tok, DataConfig()) | {"index": i})
    collator = DistillCollator(tok.pad_token_id, processor_of(tok), DataConfig().max_image_pixels)
    gen = Shown()
    source = OnPolicyBatches(Rows([collator(rows)]), gen, None, collator, 7, 1.0, 256, accum=1, steps=1)
    batch = next(source.epoch(0))
    assert [s["images"] for s in gen.shown] == [[(images / "red.png").read_bytes()], []]
    prompts = [prompt_length(r["input_ids"], r["labels"]) for r in rows]
    assert [len(s["mm_token_type_ids"]) for s in gen.shown] == prompts
    image = batch["input_ids"] == tok.image_token_id
    assert image[0].any() and not image[1].any() and "pixel_values" in batch
    assert torch.equal(batch["mm_token_type_ids"].bool(), image)
    for r, n in enumerate(prompts):
        trained = batch["labels"][r][batch["labels"][r] != IGNORE].tolist()
        assert trained == batch["input_ids"][r, n : n + 3].tolist() and len(trained) == 3  # the answer alone

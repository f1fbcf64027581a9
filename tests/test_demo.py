"""The offline demo's generated data: preference pairs whose chosen answer is right and
rejected one wrong, in the three row shapes, with the model's own wrong answers where it
has them; the same pairs as KTO's unpaired rows."""

from llmtrain.demo import OPPOSITES, make_pairs, unpaired_rows
from llmtrain.preference.pairs import pair_messages


def right_answer(question: str) -> str:
    """The demo's questions, answered independently of demo._task."""
    word = question.rsplit(" ", 1)[-1].rstrip("?")
    if question.startswith("What is") and "+" in question:
        a, b = question[len("What is ") : -1].split(" + ")
        return str(int(a) + int(b))
    if question.startswith("Uppercase"):
        return word.upper()
    if question.startswith("Reverse"):
        return word[::-1]
    if question.startswith("What number comes after"):
        return str(int(word) + 1)
    return OPPOSITES[word]


def test_pairs_come_in_three_shapes_with_the_right_answer_chosen():
    rows = make_pairs(60, seed=1)
    shapes = {("prompt" in r, isinstance(r["chosen"], str)) for r in rows}
    assert shapes == {(True, True), (True, False), (False, False)}
    for row in rows:
        prompt, chosen, rejected = pair_messages(row)
        question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        chosen = chosen if isinstance(chosen, str) else chosen[-1]["content"]
        rejected = rejected if isinstance(rejected, str) else rejected[-1]["content"]
        assert chosen == right_answer(question) != rejected, row


def test_the_models_own_wrong_answers_are_the_rejected_ones():
    """An `answer` that is wrong on every other question: those answers are rejected; where
    it is right, a made-up wrong answer is."""
    asked = []

    def answer(prompts):
        asked.extend(prompts)
        return ["oops" if i % 2 else right_answer(p[-1]["content"]) for i, p in enumerate(prompts)]

    rows = make_pairs(12, seed=2, answer=answer)
    assert len(asked) == 12 and all(p[-1]["role"] == "user" for p in asked)
    for i, row in enumerate(rows):
        _, _, rejected = pair_messages(row)
        rejected = rejected if isinstance(rejected, str) else rejected[-1]["content"]
        assert (rejected == "oops") == (i % 2 == 1), (i, row)
    assert make_pairs(12, seed=2) == make_pairs(12, seed=2)  # seeded


def test_unpaired_rows_are_the_pairs_answers_labelled_in_two_blocks(tokenizer):
    """Every chosen answer (label true), then every rejected one (label false), each after
    its pair's prompt, as KTO reads them (the same tokens as the pair's answers)."""
    from llmtrain.config import DataConfig
    from llmtrain.preference.pairs import PAIRS
    from llmtrain.preference.unpaired import UNPAIRED

    pairs = make_pairs(9, seed=3)
    rows = unpaired_rows(pairs)
    assert [r["label"] for r in rows] == [True] * 9 + [False] * 9
    cfg = DataConfig(max_seq_len=256)
    for i, pair in enumerate(pairs):
        tokens = PAIRS.process(pair, tokenizer, cfg)
        for row, side in ((rows[i], "chosen"), (rows[9 + i], "rejected")):
            out = UNPAIRED.process(row, tokenizer, cfg)
            assert (out["input_ids"], out["labels"]) == (tokens[f"{side}_input_ids"], tokens[f"{side}_labels"])


def test_scoring_a_directory_that_holds_no_model_is_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "llmtrain.demo", "score", str(tmp_path / "runs" / "dpo-demo" / "final")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: {tmp_path / 'runs' / 'dpo-demo' / 'final'}: no model directory (no config.json); give the "
        "directory a run saved, e.g. runs/dpo-demo/final"
    ]

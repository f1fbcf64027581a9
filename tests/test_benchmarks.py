"""The benchmark compares like with like: on its template, llmtrain trains exactly the
tokens that transformers' assistant mask (what TRL's assistant_only_loss uses) marks."""

import importlib.util

from llmtrain.config import DataConfig
from llmtrain.data import IGNORE, process_row

from .conftest import ROOT

spec = importlib.util.spec_from_file_location("sft_vs_trl", ROOT / "benchmarks" / "sft_vs_trl.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_trained_tokens_match_the_assistant_mask(tokenizer):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = bench.TEMPLATE
    for row in bench.make_rows(20, seed=1, seq=256):
        ours = process_row(row, "chat", tok, None, DataConfig(max_seq_len=10_000))
        theirs = tok.apply_chat_template(
            row["messages"], return_dict=True, return_assistant_tokens_mask=True, tokenize=True
        )
        assert ours["input_ids"] == theirs["input_ids"]
        trained_positions = [t + 1 for t, label in enumerate(ours["labels"]) if label != IGNORE]
        assert trained_positions == [i for i, m in enumerate(theirs["assistant_masks"]) if m]


def test_row_lengths_spread_like_instruction_data():
    lengths = sorted(sum(len(m["content"]) for m in r["messages"]) for r in bench.make_rows(500, seed=0, seq=512))
    median, p95 = lengths[250], lengths[475]
    assert 50 < median < 250 and p95 > 2 * median  # a long tail


def test_the_checksum_measurement_runs():
    import subprocess
    import sys

    from .conftest import ROOT

    proc = subprocess.run(
        [sys.executable, "benchmarks/checkpoint_checksums.py", "--gib", "0.01"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "checksums after writing" in proc.stdout and "verifying before a resume" in proc.stdout

"""Fixtures of the RL tests: the demo tokenizer with the special tokens of the tool-calling
templates the tests write out (tests/rl/test_turns.py)."""

import pytest


@pytest.fixture
def tok(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    return tok

"""llmtrain verify's parts (llmtrain/verify.py): the user's architecture shrunk with what
makes it that architecture kept, and runs compared figure by figure against tolerances.
The command on real runs, passing and failing, is tests/launch/test_verify.py's."""

import json
import math

import pytest

from llmtrain.config import ModelConfig
from llmtrain.verify import FLOAT32, compare, shrink, table

# Larger than the shrunk size, so every setting that shrinks is seen to.
MIXED = ["sliding_attention", "full_attention"]
BIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8)


@pytest.mark.parametrize(
    "cls, settings, kept",
    [
        ("LlamaConfig", {}, {}),
        (
            "Gemma2Config",
            {"sliding_window": 8, "head_dim": 32, "layer_types": ["sliding_attention", "full_attention"] * 3},
            {"sliding_window": 8},
        ),
        ("Qwen3MoeConfig", {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128}, {}),
        ("Phi3Config", {}, {}),
        ("GPT2Config", {"n_embd": 256, "n_layer": 6, "n_head": 8, "n_positions": 512}, {"n_positions": 512}),
    ],
)
def test_shrinking_keeps_the_architecture_and_the_vocabulary(cls, settings, kept, tokenizer, tmp_path):
    import transformers
    from transformers import AutoConfig

    kwargs = {} if cls == "GPT2Config" else dict(BIG)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    ids["pad_token_id"] = tokenizer.pad_token_id
    config = getattr(transformers, cls)(vocab_size=len(tokenizer), **ids, **kwargs | settings)
    config.save_pretrained(tmp_path / "big")
    tokenizer.save_pretrained(tmp_path / "big")
    out, dropout = shrink(ModelConfig(name_or_path=str(tmp_path / "big")), tmp_path / "small")
    small = AutoConfig.from_pretrained(out)
    assert type(small) is type(config) and small.vocab_size == len(tokenizer)
    assert small.num_hidden_layers == 2 and small.hidden_size == 64
    for key, value in kept.items():
        assert getattr(small, key) == value, key
    if cls == "Gemma2Config":
        assert small.layer_types == MIXED  # one layer of each kind
    if cls == "Qwen3MoeConfig":
        assert small.num_experts == 4 and small.num_experts_per_tok == 2
    if cls == "GPT2Config":
        assert dropout == "config.attn_pdrop=0.1, config.embd_pdrop=0.1, config.resid_pdrop=0.1"  # found, said
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()


def run_dir(path, losses, norms, weight: float = 1.0):
    import torch
    from safetensors.torch import save_file

    (path / "final").mkdir(parents=True)
    rows = [{"step": i + 1, "loss": loss, "grad_norm": g} for i, (loss, g) in enumerate(zip(losses, norms))]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_file({"w": torch.tensor([weight, 2.0])}, path / "final" / "model.safetensors")
    return path


def test_a_check_reports_the_figure_furthest_beyond_its_tolerance(tmp_path):
    want = run_dir(tmp_path / "want", [2.0, 1.5], [1.0, 0.8])
    same = run_dir(tmp_path / "same", [2.0, 1.5 * (1 + 1e-6)], [1.0, 0.8])
    check = compare("accumulation vs one micro-batch", same, want, FLOAT32, 1.0)
    assert check.passed and check.where == "loss at step 2" and check.worst == pytest.approx(1e-6)
    off = run_dir(tmp_path / "off", [2.0, 1.5], [1.0, 0.8 * 1.01])
    check = compare("2 processes vs one micro-batch", off, want, FLOAT32, 1.0)
    assert not check.passed and check.where == "grad_norm at step 2" and check.tolerance == FLOAT32["grad_norm"]
    exact = dict.fromkeys(FLOAT32, 0.0)
    weights = run_dir(tmp_path / "weights", [2.0, 1.5], [1.0, 0.8], weight=1.0 + 1e-7)
    check = compare("resume vs uninterrupted", weights, want, exact, 1.0)
    assert not check.passed and check.where == "final weights"
    assert "FAIL" in table([check]) and "exact" in table([check])
    short = run_dir(tmp_path / "short", [2.0], [1.0])
    assert math.isinf(compare("resume vs uninterrupted", short, want, exact, 1.0).worst)

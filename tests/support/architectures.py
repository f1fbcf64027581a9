"""Tiny random-weight checkpoints of the architectures users bring, built with
`from_config` and saved with `save_pretrained`, so tests load them through the same
`from_pretrained` path as a user's model. Every one has 2 layers of width 64 and the demo's
byte-level tokenizer; a model with a sliding window or chunks gets one of 8 tokens, shorter
than the test samples, so a mask that ignores it changes the logits."""

from __future__ import annotations

from pathlib import Path

WINDOW = 8
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MIXED = ["sliding_attention", "full_attention"]

# name -> (config class, its settings, what it stands for)
ARCHITECTURES: dict[str, tuple[str, dict, str]] = {
    "llama": ("LlamaConfig", {}, "dense"),
    "qwen2": ("Qwen2Config", {}, "dense, attention biases"),
    "qwen3": ("Qwen3Config", {"head_dim": 16}, "dense, q/k norms"),
    "phi3": ("Phi3Config", {}, "dense, fused qkv_proj and gate_up_proj"),
    "olmo2": ("Olmo2Config", {}, "dense, norms after attention and MLP"),
    "smollm3": ("SmolLM3Config", {}, "dense, layers without RoPE"),
    "granite": ("GraniteConfig", {"logits_scaling": 2.0, "residual_multiplier": 0.5}, "dense, scaled logits"),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW, "head_dim": 16}, "sliding window on every layer"),
    "gemma2": (
        "Gemma2Config",
        {"sliding_window": WINDOW, "head_dim": 16, "query_pre_attn_scalar": 16, "layer_types": MIXED},
        "sliding and full layers, soft-capped attention and logits",
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {"sliding_window": WINDOW, "head_dim": 16, "query_pre_attn_scalar": 16, "layer_types": MIXED},
        "sliding and full layers, two RoPE bases",
    ),
    "cohere2": (
        "Cohere2Config",
        {"sliding_window": WINDOW, "layer_types": MIXED},
        "sliding and full layers, parallel attention and MLP",
    ),
    "gpt_oss": (
        "GptOssConfig",
        {
            "sliding_window": WINDOW,
            "head_dim": 16,
            "layer_types": MIXED,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
        },
        "mixture of experts, sliding and full layers, attention sinks",
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, "mixture of experts"),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
        "mixture of experts",
    ),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512}, "absolute positions"),
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.25}, "partial rotary, parallel residual"),
}

SLIDING = [name for name, (_, kw, _) in ARCHITECTURES.items() if "sliding_window" in kw]
MOE = ["gpt_oss", "mixtral", "qwen3_moe"]


def config(name: str, tokenizer):
    import transformers

    cls, settings, _ = ARCHITECTURES[name]
    kwargs = {} if name == "gpt2" else dict(COMMON, max_position_embeddings=512)
    if name == "gpt_oss":  # its YaRN RoPE is configured for its own 128k context
        del kwargs["max_position_embeddings"]
    kwargs |= settings
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return getattr(transformers, cls)(vocab_size=len(tokenizer), **ids, **kwargs)


def build(name: str, path: Path, tokenizer, seed: int = 0) -> Path:
    """Save a randomly initialised `name` model and the tokenizer under `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(name, tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

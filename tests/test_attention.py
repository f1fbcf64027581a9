"""attention.choose: the backend per model and device, and the errors for what a model or
device cannot run. (Packed masks per architecture: tests/launch/test_architectures.py.)"""

import pytest
import torch

from llmtrain.attention import choose, describe_pattern, layer_types
from llmtrain.errors import AttentionError


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM, LlamaConfig(num_hidden_layers=2)


def test_auto_is_flex_for_packed_data_on_a_gpu_and_sdpa_otherwise():
    cls, mcfg = llama()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose("auto", cls, mcfg, True, cuda).name == "flex_attention"
    assert choose("auto", cls, mcfg, False, cuda).name == "sdpa"
    assert choose("auto", cls, mcfg, True, cpu).name == "sdpa"
    assert choose("eager", cls, mcfg, True, cuda).name == "eager"
    with pytest.raises(AttentionError, match="^model.attn_implementation: flex_attention cannot train on CPU"):
        choose("flex_attention", cls, mcfg, True, cpu)


def test_auto_takes_what_a_model_without_sdpa_supports():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    mcfg = Gemma2Config(num_hidden_layers=2)
    cpu = choose("auto", Gemma2ForCausalLM, mcfg, True, torch.device("cpu"))
    assert cpu.name == "eager" and "soft-capped attention scores" in cpu.reason
    assert choose("auto", Gemma2ForCausalLM, mcfg, False, torch.device("cuda")).name == "flex_attention"
    with pytest.raises(
        AttentionError, match="^model.attn_implementation: Gemma2ForCausalLM does not support sdpa; use"
    ):
        choose("sdpa", Gemma2ForCausalLM, mcfg, False, torch.device("cpu"))


def test_an_unknown_backend_names_the_known_ones():
    cls, mcfg = llama()
    with pytest.raises(
        AttentionError, match=r"^model.attn_implementation: unknown backend 'bogus'; use one of auto, eager,"
    ):
        choose("bogus", cls, mcfg, False, torch.device("cpu"))


def test_the_pattern_is_read_per_layer_from_the_config():
    from transformers import Gemma3TextConfig, Llama4TextConfig, MistralConfig, Qwen2Config

    assert describe_pattern(llama()[1]) == "full causal on all 2 layers"
    assert describe_pattern(MistralConfig(num_hidden_layers=3, sliding_window=64)) == (
        "sliding window of 64 tokens on all 3 layers"
    )
    g3 = Gemma3TextConfig(num_hidden_layers=6, sliding_window=512)
    assert describe_pattern(g3) == "sliding window of 512 tokens on 5 layers, full causal on 1 layer"
    assert layer_types(Qwen2Config(num_hidden_layers=2)) == ["full_attention"] * 2  # use_sliding_window off
    l4 = Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=16)
    assert describe_pattern(l4) == "chunks of 16 tokens on 3 layers, full causal on 1 layer"


def test_packing_is_refused_where_samples_could_not_be_kept_apart():
    from transformers import BloomConfig, BloomForCausalLM, MistralConfig, MistralForCausalLM

    with pytest.raises(AttentionError, match="^data.packing: BloomForCausalLM takes no position_ids"):
        choose("auto", BloomForCausalLM, BloomConfig(n_layer=2), True, torch.device("cpu"))
    choose("auto", BloomForCausalLM, BloomConfig(n_layer=2), False, torch.device("cpu"))  # unpacked is fine
    mixed = MistralConfig(num_hidden_layers=2, sliding_window=8)
    mixed.layer_types = ["sliding_attention", "full_attention"]  # Mistral's code takes one mask for all layers
    with pytest.raises(AttentionError, match="^data.packing: MistralForCausalLM mixes layer types"):
        choose("auto", MistralForCausalLM, mixed, True, torch.device("cpu"))

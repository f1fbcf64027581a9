import pytest

from llmtrain.config import ModelConfig
from llmtrain.errors import ModelError
from llmtrain.model import check_model
from tests.support.runs import recipe_args, run_recipe


def test_sequences_within_the_model_positions_pass(tiny_model):
    check_model(ModelConfig(name_or_path=str(tiny_model)), 512)  # the tiny model has 512


def test_sequences_beyond_the_model_positions_are_refused(tiny_model):
    with pytest.raises(
        ModelError,
        match=r"data.max_seq_len: 1024 is above the 512 positions .* "
        r"set data.max_seq_len=512 or less",
    ):
        check_model(ModelConfig(name_or_path=str(tiny_model)), 1024)


def test_rope_scaling_allows_longer_sequences(tiny_model, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model)
    config.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    config.save_pretrained(tmp_path)
    check_model(ModelConfig(name_or_path=str(tmp_path)), 2048)


def test_recipe_refuses_too_long_sequences_before_loading_anything(
    base_config, tiny_model, chat_file, cache_env, tmp_path
):
    out = tmp_path / "run"
    proc = run_recipe(
        recipe_args(
            base_config,
            tiny_model,
            chat_file,
            out,
            "data.max_seq_len=4096",
        ),
        cache_env,
        check=False,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data.max_seq_len: 4096 is above the 512 positions" in errors[0]
    assert not out.exists()


# --- the output layer the chunked loss stands in for ----------------------------------


def test_models_that_change_logits_after_the_head_get_whole_logits(tiny_model):
    from transformers import AutoModelForCausalLM

    from llmtrain.model import chunkable_head

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert chunkable_head(model) is model.lm_head
    model.config.model_type = "granite"  # divides logits by logits_scaling after lm_head
    assert chunkable_head(model) is None


def test_a_lora_adapted_head_gets_whole_logits(tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmtrain.model import chunkable_head

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert chunkable_head(get_peft_model(model, LoraConfig(target_modules=["q_proj"]))) is not None
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert chunkable_head(get_peft_model(model, LoraConfig(target_modules=["q_proj", "lm_head"]))) is None


# --- attention backend and compilation -------------------------------------------------


def test_compile_blocks_compiles_each_transformer_block_in_place(tiny_model):
    from transformers import AutoModelForCausalLM

    from llmtrain.model import compile_blocks

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    names = [n for n, _ in model.named_parameters()]
    assert compile_blocks(model) == model.config.num_hidden_layers
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints keep their keys


def test_float16_weights_that_would_train_are_refused_before_loading(tiny_model, tmp_path):
    """AdamW on fp16 weights loses small updates, and no loss scaler can unscale fp16
    gradients; model.dtype=auto on a checkpoint saved in float16 is the same case. LoRA
    on a float16 base trains float32 adapters and is allowed."""
    from transformers import AutoConfig

    with pytest.raises(ModelError, match=r"^model.dtype: float16 weights cannot be fine-tuned with AdamW \(model"):
        check_model(ModelConfig(name_or_path=str(tiny_model), dtype="float16"), 256)
    config = AutoConfig.from_pretrained(tiny_model)
    config.dtype = "float16"
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"model.dtype=auto takes the checkpoint's float16"):
        check_model(ModelConfig(name_or_path=str(tmp_path), dtype="auto"), 256)
    from llmtrain.config import LoraConfig

    check_model(ModelConfig(name_or_path=str(tiny_model), dtype="float16", lora=LoraConfig(enabled=True)), 256)


def test_one_layer_name_given_as_a_string_is_told_to_be_a_list(tiny_model):
    """peft reads a string as a pattern for whole module names, which 'q_proj' never is."""
    from llmtrain.config import LoraConfig

    cfg = ModelConfig(name_or_path=str(tiny_model), lora=LoraConfig(enabled=True, target_modules="q_proj"))
    with pytest.raises(ModelError) as e:
        check_model(cfg, 256)
    assert str(e.value).endswith("give a list: model.lora.target_modules=[q_proj]")


def test_lora_targets_that_match_nothing_are_refused_naming_the_layers(tiny_model):
    from llmtrain.config import LoraConfig

    cfg = ModelConfig(name_or_path=str(tiny_model), lora=LoraConfig(enabled=True, target_modules=["qproj"]))
    with pytest.raises(ModelError) as e:
        check_model(cfg, 256)  # at start-up, on the meta device: before any data or weights load
    assert str(e.value).startswith("model.lora.target_modules: ['qproj'] cannot be adapted (")
    assert "linear layers are named down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in str(
        e.value
    )


def test_generated_samples_longer_than_the_model_positions_are_refused(tiny_model):
    with pytest.raises(ModelError, match=r"^eval.sample_max_new_tokens: 600 is above the 512 positions of '"):
        check_model(ModelConfig(name_or_path=str(tiny_model)), 256, sample_tokens=600)
    check_model(ModelConfig(name_or_path=str(tiny_model)), 256, sample_tokens=200)


def test_a_config_json_that_builds_no_model_is_an_error_naming_the_model(tiny_model, tmp_path):
    import json
    import shutil

    from llmtrain.model import meta_model

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"hidden_size": -128}))
    cfg = ModelConfig(name_or_path=str(bad))
    with pytest.raises(ModelError, match=rf"^model.name_or_path: cannot build a model from the config of '{bad}' \("):
        meta_model(cfg, check_model(cfg, 256))


def test_added_tokens_past_the_embeddings_are_allowed_where_text_cannot_reach_them(tokenizer):
    """Gemma 3 ships its image token at id 262144 of a 262144-row text embedding: a model
    is refused only for ids that text and the chat template produce (the base vocabulary,
    bos, eos, pad, unk)."""
    import copy

    from llmtrain.model import ids_past

    tok = copy.deepcopy(tokenizer)
    base = tok.vocab_size
    tok.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    assert len(tok) == base + 1
    assert ids_past(tok, base) is None
    assert ids_past(tok, base - 1) == f"a vocabulary of {base} tokens"
    tok.add_special_tokens({"pad_token": "<image_soft_token>"})
    assert ids_past(tok, base) == f"pad_token at id {base}"


def test_a_causal_lm_that_attends_both_ways_is_refused_and_a_reward_model_is_not(
    base_config, tokenizer, chat_file, cache_env, tmp_path
):
    """Gemma's use_bidirectional_attention lets every position see later tokens: next-token
    training would show each one the token it predicts. The recipe refuses it in one line
    before training; a score head (reward models read whole sequences) may attend both ways."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmtrain.model import attention_backend
    from tests.support.architectures import config

    mcfg = config("gemma3", tokenizer)
    mcfg.use_bidirectional_attention = True
    model_dir = tmp_path / "both-ways"
    AutoModelForCausalLM.from_config(mcfg).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "run"
    proc = run_recipe(recipe_args(base_config, model_dir, chat_file, out, "data.packing=false"), cache_env, check=False)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.name_or_path: Gemma3ForCausalLM attends both ways" in errors[0], proc.stderr
    assert not out.exists()
    score = ModelConfig(name_or_path=str(model_dir), head="score")
    assert attention_backend(score, mcfg, False, torch.device("cpu")).name == "sdpa"


def test_a_sequence_classifier_is_refused_as_a_causal_lm_and_taken_as_a_reward_model(tiny_model, tmp_path):
    """A reward model's final/ loaded as a causal LM would get a random language-model head;
    the recipes that train one refuse it from its config, before any weight loads."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    scorer = tmp_path / "scorer"
    mcfg = AutoConfig.from_pretrained(tiny_model, num_labels=1)
    AutoModelForSequenceClassification.from_config(mcfg).save_pretrained(scorer)
    with pytest.raises(ModelError, match=rf"^model.name_or_path: {scorer} is a sequence classifier \(LlamaFor"):
        check_model(ModelConfig(name_or_path=str(scorer)), 256)
    check_model(ModelConfig(name_or_path=str(scorer), head="score"), 256)
    check_model(ModelConfig(name_or_path=str(tiny_model), head="score"), 256)


def tiny_moe(kind: str, **extra):
    """(config, model) of a 2-layer mixture-of-experts model of `kind`, 4 experts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    small |= dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64)
    config = AutoConfig.for_model(kind, **small | extra)
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind", ["phimoe", "llama4_text"])
def test_all_linear_leaves_a_linear_router_alone(kind):
    """PhiMoE's and Llama 4's routers are nn.Linear subclasses that return a tuple:
    all-linear (the default) must not adapt them (peft's LoRA layer would add its update to
    the tuple; and the docs promise never the router). The adapted model runs."""
    import torch

    from llmtrain.model import add_lora, lora_targets, router_names

    _, model = tiny_moe(kind, **(dict(intermediate_size_mlp=64, head_dim=8) if kind == "llama4_text" else {}))
    cfg = ModelConfig(name_or_path="m")
    cfg.lora.enabled = True
    routers = router_names(model)
    assert routers and not routers & set(lora_targets(model, cfg.lora)[0])
    adapted = add_lora(model, cfg)
    assert not any("router" in n and "lora_" in n for n, _ in adapted.named_parameters())
    adapted(input_ids=torch.arange(8)[None] % 64).logits.sum().backward()


def test_all_linear_adapts_the_experts_without_dropout_and_never_under_zero3():
    """Under DeepSpeed ZeRO-3 peft's adapters on fused expert weights trained otherwise than
    on one process (a tiny Mixtral's step-2 loss differed) and were missing from the saved
    adapter: the experts are left out there, and named."""
    from llmtrain.model import lora_targets

    _, model = tiny_moe("mixtral")
    cfg = ModelConfig(name_or_path="m")
    cfg.lora.dropout = 0.0
    experts = ["experts.down_proj", "experts.gate_up_proj"]
    assert lora_targets(model, cfg.lora)[1:] == (experts, [])
    assert lora_targets(model, cfg.lora, zero3=True)[1:] == ([], experts)
    cfg.lora.dropout = 0.05
    assert lora_targets(model, cfg.lora)[1:] == ([], experts)


def test_sizing_a_model_draws_nothing_from_the_runs_generator():
    """The meta-device model (the checks, the free-space estimate, llmtrain plan) gets its
    adapters without touching torch's generator, from which the trained model's adapters
    then draw their initial weights: those depend on train.seed alone."""
    import torch

    from llmtrain.model import meta_model

    config, _ = tiny_moe("mixtral")
    cfg = ModelConfig(name_or_path="m")
    cfg.lora.enabled = True
    torch.manual_seed(7)
    before = torch.get_rng_state()
    model = meta_model(cfg, config)
    assert any("lora_A" in name for name, _ in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), before)


def test_a_convolutions_3d_weight_is_not_taken_for_experts():
    """Qwen3-Next's linear-attention layers hold a depthwise nn.Conv1d, whose weight is 3-D
    like a bank of experts; all-linear adapts the experts and leaves the convolution alone."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.model import lora_targets

    small = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=16)
    small |= dict(num_key_value_heads=2, vocab_size=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    small |= dict(shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2)
    small |= dict(linear_key_head_dim=16, linear_value_head_dim=16)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_next", **small))
    assert any(isinstance(m, torch.nn.Conv1d) for m in model.modules())
    cfg = ModelConfig(name_or_path="m")
    assert lora_targets(model, cfg.lora)[1] == ["experts.down_proj", "experts.gate_up_proj"]


# --- the model's own random draws in training -------------------------------------------

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)


@pytest.mark.parametrize(
    "cls, settings",
    [
        ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, router_jitter_noise=0.5)),
        ("PhimoeConfig", dict(num_key_value_heads=2, num_local_experts=4, input_jitter_noise=0.5)),
        ("LlamaConfig", dict(attention_dropout=0.5)),
    ],
)
def test_model_dropout_none_turns_off_every_random_draw_the_config_sets(cls, settings):
    """random_draws names the config's dropout and router jitter; disable_dropout (what
    model.dropout=none and the preference recipes call) turns each off, so two forwards
    in training mode agree."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from llmtrain.model import disable_dropout, random_draws

    config = getattr(transformers, cls)(**SMALL, **settings)
    key, value = list(settings.items())[-1]  # the draw
    assert random_draws(config) == [f"config.{key}={value}"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, 64, (2, 12))
    if cls == "PhimoeConfig":  # its routers sample their experts whatever is set: only the jitter is turned off
        block = next(m for m in model.modules() if type(m).__name__ == "PhimoeSparseMoeBlock")
        disable_dropout(model)
        assert block.input_jitter_noise == 0.0 and block.router.input_jitter_noise == 0.0
        return
    assert not torch.equal(model(ids).logits, model(ids).logits)
    disable_dropout(model)
    assert torch.equal(model(ids).logits, model(ids).logits)


def test_what_makes_the_update_depend_on_the_batch_whatever_is_set():
    from transformers import LlamaConfig, PhimoeConfig

    from llmtrain.model import batch_dependent, random_draws

    assert batch_dependent(PhimoeConfig()) == ["PhiMoE's routers sample their experts in training (sparsemixer)"]
    assert random_draws(PhimoeConfig()) == []  # its router_jitter_noise is a routing threshold, not noise
    capacity = LlamaConfig(capacity_factor=1.25)  # a remote-code MoE's setting
    assert batch_dependent(capacity) == [
        "config.capacity_factor=1.25: experts drop the tokens routed to them past their capacity"
    ]
    assert batch_dependent(LlamaConfig()) == [] and random_draws(LlamaConfig()) == []

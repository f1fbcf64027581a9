import pytest

from llmtrain.config import ModelConfig
from llmtrain.model import ModelError, check_model

from .conftest import run_recipe


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
        [
            "--config",
            str(base_config),
            f"model.name_or_path={tiny_model}",
            f"data.train={chat_file}",
            f"output_dir={out}",
            "data.max_seq_len=4096",
        ],
        cache_env,
        check=False,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data.max_seq_len: 4096 is above the 512 positions" in errors[0]
    assert not out.exists()


# --- the chunked cross-entropy ---------------------------------------------------------


def _batch(tokenizer, packed: bool):
    """Three chat rows with different trained spans, packed into one sequence or padded."""
    from llmtrain.batches import Collator
    from llmtrain.config import DataConfig
    from llmtrain.data import process_row
    from llmtrain.demo import make_rows

    rows = [process_row(r, "chat", tokenizer, None, DataConfig()) for r in make_rows(3, seed=11)]
    collate = Collator(tokenizer.pad_token_id)
    if not packed:
        return collate(rows)
    pack = {"input_ids": [], "labels": [], "position_ids": [], "doc_ids": []}
    for d, r in enumerate(rows):
        pack["input_ids"] += r["input_ids"]
        pack["labels"] += r["labels"]
        pack["position_ids"] += range(len(r["input_ids"]))
        pack["doc_ids"] += [d] * len(r["input_ids"])
    return collate([pack])


def _loss_and_grads(model, batch, chunk):
    from llmtrain.model import token_loss

    model.zero_grad(set_to_none=True)
    loss, n = token_loss(model, batch, "sdpa", chunk)
    loss.backward()
    return loss.detach(), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_loss_equals_whole_logits_loss_and_gradients(tiny_model, tokenizer, packed):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    batch = _batch(tokenizer, packed)
    whole, n, g_whole = _loss_and_grads(model, batch, 0)
    assert 10 < n < batch["labels"].numel()  # some positions are not trained
    for chunk in (5, 10**6):  # many chunks (recomputed in backward), and one
        loss, n_chunked, grads = _loss_and_grads(model, batch, chunk)
        assert n_chunked == n
        torch.testing.assert_close(loss, whole, rtol=1e-6, atol=1e-5)
        for name, g in g_whole.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_chunked_loss_makes_logits_only_for_trained_positions_a_chunk_at_a_time(tiny_model, tokenizer, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    import llmtrain.model as lm

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    batch = _batch(tokenizer, packed=False)
    trained = int((batch["labels"] != -100).sum())
    rows = []
    real = lm._chunk_loss
    monkeypatch.setattr(lm, "_chunk_loss", lambda h, *a: rows.append(h.shape[0]) or real(h, *a))
    loss, _ = lm.token_loss(model, batch, "sdpa", 8)
    forward_rows = list(rows)
    assert max(forward_rows) <= 8 and sum(forward_rows) == trained
    loss.backward()
    assert rows[len(forward_rows) :] == forward_rows[::-1]  # each chunk recomputed once, in backward
    # The output layer is itself again afterwards: generation and export see logits.
    with torch.no_grad():
        assert model(input_ids=batch["input_ids"][:1, :5]).logits.shape[-1] == model.config.vocab_size


def test_chunked_loss_keeps_the_output_layer_in_the_graph_for_an_empty_batch(tiny_model, tokenizer, monkeypatch):
    """A process with no data left runs a batch with nothing to train; DDP still needs a
    gradient (zero) for every weight, the output layer's included."""
    import torch
    from transformers import AutoModelForCausalLM

    import llmtrain.model as lm
    from llmtrain.batches import Collator

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    rows = []
    real = lm._chunk_loss
    monkeypatch.setattr(lm, "_chunk_loss", lambda h, *a: rows.append(h.shape[0]) or real(h, *a))
    loss, n, grads = _loss_and_grads(model, Collator(tokenizer.pad_token_id).empty_batch(packed=False), 4)
    assert n == 0 and loss == 0 and rows == [0]  # the head ran, on no rows
    assert set(grads) == {name for name, _ in model.named_parameters()}
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


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


def test_auto_attention_is_flex_for_packed_data_on_a_gpu_and_sdpa_otherwise():
    import torch

    from llmtrain.model import attention_backend

    auto = ModelConfig(attn_implementation="auto")
    assert attention_backend(auto, True, torch.device("cuda")) == "flex_attention"
    assert attention_backend(auto, False, torch.device("cuda")) == "sdpa"
    assert attention_backend(auto, True, torch.device("cpu")) == "sdpa"
    assert attention_backend(ModelConfig(attn_implementation="eager"), True, torch.device("cuda")) == "eager"
    with pytest.raises(ModelError, match="model.attn_implementation: flex_attention cannot train on CPU"):
        attention_backend(ModelConfig(attn_implementation="flex_attention"), True, torch.device("cpu"))


def test_compile_blocks_compiles_each_transformer_block_in_place(tiny_model):
    from transformers import AutoModelForCausalLM

    from llmtrain.model import compile_blocks

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    names = [n for n, _ in model.named_parameters()]
    assert compile_blocks(model) == model.config.num_hidden_layers
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints keep their keys

"""QLoRA on CPU: the frozen base loaded in 4-bit NF4 by bitsandbytes, LoRA adapters trained
on it with gradient checkpointing, under DDP (two processes): the loss falls, a checkpoint
resumes to the same losses and adapter, final/ holds the adapter (loadable with peft on the
base model) and, with export.merge_lora, the merged model in the base's own dtype."""

import pytest
import torch
from safetensors.torch import load_file

from tests.support.runs import check_card, launch, recipe_args, rewind, run_recipe, train_rows

pytestmark = pytest.mark.slow
pytest.importorskip("bitsandbytes")


def test_qlora_trains_resumes_exactly_and_exports(base_config, tiny_model, chat_file, cache_env, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "qlora"
    args = recipe_args(
        base_config,
        tiny_model,
        chat_file,
        out,
        "model.quantization=nf4",
        "model.lora.enabled=true",
        "model.lora.r=8",
        "model.lora.dropout=0",
        "model.gradient_checkpointing=true",
        "export.merge_lora=true",
        "train.lr=1e-2",
        "train.micro_batch_size=2",
        "train.epochs=3",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=3",
    )
    run_recipe(args, cache_env, nproc=2)
    rows = train_rows(out)
    assert len(rows) == 15 and rows[-1]["loss"] < rows[0]["loss"] - 0.2
    adapter = load_file(out / "final" / "adapter" / "adapter_model.safetensors")

    rewind(out, 8)  # as if killed after step 8
    proc = run_recipe(args, cache_env, nproc=2)
    assert "resumed from" in proc.stdout and "at step 8" in proc.stdout
    assert [r["loss"] for r in train_rows(out)] == [r["loss"] for r in rows]  # exactly
    for key, value in load_file(out / "final" / "adapter" / "adapter_model.safetensors").items():
        torch.testing.assert_close(value, adapter[key], rtol=0, atol=0, msg=key)

    check_card(out / "final", ["sft", "qlora"], "AutoModelForCausalLM")  # merged
    merged = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert merged.dtype == base.dtype == torch.float32  # the base's own dtype, not 4-bit
    with_adapter = PeftModel.from_pretrained(base, out / "final" / "adapter").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, with_adapter(ids).logits, atol=1e-4, rtol=1e-4)
        plain = AutoModelForCausalLM.from_pretrained(tiny_model)(ids).logits
        assert not torch.allclose(merged(ids).logits, plain, atol=1e-3)

    # Another quantization reads the 4-bit codes in another format (nf4 and fp4 have the same
    # shapes): refused, naming the key, before anything is written.
    rewind(out, 8)
    for other in ("fp4", "none"):
        proc = run_recipe([*args, f"model.quantization={other}"], cache_env, nproc=2, check=False)
        assert proc.returncode != 0, proc.stderr[-2000:]  # the launcher exits 1 after the error line
        assert f"was trained on base weights loaded with model.quantization=nf4, now {other}" in proc.stderr


def test_qlora_trains_alike_on_one_process_under_ddp_and_under_fsdp2(
    base_config, tiny_model, chat_file, cache_env, tmp_path
):
    """The same global batch of 8 as 8 x 1, and as 2 processes x 2 x 2 under DDP and under
    FSDP2 (the 4-bit base frozen beside the sharded adapters): the same losses."""
    common = [
        "--config",
        str(base_config),
        f"model.name_or_path={tiny_model}",
        f"data.train={chat_file}",
        "model.quantization=nf4",
        "model.lora.enabled=true",
        "model.lora.dropout=0",
        "train.lr=1e-2",
        "train.max_steps=3",
    ]
    split = ["train.micro_batch_size=2", "train.grad_accum_steps=2"]
    run_recipe([*common, f"output_dir={tmp_path / 'one'}", "train.micro_batch_size=8"], cache_env)
    run_recipe([*common, f"output_dir={tmp_path / 'ddp'}", *split], cache_env, nproc=2)
    launch([*common, f"output_dir={tmp_path / 'fsdp2'}", *split], cache_env, "fsdp2")
    ref = train_rows(tmp_path / "one")
    for name in ("ddp", "fsdp2"):
        rows = train_rows(tmp_path / name)
        assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=1e-5), name
        assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4), name


def odd_model(tmp_path, tokenizer):
    """A tiny Llama with an intermediate width of 340: not a multiple of the 32-row tiles
    or 64-value blocks of bitsandbytes' CPU inference kernels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path / "odd"
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=340,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model)
    tokenizer.save_pretrained(model)
    return model


def test_odd_widths_train_and_evaluate_in_4bit_without_a_line_from_bitsandbytes(
    base_config, tmp_path, cache_env, tokenizer
):
    """Every linear layer of odd width is quantized, and the run trains and evaluates
    (bitsandbytes' CPU inference path failed mid-run on such widths); its import line about
    CPU kernels is dropped."""
    import json

    from llmtrain.demo import make_rows, write_jsonl

    data = tmp_path / "rows.jsonl"
    write_jsonl(make_rows(12, seed=4), data)
    out = tmp_path / "out"
    proc = run_recipe(
        recipe_args(
            base_config,
            odd_model(tmp_path, tokenizer),
            data,
            out,
            "model.quantization=nf4",
            "model.lora.enabled=true",
            f"data.eval={data}",
            "eval.every_steps=2",
            "train.max_steps=2",
            "train.micro_batch_size=4",
        ),
        cache_env,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 2]
    assert "Failed to load CPU gemm_4bit_forward" not in proc.stderr  # bitsandbytes' import line is dropped


def test_evaluation_leaves_4bit_training_exact_on_cpus_with_avx512_bf16(tmp_path, tokenizer, monkeypatch):
    """On a CPU bitsandbytes takes for AVX512-BF16 (forced here), an evaluation between
    training steps must not change the next step's LoRA gradients (its inference path
    repacked the weights for a kernel without a backward: gradients came out wrong with no
    error), and evaluation must run on every width."""
    import bitsandbytes as bnb
    from bitsandbytes.nn import modules

    from llmtrain.config import LoraConfig, ModelConfig
    from llmtrain.model import load_model

    monkeypatch.setattr(modules, "has_avx512bf16", lambda: True)
    cfg = ModelConfig(
        name_or_path=str(odd_model(tmp_path, tokenizer)),
        attn_implementation="sdpa",
        quantization="nf4",
        lora=LoraConfig(enabled=True, dropout=0.0),
    )
    ids = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))

    def grads(model):
        model.train()
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    torch.manual_seed(1)
    model = load_model(cfg)
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 14  # 7 per layer: q, k, v, o, gate, up, down (the output layer stays)
    for param in model.parameters():  # LoRA B starts at zero: give every adapter a gradient path
        if param.requires_grad:
            torch.nn.init.normal_(param, std=0.02, generator=torch.Generator().manual_seed(2))
    before = grads(model)
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    after = grads(model)
    assert before.keys() == after.keys() and before
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)

"""Model and tokenizer loading, LoRA, and the summed token loss of one batch."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .data import IGNORE
from .packing import document_mask

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


class ModelError(ValueError):
    pass


def _hub_kwargs(cfg: ModelConfig) -> dict:
    kw = {"trust_remote_code": cfg.trust_remote_code}
    if cfg.revision:
        kw["revision"] = cfg.revision
    return kw


def check_model(cfg: ModelConfig, max_seq_len: int) -> None:
    """Read the model's config (no weights) before any data or weights load: a bad
    model.name_or_path, or sequences longer than the model's positions without rope
    scaling (they would train on positions the model never learned), stop the run here."""
    from transformers import AutoConfig

    name = cfg.name_or_path
    if (name.startswith((".", "/", "~")) or name.count("/") > 1) and not Path(name).expanduser().is_dir():
        raise ModelError(
            f"model.name_or_path: no such directory: {name}; give a local model directory "
            "(with config.json) or a hub name like 'owner/model'"
        )
    try:
        mcfg = AutoConfig.from_pretrained(name, **_hub_kwargs(cfg))
    except Exception as e:
        raise ModelError(
            f"model.name_or_path: could not load a model config from '{name}' "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    limit = getattr(mcfg, "max_position_embeddings", None)
    if not isinstance(limit, int) or max_seq_len <= limit or _rope_scaled(mcfg):
        return
    raise ModelError(
        f"data.max_seq_len: {max_seq_len} is above the {limit} positions of '{cfg.name_or_path}' "
        f"(max_position_embeddings, no rope scaling); set data.max_seq_len={limit} or less, or use "
        "a model configured for longer context"
    )


def _rope_scaled(mcfg) -> bool:
    for name in ("rope_scaling", "rope_parameters"):
        rope = getattr(mcfg, name, None)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in (None, "default"):
            return True
    return False


def attention_backend(cfg: ModelConfig, packing: bool, device: torch.device) -> str:
    """model.attn_implementation with 'auto' resolved: FlexAttention for packed batches
    on a GPU (a block-sparse document mask), SDPA otherwise."""
    name = cfg.attn_implementation
    if name == "auto":
        name = "flex_attention" if packing and device.type == "cuda" else "sdpa"
    if name == "flex_attention" and device.type == "cpu":
        raise ModelError(
            "model.attn_implementation: flex_attention cannot train on CPU (PyTorch has no "
            "FlexAttention backward there); use auto or sdpa, whose dense document mask isolates "
            "packed samples as well"
        )
    return name


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(cfg.name_or_path, **_hub_kwargs(cfg))
    except Exception as e:
        raise ModelError(
            f"model.name_or_path: could not load a tokenizer from '{cfg.name_or_path}' "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if not tok.is_fast:
        raise ModelError(
            f"model.name_or_path: '{cfg.name_or_path}' has no fast tokenizer; llmtrain needs one "
            "(character offsets locate assistant turns)"
        )
    return tok


def pad_id(tokenizer) -> int:
    """Padding never reaches the loss, so a tokenizer without a pad token pads with EOS."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if tid is not None:
            return tid


def load_model(cfg: ModelConfig):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.name_or_path, dtype=DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation, **_hub_kwargs(cfg)
        )
    except Exception as e:
        raise ModelError(
            f"model.name_or_path: could not load a causal LM from '{cfg.name_or_path}' "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules,
            task_type="CAUSAL_LM",
        )
        if cfg.gradient_checkpointing:
            model.enable_input_require_grads()
        model = get_peft_model(model, lora)
    return model


def compile_blocks(model) -> int:
    """torch.compile every transformer block in place (regional compilation). The blocks
    share one compiled graph, so it compiles once whatever the depth; parameter names,
    checkpoints and wrappers (DDP, FSDP) are unaffected. Returns the number of blocks."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not blocks:
        raise ModelError(
            f"train.compile: found no transformer blocks in {type(model).__name__} to compile; set train.compile=false"
        )
    for block in blocks:
        block.compile()
    return len(blocks)


# Architectures whose forward returns lm_head's output untouched (no soft-capping or
# scaling after it), checked against their transformers source: the chunked loss stands in
# for their lm_head. Others get whole logits.
PLAIN_HEADS = {
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "phi",
    "phi3",
    "gemma",
    "olmo",
    "olmo2",
    "smollm3",
    "starcoder2",
    "gpt_neox",
}


def chunkable_head(model) -> torch.nn.Linear | None:
    """The model's output layer if the chunked loss can stand in for it: a plain Linear
    (not a LoRA-adapted one) of an architecture in PLAIN_HEADS. Found once, before
    accelerator.prepare, and passed to token_loss."""
    from accelerate.utils import extract_model_from_parallel

    base = extract_model_from_parallel(model)
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or getattr(base.config, "model_type", None) not in PLAIN_HEADS:
        return None
    return head


def _chunk_loss(hidden, weight, bias, labels):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, reduction="sum")


def _chunked_head(head: torch.nn.Linear, labels: torch.Tensor, chunk: int):
    """A forward for `head` that returns the summed cross-entropy of the trained positions
    instead of logits. Logits exist for at most `chunk` tokens at a time; when there is
    more than one chunk each is recomputed in backward rather than kept."""

    def forward(hidden):
        flat = labels.flatten()
        where = (flat != IGNORE).nonzero().squeeze(1)
        h, y = hidden.flatten(0, -2).index_select(0, where), flat.index_select(0, where)
        n = h.shape[0]
        total = h.new_zeros((), dtype=torch.float32)
        for s in range(0, max(n, 1), chunk):  # one (empty) chunk keeps the head in the graph
            args = (h[s : s + chunk], head.weight, head.bias, y[s : s + chunk])
            total = total + (checkpoint(_chunk_loss, *args, use_reentrant=False) if n > chunk else _chunk_loss(*args))
        return total

    return forward


def token_loss(
    model, batch: dict, attn_implementation: str, chunk: int = 0, head: torch.nn.Linear | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies over the batch and the number of trained tokens.

    Labels are already shifted (labels[t] is the target of position t). Packed batches get
    a document mask (see packing.document_mask). With `chunk` > 0 and the model's
    chunkable_head as `head` (looked up here if not given), the loss is computed inside
    the output layer's forward, `chunk` tokens at a time and only at trained positions, so
    the full [tokens, vocab] fp32 logits never exist; it runs inside the model's forward so
    DDP, FSDP and ZeRO-3 see the layer used as usual."""
    kwargs = {"input_ids": batch["input_ids"], "use_cache": False}
    if "doc_ids" in batch:
        kwargs["position_ids"] = batch["position_ids"]
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        kwargs["attention_mask"] = document_mask(batch["doc_ids"], attn_implementation, dtype)
    else:
        kwargs["attention_mask"] = batch["attention_mask"]
    labels = batch["labels"]
    n = (labels != IGNORE).sum()
    if chunk > 0 and head is None:
        head = chunkable_head(model)
    if chunk <= 0 or head is None:
        logits = model(**kwargs).logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"), n
    head.forward = _chunked_head(head, labels, chunk)
    try:
        return model(**kwargs).logits, n
    finally:
        del head.forward  # the class's forward again (generation, export)

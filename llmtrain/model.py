"""Model and tokenizer loading, LoRA, and the summed token loss of one batch."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

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
        raise ModelError(f"model.name_or_path: no such directory: {name}; give a local model directory "
                         "(with config.json) or a hub name like 'owner/model'")
    try:
        mcfg = AutoConfig.from_pretrained(name, **_hub_kwargs(cfg))
    except Exception as e:
        raise ModelError(f"model.name_or_path: could not load a model config from '{name}' "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    limit = getattr(mcfg, "max_position_embeddings", None)
    if not isinstance(limit, int) or max_seq_len <= limit or _rope_scaled(mcfg):
        return
    raise ModelError(f"data.max_seq_len: {max_seq_len} is above the {limit} positions of '{cfg.name_or_path}' "
                     f"(max_position_embeddings, no rope scaling); set data.max_seq_len={limit} or less, or use "
                     "a model configured for longer context")


def _rope_scaled(mcfg) -> bool:
    for name in ("rope_scaling", "rope_parameters"):
        rope = getattr(mcfg, name, None)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in (None, "default"):
            return True
    return False


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(cfg.name_or_path, **_hub_kwargs(cfg))
    except Exception as e:
        raise ModelError(f"model.name_or_path: could not load a tokenizer from '{cfg.name_or_path}' "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not tok.is_fast:
        raise ModelError(f"model.name_or_path: '{cfg.name_or_path}' has no fast tokenizer; llmtrain needs one "
                         "(character offsets locate assistant turns)")
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
            cfg.name_or_path, dtype=DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation,
            **_hub_kwargs(cfg))
    except Exception as e:
        raise ModelError(f"model.name_or_path: could not load a causal LM from '{cfg.name_or_path}' "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                          target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM")
        if cfg.gradient_checkpointing:
            model.enable_input_require_grads()
        model = get_peft_model(model, lora)
    return model


def token_loss(model, batch: dict, attn_implementation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies over the batch and the number of trained tokens.

    Labels are already shifted (labels[t] is the target of position t). Packed batches get
    a document mask; flash-attention backends isolate samples from position_ids instead."""
    kwargs = {"input_ids": batch["input_ids"], "use_cache": False}
    if "doc_ids" in batch:
        kwargs["position_ids"] = batch["position_ids"]
        if not attn_implementation.startswith("flash"):
            dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
            kwargs["attention_mask"] = document_mask(batch["doc_ids"], attn_implementation, dtype)
    else:
        kwargs["attention_mask"] = batch["attention_mask"]
    logits = model(**kwargs).logits
    labels = batch["labels"]
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss, (labels != IGNORE).sum()

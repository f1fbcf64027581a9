"""Supervised fine-tuning as a method (recipes/finetune.py): token rows, padded or packed, and
the summed cross-entropy of their trained tokens (objective.TokenLoss)."""

from __future__ import annotations

import math

from ..config import Config
from ..data.batches import Collator
from ..data.build import ROWS
from ..model import disable_dropout, pad_id
from ..vision import IMAGE_ROWS, ImageCollator, processor_of
from .method import TRAINED_CLOSE, TRAINED_OPEN, Method, Parts, preview_row
from .objective import TokenLoss
from .source import loader_source


def finetune_parts(cfg, accelerator, model, tokenizer, train_set, eval_set) -> Parts:
    """The summed cross-entropy of the trained tokens, over padded or packed rows."""
    if cfg.model.dropout == "none":
        disable_dropout(model)
    objective = TokenLoss.for_model(model, cfg.train.loss_chunk_logits, cfg.model.router_aux_loss)
    collator = rows_collator(cfg, tokenizer)
    return Parts(objective, loader_source(cfg, accelerator, objective, train_set, eval_set, collator))


def rows_collator(cfg, tokenizer) -> Collator:
    """The collator of SFT rows (build.ROWS) for this model: a vision-language model's carry
    their images (vision.IMAGE_ROWS)."""
    if processor_of(tokenizer) is not None:
        width = IMAGE_ROWS.width * cfg.data.max_seq_len if cfg.data.packing else 0
        return ImageCollator(pad_id(tokenizer), processor_of(tokenizer), cfg.data.max_image_pixels, width)
    return Collator(pad_id(tokenizer), ROWS.width * cfg.data.max_seq_len if cfg.data.packing else 0)


def describe_rows(cfg, first: dict, tokenizer) -> list[str]:
    return [
        f"\n== first training row ({TRAINED_OPEN}trained{TRAINED_CLOSE}, the rest masked) ==",
        preview_row(first, tokenizer),
    ]


FINETUNE = Method(
    name="finetune",
    schema=Config,
    description="Fine-tune a causal language model (full or LoRA) on instruction, chat or text data.",
    data=ROWS,
    parts=finetune_parts,
    describe=describe_rows,
    demo="demo.yaml",
    template="llama_full.yaml",
    tags=lambda cfg: ["sft"],
    keeps_dropout=lambda cfg: cfg.model.dropout == "model",
    derived=lambda figures: {"eval_perplexity": math.exp(figures["eval_loss"])} if "eval_loss" in figures else {},
)

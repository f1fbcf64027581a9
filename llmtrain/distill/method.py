"""Distillation as a method (recipes/distill.py), as the method table (llmtrain/methods.py)
lists it: SFT rows (with their index where the student answers some itself), the teacher,
and the divergence between the two models' distributions."""

from __future__ import annotations

import dataclasses

from ..core.finetune import rows_collator
from ..core.method import TRAINED_CLOSE, TRAINED_OPEN, Method, Parts, PlanFigures, preview_row, scaled_length
from ..core.objective import chunk_positions
from ..core.source import loader_source
from ..data.build import ROWS
from ..distributed.topology import Topology
from ..errors import warn
from ..model import (
    check_reference,
    chunkable_head,
    disable_dropout,
    kv_cache_bytes,
    load_frozen,
    pad_id,
    saved_weights_bytes,
)
from ..processor import processor_of
from ..rl.sampling import HFGenerator
from ..vision import IMAGE_ROWS
from .config import DistillConfig
from .loss import DistillLoss
from .onpolicy import INDEX, DistillCollator, OnPolicyBatches, whole_steps

# SFT rows numbered (the index seeds each on-policy answer): a run with on-policy steps; a
# vision-language model's with their images.
INDEXED_ROWS = dataclasses.replace(ROWS, index=INDEX, images=dataclasses.replace(IMAGE_ROWS, index=INDEX))


def distill_rows(cfg):
    """The rows: SFT's, numbered where the student answers some of them itself."""
    return INDEXED_ROWS if cfg.on_policy() else ROWS


def check_distill(cfg, tokenizer) -> None:
    """distill.teacher reads the student's token ids (model.check_reference), before any data
    or weights load."""
    check_reference(cfg.distill.teacher, "distill.teacher", cfg.model, tokenizer, role="teacher")


def distill_parts(cfg, accelerator, model, tokenizer, train_set, eval_set) -> Parts:
    """The divergence to the teacher over padded or packed rows; with on-policy steps, their
    rows' answers sampled by the student as the loop draws them (onpolicy.OnPolicyBatches),
    under ZeRO-3 and FSDP2 by every process together."""
    if cfg.model.dropout == "none":
        disable_dropout(model)
    d = cfg.distill
    # Frozen, in the student's dtype and attention, never LoRA-adapted; whole on each process
    # until distill.shard_teacher shards it beside the prepared student.
    teacher = load_frozen(cfg.model, d.teacher, accelerator.device)
    sharded = Topology.of(accelerator).sharded and accelerator.num_processes > 1  # forwards are collectives
    shard = d.shard_teacher and sharded
    # Both output layers in chunks, where both can be (a sharded teacher's weights exist only
    # inside its own forward: whole logits then).
    logits = cfg.train.loss_chunk_logits
    head = chunkable_head(model) if logits and not shard else None
    objective = DistillLoss(
        teacher,
        d.loss,
        d.beta,
        d.temperature,
        d.top_k,
        d.estimator,
        d.forward_top_k,
        on_policy=cfg.on_policy(),
        head=head,
        chunk_tokens=chunk_positions(head, logits),
        teacher_head=chunkable_head(teacher) if head is not None else None,
    )
    # Offline: SFT rows as recipes/finetune.py collates them (a vision-language model's with images).
    if cfg.on_policy():
        collator = DistillCollator(pad_id(tokenizer), processor_of(tokenizer), cfg.data.max_image_pixels)
    else:
        collator = rows_collator(cfg, tokenizer)
    rows = loader_source(cfg, accelerator, objective, train_set, eval_set, collator)

    def source(prepared, backend, beat):
        if shard:
            objective.teacher = backend.shard_frozen(objective.teacher)
            how = "ZeRO-3" if backend.topology.zero3 else "FSDP2"
            accelerator.print(f"distill.teacher: sharded across {accelerator.num_processes} processes ({how})")
        elif d.shard_teacher:
            warn(
                "distill.shard_teacher: the student is not sharded (ZeRO-3 or FSDP2 on several processes), so the "
                "teacher is held whole on each process"
            )
        if not cfg.on_policy():
            return rows(prepared, backend, beat)
        generator = HFGenerator(
            tokenizer,
            d.max_completion_length,
            d.temperature,
            synced=sharded,
            max_image_pixels=cfg.data.max_image_pixels,
        )
        loaded = rows(prepared, backend, beat)
        t = cfg.train
        return OnPolicyBatches(
            loaded,
            generator,
            accelerator.unwrap_model(prepared),
            collator,
            t.seed,
            d.on_policy_fraction,
            cfg.data.max_seq_len,
            t.grad_accum_steps,
            whole_steps(len(loaded.sampler), t.micro_batch_size, t.grad_accum_steps, accelerator.num_processes),
        )

    return Parts(objective, source)


def describe_distill(cfg, first: dict, tokenizer) -> list[str]:
    d = cfg.distill
    if d.loss == "jsd":
        what = {0.0: "forward KL(teacher || student)", 1.0: "reverse KL(student || teacher)"}.get(
            d.beta, f"generalized JSD, beta {d.beta:g}"
        )
        what += f" over the teacher's top {d.top_k} tokens" if d.top_k else " over the vocabulary"
    else:
        what = f"reverse KL at the student's sampled tokens ({d.estimator})"
        what += f", plus the forward KL over the teacher's top {d.forward_top_k}" if d.forward_top_k else ""
    answers = (
        "the data's answers"
        if not cfg.on_policy()
        else f"{d.on_policy_fraction:.0%} of steps answered by the student (at most {d.max_completion_length} tokens, "
        f"temperature {d.temperature:g}), the rest the data's"
    )
    held = "sharded as the student under ZeRO-3 or FSDP2" if d.shard_teacher else "whole on each process"
    return [
        f"\n== distillation from {d.teacher} (frozen, {held}) ==",
        f"  loss: {what}, at temperature {d.temperature:g}, per trained token",
        f"  answers: {answers}",
        f"\n== first training row ({TRAINED_OPEN}trained{TRAINED_CLOSE}, the rest masked) ==",
        preview_row(first, tokenizer),
    ]


def steps_per_epoch(cfg, rows: int, world: int) -> int | None:
    """With on-policy steps, whole global batches only (onpolicy.OnPolicyBatches); else the
    loader's."""
    t = cfg.train
    return whole_steps(rows, t.micro_batch_size, t.grad_accum_steps, world) if cfg.on_policy() else None


def memory(cfg, mcfg, total: int, width: int, tokens: int) -> dict[str, float]:
    """The teacher's weights, whole on each process (distill.shard_teacher: the plan's
    figures are a whole process's; its share is what ZeRO-3 or FSDP2 give it); both models'
    float32 logits of a micro-batch, at most train.loss_chunk_logits at a time (DistillLoss);
    with on-policy steps, generation's KV cache."""
    out = {f"teacher {cfg.distill.teacher}": saved_weights_bytes(cfg.distill.teacher)}
    logits = tokens * getattr(mcfg, "vocab_size", 0)  # in chunks of at most train.loss_chunk_logits
    out["student and teacher logits (float32)"] = 2.0 * 4 * min(logits, cfg.train.loss_chunk_logits or logits)
    if cfg.on_policy():
        out["generation KV cache"] = kv_cache_bytes(mcfg, width, tokens)
    return out


DISTILL = Method(
    name="distill",
    schema=DistillConfig,
    description="Distil a teacher model into a causal language model: GKD, on-policy or offline (full or LoRA).",
    data=distill_rows,
    parts=distill_parts,
    describe=describe_distill,
    demo="distill_demo.yaml",
    template="distill.yaml",
    check=check_distill,
    tags=lambda cfg: ["distillation"],
    keeps_dropout=lambda cfg: cfg.model.dropout == "model",
    # verify's shorter runs: completions as much shorter, so that they leave a prompt room
    verify=lambda cfg, n: [f"distill.max_completion_length={scaled_length(cfg.distill.max_completion_length, cfg, n)}"],
    plan=PlanFigures(steps_per_epoch=steps_per_epoch, memory=memory),
)

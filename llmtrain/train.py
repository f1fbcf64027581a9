"""Setup and the training loop.

The loss of an optimizer step is the sum of token losses over every micro-batch of the
step on every process, divided by the number of trained tokens in that global batch. To
get that, each step first draws its whole window of micro-batches, sums their trained
tokens across processes, and only then runs forward and backward, scaling each
micro-batch's summed loss by world_size / global_tokens (DDP averages gradients over
processes, so the world_size cancels). A per-micro-batch mean divided by the number of
accumulation steps would weight short rows more and break 8x1 == 2x4 equivalence.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch

from . import checkpoint
from .batches import Collator, make_loader
from .config import Config, ConfigError, flat_dict, to_yaml
from .data import as_list, prepare_split
from .metrics import MetricsLog, tracker_name
from .model import pad_id, token_loss
from .packing import PackedDataset
from .stop import StopRequest
from .throughput import device_peak_flops, document_sizes, matmul_params, peak_memory_gib, step_flops


def setup_accelerator(cfg: Config):
    """The Accelerator; topology and precision come from `accelerate launch` / its config."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

    tracker = tracker_name(cfg.log.tracker)
    accelerator = Accelerator(
        log_with=tracker,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=str(Path(cfg.output_dir) / "logs")),
        # Uneven last batches are not padded by repeating rows (which would count them
        # twice); a process with nothing left runs an empty batch instead (see `windows`).
        dataloader_config=DataLoaderConfiguration(even_batches=False),
        # The schedule is written in optimizer steps, so step it once per step.
        step_scheduler_with_optimizer=False,
    )
    check_topology(accelerator)
    # torchrun/accelerate launch tell every process the world size. If the processes did
    # not form a group (no GPU and no ACCELERATE_USE_CPU=1), each would train alone on the
    # whole data set and overwrite the others' output.
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes != launched:
        raise ConfigError([f"launch: {launched} processes were started but they did not join one process group "
                           "(no GPU found); for DDP on CPU set ACCELERATE_USE_CPU=1 before accelerate launch"])
    set_seed(cfg.train.seed)
    return accelerator


class TrainingError(RuntimeError):
    """Training cannot go on; the message says what happened and what to try."""


def raise_nonfinite(cfg: Config, step: int, in_a_row: int) -> None:
    found = checkpoint.complete_checkpoints(cfg.output_dir)
    newest = f"{found[-1][1]} (untouched)" if found else "none"
    raise TrainingError(
        f"train: the loss or gradient norm was not finite at step {step} ({in_a_row} step(s) in a row, "
        f"train.on_nonfinite={cfg.train.on_nonfinite}, train.max_consecutive_skips={cfg.train.max_consecutive_skips}); "
        f"nothing after the last good step was saved; newest complete checkpoint: {newest}. Try a lower train.lr, "
        "more train.warmup_steps, bf16 instead of fp16, or look for broken rows or weights")


def check_topology(accelerator) -> None:
    """Refuse launches the loop does not drive correctly yet. DeepSpeed scales the loss by
    its own accumulation count and steps inside backward(); FSDP needs sharded checkpoint
    and export paths. Training under them now would give numbers that cannot be trusted."""
    kind = str(accelerator.distributed_type).split(".")[-1]
    if kind in ("DEEPSPEED", "FSDP"):
        raise ConfigError([f"launch: {kind} is not supported by recipes/finetune.py yet; launch with DDP "
                           "(accelerate_configs/multi_gpu.yaml) or a single process, and use model.lora or "
                           "model.gradient_checkpointing to save memory"])


def build_datasets(cfg: Config, accelerator, tokenizer):
    """Tokenize train/eval once (main process first; the others read its cache) and pack
    them if asked. Returns (train_set, eval_set or None)."""
    sets: list = []
    with accelerator.main_process_first():
        for key, names in (("data.train", as_list(cfg.data.train)), ("data.eval", as_list(cfg.data.eval))):
            if not names:
                sets.append(None)
                continue
            ds, stats = prepare_split(key, names, tokenizer, cfg.data)
            accelerator.print(stats.summary(key))
            if cfg.data.packing:
                ds = PackedDataset(ds, cfg.data.max_seq_len)
                accelerator.print(f"{key}: packed {stats.kept} rows into {len(ds)} sequences of "
                                  f"{cfg.data.max_seq_len} tokens ({ds.efficiency():.1%} filled)")
            sets.append(ds)
    return sets[0], sets[1]


def build_optimizer(model, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    t = cfg.train
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, fused=device.type == "cuda" or None)


def lr_factor(step: int, total: int, cfg: Config) -> float:
    """Multiplier of train.lr at optimizer step `step` (0-based): linear warm-up, then decay."""
    t = cfg.train
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - t.warmup_steps) / max(1, total - t.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1 - progress
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape


@dataclass
class Window:
    """One optimizer step's micro-batches on this process, with global counts."""

    batches: list
    trained_tokens: int  # all processes
    input_tokens: int  # non-padding tokens, all processes
    squared_lengths: int  # sum of squared document lengths, all processes (attention FLOPs)
    data_wait: float  # seconds this process waited for the batches


def windows(batches, size: int, accelerator, stop: StopRequest | None = None):
    """Yield a Window per optimizer step until every process has run out. A process may
    get fewer than `size` micro-batches, or none, at the end.

    With `stop`, the same reduce tells every process whether any was signalled; then
    all return before the step, with stop.agreed set."""
    while True:
        start = time.perf_counter()
        window = list(islice(batches, size))
        wait = time.perf_counter() - start
        signalled = stop is not None and stop.signum != 0
        sizes = [document_sizes(b) for b in window]
        local = torch.tensor([len(window), sum(int((b["labels"] != -100).sum()) for b in window), int(signalled),
                              sum(s for s, _ in sizes), sum(q for _, q in sizes)], device=accelerator.device)
        total = accelerator.reduce(local, reduction="sum").tolist()
        if total[2] > 0:
            stop.agreed = int(accelerator.gather(torch.tensor([stop.signum], device=accelerator.device)).max())
            return
        if total[0] == 0:
            return
        yield Window(window, total[1], total[3], total[4], wait)


@torch.no_grad()
def evaluate(model, loader, accelerator, collator: Collator, packed: bool, attn: str) -> float:
    """Mean loss over all trained tokens of the eval set, across processes."""
    model.eval()
    empty = {k: v.to(accelerator.device) for k, v in collator.empty_batch(packed).items()}
    sums = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for window in windows(iter(loader), 1, accelerator):
        loss, n = token_loss(model, window.batches[0] if window.batches else empty, attn)
        sums += torch.stack([loss.double(), n.double()])
    model.train()
    sums = accelerator.reduce(sums, reduction="sum")
    return float(sums[0] / sums[1])


def train(cfg: Config, accelerator, model, tokenizer, train_set, eval_set, resume_from: Path | None,
          stop: StopRequest):
    """Run the optimizer steps; returns the (prepared) model. If a stop is requested
    (stop.agreed after return), a checkpoint of the last finished step has been written."""
    t, attn, packed = cfg.train, cfg.model.attn_implementation, cfg.data.packing
    collator = Collator(pad_id(tokenizer))
    train_loader = make_loader(train_set, t.micro_batch_size, collator, t.seed, True, cfg.data.num_workers)
    sampler = train_loader.sampler  # kept: prepare() wraps it, and we set its epoch
    eval_loader = None
    if eval_set is not None:
        eval_loader = make_loader(eval_set, cfg.eval.micro_batch_size or t.micro_batch_size, collator, t.seed,
                                  False, cfg.data.num_workers)

    world = accelerator.num_processes
    per_process = math.ceil(math.ceil(len(train_set) / t.micro_batch_size) / world)
    steps_per_epoch = math.ceil(per_process / t.grad_accum_steps)
    total_steps = t.max_steps or t.epochs * steps_per_epoch

    model = model.to(accelerator.device)
    n_params, peak = matmul_params(model), device_peak_flops(accelerator.device)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    optimizer = build_optimizer(model, cfg, accelerator.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)

    step, epoch, consumed, skipped = 0, 0, 0, 0
    if resume_from is not None:
        state = checkpoint.load(accelerator, resume_from, cfg)
        step, epoch, consumed = state["step"], state["epoch"], state["batches_in_epoch"]
        accelerator.print(f"resumed from {resume_from} at step {step} (epoch {epoch})")
    log = MetricsLog(accelerator, cfg.output_dir, step if resume_from is not None else None)
    if tracker_name(cfg.log.tracker):
        accelerator.init_trackers(cfg.log.project, config=flat_dict(cfg))
    accelerator.print(f"training {total_steps} steps ({steps_per_epoch} per epoch), global batch "
                      f"{t.micro_batch_size * t.grad_accum_steps * world} sequences on {world} process(es)")

    progress = None
    if cfg.log.progress_bar and accelerator.is_main_process:
        from tqdm.auto import tqdm

        progress = tqdm(total=total_steps, initial=step, desc="train", dynamic_ncols=True)
    empty = {k: v.to(accelerator.device) for k, v in collator.empty_batch(packed).items()}
    config_yaml = to_yaml(cfg)
    if eval_loader is not None and step == 0:  # the baseline the run improves on
        eval_loss = evaluate(model, eval_loader, accelerator, collator, packed, attn)
        log.log({"step": 0, "eval_loss": eval_loss})
        accelerator.print(f"step 0: eval_loss {eval_loss:.4f}")
    model.train()
    tick = time.perf_counter()

    def save_checkpoint() -> Path:
        state = {"step": step, "epoch": epoch, "batches_in_epoch": consumed,
                 "settings": checkpoint.position_settings(cfg, world)}
        return checkpoint.save(accelerator, cfg.output_dir, state, config_yaml, cfg.checkpoint.keep_last)

    while step < total_steps:
        loader = accelerator.skip_first_batches(train_loader, consumed) if consumed else train_loader
        # Accelerate's loader re-applies its own epoch counter to the sampler on every
        # iter(), and a loader made by skip_first_batches starts that counter at 0: set both,
        # or the epoch after a mid-epoch resume would repeat epoch 0's order.
        sampler.set_epoch(epoch)
        loader.set_epoch(epoch)
        for window in windows(iter(loader), t.grad_accum_steps, accelerator, stop):
            consumed += len(window.batches)
            global_tokens = window.trained_tokens
            micro = window.batches or [empty]
            loss_sum = torch.zeros((), device=accelerator.device)
            for i, batch in enumerate(micro):
                # Gradients are all-reduced only on the last micro-batch of the step.
                sync = nullcontext() if i == len(micro) - 1 else accelerator.no_sync(model)
                with sync:
                    loss, _ = token_loss(model, batch, attn)
                    accelerator.backward(loss * (world / global_tokens))
                loss_sum += loss.detach()
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm or float("inf")))
            # Both numbers are the same on every process (the loss is reduced, the gradients
            # were all-reduced), so every process takes the same decision without a collective.
            step_loss = float(accelerator.reduce(loss_sum, reduction="sum")) / global_tokens
            fp16 = accelerator.scaler is not None  # fp16 overflows are the scaler's to skip
            if not math.isfinite(step_loss) or (not fp16 and not math.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                log.log({"step": step + 1, "skipped": f"non-finite loss {step_loss} or grad_norm {grad_norm}"})
                if t.on_nonfinite == "abort" or skipped >= t.max_consecutive_skips:
                    raise_nonfinite(cfg, step + 1, skipped)
                tick = time.perf_counter()
                continue
            skipped = 0
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if accelerator.optimizer_step_was_skipped:  # fp16 overflow: the schedule and step count stay
                log.log({"step": step + 1, "skipped": "fp16 gradient overflow; loss scale lowered"})
                tick = time.perf_counter()
                continue
            scheduler.step()
            step += 1

            seconds = time.perf_counter() - tick
            mfu = None
            if peak is not None:
                flops = step_flops(window.input_tokens, window.squared_lengths, n_params, layers, hidden)
                mfu = flops / (seconds * world * peak)
            if step % cfg.log.every_steps == 0 or step == total_steps:
                row = {"step": step, "epoch": epoch, "loss": step_loss, "lr": lr, "grad_norm": grad_norm,
                       "tokens": global_tokens, "tokens_per_s": global_tokens / seconds,
                       "input_tokens_per_s": window.input_tokens / seconds,
                       "data_wait": window.data_wait / seconds, "peak_mem_gib": peak_memory_gib(accelerator.device)}
                log.log(row | ({"mfu": mfu} if mfu is not None else {}))
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{global_tokens / seconds:.0f}",
                                     **({"mfu": f"{mfu:.1%}"} if mfu is not None else {}))
            if eval_loader is not None and (step == total_steps or
                                            (cfg.eval.every_steps and step % cfg.eval.every_steps == 0)):
                eval_loss = evaluate(model, eval_loader, accelerator, collator, packed, attn)
                log.log({"step": step, "eval_loss": eval_loss})
                accelerator.print(f"step {step}: eval_loss {eval_loss:.4f}")
            if cfg.checkpoint.every_steps and (step % cfg.checkpoint.every_steps == 0 or step == total_steps):
                save_checkpoint()
            tick = time.perf_counter()
            if step >= total_steps:
                break
        else:  # the epoch ran out before total_steps, or a stop was agreed
            if stop.agreed:
                break
            epoch, consumed = epoch + 1, 0

    if progress is not None:
        progress.close()
    if stop.agreed:
        path = checkpoint.checkpoint_root(cfg.output_dir) / f"step-{step}"
        if not path.exists():
            path = save_checkpoint()
        accelerator.print(f"stopped on {stop.name} after step {step}; checkpoint {path} is complete; run again "
                          "with checkpoint.resume=auto to continue")
    return model

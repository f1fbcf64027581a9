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
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
from accelerate.utils import (
    DistributedType,
    gather_object,
    parse_flag_from_env,
    send_to_device,
)

from . import checkpoint
from .batches import Collator, make_loader
from .config import Config, ConfigError, flat_dict, to_yaml
from .data import DataError, as_list, prepare_split, resolve_chat_template
from .metrics import MetricsLog, tracker_name
from .model import chunkable_head, compile_blocks, pad_id, token_loss
from .packing import PackedDataset
from .spike import SpikeGuard
from .stop import StopRequest
from .stream import StreamedRows
from .throughput import (
    device_peak_flops,
    document_sizes,
    full_numel,
    matmul_params,
    peak_memory_gib,
    step_flops,
)
from .watchdog import Watchdog


def process_group_backend() -> str | None:
    """gloo for DeepSpeed on a CPU-only machine (its CPU accelerator): Accelerate finds no
    device backend there and would leave the processes without a group. None otherwise
    (Accelerate chooses)."""
    if (
        parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
        and not parse_flag_from_env("ACCELERATE_USE_CPU")
        and not torch.cuda.is_available()
    ):
        return "gloo"
    return None


def setup_accelerator(cfg: Config):
    """The Accelerator; topology and precision come from `accelerate launch` / its config."""
    from accelerate import Accelerator
    from accelerate.utils import (
        DataLoaderConfiguration,
        InitProcessGroupKwargs,
        ProjectConfiguration,
        set_seed,
    )

    backend = process_group_backend()
    handlers = [InitProcessGroupKwargs(backend=backend)] if backend else []
    tracker = tracker_name(cfg.log.tracker)
    accelerator = Accelerator(
        log_with=tracker,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=str(Path(cfg.output_dir) / "logs")),
        # Uneven last batches are not padded by repeating rows (which would count them
        # twice); a process with nothing left runs an empty batch instead (see `windows`).
        # Batches from pinned memory (batches.make_loader) are copied to the GPU without blocking.
        dataloader_config=DataLoaderConfiguration(even_batches=False, non_blocking=True),
        kwargs_handlers=handlers,
    )
    check_topology(accelerator)
    # torchrun/accelerate launch tell every process the world size. If the processes did
    # not form a group (no GPU and no ACCELERATE_USE_CPU=1), each would train alone on the
    # whole data set and overwrite the others' output.
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes != launched:
        raise ConfigError(
            [
                f"launch: {launched} processes were started but they did not join one process group "
                "(no GPU found); for DDP on CPU set ACCELERATE_USE_CPU=1 before accelerate launch"
            ]
        )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        configure_deepspeed(accelerator, cfg)
        # DeepSpeed calls torch.distributed functions that torch has renamed; torch warns on
        # every call, burying the training log under advice meant for DeepSpeed's authors.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    set_seed(cfg.train.seed)
    return accelerator


def check_topology(accelerator) -> None:
    """Refuse launches that would silently not be what was asked for."""
    kind = accelerator.distributed_type
    if kind == DistributedType.MULTI_CPU and parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        raise ConfigError(
            [
                "launch: ACCELERATE_USE_CPU=1 (or use_cpu: true) turns DeepSpeed off in Accelerate; "
                "for DeepSpeed on CPU launch without it (DeepSpeed picks its CPU accelerator by itself)"
            ]
        )
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and kind != DistributedType.FSDP:
        raise ConfigError(
            [
                "launch: FSDP was asked for but Accelerate runs FSDP only on GPUs (or other accelerators); "
                "on CPU use DDP (accelerate_configs/cpu_ddp.yaml) "
                "or DeepSpeed (accelerate_configs/ds_zero3.yaml)"
            ]
        )
    if kind == DistributedType.FSDP and accelerator.state.fsdp_plugin.fsdp_version != 2:
        raise ConfigError(
            [
                "launch: FSDP1 is not supported; set fsdp_config.fsdp_version: 2 in the accelerate config "
                "(see accelerate_configs/fsdp2.yaml)"
            ]
        )


def configure_deepspeed(accelerator, cfg: Config) -> None:
    """Make the recipe's batch settings DeepSpeed's: "auto" (or absent) values are filled
    in from train.*; an explicit value that differs is an error naming both settings.
    ZeRO-3 is told to gather full weights on save, which export needs."""
    plugin = accelerator.state.deepspeed_plugin
    ds = plugin.deepspeed_config
    t, world = cfg.train, accelerator.num_processes
    if t.spike_factor:
        raise ConfigError(
            [
                "train.spike_factor: the spike guard cannot run under DeepSpeed (its engine takes the "
                "optimizer step inside backward, before the step's loss is known); "
                "set train.spike_factor=0"
            ]
        )
    if t.compile:
        raise ConfigError(
            [
                "train.compile: not supported with DeepSpeed (its ZeRO hooks run inside every block); "
                "set train.compile=false, or use DDP or FSDP2"
            ]
        )
    where = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "the accelerate config's deepspeed_config"
    wanted = [
        ("train_micro_batch_size_per_gpu", t.micro_batch_size, "train.micro_batch_size"),
        ("gradient_accumulation_steps", t.grad_accum_steps, "train.grad_accum_steps"),
        (
            "train_batch_size",
            t.micro_batch_size * t.grad_accum_steps * world,
            f"train.micro_batch_size x train.grad_accum_steps x {world} processes",
        ),
        ("gradient_clipping", float(t.max_grad_norm or 0.0), "train.max_grad_norm"),
    ]
    problems = []
    for key, ours, name in wanted:
        theirs = ds.get(key, "auto")
        if theirs == "auto":
            ds[key] = ours
        elif float(theirs) != float(ours):
            problems.append(
                f'{name}={ours} conflicts with {key}={theirs} in {where}; set {key} to "auto" '
                f"there (the recipe's value is then used) or make them equal"
            )
    if problems:
        raise ConfigError(problems)
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("stage") == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    # Accelerate compares its own count with DeepSpeed's; it does not scale the loss
    # under DeepSpeed, so matching it only silences a mismatch warning.
    accelerator.gradient_accumulation_steps = t.grad_accum_steps


class TrainingError(RuntimeError):
    """Training cannot go on; the message says what happened and what to try."""


def raise_skips(cfg: Config, step: int, in_a_row: int, reason: str) -> None:
    found = checkpoint.complete_checkpoints(cfg.output_dir)
    newest = f"{found[-1][1]} (untouched)" if found else "none"
    raise TrainingError(
        f"train: {reason} at step {step} ({in_a_row} skipped step(s) in a row, "
        f"train.on_nonfinite={cfg.train.on_nonfinite}, train.max_consecutive_skips={cfg.train.max_consecutive_skips}); "
        f"nothing after the last good step was saved; newest complete checkpoint: {newest}. Try a lower train.lr, "
        "more train.warmup_steps, bf16 instead of fp16, or look for broken rows or weights"
    )


def build_datasets(cfg: Config, accelerator, tokenizer):
    """Tokenize train/eval once (main process first; the others read its cache) and pack
    them if asked; with data.streaming, data.train is a StreamedRows read during training.
    Returns (train_set, eval_set or None)."""
    sets: list = []
    with accelerator.main_process_first():
        for key, names in (("data.train", as_list(cfg.data.train)), ("data.eval", as_list(cfg.data.eval))):
            if not names:
                sets.append(None)
                continue
            if key == "data.train" and cfg.data.streaming:
                sets.append(
                    StreamedRows(
                        key,
                        names,
                        tokenizer,
                        resolve_chat_template(cfg.data),
                        cfg.data,
                        cfg.train.seed,
                        accelerator.process_index,
                        accelerator.num_processes,
                    )
                )
                accelerator.print(
                    f"{key}: streaming {len(names)} source(s); rows are tokenized"
                    f"{' and packed' if cfg.data.packing else ''} as they are read"
                )
                continue
            ds, stats = prepare_split(key, names, tokenizer, cfg.data)
            accelerator.print(stats.summary(key))
            if cfg.data.packing:
                ds = PackedDataset(ds, cfg.data.max_seq_len)
                accelerator.print(
                    f"{key}: packed {stats.kept} rows into {len(ds)} sequences of "
                    f"{cfg.data.max_seq_len} tokens ({ds.efficiency():.1%} filled)"
                )
            sets.append(ds)
    return sets[0], sets[1]


def build_optimizer(model, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    t = cfg.train
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        fused=device.type == "cuda" or None,
    )


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
    micro_steps: int  # the most micro-batches any process has; every process runs this many
    trained_tokens: int  # all processes
    input_tokens: int  # non-padding tokens, all processes
    squared_lengths: int  # sum of squared document lengths, all processes (attention FLOPs)
    data_wait: float  # seconds this process waited for the batches


def fault_message(e: DataError) -> str:
    """The DataError's own line; from a DataLoader worker it arrives wrapped in a traceback."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    last = lines[-1] if lines else type(e).__name__
    return last.split("DataError: ", 1)[1] if "Original Traceback" in str(e) and "DataError: " in last else last


def windows(batches, size: int, accelerator, stop: StopRequest | None = None, beat=None):
    """Yield a Window per optimizer step until every process has run out. A process may
    get fewer than `size` micro-batches, or none, at the end; it then runs empty batches
    up to `micro_steps`, so that sharded models (ZeRO-3, FSDP), whose forward passes are
    collectives, see the same number of passes on every process.

    With `stop`, the same gather tells every process whether any was signalled, or met
    bad data while drawing its batches; then all return before the step, with
    stop.agreed set to the signal or stop.failed set. `beat(where)` marks progress for
    the watchdog before each window."""
    while True:
        if beat is not None:
            beat("fetching batches and agreeing on the next step with the other processes")
        start = time.perf_counter()
        try:
            window = list(islice(batches, size))
        except DataError as e:  # a bad streamed row or an unreadable file
            if stop is None:
                raise
            stop.fault, window = fault_message(e), []
        wait = time.perf_counter() - start
        signum = stop.signum if stop is not None else 0
        sizes = [document_sizes(b) for b in window]
        local = torch.tensor(
            [
                len(window),
                sum(int((b["labels"] != -100).sum()) for b in window),
                signum,
                sum(s for s, _ in sizes),
                sum(q for _, q in sizes),
                int(bool(stop and stop.fault)),
            ],
            device=accelerator.device,
        )
        every = accelerator.gather(local[None]).view(-1, len(local))  # one row per process
        total, most = every.sum(0).tolist(), every.max(0).values.tolist()
        if most[5] > 0:
            stop.failed = True
            return
        if most[2] > 0:
            stop.agreed = int(most[2])
            return
        if total[0] == 0:
            return
        yield Window(window, int(most[0]), total[1], total[3], total[4], wait)


@torch.no_grad()
def evaluate(
    model, loader, accelerator, collator: Collator, packed: bool, attn: str, chunk: int, head=None, beat=None
) -> float:
    """Mean loss over all trained tokens of the eval set, across processes."""
    model.eval()
    empty = {k: v.to(accelerator.device) for k, v in collator.empty_batch(packed).items()}
    sums = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for window in windows(iter(loader), 1, accelerator, beat=beat):
        loss, n = token_loss(model, window.batches[0] if window.batches else empty, attn, chunk, head)
        sums += torch.stack([loss.double(), n.double()])
    model.train()
    sums = accelerator.reduce(sums, reduction="sum")
    return float(sums[0] / sums[1])


def train(
    cfg: Config,
    accelerator,
    model,
    tokenizer,
    train_set,
    eval_set,
    resume_from: Path | None,
    stop: StopRequest,
    watchdog: Watchdog,
):
    """Run the optimizer steps; returns the (prepared) model. If a stop is requested
    (stop.agreed after return), a checkpoint of the last finished step has been written."""
    t, attn, packed = cfg.train, cfg.model.attn_implementation, cfg.data.packing
    streaming = isinstance(train_set, StreamedRows)
    collator = Collator(pad_id(tokenizer), cfg.data.max_seq_len if packed else 0)
    train_loader = make_loader(train_set, t.micro_batch_size, collator, t.seed, cfg.data.shuffle, cfg.data.num_workers)
    sampler = train_loader.sampler  # kept: prepare() wraps it, and we set its epoch
    eval_loader = None
    if eval_set is not None:
        eval_loader = make_loader(
            eval_set, cfg.eval.micro_batch_size or t.micro_batch_size, collator, t.seed, False, cfg.data.num_workers
        )

    world = accelerator.num_processes
    if streaming:
        total_steps = t.max_steps
        per_epoch = "a pass over the stream ends when every process has run out"
    else:
        per_process = math.ceil(math.ceil(len(train_set) / t.micro_batch_size) / world)
        steps_per_epoch = math.ceil(per_process / t.grad_accum_steps)
        total_steps = t.max_steps or t.epochs * steps_per_epoch
        per_epoch = f"{steps_per_epoch} per epoch"

    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    # DeepSpeed divides every backward by its accumulation count; multiplying by it keeps a
    # step's gradient at sum(token losses) / global tokens, a partial last window included.
    ds_accum = t.grad_accum_steps if deepspeed else 1
    if not deepspeed and accelerator.distributed_type != DistributedType.FSDP:
        # DeepSpeed and FSDP place (and with offload, keep off the GPU) the weights themselves.
        model = model.to(accelerator.device)
    if t.compile:
        accelerator.print(f"compiling {compile_blocks(model)} transformer blocks (the first steps include compiling)")
    n_params, peak = matmul_params(model), device_peak_flops(accelerator.device)
    head = chunkable_head(model) if t.loss_chunk_tokens else None
    chunk = t.loss_chunk_tokens if head is not None else 0  # whole logits when the head cannot be chunked
    head_params = full_numel(head.weight) if head is not None else 0  # run at trained positions only
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    optimizer = build_optimizer(model, cfg, accelerator.device)
    # No LR scheduler object: the rate is a function of the step, set before each step (under
    # DeepSpeed the optimizer steps inside backward, and ZeRO regroups the parameters), and
    # the step is in every checkpoint.
    watchdog.beat("setting up the model and optimizer across processes")
    if streaming:  # each process already reads only its part; Accelerate would re-shard it and repeat rows
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)

    step, epoch, consumed, skipped = 0, 0, 0, 0
    spikes = SpikeGuard(t.spike_factor, t.spike_window)
    if resume_from is not None:
        watchdog.beat(f"loading {resume_from}")
        state = checkpoint.load(accelerator, resume_from, cfg)
        step, epoch, consumed = state["step"], state["epoch"], state["batches_in_epoch"]
        spikes = SpikeGuard(t.spike_factor, t.spike_window, state.get("recent_losses"))
        accelerator.print(f"resumed from {resume_from} at step {step} (epoch {epoch})")
    log = MetricsLog(accelerator, cfg.output_dir, step if resume_from is not None else None)
    if tracker_name(cfg.log.tracker):
        accelerator.init_trackers(cfg.log.project, config=flat_dict(cfg))
    accelerator.print(
        f"training {total_steps} steps ({per_epoch}), global batch "
        f"{t.micro_batch_size * t.grad_accum_steps * world} sequences on {world} process(es)"
    )

    progress = None
    if cfg.log.progress_bar and accelerator.is_main_process:
        from tqdm.auto import tqdm

        progress = tqdm(total=total_steps, initial=step, desc="train", dynamic_ncols=True)
    empty = {k: v.to(accelerator.device) for k, v in collator.empty_batch(packed).items()}
    config_yaml = to_yaml(cfg)

    def run_eval() -> None:
        eval_loss = evaluate(model, eval_loader, accelerator, collator, packed, attn, chunk, head, watchdog.beat)
        log.log({"step": step, "eval_loss": eval_loss})
        accelerator.print(f"step {step}: eval_loss {eval_loss:.4f}")

    if eval_loader is not None and step == 0:  # the baseline the run improves on
        run_eval()
    model.train()
    tick = time.perf_counter()

    def save_checkpoint() -> Path:
        watchdog.beat(f"writing the checkpoint of step {step}")
        state = {
            "step": step,
            "epoch": epoch,
            "batches_in_epoch": consumed,
            "recent_losses": spikes.recent,
            "settings": checkpoint.position_settings(cfg, world),
        }
        return checkpoint.save(accelerator, cfg.output_dir, state, config_yaml, cfg.checkpoint.keep_last)

    def last_step_checkpoint() -> Path:
        """The checkpoint of the last finished step, written now unless it already was."""
        path = checkpoint.checkpoint_root(cfg.output_dir) / f"step-{step}"
        return path if path.exists() else save_checkpoint()

    while step < total_steps:
        if streaming:
            # The stream's order depends only on (seed, pass, processes): reading it again up
            # to the saved position gives a resumed run exactly the rows that come next.
            train_set.set_epoch(epoch)
            batches = (
                send_to_device(b, accelerator.device, non_blocking=True) for b in islice(train_loader, consumed, None)
            )
        else:
            loader = accelerator.skip_first_batches(train_loader, consumed) if consumed else train_loader
            # Accelerate's loader re-applies its own epoch counter to the sampler on every
            # iter(), and a loader made by skip_first_batches starts that counter at 0: set both,
            # or the epoch after a mid-epoch resume would repeat epoch 0's order.
            sampler.set_epoch(epoch)
            loader.set_epoch(epoch)
            batches = iter(loader)
        fresh_pass = consumed == 0
        for window in windows(batches, t.grad_accum_steps, accelerator, stop, watchdog.beat):
            fresh_pass = False
            consumed += len(window.batches)
            lr = t.lr * lr_factor(step, total_steps, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            global_tokens = window.trained_tokens
            micro = window.batches + [empty] * (window.micro_steps - len(window.batches))
            loss_sum = torch.zeros((), device=accelerator.device)
            for i, batch in enumerate(micro):
                watchdog.beat(f"step {step + 1}, micro-batch {i + 1} of {len(micro)}")
                last = i == len(micro) - 1
                # Gradients are reduced only on the last micro-batch of the step; DeepSpeed
                # also takes its optimizer step inside that backward.
                accelerator.gradient_state._set_sync_gradients(last)
                with nullcontext() if last else accelerator.no_sync(model):
                    loss, _ = token_loss(model, batch, attn, chunk, head)
                    accelerator.backward(loss * (world * ds_accum / global_tokens))
                loss_sum += loss.detach()
            norm = accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm or float("inf"))
            grad_norm = float(norm) if norm is not None else math.nan
            # Both numbers are the same on every process (the loss is reduced, the gradients
            # were all-reduced), so every process takes the same decision without a collective.
            step_loss = float(accelerator.reduce(loss_sum, reduction="sum")) / global_tokens
            fp16 = accelerator.mixed_precision == "fp16"  # fp16 overflows are the loss scaler's to skip
            # DeepSpeed has already stepped; it skips (and clears) a step whose gradient norm
            # is not finite, which in bf16/fp32 is the same fault.
            engine_skipped = deepspeed and not fp16 and accelerator.optimizer_step_was_skipped
            nonfinite = not math.isfinite(step_loss) or (not fp16 and not math.isfinite(grad_norm)) or engine_skipped
            if nonfinite or spikes.is_spike(step_loss):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                reason = (
                    f"the loss or gradient norm was not finite (loss {step_loss}, grad_norm {grad_norm})"
                    if nonfinite
                    else (
                        f"the loss {step_loss:.4g} spiked above train.spike_factor={t.spike_factor:g} x "
                        f"the median of the last {t.spike_window} steps"
                    )
                )
                log.log({"step": step + 1, "skipped": reason})
                accelerator.print(f"step {step + 1} skipped: {reason}")
                if (nonfinite and t.on_nonfinite == "abort") or skipped >= t.max_consecutive_skips:
                    raise_skips(cfg, step + 1, skipped, reason)
                tick = time.perf_counter()
                continue
            skipped = 0
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if accelerator.optimizer_step_was_skipped:  # fp16 overflow: the schedule and step count stay
                log.log({"step": step + 1, "skipped": "fp16 gradient overflow; loss scale lowered"})
                tick = time.perf_counter()
                continue
            step += 1
            spikes.accept(step_loss)

            seconds = time.perf_counter() - tick
            mfu = None
            if peak is not None:
                flops = step_flops(
                    window.input_tokens, window.squared_lengths, n_params, layers, hidden, head_params, global_tokens
                )
                mfu = flops / (seconds * world * peak)
            if step % cfg.log.every_steps == 0 or step == total_steps:
                row = {
                    "step": step,
                    "epoch": epoch,
                    "loss": step_loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens": global_tokens,
                    "tokens_per_s": global_tokens / seconds,
                    "input_tokens_per_s": window.input_tokens / seconds,
                    "data_wait": window.data_wait / seconds,
                    "peak_mem_gib": peak_memory_gib(accelerator.device),
                }
                log.log(row | ({"mfu": mfu} if mfu is not None else {}))
            if progress is not None:
                progress.update(1)
                progress.set_postfix(
                    loss=f"{step_loss:.4f}",
                    lr=f"{lr:.2e}",
                    tok_s=f"{global_tokens / seconds:.0f}",
                    **({"mfu": f"{mfu:.1%}"} if mfu is not None else {}),
                    wait=f"{window.data_wait / seconds:.1%}",
                    mem=f"{peak_memory_gib(accelerator.device):.2f}G",
                )
            if eval_loader is not None and (
                step == total_steps or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0)
            ):
                run_eval()
            if cfg.checkpoint.every_steps and (step % cfg.checkpoint.every_steps == 0 or step == total_steps):
                save_checkpoint()
            tick = time.perf_counter()
            if step >= total_steps:
                break
        else:  # the epoch ran out before total_steps, or a stop was agreed
            if stop.agreed or stop.failed:
                break
            if fresh_pass:
                raise DataError(
                    "data.train: a whole pass over the stream gave no usable row on any process (see the "
                    "dropped-row counts above); check data.max_seq_len, data.overlong and data.loss_on"
                )
            epoch, consumed = epoch + 1, 0

    if progress is not None:
        progress.close()
    if stop.failed:  # bad streamed data on some process: keep what was trained, then report it
        fault = next(f for f in gather_object([stop.fault]) if f)
        if step == 0:
            raise DataError(f"{fault}; nothing was trained yet")
        path = last_step_checkpoint()
        raise DataError(
            f"{fault}. Training stopped after step {step} with checkpoint {path} complete; fix or remove "
            "the row and run the same command again to continue from it"
        )
    if stop.agreed:
        path = last_step_checkpoint()
        accelerator.print(
            f"stopped on {stop.name} after step {step}; checkpoint {path} is complete; run again "
            "with checkpoint.resume=auto to continue"
        )
    return model

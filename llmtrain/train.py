"""Setup and the training loop.

`setup` builds everything a run needs (optimizer, `accelerator.prepare`, the method's data
source, resume, trackers) into a `Run`; `train` is the loop: for each window of micro-batches,
agreed across processes (`window.draw_window`), one optimizer step (`step.train_step`),
then log, evaluate, checkpoint, stop. The loss of a step is the mean over the whole
global batch (every micro-batch, every process) of the objective's units
(`objective`); backend differences live in `backend.Backend`; where the run stands is
one `state.TrainState`, which checkpoints save and load whole.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import DistributedDataParallelKwargs, gather_object, send_to_device

from .config import Config, to_yaml
from .config.load import flat_dict
from .core.method import Parts
from .core.objective import Objective
from .core.optim import build_optimizer, learning_rate
from .core.source import Batches
from .core.spike import SpikeGuard
from .core.state import Skip, StepResult, TrainState
from .core.step import train_step
from .core.window import Outcome, Window, draw_window
from .distributed.backend import Backend
from .distributed.stop import StopRequest
from .distributed.watchdog import Watchdog
from .errors import CheckpointError, DataError, TrainingError, warn
from .model import compile_blocks
from .observe import console
from .observe.metrics import MetricsLog, tracker_kwargs, tracker_name
from .observe.profiler import StepProfiler
from .observe.throughput import StepMeter, peak_memory_gib
from .output import checkpoint
from .output.evals import CheckpointEvals
from .processor import trains_vision
from .rl.tasks import Tasks

# Fields of the metrics rows the loop writes itself (an objective's metrics join them).
ROW_KEYS = set("step epoch loss lr grad_norm input_tokens_per_s data_wait peak_mem_gib mfu eval_loss skipped".split())  # noqa: SIM905


def check_metric_names(objective: Objective) -> None:
    """An objective's metrics join the loop's own fields in each metrics row: refuse a
    name that would overwrite one (a bug in the objective, not a user's mistake)."""
    clash = sorted(set(objective.metric_names) & (ROW_KEYS | {objective.unit, f"{objective.unit}_per_s"}))
    if clash:
        raise ValueError(f"{type(objective).__name__}.metric_names: {clash} are the metrics row's own fields")


def check_lengths(t, total_steps: int) -> None:
    """Warn about step counts that make no sense for a run of total_steps (known only once
    the data is): a warm-up that never ends, a profile of steps the run never takes."""
    if t.warmup_steps >= total_steps:
        warn(
            f"train.warmup_steps: {t.warmup_steps} is not below the run's {total_steps} steps, so the learning rate "
            f"never reaches train.lr={t.lr}; lower train.warmup_steps"
        )
    profile = t.profile_range()
    if profile is not None and profile[0] > total_steps:
        warn(
            f"train.profile_steps: steps {t.profile_steps} are beyond the run's {total_steps} steps; nothing is "
            "profiled"
        )


@dataclass
class Run:
    """What the loop works with; built by `setup`."""

    cfg: Config
    accelerator: object
    model: torch.nn.Module  # prepared (wrapped for DDP, DeepSpeed or FSDP)
    optimizer: torch.optim.Optimizer
    objective: Objective
    backend: Backend
    state: TrainState
    data: Batches  # the method's micro-batches (core/source.py)
    empty: dict  # a micro-batch with nothing to train, run by a process with no data left
    total_steps: int
    settings: dict  # what the data position means (checkpoint.position_settings)
    log: MetricsLog
    meter: StepMeter
    profiler: StepProfiler
    stop: StopRequest
    watchdog: Watchdog
    progress: object | None  # the progress bar, on the main process
    tasks: Tasks | None = None  # eval.tasks, evaluated with the data source's held-out measures
    evals: CheckpointEvals | None = None  # eval.lm_eval_tasks on each checkpoint, in a subprocess

    def evaluates(self) -> bool:
        return self.data.evaluates or self.tasks is not None


def setup(
    cfg: Config,
    accelerator,
    model,
    parts: Parts,
    resume_from: Path | None,
    stop: StopRequest,
    watchdog: Watchdog,
    settings: dict,
    tasks: Tasks | None = None,
    evals: CheckpointEvals | None = None,
) -> Run:
    """Optimizer and `accelerator.prepare`, the method's data source (`parts.source`) and
    its `after_prepare`, then the state from `resume_from` (a checkpoint, or None for a
    fresh start), metrics and trackers. `settings`: what the data position means
    (checkpoint.position_settings), saved with every checkpoint and checked on resume.
    `tasks`: eval.tasks (rl/tasks.Tasks, read), given the prepared model here; `evals`: lm-eval
    on each checkpoint (output/evals.CheckpointEvals), started here."""
    t, world, objective = cfg.train, accelerator.num_processes, parts.objective
    check_metric_names(objective)
    backend = Backend(accelerator, t.grad_accum_steps)
    model = backend.place(model)
    if t.compile:
        accelerator.print(f"compiling {compile_blocks(model)} transformer blocks (the first steps include compiling)")
    meter = StepMeter(model, accelerator.device, world, objective.unit, objective.head)
    optimizer = build_optimizer(model, t, accelerator.device)
    if world > 1 and not backend.topology.sharded and trains_vision(model):
        # A trainable vision tower may hold weights no forward uses (LLaVA reads an inner
        # layer's features: its tower's post_layernorm never gets a gradient). DDP waits for
        # every gradient and fails at the second step unless told to look for unused ones.
        accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    watchdog.beat("setting up the model and optimizer across processes")
    model, optimizer = accelerator.prepare(model, optimizer)
    data = parts.source(model, backend, watchdog.beat)
    if tasks is not None:
        tasks.bind(model, backend.topology.sharded and world > 1, watchdog.beat)
    empty = send_to_device(data.empty_batch(), accelerator.device)
    if parts.after_prepare is not None:
        with stop.deferred(after=None):  # a long pass (the reference log-probs) stops at an agreed batch
            parts.after_prepare(model, accelerator, empty, watchdog.beat, stop)
            stop.agree(accelerator, " before training; nothing was trained yet")  # one after its last batch

    state = TrainState(spikes=SpikeGuard(t.spike_factor, t.spike_window))
    watchdog.beat("checking that the weights are finite")
    nonfinite = backend.nonfinite_weights(model)
    if resume_from is not None:
        watchdog.beat(f"loading {resume_from}")
        data.restore(checkpoint.load(accelerator, resume_from, cfg, state, settings, model))
        checkpoint.check_position(
            resume_from, state, t.total_steps(data.steps_per_epoch), data.steps_per_epoch, t.grad_accum_steps
        )
        nonfinite = backend.nonfinite_weights(model)
        if nonfinite > state.nonfinite_weights:
            raise CheckpointError(
                f"checkpoint.resume: {resume_from} holds {nonfinite} non-finite weight values, more than the "
                f"{state.nonfinite_weights} its run started with; resume from an earlier checkpoint"
            )
        accelerator.print(f"resumed from {resume_from} at step {state.step} (epoch {state.epoch})")
    elif nonfinite:
        warn(
            f"model.name_or_path: {nonfinite} of the trainable weight values are not finite; steps whose "
            "loss or gradients they reach are skipped, and no update may add more"
        )
    state.nonfinite_weights = nonfinite
    log = MetricsLog(accelerator, cfg.output_dir, state.step if resume_from is not None else None)
    if tracker_name(cfg.log.tracker):
        accelerator.init_trackers(cfg.log.project, config=flat_dict(cfg), init_kwargs=tracker_kwargs(cfg))
    if evals is not None:  # a resumed run's lm-eval left unjoined goes to the trackers too
        evals.start(log, state.step if resume_from is not None else None)
    per_epoch = data.steps_per_epoch
    total_steps = t.total_steps(per_epoch)
    check_lengths(t, total_steps)
    accelerator.print(
        f"training {total_steps} steps ("
        + (
            "a pass over the stream ends when every process has run out"
            if per_epoch is None
            else f"{per_epoch} per epoch"
        )
        + f"), global batch {t.global_batch(world)} {data.items} on {world} process(es)"
    )
    progress = None
    if cfg.log.progress_bar and accelerator.is_main_process:
        progress = console.progress(total_steps, state.step, "train")  # off a terminal, a line every 30 s
    profiler = StepProfiler(t.profile_range(), cfg.output_dir, accelerator, watchdog.beat)
    return Run(
        cfg=cfg,
        accelerator=accelerator,
        model=model,
        optimizer=optimizer,
        objective=objective,
        backend=backend,
        state=state,
        data=data,
        empty=empty,
        total_steps=total_steps,
        settings=settings,
        log=log,
        meter=meter,
        profiler=profiler,
        stop=stop,
        watchdog=watchdog,
        progress=progress,
        tasks=tasks,
        evals=evals,
    )


def train(run: Run) -> Outcome:
    """Run optimizer steps until the last (FINISHED), or until a stop signal that every
    process agrees on (STOPPED, after a checkpoint of the last step taken). Bad streamed
    data met by any process stops all of them alike, after a checkpoint, with its error."""
    cfg, state = run.cfg, run.state
    try:
        if run.evaluates() and state.step == 0:
            run_eval(run)  # the baseline the run improves on
        run.model.train()
        batches = run.data.epoch(state.epoch, state.batches_in_epoch)
        drew_in_pass = state.batches_in_epoch > 0
        every_s, saved_at = cfg.checkpoint.every_minutes * 60, time.monotonic()
        while state.step < run.total_steps:
            run.profiler.before(state.step + 1)
            clock_due = bool(every_s) and time.monotonic() - saved_at >= every_s  # checkpoint.every_minutes
            window = draw_window(
                batches,
                cfg.train.grad_accum_steps,
                run.accelerator,
                run.objective.count,
                run.stop,
                run.watchdog.beat,
                clock_due,
            )
            if window.outcome is Outcome.EXHAUSTED:
                if not drew_in_pass:
                    raise DataError(
                        "data.train: a whole pass over the stream gave no usable row on any process (see the "
                        "dropped-row counts above); check data.max_seq_len, data.overlong and data.loss_on"
                    )
                state.next_epoch()
                batches, drew_in_pass = run.data.epoch(state.epoch), False
                continue
            if window.outcome is not Outcome.STEP:  # a stop signal or bad data, on some process
                return stop_early(run, window)
            drew_in_pass = True
            state.batches_in_epoch += window.micro_steps  # the same on every process
            result = run_step(run, window)
            state.record(result)
            run.profiler.after(state.step)
            report(run, window, result)
            if run.evals is not None:
                run.evals.join(state.step)  # lm-eval on earlier checkpoints, where finished
            if result.skip is not None:
                check_skips(run, result)
                continue
            if run.evaluates() and (state.step == run.total_steps or due(state.step, cfg.eval.every_steps)):
                run_eval(run)
            if window.checkpoint_due or (
                cfg.checkpoint.every_steps
                and (state.step == run.total_steps or due(state.step, cfg.checkpoint.every_steps))
            ):
                path = save_checkpoint(run)
                saved_at = time.monotonic()
                if run.evals is not None:
                    run.evals.launch(state.step, path)
        if run.evals is not None:
            run.evals.close(state.step)  # the last checkpoints' lm-eval, joined before final/
        return Outcome.FINISHED
    except BaseException:
        run.profiler.abandon()  # the error is what the user must see, not a trace write's
        raise
    finally:
        close_progress(run)
        run.profiler.close()


def due(step: int, every: int) -> bool:
    return bool(every) and step % every == 0


def report(run: Run, window: Window, result: StepResult) -> None:
    """The step's row in metrics.jsonl (every log.every_steps, and the last) and the
    progress bar; a skipped window's row says why."""
    state = run.state
    if result.skip is not None:
        run.log.log({"step": state.step + 1, "skipped": result.reason})
        if result.skip is not Skip.OVERFLOW:
            run.accelerator.print(f"step {state.step + 1} skipped: {result.reason}")
        return
    figures = run.meter.figures(window, result)
    if state.step % run.cfg.log.every_steps == 0 or state.step == run.total_steps:
        row = {"step": state.step, "epoch": state.epoch, "loss": result.loss, "lr": result.lr}
        row |= {"grad_norm": result.grad_norm, run.objective.unit: result.count}
        run.log.log(row | result.metrics | run.data.metrics | figures)
        for line in run.data.shown():  # completions an RL run shows, once per generation round
            run.accelerator.print(line)
    if run.progress is not None:
        bar = {"loss": f"{result.loss:.4f}"}
        bar |= {short: f"{result.metrics[name]:.3f}" for name, short in run.objective.progress_metrics.items()}
        bar |= {"lr": f"{result.lr:.2e}", f"{run.objective.unit}_s": f"{result.count / result.seconds:.0f}"}
        bar |= {"mfu": f"{figures['mfu']:.1%}"} if "mfu" in figures else {}
        bar |= {"wait": f"{figures['data_wait']:.1%}", "mem": f"{peak_memory_gib(run.accelerator.device):.2f}G"}
        run.progress.set_postfix(bar, refresh=False)
        run.progress.update(1)  # draws the step with its figures


def check_skips(run: Run, result: StepResult) -> None:
    """Stop the run when a skip must not be retried: a non-finite step under
    train.on_nonfinite=abort, or train.max_consecutive_skips in a row. An fp16 overflow
    is the loss scaler's and never stops it."""
    t, state = run.cfg.train, run.state
    if result.skip is Skip.OVERFLOW:
        return
    if result.skip is Skip.POISONED:
        found = checkpoint.complete_checkpoints(run.cfg.output_dir)
        raise TrainingError(
            f"train: {result.reason} at step {state.step + 1} (the loss and gradient norm were finite: "
            f"train.lr={t.lr:g}, or an optimizer fault). An update cannot be undone, so the run stops; nothing "
            f"after step {state.step} was saved; newest complete checkpoint: {found[-1][1] if found else 'none'}"
        )
    if (result.skip is Skip.NONFINITE and t.on_nonfinite == "abort") or state.skips_in_a_row >= t.max_consecutive_skips:
        found = checkpoint.complete_checkpoints(run.cfg.output_dir)
        newest = f"{found[-1][1]} (untouched)" if found else "none"
        raise TrainingError(
            f"train: {result.reason} at step {state.step + 1} ({state.skips_in_a_row} skipped step(s) in a row, "
            f"train.on_nonfinite={t.on_nonfinite}, train.max_consecutive_skips={t.max_consecutive_skips}); "
            f"nothing after the last good step was saved; newest complete checkpoint: {newest}. Try a lower "
            "train.lr, more train.warmup_steps, bf16 instead of fp16, or look for broken rows or weights"
        )


def run_step(run: Run, window: Window) -> StepResult:
    """step.train_step on `window` with the run's parts, at the step's learning rate."""
    return train_step(
        run.model,
        run.optimizer,
        window,
        run.objective,
        run.backend,
        run.state,
        lr=learning_rate(run.state.step, run.total_steps, run.cfg.train),
        max_grad_norm=run.cfg.train.max_grad_norm,
        empty=run.empty,
        beat=run.watchdog.beat,
    )


def run_eval(run: Run) -> None:
    """The data source's held-out measures and eval.tasks' figures, in one metrics row;
    the main ones printed."""
    state = run.state
    metrics = run.data.evaluate(state.step) if run.data.evaluates else {}
    if run.tasks is not None:
        metrics |= run.tasks.evaluate(state.step, run.total_steps, state.epoch)
    run.log.log({"step": state.step} | metrics)
    shown = {f"eval_{k}" for k in run.objective.progress_metrics} | {"eval_loss", "eval_reward"}
    shown |= run.tasks.shown() if run.tasks is not None else set()
    line = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k in shown)
    run.accelerator.print(f"step {run.state.step}: {line}")


def save_checkpoint(run: Run) -> Path:
    extra = run.data.saved(run.state.batches_in_epoch)  # a rollout in progress
    return keep_writing(
        run,
        f"the checkpoint of step {run.state.step}",
        lambda: checkpoint.save(
            run.accelerator,
            run.cfg.output_dir,
            run.state,
            run.settings,
            to_yaml(run.cfg),
            run.cfg.checkpoint.keep_last,
            extra,
        ),
    )


def keep_writing(run: Run, what: str, write):
    """`write()` (a checkpoint, final/; a collective), with signals held back meanwhile
    (stop.saving), tried again once a minute while it fails with checkpoint.WriteFailed,
    until it succeeds, checkpoint.write_retry_s have passed since the first try or a stop
    signal comes while waiting (on any process): then the WriteFailed propagates. Signals
    that come while writing do not give up: a Ctrl-C reaches a one-process launcher too,
    whose exit then sends SIGTERM while the stop checkpoint is written."""
    deadline = time.monotonic() + run.cfg.checkpoint.write_retry_s
    with run.stop.saving(what):
        while True:
            run.watchdog.beat(f"writing {what}")
            try:
                return write()
            except checkpoint.WriteFailed as e:
                requests = run.stop.requests
                # Every process takes the least time left of any, so all decide alike.
                wait = min(60, min(gather_object([int(deadline - time.monotonic())])))
                if wait <= 0:
                    raise
                run.accelerator.print(
                    f"{what}: writing it failed ({e.reason}); the steps trained since the last complete checkpoint "
                    f"are in memory only. Free space in {e.where} (or fix its permissions): trying again in {wait} s "
                    "(see checkpoint.write_retry_s); a stop signal (Ctrl-C) gives up",
                    flush=True,
                )
                run.stop.note = f"giving up on {what}"
                for _ in range(wait):
                    run.watchdog.beat(f"waiting to write {what} again")
                    time.sleep(1)
                    if any(gather_object([run.stop.requests > requests])):  # the same decision on every process
                        raise
                run.stop.note = f"writing {what} first"


def last_step_checkpoint(run: Run) -> Path:
    """The checkpoint of the last step taken, written now unless it already was."""
    path = checkpoint.checkpoint_root(run.cfg.output_dir) / f"step-{run.state.step}"
    return path if path.exists() else save_checkpoint(run)


def stop_early(run: Run, window: Window) -> Outcome:
    """Every process agreed to stop before this window: keep what was trained, then
    report bad data as its error, or a signal as STOPPED (stop.agreed says which)."""
    close_progress(run)
    step = run.state.step
    if window.outcome is Outcome.DATA_FAULT:
        fault = next(f for f in gather_object([window.fault]) if f)  # the message of a process that met it
        if step == 0:
            raise DataError(f"{fault}; nothing was trained yet")
        path = last_step_checkpoint(run)
        raise DataError(
            f"{fault}. Training stopped after step {step} with checkpoint {path} complete; fix or remove "
            "the row and run the same command again to continue from it"
        )
    run.stop.agreed = window.signal
    if step == 0:  # a fresh start stopped before its first step (in the baseline evaluation, say)
        run.accelerator.print(f"stopped on {run.stop.name} before step 1; nothing was trained yet")
        return Outcome.STOPPED
    path = last_step_checkpoint(run)
    # The same command continues (checkpoint.resume=auto is the default, and a given path
    # continues the run it started, rundir.find_start); only resume=none must be changed.
    again = (
        "run again with checkpoint.resume=auto" if run.cfg.checkpoint.resume == "none" else "run the same command again"
    )
    run.accelerator.print(
        f"stopped on {run.stop.name} after step {step}; checkpoint {path} is complete; {again} to continue"
    )
    return Outcome.STOPPED


def close_progress(run: Run) -> None:
    if run.progress is not None:
        run.progress.close()

"""Resumable checkpoints that become visible only once complete.

A checkpoint is written by every process into `checkpoints/.tmp-step-N/` (model,
optimizer and each rank's RNG through `accelerator.save_state`, then the
training position and the config), and the main process renames it to `step-N` only
after all ranks have finished. A directory named `step-N` is therefore always complete;
older ones are pruned (`checkpoint.keep_last`) only after the new one is in place.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from pathlib import Path

import yaml

from .. import safefs
from ..config.load import BoundedLoader
from ..core.state import TrainState
from ..distributed.topology import Topology
from ..errors import CheckpointError, describe
from ..files import load_json, read_own

STATE_FILE = "train_state.json"
# Settings that fix what a step's data is: a resume that changes them would not continue
# the same run.
POSITION_KEYS = (
    "train.micro_batch_size",
    "train.grad_accum_steps",
    "train.seed",
    "data.max_seq_len",
    "data.packing",
    "data.shuffle",
    "world_size",
    "global_batch",
)


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints, oldest first: every step-N directory, each complete
    when it was published. One that has since lost files (its train_state.json too) is
    damaged, which find_resume reports, not a checkpoint that never was: left out here, a
    run would start over and replace the others without a word."""
    root = checkpoint_root(output_dir)
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = re.fullmatch(r"step-(\d+)", p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
    return sorted(found)


def find_resume(output_dir: str, resume: str, warn=None, rng_required: bool = True, accelerator=None) -> Path | None:
    """The checkpoint to resume from for checkpoint.resume = auto | none | <path>.

    auto takes the newest complete checkpoint whose files are all there, whole; a damaged
    one is skipped with a warning (through `warn`) naming it. If every checkpoint is
    damaged, or an explicit path is, that is an error: never a silent start from scratch.
    With rng_required off, a checkpoint whose only fault is its RNG state is used, with a
    warning. Every process reaches the same answer from the files alone."""
    warn = warn or (lambda message: None)
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        problems = []
        for _, path in reversed(found):
            why = usable(path, rng_required, warn, accelerator)
            if why is None:
                return path
            problems.append(f"{path.name}: {why}")
            warn(f"checkpoint {path} is damaged ({why}); skipping it and trying the one before")
        if problems:
            raise CheckpointError(
                f"checkpoint.resume=auto: no usable checkpoint in {checkpoint_root(output_dir)} "
                f"({'; '.join(problems)}); move them away to start over, or use a new output_dir"
            )
        return None
    if resume == "none":
        if complete_checkpoints(output_dir):
            raise CheckpointError(
                f"checkpoint.resume=none but {checkpoint_root(output_dir)} holds checkpoints of an earlier run; "
                "use checkpoint.resume=auto to continue it or choose a new output_dir"
            )
        return None
    path = Path(resume)
    give = "give a checkpoints/step-N directory of an earlier run, or checkpoint.resume=auto"
    if (path / "checkpoints").is_dir():  # a run's output_dir
        give = f"it is a run's output_dir: to continue that run, give output_dir={resume} checkpoint.resume=auto"
    if not path.is_dir():
        what = f"{resume} is not a directory" if path.exists() else f"no such directory: {resume}"
        raise CheckpointError(f"checkpoint.resume: {what}; {give}")
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(
            f"checkpoint.resume: {resume} is not a complete llmtrain checkpoint (no {STATE_FILE}); {give}"
        )
    if (path / "llmtrain_config.yaml").is_file() and not (path / "config.yaml").is_file():
        raise CheckpointError(
            f"checkpoint.resume: {resume} is an export (final/), not a checkpoint: it has no optimizer state or "
            f"data position to resume; give a checkpoints/step-N directory, or start a new run from its weights "
            f"with model.name_or_path={resume}"
        )
    why = usable(path, rng_required, warn, accelerator)
    if why is not None:
        raise CheckpointError(f"checkpoint.resume: {resume} is damaged ({why}); resume from an earlier checkpoint")
    return path


def manifest(path: Path, accelerator=None) -> dict[str, dict]:
    """{relative path: {size, crc32}} of every file under `path` but the state file. The
    checksums are split across processes (see `checksums`)."""
    files = [f for f in sorted(Path(path).rglob("*")) if f.is_file() and f.name != STATE_FILE]
    # Sizes first: once the checksums' collective returns, the main process may publish
    # (rename) the directory while another process would still be reading it.
    sizes = {str(f.relative_to(path)): f.stat().st_size for f in files}
    sums = checksums(path, list(sizes), accelerator)
    return {rel: {"size": size, "crc32": sums[rel]} for rel, size in sizes.items()}


def checksum(path: Path) -> str:
    """CRC-32 of a file's content: a fast check (about 2 GB/s here, 0.5 s per GB, on a
    file still in the page cache) that catches damage a size check misses."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def checksums(root: Path, rels: list[str], accelerator=None) -> dict[str, str]:
    """{rel: checksum} of the files `rels` under `root`, in that order. With several
    processes each hashes every N-th file and all receive every result (a collective: call
    it on every process with the same list)."""
    world = accelerator.num_processes if accelerator is not None else 1
    mine = [(rel, checksum(Path(root) / rel)) for rel in rels[(accelerator.process_index if world > 1 else 0) :: world]]
    if world > 1:
        from accelerate.utils import gather_object

        mine = gather_object(mine)
    found = dict(mine)
    return {rel: found[rel] for rel in rels}


def usable(path: Path, rng_required: bool, warn, accelerator=None) -> str | None:
    """Why checkpoint `path` cannot be resumed from, or None: `damage` first, then each
    file's content against its checksum (split across processes). RNG faults count only
    when rng_required; otherwise they are waived with a warning."""
    why, rng_faults = damage(path)
    if why is None:
        for rel, fault in content_damage(path, accelerator):
            if is_rng_file(rel):
                rng_faults.append((rel, fault))
            elif why is None:
                why = fault
    if why is None and rng_faults:
        if rng_required:
            return rng_faults[0][1]
        warn(
            f"checkpoint {path}: {', '.join(rel for rel, _ in rng_faults)} missing or unreadable; resuming "
            "without it (checkpoint.require_rng_state=false), so random draws such as dropout differ from the "
            "uninterrupted run"
        )
    return why


def damage(path: Path) -> tuple[str | None, list[tuple[str, str]]]:
    """What is wrong with checkpoint `path`, caught before anything loads: the first fault
    outside the per-rank RNG states (its training position unreadable, a file it was
    written with missing or of another size), or None; and each RNG state that is missing,
    cut short or unreadable (Accelerate would skip an unreadable one silently), as
    (file, fault)."""
    try:
        state = load_json(Path(path) / STATE_FILE)
    except FileNotFoundError:
        return f"{STATE_FILE} is missing", []
    except (OSError, ValueError) as e:
        return f"{STATE_FILE} is unreadable ({type(e).__name__})", []
    if (why := state_problem(state)) is not None:
        return f"{STATE_FILE} {why}", []
    named = re.fullmatch(r"step-(\d+)", Path(path).name)
    if named and int(named[1]) != state["step"]:  # `save` names each checkpoint by its step: edited by hand
        return f"{STATE_FILE} says step {state['step']}, but the checkpoint is {Path(path).name}", []
    files = state["files"]
    listed = {str(f.relative_to(path)) for f in Path(path).rglob("*") if f.is_file() and f.name != STATE_FILE}
    if unlisted := sorted(listed - set(files)):
        return f"{unlisted[0]} is not in the file list of {STATE_FILE}", []
    why, rng_faults = None, []
    for rel, entry in files.items():
        size = entry["size"] if isinstance(entry, dict) else entry  # checkpoints of 0.1 listed sizes only
        f = Path(path) / rel
        if not f.is_file():
            fault = f"{rel} is missing"
        elif f.stat().st_size != size:
            fault = f"{rel} is {f.stat().st_size} bytes but {size} were written"
        elif is_rng_file(rel) and not rng_readable(f):
            fault = f"{rel} cannot be read"
        else:
            continue
        if is_rng_file(rel):
            rng_faults.append((rel, fault))
        elif why is None:
            why = fault
    return why, rng_faults


def state_problem(state) -> str | None:
    """What makes a train_state.json unfit to resume from (edited by hand, or written by
    something else), or None: its position, counters and recent losses, the settings and
    the file list must all have their types."""

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(state, dict):
        return "is not a JSON object"
    if not all(count(state.get(k)) for k in TrainState.POSITION):
        return f"has no training position ({', '.join(TrainState.POSITION)} as counts)"
    if not all(count(state.get(k, 0)) for k in ("skips_in_a_row", "nonfinite_weights")):
        return "has a counter that is not a count (skips_in_a_row, nonfinite_weights)"
    losses = state.get("recent_losses") or []
    if not isinstance(losses, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in losses):
        return "has recent_losses that are not a list of numbers"
    if not isinstance(state.get("settings"), dict):
        return "has no settings"
    layout = [k for k in (*LAYOUT_KEYS, "global_batch") if k in state["settings"]]
    if not all(count(state["settings"][k]) for k in layout):  # a resume converts the position with them
        return f"has settings that are not counts ({', '.join(layout)})"
    if "run" in state and not isinstance(state["run"], dict):
        return "has a run record that is not a JSON object"
    files = state.get("files")
    if not isinstance(files, dict) or not files:
        return "has no file list"
    for rel, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else entry
        if not count(size) or (isinstance(entry, dict) and not isinstance(entry.get("crc32", ""), str)):
            return f"lists {rel} without its size and checksum"
    return None


def check_position(path: Path, state: TrainState, total_steps: int, steps_per_epoch: int | None, accum: int) -> None:
    """Refuse to resume from `path` at a position this run cannot be at (its train_state.json
    edited by hand, or the run made shorter or its data smaller since): a step past the run's
    last (`total_steps`), or a position past the end of a pass over the data (at most
    `steps_per_epoch` x `accum` micro-batches on each process; a stream's pass has no known
    end). A negative or non-integer field is a `state_problem`. The epoch has no such
    bound: skipped windows take no step, so a run may take more passes than its steps fill."""
    where = f"checkpoint.resume: {Path(path) / STATE_FILE}"
    if state.step > total_steps:
        raise CheckpointError(
            f"{where}: step {state.step} is past the end of this run ({total_steps} steps); resume from an earlier "
            f"checkpoint, or set train.max_steps to at least {state.step} to go on from this one"
        )
    if steps_per_epoch is not None and state.batches_in_epoch > steps_per_epoch * accum:
        raise CheckpointError(
            f"{where}: batches_in_epoch: its position, {state.batches_in_epoch} micro-batches into pass "
            f"{state.epoch}, is past the end of a pass over this run's data ({steps_per_epoch * accum} on each "
            "process); resume with the data it was written on, or start a new output_dir"
        )


def content_damage(path: Path, accelerator=None) -> list[tuple[str, str]]:
    """(file, fault) for each file whose content no longer matches the checksum written
    with it (a same-size corruption). A collective with several processes."""
    files = load_json(Path(path) / STATE_FILE)["files"]
    expected = {  # files `damage` found missing or of another size are its to report
        rel: e["crc32"]
        for rel, e in files.items()
        if isinstance(e, dict)
        and "crc32" in e
        and (Path(path) / rel).is_file()
        and (Path(path) / rel).stat().st_size == e["size"]
    }
    found = checksums(path, sorted(expected), accelerator)
    return [
        (rel, f"{rel} does not match the checksum it was written with") for rel in found if found[rel] != expected[rel]
    ]


def is_rng_file(rel: str) -> bool:
    return re.fullmatch(r"random_states_\d+\.pkl", rel) is not None


def rng_readable(path: Path) -> bool:
    """Whether a rank's RNG state loads (with weights_only, as Accelerate loads it)."""
    from accelerate.utils import load

    try:
        states = load(path)
    except Exception:  # any unpickling failure: a damaged file
        return False
    return isinstance(states, dict) and "torch_manual_seed" in states


# How the global batch is split; with the same global batch a resume may change them (see
# `load`), except for a stream, whose per-process shares depend on the process count.
LAYOUT_KEYS = ("train.micro_batch_size", "train.grad_accum_steps", "world_size")


def position_settings(cfg, world_size: int, own: dict | None = None) -> dict:
    """What a checkpoint's data position means: the shared settings it depends on, then
    `own`, the method's (core/method.Method.position: an RL run counts generation rounds of
    so many prompts and steps). A resume must keep them, its layout excepted (`load`)."""
    return {
        "global_batch": cfg.train.global_batch(world_size),
        "train.micro_batch_size": cfg.train.micro_batch_size,
        "train.grad_accum_steps": cfg.train.grad_accum_steps,
        "train.seed": cfg.train.seed,
        "data.max_seq_len": cfg.data.max_seq_len,
        "data.packing": cfg.data.packing,
        "data.shuffle": cfg.data.shuffle,
        "world_size": world_size,
        # A stream's order also depends on its loader workers: each reads its own shards, and
        # datasets' buffer shuffle draws otherwise inside a worker than in the process.
        **(
            {
                "data.streaming": True,
                "data.shuffle_buffer": cfg.data.shuffle_buffer,
                "data.num_workers": cfg.data.num_workers,
            }
            if cfg.data.streaming
            else {}
        ),
        **(own or {}),
    }


def publish(tmp: Path, final: Path) -> None:
    """Move a fully written directory into place. If `final` exists (the same step saved
    again by a resumed run, or a second export), it is swapped out first and deleted only
    after the new one is in place, so a complete copy exists at every moment."""
    safefs.opened(tmp)  # private while it was written (safefs.fresh_dir)
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        safefs.rmtree(old)
        os.rename(final, old)
        os.rename(tmp, final)
        safefs.rmtree(old)
    else:
        os.rename(tmp, final)


ROLLOUT_FILE = "rollout.safetensors"


class WriteFailed(CheckpointError):
    """A checkpoint or final/ that could not be written (a full disk, permissions), raised
    on every process alike. `reason` says what failed, `where` is the directory to free
    space in; the trained state is still in memory (train.keep_writing tries again)."""

    def __init__(self, message: str, reason: str, where: Path):
        super().__init__(message)
        self.reason, self.where = reason, where


def save(
    accelerator, output_dir: str, state: TrainState, settings: dict, config_yaml: str, keep_last: int, extra=None
) -> Path:
    """Write checkpoint step-<state.step> on all ranks: what Accelerate saves (model,
    optimizer, every rank's RNG), the run's TrainState with the `settings` that fix what
    its data position means (`position_settings`), the config, and `extra` tensors (an RL
    run's generation round in progress) as rollout.safetensors. Returns its path. A
    failed write (disk full, permissions) on any process removes the partial directory
    and raises WriteFailed on every process; the previous checkpoint is untouched."""
    root = checkpoint_root(output_dir)
    step = state.step
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    main = accelerator.is_main_process

    def begin():
        safefs.make_dir(root)
        safefs.fresh_dir(tmp)  # made here, so save_state writes into a directory that is no link
        (tmp / "config.yaml").write_text(config_yaml)

    def state_files():
        accelerator.save_state(str(tmp))
        if extra is not None and main:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in extra.items()}, str(tmp / ROLLOUT_FILE))

    def finish(files):
        saved = state.state_dict() | {"settings": settings, "files": files}
        with open(tmp / STATE_FILE, "w") as f:  # written last inside the directory
            json.dump(saved, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, final)

    # Each phase's fault is agreed before the next (the agreement stands in for a barrier),
    # so every process raises, or tries again, together.
    error = agreed_error(accelerator, attempt(begin) if main else None)
    if error is None:
        error = agreed_error(accelerator, attempt(state_files))
    if error is None:
        files = manifest(tmp, accelerator)  # sizes and checksums let a resume detect a missing, cut or damaged file
        error = agreed_error(accelerator, attempt(lambda: finish(files)) if main else None)
    if error is not None:
        if main:
            safefs.rmtree(tmp)
        previous = complete_checkpoints(output_dir)
        kept = (
            f"the newest complete checkpoint, {previous[-1][1]}, is intact"
            if previous
            else "there is no earlier checkpoint"
        )
        raise WriteFailed(
            f"checkpoint: writing {tmp} failed ({error}); {kept}. Free space in "
            f"{root} (or fix its permissions), then run the same command again to resume",
            error,
            root,
        )
    if main and keep_last:
        for _, path in complete_checkpoints(output_dir)[:-keep_last]:
            remove(path)
    accelerator.wait_for_everyone()
    return final


def attempt(write) -> str | None:
    """Run `write()`; what failed if it failed to write a file (write_failed), else None.
    Any other exception is a bug and propagates."""
    try:
        write()
    except Exception as e:
        if not write_failed(e):
            raise
        return write_failed(e)
    return None


def agreed_error(accelerator, error: str | None) -> str | None:
    """The first process's `error` (what failed, or None) of any that has one, on every
    process: a collective, which also waits for every process."""
    if accelerator.num_processes == 1:
        return error
    from accelerate.utils import gather_object

    return next((e for e in gather_object([error]) if e is not None), None)


# What the writers raise when the disk is full or a file may not grow: OSError from Python,
# RuntimeError from torch's zip writer, SafetensorError from safetensors (Rust's IoError).
WRITE_FAULTS = (
    "No space left",
    "StorageFull",
    "Disk quota",
    "QuotaExceeded",
    "File too large",
    "FileTooLarge",
    "file write failed",
    "unexpected pos",
    "Permission denied",
    "PermissionDenied",
)


def write_failed(e: Exception) -> str | None:
    """What went wrong, in a few words, when `e` says that writing a file failed (whatever
    layer raised it); None for anything else, which is a bug."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    found = next((fault for fault in WRITE_FAULTS if fault in str(e)), None)
    return f"{found}: {describe(e)}" if found else None


def remove(path: Path) -> None:
    """Delete a checkpoint directory so that no directory named step-N is ever left half
    deleted: it is renamed aside first, then removed (`clean_leftovers` finishes the job
    after a kill)."""
    aside = path.with_name(f".deleting-{path.name}")
    safefs.rmtree(aside)
    os.rename(path, aside)
    safefs.rmtree(aside)


def clean_leftovers(output_dir: str | Path) -> None:
    """Finish what a killed run left half done, on the main process before anything else
    looks at output_dir: directories being written (.tmp-*) or deleted (.deleting-*) are
    removed; a complete one set aside while being replaced (.old-X, see `publish`) is put
    back where X is missing, and removed otherwise."""
    out = Path(output_dir)
    for parent, names in ((out, r"final"), (checkpoint_root(out), r"step-\d+")):
        if not parent.is_dir():
            continue
        for p in sorted(parent.iterdir()):
            kind = re.fullmatch(rf"\.(tmp|deleting|old)-({names})", p.name)
            if kind is None or not p.is_dir():
                continue
            if kind[1] in ("tmp", "deleting") or p.is_symlink():  # a link is not ours to put back
                safefs.rmtree(p)
            else:
                original = p.with_name(p.name[len(".old-") :])
                if original.exists():
                    safefs.rmtree(p)
                else:
                    os.rename(p, original)


def deepspeed_state_classes() -> list:
    """The classes DeepSpeed pickles into its checkpoints besides tensors and plain data."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return []
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def refused_pickle(e: BaseException) -> str | None:
    """Why torch's weights_only unpickler refused a file, in llmtrain's words, or None for
    another error. torch's own message advises loading again with weights_only=False, which
    on a file someone else wrote would run whatever code it carries: never repeated."""
    text = str(e)
    if "weights_only" not in text and "Weights only load failed" not in text:
        return None
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    return f"it holds {found[1]}, which is neither a tensor nor plain data" if found else "it is no plain tensor data"


def check_pickles(
    path: Path,
    what: str = "checkpoint.resume",
    advice: str = "Resume only from checkpoints you wrote, or from an earlier one",
) -> None:
    """DeepSpeed reads its checkpoint files (*.pt) with weights_only=False, which would run
    any code a tampered file carries. Each is read here first with weights_only=True
    (memory-mapped: the pickle, not the tensor data), allowing only DeepSpeed's own state
    classes; anything else stops the resume (or what `what` names)."""
    import torch

    allowed = deepspeed_state_classes()
    for f in sorted(Path(path).rglob("*.pt")):
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # any unpickling failure: refuse the file
            why = refused_pickle(e) or describe(e)
            raise CheckpointError(f"{what}: refusing to unpickle {f}: {why}. {advice}") from None


def check_weight_format(path: Path, cfg) -> None:
    """Refuse a checkpoint whose base weights were quantized otherwise (model.quantization,
    from its config.yaml). nf4 and fp4 pack 4-bit codes into tensors of the same shape, so a
    load would read one as the other without an error and train a scrambled base."""
    try:
        saved = yaml.load(read_own(Path(path) / "config.yaml"), Loader=BoundedLoader)["model"]["quantization"]
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return  # no record of it (written before it was kept): the load's own checks stand
    if saved != cfg.model.quantization:
        raise CheckpointError(
            f"checkpoint.resume: {path} was trained on base weights loaded with model.quantization={saved}, "
            f"now {cfg.model.quantization}: its weights would be read in another format. Resume with "
            f"model.quantization={saved}, or start a new output_dir"
        )


def load(accelerator, path: Path, cfg, state: TrainState, settings: dict, model=None) -> dict | None:
    """Restore model, optimizer and RNG from `path` and `state` from its train_state.json,
    after checking that the run's data settings (`settings`: position_settings of this run)
    are the ones it was written with. Returns the checkpoint's `extra` tensors (see `save`),
    or None.

    The global batch may be split differently (another number of processes, micro-batch
    size or accumulation): each pass's order is seeded and the loader deals its batches
    out round-robin, so step k reads rows k*G to (k+1)*G of the pass (G the global batch)
    whatever the split, and the saved position converts exactly. Not under DeepSpeed with
    another process count (its optimizer state is partitioned per process), nor for a
    stream (each process reads its own share of the sources)."""
    saved = load_json(Path(path) / STATE_FILE)
    was = dict(saved["settings"])
    was.setdefault("global_batch", math.prod(was.get(k, 1) for k in LAYOUT_KEYS))  # written before it was saved
    if was.get("data.streaming"):
        was.setdefault("data.num_workers", cfg.data.num_workers)  # likewise: not known, taken as unchanged
    now = settings
    flexible = () if cfg.data.streaming else LAYOUT_KEYS
    changed = [f"{k} was {was.get(k)!r}, now {v!r}" for k, v in now.items() if k not in flexible and was.get(k) != v]
    if changed:
        raise CheckpointError(
            f"checkpoint.resume: {path} was written with other data settings ({'; '.join(changed)}); the saved "
            "position would not mean the same rows. Resume with the same settings (the same global batch: "
            "train.micro_batch_size x train.grad_accum_steps x processes) or start a new output_dir"
        )
    check_weight_format(path, cfg)
    relaid = any(was.get(k) != now[k] for k in LAYOUT_KEYS)
    if relaid and was.get("world_size") != now["world_size"] and Topology.of(accelerator).deepspeed:
        raise CheckpointError(
            f"checkpoint.resume: {path} was written by {was.get('world_size')} DeepSpeed processes, whose optimizer "
            f"state is partitioned per process and cannot be resharded to {now['world_size']} here; resume on "
            f"{was.get('world_size')} processes (or convert it with DeepSpeed's universal checkpoint tools)"
        )
    check_pickles(path)
    kwargs = {}
    if cfg.model.quantization != "none":
        # The quantized base's state holds bitsandbytes' quantization constants beside each
        # weight (absmax, quant_map, ...), which load_state_dict calls unexpected keys; the
        # base is the one loaded at start-up anyway. Load non-strictly, once every weight
        # that trains is known to be in the checkpoint.
        check_trained_weights(accelerator.unwrap_model(model), path)
        kwargs["strict"] = False
    try:
        accelerator.load_state(str(path), **kwargs)  # Accelerate's own files load with weights_only
    except Exception as e:  # files that passed the checks but do not fit this model or run
        if why := refused_pickle(e):
            raise CheckpointError(
                f"checkpoint.resume: refusing to unpickle a file of {path}: {why}. Resume only from checkpoints you "
                "wrote, or from an earlier one"
            ) from None
        raise CheckpointError(
            f"checkpoint.resume: cannot load {path} ({describe(e)}); was it written by this run with the same "
            "model settings (model.*, LoRA)? Resume from a checkpoint of this run, or start a new output_dir"
        ) from None
    state.load_state_dict(saved)
    if relaid:
        rows = state.batches_in_epoch * was["train.micro_batch_size"] * was["world_size"]
        per_batch = now["train.micro_batch_size"] * now["world_size"]
        state.batches_in_epoch = -(-rows // per_batch)  # whole steps: rows is a multiple of the global batch

        def layout(settings: dict) -> str:
            w, m, a = (settings.get(k) for k in ("world_size", "train.micro_batch_size", "train.grad_accum_steps"))
            return f"{w} process(es) x {m} x {a}"

        accelerator.print(
            f"resuming a run of {layout(was)} as {layout(now)}, the same global batch of "
            f"{now['global_batch']}: every later step reads the rows it would have read"
            + (
                "; random draws (dropout) differ from the uninterrupted run's, each process's RNG state being saved "
                "per process"
                if was.get("world_size") != now["world_size"]
                else ""
            )
        )
    rollout = Path(path) / ROLLOUT_FILE
    if not rollout.exists():
        return None
    from safetensors.torch import load_file

    return load_file(str(rollout))  # tensors only: nothing in it is unpickled


def check_trained_weights(model, path: Path) -> None:
    """Every trainable weight of `model` (unwrapped) is in the checkpoint's weights."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("model*.safetensors"))
    saved = set()
    for f in files:
        with safe_open(f, "pt") as handle:
            saved |= set(handle.keys())
    missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in saved]
    if missing:
        raise CheckpointError(
            f"checkpoint.resume: {path} lacks {len(missing)} of the weights this run trains ({missing[0]}, ...); "
            "was it written by this run with the same LoRA settings? Resume from one that was, or start a new "
            "output_dir"
        )

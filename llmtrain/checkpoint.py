"""Resumable checkpoints that become visible only once complete.

A checkpoint is written by every process into `checkpoints/.tmp-step-N/` (model,
optimizer, scheduler and each rank's RNG through `accelerator.save_state`, then the
training position and the config), and the main process renames it to `step-N` only
after all ranks have finished. A directory named `step-N` is therefore always complete;
older ones are pruned (`checkpoint.keep_last`) only after the new one is in place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

STATE_FILE = "train_state.json"
# Settings that fix what a step's data is: a resume that changes them would not continue
# the same run.
POSITION_KEYS = ("train.micro_batch_size", "train.grad_accum_steps", "train.seed", "data.max_seq_len",
                 "data.packing", "world_size")


class CheckpointError(ValueError):
    pass


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = re.fullmatch(r"step-(\d+)", p.name)
            if m and p.is_dir() and (p / STATE_FILE).is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def find_resume(output_dir: str, resume: str) -> Path | None:
    """The checkpoint to resume from for checkpoint.resume = auto | none | <path>."""
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1][1] if found else None
    if resume == "none":
        if complete_checkpoints(output_dir):
            raise CheckpointError(
                f"checkpoint.resume=none but {checkpoint_root(output_dir)} holds checkpoints of an earlier run; "
                "set checkpoint.resume=auto to continue it, or choose a new output_dir")
        return None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"checkpoint.resume: {resume} is not a complete llmtrain checkpoint (no {STATE_FILE})")
    return path


def position_settings(cfg, world_size: int) -> dict:
    return {"train.micro_batch_size": cfg.train.micro_batch_size, "train.grad_accum_steps": cfg.train.grad_accum_steps,
            "train.seed": cfg.train.seed, "data.max_seq_len": cfg.data.max_seq_len, "data.packing": cfg.data.packing,
            "world_size": world_size}


def publish(tmp: Path, final: Path) -> None:
    """Move a fully written directory into place. If `final` exists (the same step saved
    again by a resumed run, or a second export), it is swapped out first and deleted only
    after the new one is in place, so a complete copy exists at every moment."""
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def save(accelerator, output_dir: str, state: dict, config_yaml: str, keep_last: int) -> Path:
    """Write checkpoint step-<state['step']> on all ranks; returns its path."""
    root = checkpoint_root(output_dir)
    step = state["step"]
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "config.yaml").write_text(config_yaml)
        with open(tmp / STATE_FILE, "w") as f:  # written last inside the directory
            json.dump(state, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, final)
        if keep_last:
            for _, path in complete_checkpoints(output_dir)[:-keep_last]:
                shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load(accelerator, path: Path, cfg) -> dict:
    """Restore model, optimizer, scheduler and RNG from `path`; return the training state."""
    state = json.loads((Path(path) / STATE_FILE).read_text())
    now = position_settings(cfg, accelerator.num_processes)
    changed = [f"{k} was {state['settings'].get(k)!r}, now {v!r}" for k, v in now.items()
               if state["settings"].get(k) != v]
    if changed:
        raise CheckpointError(f"checkpoint.resume: {path} was written with other data settings ({'; '.join(changed)}); "
                              "resume with the same settings or start a new output_dir")
    accelerator.load_state(str(path))
    return state

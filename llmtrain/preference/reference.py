"""The reference log-probs of a full fine-tune's preference run, computed once before
training so that no second model sits in memory while it trains.

Every pair of the train and eval sets (numbered by `pair_index`, eval after train) gets
its chosen and rejected answers' summed log-probs under the reference model (a KTO row,
numbered by `row_index`, its completion's and its KL sequence's: the objective's `logps`
gives each example's two sequences, first ones then second ones): the
policy's starting weights (the prepared model itself, before a resumed run loads its
checkpoint, so ZeRO-3 and FSDP shard it as in training) or another model named by
dpo.reference (loaded whole on each process for the pass, then freed). Each process
takes every world-th batch; batches go one at a time through the window agreement, so a
process that has run out runs empty batches while the others finish, and a sharded
model's forward passes line up (`window.draw_window`). The table is gathered to every
process and cached in output_dir, keyed by the models' files and the tokenized data, so a
resumed run or a rerun reads it instead of computing it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from .. import safefs
from ..core.window import Outcome, draw_window
from ..errors import DataError, ModelError, warn
from ..files import content_hash
from ..output.checkpoint import attempt

CACHE = "reference_logps.pt"


def model_files_key(name_or_path: str, revision: str = "") -> dict:
    """What identifies a model's weights: a local directory's weight files (name and
    content: weights replaced by a copy that kept the size and mtime are new weights), or
    a hub name and revision."""
    path = Path(name_or_path)
    if not path.is_dir():
        return {"name": name_or_path, "revision": revision}
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".json") and p.is_file())
    return {"name": str(path.resolve()), "files": [(p.name, content_hash(p)) for p in files]}


def data_key(dataset) -> str:
    """The tokenized pairs' fingerprint (datasets' own, for a Dataset or the one a
    pairs.PackedPairs packs)."""
    rows = getattr(dataset, "pairs", dataset)
    return f"{getattr(rows, '_fingerprint', '')}:{len(rows)}"


def cache_key(cfg, sets: list, precision: str) -> str:
    model = cfg.dpo.reference or cfg.model.name_or_path
    revision = "" if cfg.dpo.reference else cfg.model.revision
    what = {
        "model": model_files_key(model, revision),
        "dtype": cfg.model.dtype,
        "precision": precision,
        "attn": cfg.model.attn_implementation,
        "data": [data_key(s) for s in sets],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def load_cached(path: Path, key: str, pairs: int) -> torch.Tensor | None:
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # absent, torn, or not ours (unpickling raises many kinds): a cache, computed again
        return None
    if not isinstance(saved, dict) or saved.get("key") != key:
        return None
    table = saved.get("logps")
    ok = isinstance(table, torch.Tensor) and table.shape == (pairs, 2) and bool(table.isfinite().all())
    return table if ok else None


def save_cached(path: Path, key: str, table: torch.Tensor) -> None:
    tmp = safefs.new_temp(path.parent, f".tmp-{path.name}-")  # created exclusively: never a planted link
    try:
        torch.save({"key": key, "logps": table}, tmp)
        os.replace(tmp, path)  # replaces a link at path, never follows it
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@torch.no_grad()
def compute(
    model,
    objective,
    sets: list,
    collator,
    batch_size: int,
    accelerator,
    empty: dict,
    beat,
    index: str = "pair_index",
    stop=None,
) -> torch.Tensor:
    """The [pairs, 2] table (chosen, rejected log-probs) over `sets`, numbered in order by
    the column `index`, from this process's share of the batches and every other process's.
    A stop signal to any process (`stop`, a StopRequest) ends the pass on all at the same
    batch: they exit with its code (nothing is trained yet, nothing to save)."""
    from accelerate.utils import gather_object, send_to_device

    rank, world = accelerator.process_index, accelerator.num_processes
    found_index, found_logps = [], []
    was_training = model.training
    model.eval()
    for dataset in sets:
        if hasattr(dataset, "select_columns"):
            dataset = dataset.select_columns(list(collator.columns))
        n = len(dataset)
        # This process's batches: every world-th run of batch_size rows, in order.
        starts = range(rank * batch_size, n, world * batch_size)
        batches = [list(range(s, min(s + batch_size, n))) for s in starts]
        # A generator of its own: iter() would draw from torch's global one, and training's
        # dropout masks would then depend on whether the reference came from the cache.
        generator = torch.Generator().manual_seed(0)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=collator, generator=generator)
        mine = (send_to_device(b, accelerator.device) for b in loader)
        while (window := draw_window(mine, 1, accelerator, objective.count, stop, beat)).outcome is Outcome.STEP:
            batch = window.micro_batches(empty)[0]
            with accelerator.autocast():
                sums, _ = objective.logps(model, batch)
            if objective.count(batch):
                k = objective.count(batch)
                found_index.append(batch[index].cpu())
                found_logps.append(torch.stack([sums[:k], sums[k:]], 1).float().cpu())
        if window.outcome is Outcome.STOPPED:
            stop.stop_all(window.signal, accelerator, " during the reference pass; nothing was trained yet")
        if window.outcome is Outcome.DATA_FAULT:  # a row that cannot be collated, met by some process
            raise DataError(next(f for f in gather_object([window.fault]) if f))
    model.train(was_training)
    pairs = sum(len(getattr(s, "pairs", s)) for s in sets)
    table, got = torch.zeros(pairs, 2), torch.zeros(pairs, dtype=torch.bool)
    for index, logps in gather_object([(torch.cat(found_index), torch.cat(found_logps))] if found_index else []):
        table[index], got[index] = logps, True
    if not got.all():  # every pair is some process's: a bug, not the user's
        raise RuntimeError(f"reference pass: {int((~got).sum())} of {pairs} pairs got no log-probs")
    return table


def check_finite(table: torch.Tensor, cfg, precision: str) -> None:
    """Non-finite reference log-probs would make every loss they touch NaN: the reference
    model's weights hold NaN or inf, or its activations overflow in half precision."""
    bad = int((~table.isfinite()).any(1).sum())
    if not bad:
        return
    ref = cfg.dpo.reference
    key, which = ("dpo.reference", f"'{ref}'") if ref else ("model.name_or_path", f"'{cfg.model.name_or_path}'")
    amp = f", {precision} mixed precision" if precision != "no" else ""
    raise ModelError(
        f"{key}: the reference model {which} gives non-finite log-probs for {bad} of {len(table)} pairs "
        f"(model.dtype={cfg.model.dtype}{amp}); its weights hold NaN or inf, or its activations overflow in half "
        "precision: check the model's weights, or run with model.dtype=float32 or bfloat16"
    )


class ReferencePass:
    """`core/method.Parts.after_prepare` for a preference run that needs the table: reads it
    from output_dir's cache or computes it, and gives it to the objective."""

    def __init__(self, cfg, objective, sets: list, collator, make_reference=None, index: str = "pair_index"):
        self.cfg, self.objective, self.sets, self.collator = (
            cfg,
            objective,
            [s for s in sets if s is not None],
            collator,
        )
        self.make_reference = make_reference  # () -> (model, objective for its log-probs), for dpo.reference
        self.index = index  # the column numbering the examples (pair_index, or row_index for KTO)

    def __call__(self, model, accelerator, empty: dict, beat, stop=None) -> None:
        cfg = self.cfg
        path = Path(cfg.output_dir) / CACHE
        beat("fingerprinting the reference model's files")
        # The main process reads the weights' content for the key once, not every process.
        key = [cache_key(cfg, self.sets, str(accelerator.mixed_precision)) if accelerator.is_main_process else ""]
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(key)
        key = key[0]
        pairs = sum(len(getattr(s, "pairs", s)) for s in self.sets)
        beat("reading the cached reference log-probs")
        table = load_cached(path, key, pairs)
        if table is not None:
            accelerator.print(f"reference log-probs: {pairs} {self.objective.unit} read from {path}")
        else:
            started = time.perf_counter()
            ref_model, ref_objective = model, self.objective
            if self.make_reference is not None:
                beat(f"loading the reference model {cfg.dpo.reference}")
                ref_model, ref_objective = self.make_reference()
                ref_model.to(accelerator.device)
            batch_size = cfg.eval.micro_batch_size or cfg.train.micro_batch_size
            args = (self.sets, self.collator, batch_size, accelerator, empty, beat, self.index, stop)
            table = compute(ref_model, ref_objective, *args)
            del ref_model
            check_finite(table, cfg, str(accelerator.mixed_precision))  # every process holds the whole table
            # A cache: every process holds the table, so a write fault is a warning.
            if accelerator.is_main_process and (why := attempt(lambda: save_cached(path, key, table))):
                warn(
                    f"reference log-probs: cannot cache them in {path} ({why}); training goes on, and a "
                    "resumed run or a rerun computes them again"
                )
            accelerator.wait_for_everyone()
            seconds = time.perf_counter() - started
            accelerator.print(
                f"reference log-probs: {pairs} {self.objective.unit} in {seconds:.1f} s (cached in {path})"
            )
        self.objective.reference = table.to(accelerator.device)

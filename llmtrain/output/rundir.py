"""One run per output directory, and what a rerun finds there.

A run holds an exclusive lock on output_dir for its lifetime (`lock`): an flock on
output_dir/.llmtrain.lock, taken by the main process (locks.py: never stale, across nodes
where the filesystem supports locks). The lock file says who holds it, so a second run
stops at once naming the first.

A finished run leaves final/train_state.json, the state it was exported at. A rerun of a
finished run says so and exits instead of exporting again; a fresh start in a directory
that holds a finished run (and no checkpoint to continue it) is refused rather than
overwriting it, and a resume with other settings keeps the finished final/ aside
(`keep_finished`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from .. import locks, safefs
from ..config.load import BoundedLoader, as_dict
from ..config.validate import iter_paths
from ..errors import CheckpointError, shown, warn
from ..files import content_hash, fingerprint, load_json, read_own, tree_fingerprint
from ..observe.throughput import full_numel
from ..usercode import code_files
from . import checkpoint
from .checkpoint import POSITION_KEYS, STATE_FILE, checkpoint_root, complete_checkpoints

LOCK_FILE = ".llmtrain.lock"


@dataclass(frozen=True)
class Start:
    """Where a run starts in its output directory (`prepare`)."""

    identity: dict  # the recipe and the training files' content (`identity`), recorded with the run
    resume_from: Path | None = None  # the checkpoint to continue from; None: from the start
    finished_at: int | None = None  # the step a finished run with these settings ended at: nothing to do
    started_from: str = ""  # the checkpoint a checkpoint.resume=<path> run started from (`recorded_start`)
    going_back: bool = False  # resume_from is an earlier checkpoint of output_dir itself (`set_aside_later`)


def prepare(cfg, accelerator, recipe: str, need: dict[str, int]) -> Start:
    """Take output_dir for this run, on every process alike, and say where it starts:
    output_dir must be writable and hold no planted link; the run locks it; the
    directory must hold this recipe's run on this data, or none; a finished run with
    these settings is left as it is; otherwise the disk must hold `need` (one checkpoint
    and the export, `output_bytes`), what a killed run left half done is finished, and the
    checkpoint to resume from (checkpoint.resume) is found and checked against this
    run's settings."""
    out = cfg.output_dir
    check_writable(out)
    safefs.check_output_dir(out)  # no planted link where the run will write
    lock(out, accelerator)  # one run per output_dir, until this process ends
    ident = identity(recipe, cfg)
    check_same_run(out, ident)
    if (step := already_finished(cfg, accelerator.num_processes)) is not None:
        return Start(ident, finished_at=step)
    check_free_space(out, need, cfg.checkpoint.keep_last)
    if accelerator.is_main_process:
        checkpoint.clean_leftovers(out)  # what a killed run left half written or half deleted
    accelerator.wait_for_everyone()
    resume_from, started = find_start(cfg, accelerator)
    check_rerun(cfg, resume_from, accelerator.num_processes)
    check_same_run(out, ident, resume_from)
    going_back = False
    if resume_from is not None:
        warn_changes(resume_from, cfg)
        going_back = cfg.checkpoint.resume not in ("auto", "none") and started == str(resume_from.resolve())
    return Start(ident, resume_from, started_from=started, going_back=going_back)


def find_start(cfg, accelerator) -> tuple[Path | None, str]:
    """(the checkpoint to resume from, the checkpoint the run started from or ''), for
    checkpoint.resume: auto, none and a path as `checkpoint.find_resume` takes them, but
    - the path that the run in output_dir started from (`recorded_start`), with the same
      settings (the same command run again: a rerun, a requeued job) continues that run,
      from its newest checkpoint, or from the path where it has none yet;
    - auto, where output_dir holds no checkpoint but a run that started from a path,
      starts from that path again (killed before its first checkpoint)."""
    out, resume, require_rng = cfg.output_dir, cfg.checkpoint.resume, cfg.checkpoint.require_rng_state
    started = recorded_start(out)
    if resume in ("auto", "none"):
        resume_from = checkpoint.find_resume(out, resume, warn, require_rng, accelerator)
        if resume_from is None and resume == "auto" and started and Path(started).is_dir():
            return checkpoint.find_resume(out, started, warn, require_rng, accelerator), started
        return resume_from, started if resume_from is not None else ""
    given = str(Path(resume).resolve())
    same_run = given == started and not run_changes(out, cfg)
    if same_run and (own := checkpoint.find_resume(out, "auto", warn, require_rng, accelerator)):
        return own, started
    return checkpoint.find_resume(out, resume, warn, require_rng, accelerator), given


def saved_config(output_dir: str) -> str:
    """output_dir's config.yaml (the last run's settings), or '' where it cannot be read."""
    try:
        return read_own(Path(output_dir) / "config.yaml")
    except (OSError, ValueError):
        return ""


def saved_run(output_dir: str) -> dict:
    """output_dir's run.json (the last run's record, `identity` included), or {}."""
    try:
        run = load_json(Path(output_dir) / "run.json")
    except (OSError, ValueError):
        return {}
    return run if isinstance(run, dict) else {}


def run_changes(output_dir: str, cfg) -> list[str]:
    """What this command changes of the run output_dir last ran: its settings
    (`changed_settings` of config.yaml) and the files they name (`input_changes` of
    run.json)."""
    return changed_settings(saved_config(output_dir), cfg) + input_changes(saved_run(output_dir), cfg)


def recorded_start(output_dir: str) -> str:
    """The checkpoint the run in output_dir started from with checkpoint.resume=<path>, as
    its run.json records it (kept while it continues from its own checkpoints); '' for
    none. So the same command run again continues that run, as checkpoint.resume=auto
    would, rather than going back to where it started."""
    started = saved_run(output_dir).get("started_from")
    return started if isinstance(started, str) else ""


def set_aside_later(output_dir: str, resume_from: Path, accelerator) -> None:
    """checkpoint.resume=<a checkpoint of output_dir> goes back to it: the run's later
    checkpoints belong to the run it leaves, and as the newest they would be what auto
    resumes and pruning keeps. They move to checkpoints/earlier-run[-N]/ (kept, never
    resumed), with a warning. Called once the run is about to train (`Start.going_back`),
    so that a run stopped before (a refused resume, --prepare-only) moves nothing."""
    root, found = checkpoint_root(output_dir), complete_checkpoints(output_dir)
    at = [(n, path.name) for n, path in found if path.resolve() == resume_from.resolve()]  # a link's too
    if accelerator.is_main_process and at:
        step, name = at[0]
        later = [path for n, path in found if n > step]
        if later:
            aside = free_name(root / "earlier-run")
            aside.mkdir()
            for path in later:
                os.rename(path, aside / path.name)
            warn(
                f"checkpoint.resume: going back to {name}, the later checkpoints of the run it leaves "
                f"({', '.join(p.name for p in later)}) are moved to {aside}; delete them once you no longer need them"
            )
    accelerator.wait_for_everyone()


def check_writable(output_dir: str) -> None:
    """Create output_dir and write and remove a file in it, so that an unwritable directory
    stops the run at start-up rather than at its first checkpoint."""
    path = Path(output_dir)
    if path.is_symlink() and not path.is_dir():
        target = os.readlink(path)
        what = "a file" if path.exists() else "nothing (its target is missing)"
        raise CheckpointError(
            f"output_dir: {output_dir} is a link to {target}, which is {what}; make the link point to a directory, "
            "or choose another output_dir"
        )
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"output_dir: {output_dir} is a file, not a directory; choose another output_dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
        safefs.new_temp(output_dir, ".llmtrain-write-test-").unlink()  # created exclusively: never a planted link
    except OSError as e:
        raise CheckpointError(
            f"output_dir: cannot write to {output_dir} ({e.strerror or e}); choose a directory "
            "you can write to, or fix its permissions"
        ) from None


def output_bytes(model) -> dict[str, int]:
    """Rough size on disk of one checkpoint and the export: the weights, and AdamW's two
    moments per trainable parameter (in the parameter's dtype)."""
    weights = optimizer = 0
    for p in model.parameters():
        n = full_numel(p) * p.element_size()
        weights += n
        optimizer += 2 * n if p.requires_grad else 0
    return {"checkpoint": weights + optimizer, "export": weights}


def check_free_space(output_dir: str, need: dict[str, int], keep_last: int) -> None:
    """Refuse to start when output_dir cannot hold one checkpoint and the final export;
    warn when it cannot hold the keep_last + 1 checkpoints that exist while one is written
    (the run may be short enough to write none: checkpoint.every_minutes)."""
    free, total = shutil.disk_usage(output_dir).free, need["checkpoint"] + need["export"]
    gib = 2**30
    if free < total:
        raise CheckpointError(
            f"output_dir: {output_dir} has {free / gib:.2f} GiB free, but one checkpoint "
            f"({need['checkpoint'] / gib:.2f} GiB) and the final export ({need['export'] / gib:.2f} GiB) need "
            f"{total / gib:.2f} GiB; free space or choose an output_dir on a larger disk"
        )
    most = keep_last + 1
    if keep_last and free < most * need["checkpoint"] + need["export"]:
        warn(
            f"output_dir: {output_dir} has {free / gib:.2f} GiB free, room for one checkpoint "
            f"({need['checkpoint'] / gib:.2f} GiB) and the export but not the {most} checkpoints that exist while one "
            f"is written with checkpoint.keep_last={keep_last} (checkpoint.every_steps, every_minutes); one that does "
            "not fit waits for space (checkpoint.write_retry_s). Free space, or set checkpoint.keep_last=1"
        )


_HELD: dict[str, object] = {}  # output_dir -> the open lock file, for the life of the process


def lock(output_dir: str, accelerator) -> None:
    """Hold output_dir for this run, from the main process until it ends (the kernel
    releases the lock then, however it ends: locks.py). Every process raises the same
    CheckpointError if another run holds it."""
    from accelerate.utils import broadcast_object_list

    refused = [""]
    if accelerator.is_main_process and output_dir not in _HELD:
        path = Path(output_dir) / LOCK_FILE
        try:
            _HELD[output_dir] = locks.take(path)
        except locks.Busy as e:
            refused[0] = (
                f"output_dir: {output_dir} is in use by another run ({e.holder}); "
                "wait for it to end, or choose another output_dir"
            )
        except locks.NoLocks as e:  # go on, unguarded
            warn(f"output_dir: cannot lock {path} ({e.reason}); a second run into it would not be stopped")
    if accelerator.num_processes > 1:
        broadcast_object_list(refused)
    if refused[0]:
        raise CheckpointError(refused[0])


def finished_state(output_dir: str) -> dict | None:
    """The TrainState a finished run exported final/ at, or None when there is no final/.
    A final/ whose state cannot be read (written by hand, by an older version, or
    damaged) still holds a finished run: its step is None then."""
    final = Path(output_dir) / "final"
    if not final.is_dir():
        return None
    try:
        state = load_json(final / STATE_FILE)
    except (OSError, ValueError):
        state = None
    step = state.get("step") if isinstance(state, dict) else None
    return state if isinstance(step, int) and not isinstance(step, bool) else {"step": None}


def holds_run(output_dir: str) -> bool:
    """Whether output_dir holds what a run writes: metrics, checkpoints or an export."""
    out = Path(output_dir)
    return (out / "metrics.jsonl").is_file() or (out / "final").is_dir() or bool(complete_checkpoints(out))


# Settings that do not change what a run computes: where and how it reports, how it
# checkpoints, how fast it reads. A rerun that changes only these is the same run. (A
# stream's order depends on data.num_workers too: its resume refuses a change, as
# checkpoint.position_settings records it.)
SAME_RUN = (
    "output_dir",
    "log.",
    "checkpoint.",
    "data.num_workers",
    "train.hang_timeout_s",
    "train.profile_steps",
    "eval.sample_prompts",
    "eval.sample_max_new_tokens",
)


def changed_settings(saved_yaml: str, cfg) -> list[str]:
    """'key: old -> new' for each setting that alters the run and differs from the
    config a checkpoint or export was written with."""

    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in tree.items():
            out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
        return out

    try:
        saved = yaml.load(saved_yaml, Loader=BoundedLoader)
    except yaml.YAMLError:
        saved = None
    if not isinstance(saved, dict):
        return ["(the saved config cannot be read, so changes are not known)"]
    old, new = flat(saved), flat(as_dict(cfg))
    return [
        f"{key}: {shown(old.get(key))} -> {shown(value)}"
        for key, value in new.items()
        if not key.startswith(SAME_RUN) and key in old and not same_setting(old[key], value)
    ]


def same_setting(old, new) -> bool:
    """Whether a saved setting is the one loaded now. A relative path that a run saved
    before the recipe made the config's paths absolute (config.load.absolute_paths) is the same as
    the absolute path it names from the working directory now."""
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(map(same_setting, old, new))
    if isinstance(old, dict) and isinstance(new, dict):
        return old.keys() == new.keys() and all(same_setting(old[k], new[k]) for k in old)
    if isinstance(old, str) and isinstance(new, str) and old and not os.path.isabs(old) and os.path.isabs(new):
        return new == str(Path.cwd() / old)
    return old == new


def already_finished(cfg, world_size: int) -> int | None:
    """The step of final/ when output_dir holds this very run, finished (its export was
    written with the same settings, but for how it reports and checkpoints, and the same
    global batch); else None."""
    done = finished_state(cfg.output_dir)
    if done is None or done["step"] is None or final_changes(cfg, world_size, done):  # an unreadable config is a change
        return None
    return done["step"]


def up_to_date(cfg, step: int, total_steps: int, world_size: int) -> bool:
    """Whether a resumed run has no step left and final/ was exported at that step (the
    settings changed, say the rate, but not the length: exporting again would change
    nothing). When the only changes are export settings (export.merge_lora, the shard
    size), it is not: the last checkpoint is exported again, and final/ records settings
    that every step was trained with."""
    done = finished_state(cfg.output_dir)
    if not (step >= total_steps and done is not None and done["step"] == step):
        return False
    changes = final_changes(cfg, world_size, done)
    return not changes or not all(change.startswith("export.") for change in changes)


def final_changes(cfg, world_size: int, done: dict) -> list[str]:
    """`changed_settings` of final/'s config against `cfg` (one line saying so when it
    cannot be read), the files they name against the run record of `done` (final/'s state,
    finished_state: `input_changes`), and the process count against `done` (the config
    does not hold it): another count gives another global batch, or with the same one
    another split of its config."""
    try:
        changes = changed_settings(read_own(Path(cfg.output_dir) / "final" / "llmtrain_config.yaml"), cfg)
    except (OSError, ValueError):
        return ["(the saved config cannot be read, so changes are not known)"]
    changes += input_changes(done.get("run"), cfg)
    was = done.get("settings")
    was = was if isinstance(was, dict) else {}  # exported before final/ recorded them: not known
    processes = was.get("world_size")
    if isinstance(processes, int) and processes != world_size:
        now = cfg.train.global_batch(world_size)
        changes.append(f"processes: {processes} -> {world_size} (global batch {was.get('global_batch')} -> {now})")
    return changes


def keep_finished(cfg, accelerator) -> Path | None:
    """Before this run exports: a finished run's final/ that it would replace with a model
    trained otherwise (it resumed from an earlier checkpoint with other settings: the rate,
    the length, the process count) is renamed final-step-N/ and kept, so a rerun never
    loses what a run trained. A re-export of the same training (only export.* changed)
    replaces final/. Every process calls it; returns where the old final/ went, or None."""
    kept = None
    if accelerator.is_main_process and (done := finished_state(cfg.output_dir)) is not None:
        changes = [c for c in final_changes(cfg, accelerator.num_processes, done) if not c.startswith("export.")]
        if changes or done["step"] is None:
            final = Path(cfg.output_dir) / "final"
            name = f"final-step-{done['step']}" if done["step"] is not None else "final-earlier"
            kept = free_name(final.with_name(name))
            os.rename(final, kept)
            why = "; ".join(changes) or "its train_state.json cannot be read"
            warn(
                f"output_dir: final/ held a finished run trained with other settings ({why}); it is "
                f"kept as {kept.name}/ and this run's model becomes final/"
            )
    accelerator.wait_for_everyone()
    return kept


def free_name(path: Path) -> Path:
    """`path`, or where that is taken `path-2`, `path-3`, ...: where output_dir keeps what a
    rerun set aside (an earlier final/, a left run's checkpoints) without replacing anything."""
    names = (path.with_name(f"{path.name}-{n}" if n > 1 else path.name) for n in range(1, 10_000))
    return next(p for p in names if not os.path.lexists(p))


def check_rerun(cfg, resume_from: Path | None, world_size: int) -> None:
    """Refuse a run that would overwrite another's results: a fresh start over a finished
    run (it would train again from scratch and replace its metrics and final/), and a
    resume from another directory's checkpoint into one that holds a run (the two runs'
    metrics and checkpoints would mix), unless that run started there (`recorded_start`)
    and has no checkpoint of its own yet."""
    out = cfg.output_dir
    foreign = resume_from is not None and resume_from.resolve().parent != checkpoint_root(out).resolve()
    started_here = foreign and str(resume_from.resolve()) == recorded_start(out)
    if started_here and complete_checkpoints(out):  # find_start continues it unless the settings changed
        raise CheckpointError(
            f"output_dir: {out} holds the run that started from {resume_from}, and this command changes its "
            f"settings ({'; '.join(run_changes(out, cfg))}); to continue that run with them, "
            f"use checkpoint.resume=auto; to start from {resume_from} again, use a new output_dir"
        )
    if foreign and holds_run(out) and not started_here:
        raise CheckpointError(
            f"output_dir: {out} holds another run, and resuming {resume_from} into it would mix the two runs' "
            "metrics, checkpoints and final/; resume it into a new output_dir"
        )
    done = finished_state(out)
    if done is not None and resume_from is None:
        at = f"exported at step {done['step']}" if done["step"] is not None else "whose train_state.json cannot be read"
        changes = "; ".join(final_changes(cfg, world_size, done)) or "other settings"
        raise CheckpointError(
            f"output_dir: {out} holds a finished run (final/ {at}) with other settings ({changes}), and no "
            "checkpoint to continue or export it from; choose another output_dir, or delete its final/ to train "
            "again from scratch"
        )


def identity(recipe: str, cfg) -> dict:
    """What an output_dir's run belongs to and depends on, recorded in every
    train_state.json (checkpoints and final/, as "run") and run.json:
    - recipe: the recipe that trains it;
    - data: the content of each local training file (its name in data.train ->
      `files.content_hash`); streamed files by size and modification time only
      (data.streaming is for corpora too large to read an extra time at every start);
    - inputs: every other file the config names that decides what the run trains
      (`inputs`).
    Another recipe or training data is another run (`identity_change`, refused); a changed
    input is a change of the setting that names it (`input_changes`), as a new value there
    would be. Hub models and data sets are named by the config (and pinned by
    model.revision), so only local files are fingerprinted."""
    data = {}
    for name in cfg.data.names():
        try:
            if not Path(name).is_file():
                continue
            if cfg.data.streaming:  # a corpus too large to prepare is not read whole at every start
                stat = Path(name).stat()
                data[name] = f"size {stat.st_size}, modified {stat.st_mtime_ns}"
            else:
                data[name] = content_hash(Path(name))
        except OSError:  # unreadable: the data loader names the file and the fix
            pass
    return {"recipe": recipe, "data": data, "streamed": bool(cfg.data.streaming), "inputs": inputs(cfg)}


def inputs(cfg) -> dict[str, dict]:
    """{key: {local file or directory: its fingerprint}} for every path key of the config
    (config.validate.iter_paths, so a key added to any recipe's tree is covered) but
    data.train, which `identity` records as the data, and the keys that do not alter the run
    (SAME_RUN: output_dir, checkpoint.resume). A file is known by `files.fingerprint` (small
    ones by content, large ones by size and time); a directory (a model: the base, a
    reference, a reward model) by the files directly in it (`files.tree_fingerprint`). Each
    `:`-separated part of a name that holds paths (grpo.rewards' path/to/file.py:function and
    reward_model:DIR) counts alone; a name that loads code (grpo.rewards' module:function
    too) brings the files of that code and the modules of the user's it imports
    (usercode.code_files). A name that is no local path (a hub name, a built-in reward,
    template text) has nothing to fingerprint."""
    found: dict[str, dict] = {}
    for key, value, kind in iter_paths(cfg):
        if key.startswith(SAME_RUN) or key == "data.train" or (kind.text and "{" in value):
            continue
        names = value.split(":") if kind.parts else [value]
        if kind.code:
            names += [str(f) for f in code_files(value) if str(f) not in names]
        for name in names:
            path = Path(name)
            try:
                if path.is_file():
                    found.setdefault(key, {})[name] = fingerprint(path)
                elif name and path.is_dir():
                    found.setdefault(key, {})[name] = tree_fingerprint(path)
            except OSError:  # unreadable: what loads it names the file and the fix
                pass
    return found


def input_changes(saved, cfg) -> list[str]:
    """'key: name changed' for each file or directory of `inputs` that the run record `saved`
    (a train_state.json's "run", or run.json) names under the same key with other content,
    a directory's changed files in brackets. A name only one of them holds is a change of the
    setting itself, which `changed_settings` reports; a record written before inputs were
    recorded has none to compare."""
    was = saved.get("inputs") if isinstance(saved, dict) else None
    if not isinstance(was, dict):
        return []
    changes = []
    for key, names in inputs(cfg).items():
        old = was.get(key) if isinstance(was.get(key), dict) else {}
        for name, now in names.items():
            if name not in old or old[name] == now:
                continue
            if isinstance(now, dict) and isinstance(old[name], dict):
                files = sorted(f for f in now.keys() | old[name].keys() if now.get(f) != old[name].get(f))
                more = f" and {len(files) - 3} more" if len(files) > 3 else ""
                changes.append(f"{key}: {name} changed ({', '.join(files[:3])}{more})")
            else:
                changes.append(f"{key}: {name} changed")
    return changes


def identity_change(saved, now: dict, elsewhere: bool = False) -> str | None:
    """How the run that wrote a train_state.json's `saved` record differs from this one
    (`now`, from `identity`), as the end of a sentence, or None. A state written before
    runs were recorded has none, and passes. A file named by only one of the two is a
    change of data.train itself, which `warn_changes` reports as a setting. `elsewhere`:
    the state is a checkpoint of another output_dir (checkpoint.resume=<path>), so the fix
    is another checkpoint, not another output_dir."""
    if saved is None:
        return None
    readable = isinstance(saved, dict) and isinstance(saved.get("recipe"), str) and isinstance(saved.get("data"), dict)
    if not readable:
        return "has a run record (recipe, data) that cannot be read; " + (
            "give another checkpoint" if elsewhere else "choose another output_dir"
        )
    if saved["recipe"] != now["recipe"]:
        fix = (
            f"resume from a checkpoint of a {now['recipe']} run instead"
            if elsewhere
            else f"choose another output_dir for this {now['recipe']} run"
        )
        return (
            f"was trained by the {saved['recipe']} recipe, not {now['recipe']}: its optimizer, schedule and metrics "
            f"are that recipe's; {fix} (to start from that run's weights, set model.name_or_path to its final/)"
        )
    for name, digest in now["data"].items():
        if saved["data"].get(name, digest) != digest:
            fix = "start afresh (checkpoint.resume=auto)" if elsewhere else "choose another output_dir"
            return (
                f"was trained on other content of {name} (the file changed since, same path): its position and "
                f"weights are from the old rows; restore the file, or {fix} to train on the new one"
            )
    return None


def check_same_run(output_dir: str, now: dict, resume_from: Path | None = None) -> None:
    """Refuse to go on with a run whose final/ or checkpoint `resume_from` was written by
    another recipe or on other content of the same training files: the export would be
    called up to date, or training would continue at a data position that no longer
    means the same rows, with the other recipe's optimizer and schedule. Starting afresh
    instead would overwrite that run's results, so neither is done silently."""
    for where in (Path(output_dir) / "final", resume_from):
        if where is None:
            continue
        try:
            state = load_json(where / STATE_FILE)
        except (OSError, ValueError):
            continue  # no state or an unreadable one: finished_state and the checkpoint checks say so
        elsewhere = where is resume_from and where.resolve().parent != checkpoint_root(output_dir).resolve()
        saved = state.get("run") if isinstance(state, dict) else None
        key = "checkpoint.resume" if elsewhere else "output_dir"
        # A stream stopped by a bad row is resumed once the row is fixed (the run reads on
        # from the checkpoint's position): there a changed file is said, not refused.
        mid_stream = where is resume_from and now.get("streamed")
        if change := identity_change(saved, {**now, "data": {}} if mid_stream else now, elsewhere):
            raise CheckpointError(f"{key}: {where} {change}")
        if mid_stream and (change := identity_change(saved, now, elsewhere)):
            warn(
                f"{key}: {where} {change.split(':')[0]}; data.streaming reads on from the checkpoint's position: "
                "a fixed row continues the run exactly, other edits change what it trains"
            )


def warn_changes(resume_from: Path, cfg) -> None:
    """Warn, naming each, about settings that alter the run and differ from those the
    checkpoint was written with, and files they name that changed since (those that fix
    what its data position means are refused by checkpoint.load instead)."""
    try:
        saved = read_own(resume_from / "config.yaml")
    except (OSError, ValueError):
        saved = ""
    try:
        state = load_json(resume_from / STATE_FILE)
    except (OSError, ValueError):
        state = None
    record = state.get("run") if isinstance(state, dict) else None
    changes = [c for c in changed_settings(saved, cfg) if c.split(":")[0] not in POSITION_KEYS]
    changes += input_changes(record, cfg)
    if changes:
        warn(
            f"checkpoint.resume: {resume_from} was written with other settings; the run goes on with the new "
            f"ones: {'; '.join(changes)}"
        )

"""Each tracker llmtrain offers (log.tracker: tensorboard, trackio, wandb offline), read back
from the files it wrote: every train row's loss and every evaluation at its step, as
metrics.jsonl holds them, and the run's config."""

import json
import struct
from pathlib import Path

import pytest

from tests.support.runs import metrics, recipe_args, run_recipe


def tensorboard_rows(out: Path, cache_env) -> tuple[dict, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for events in (out / "logs").rglob("events.out.tfevents*"):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for e in acc.Scalars(tag):
                found.setdefault(e.step, {})[tag] = e.value
    return found, {}  # Accelerate gives TensorBoard the config as hparams, not read back here


def trackio_rows(out: Path, cache_env) -> tuple[dict, dict]:
    """Read by a process of its own: trackio reads TRACKIO_DIR when imported, and this one
    may have imported it already (TRL's trainers do) with the default."""
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from trackio.sqlite_storage import SQLiteStorage as S\n"
        "print(json.dumps([S.get_logs('llmtrain', sys.argv[1]), S.get_run_config('llmtrain', sys.argv[1]) or {}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, out.name], env=cache_env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs, config = json.loads(proc.stdout.strip().splitlines()[-1])
    found = {}
    for row in logs:
        found.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k not in ("step", "timestamp")})
    return found, config


def wandb_records(path: Path):
    """The protobuf records of a .wandb file: a 7-byte header, then LevelDB-log records (a
    CRC, a length and a type before each chunk) in blocks of 32 KiB. Read by hand: wandb
    0.31 no longer ships a reader in Python."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_rows(out: Path, cache_env) -> tuple[dict, dict]:
    (path,) = (out / "logs" / "wandb").rglob("*.wandb")
    found, config = {}, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = items.pop("_step", record.history.step.num)
            found.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
        elif kind == "config":
            config |= {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.config.update}
    return found, {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()}


READERS = {"tensorboard": tensorboard_rows, "trackio": trackio_rows, "wandb": wandb_rows}


LM_EVAL_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}}]
"""


@pytest.mark.parametrize("tracker", sorted(READERS))
def test_the_tracker_holds_every_row_of_the_run(tracker, base_config, tiny_model, chat_file, cache_env, tmp_path):
    """With wandb, lm-eval on a checkpoint too: its figures are joined when it finishes, after
    later steps, which wandb's history (only forward) takes at the step they are joined, with
    their own step beside them (lm_eval/step)."""
    out = tmp_path / f"run-{tracker}"
    extra = [f"log.tracker={tracker}", f"data.eval={chat_file}", "eval.every_steps=2", "train.max_steps=4"]
    if tracker == "wandb":
        (tmp_path / "tasks").mkdir()
        rows = [{"question": f"Say {c}", "choices": [c, "x"]} for c in "abcd"]
        (tmp_path / "tasks" / "choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / "tasks" / "choice.yaml").write_text(LM_EVAL_TASK.format(data=tmp_path / "tasks" / "choice.jsonl"))
        extra += ["eval.lm_eval_tasks=[tiny_choice]", f"eval.lm_eval_include={tmp_path / 'tasks'}"]
        extra += ["checkpoint.every_steps=2"]
    run_recipe(recipe_args(base_config, tiny_model, chat_file, out, "train.micro_batch_size=2", *extra), cache_env)
    found, config = READERS[tracker](out, cache_env)
    rows = metrics(out)
    for row in rows:
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in row:
                assert found[row["step"]][key] == pytest.approx(row[key], rel=1e-6), (tracker, row["step"], key)
    assert sorted(s for s, r in found.items() if "eval_loss" in r) == [0, 2, 4]
    assert sorted(s for s, r in found.items() if "loss" in r) == [1, 2, 3, 4]
    if tracker == "wandb":
        late = {r["step"]: r["lm_eval/tiny_choice/acc"] for r in rows if "lm_eval/tiny_choice/acc" in r}
        assert sorted(late) == [2, 4]
        got = {r["lm_eval/step"]: r["lm_eval/tiny_choice/acc"] for r in found.values() if "lm_eval/step" in r}
        assert got == pytest.approx(late)
    if tracker != "tensorboard":
        assert config["train.lr"] == 1e-3 and config["log.tracker"] == tracker, sorted(config)[:20]

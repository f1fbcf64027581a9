"""Non-finite losses: one decision on all processes before the optimizer step; skip
(bounded) or abort; nothing poisoned is ever saved as a checkpoint."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from llmtrain.demo import make_rows, write_jsonl

from .conftest import metrics, run_recipe, train_rows

pytestmark = pytest.mark.slow
POISON = "~"


@pytest.fixture(scope="module")
def poisoned_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with untied embeddings and a NaN input embedding for one character:
    exactly the batches that contain it produce a NaN loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = AutoModelForCausalLM.from_pretrained(tiny_model).config
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    (poison_id,) = tokenizer(POISON, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        model.get_input_embeddings().weight[poison_id] = float("nan")
    path = tmp_path_factory.mktemp("poisoned") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def rows_with_poison(path: Path, poisoned: set[int], n: int = 20) -> Path:
    rows = make_rows(n, seed=31)
    for i in poisoned:
        rows[i]["messages"][-1]["content"] += POISON
    write_jsonl(rows, path)
    return path


def args(base_config, model, data, out, *extra):
    return ["--config", str(base_config), f"model.name_or_path={model}", f"data.train={data}", f"output_dir={out}",
            "train.micro_batch_size=2", *extra]


def test_a_poisoned_step_is_skipped_on_every_process(base_config, poisoned_model, cache_env, tmp_path):
    data = rows_with_poison(tmp_path / "d.jsonl", {7})
    out = tmp_path / "out"
    run_recipe(args(base_config, poisoned_model, data, out), cache_env, nproc=2)  # the row is on one rank only
    skips = [r for r in metrics(out) if "skipped" in r]
    assert skips and all("not finite (loss nan" in r["skipped"] for r in skips)
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # 20 rows / (2 x 2) per step; skipped windows don't count
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    from safetensors.torch import load_file

    weights = load_file(out / "final" / "model.safetensors")
    for name, w in weights.items():
        bad = ~torch.isfinite(w)
        if "embed_tokens" in name:
            assert bad.any(dim=1).sum() == 1  # only the row poisoned on purpose
        else:
            assert not bad.any(), name


def test_abort_keeps_the_last_good_checkpoint_and_saves_nothing_after(base_config, poisoned_model, cache_env,
                                                                      tmp_path):
    data = rows_with_poison(tmp_path / "d.jsonl", {13})
    out = tmp_path / "out"
    proc = run_recipe(args(base_config, poisoned_model, data, out, "train.on_nonfinite=abort",
                           "checkpoint.every_steps=1", "checkpoint.keep_last=0"), cache_env, nproc=2, check=False)
    assert proc.returncode != 0  # the launcher reports 1 for a worker's 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    bad_step = [r for r in metrics(out) if "skipped" in r][0]["step"]
    assert re.match(rf"error: train: the loss or gradient norm was not finite \(loss nan.*\) at step {bad_step} ",
                    errors[0]), errors[0]
    assert bad_step > 1  # the seed puts the poisoned row after a few good steps
    saved = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    assert saved == list(range(1, bad_step))
    assert f"newest complete checkpoint: {out}/checkpoints/step-{bad_step - 1} (untouched)" in errors[0]
    state = json.loads((out / "checkpoints" / f"step-{bad_step - 1}" / "train_state.json").read_text())
    assert state["step"] == bad_step - 1
    assert not (out / "final").exists()


def test_consecutive_skips_are_bounded(base_config, poisoned_model, cache_env, tmp_path):
    data = rows_with_poison(tmp_path / "d.jsonl", set(range(20)))
    out = tmp_path / "out"
    proc = run_recipe(args(base_config, poisoned_model, data, out, "train.max_consecutive_skips=3"), cache_env,
                      check=False)
    assert proc.returncode == 2
    assert ") at step 1 (3 skipped step(s) in a row" in proc.stderr
    assert len([r for r in metrics(out) if "skipped" in r]) == 3 and not train_rows(out)
    assert not (out / "final").exists() and not (out / "checkpoints").exists()

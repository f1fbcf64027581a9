"""Non-finite losses: one decision on all processes before the optimizer step; skip
(bounded) or abort; nothing poisoned is ever saved as a checkpoint."""

import json
import math
import re
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from llmtrain.demo import make_rows, write_jsonl
from llmtrain.errors import TrainingError
from tests.support.runs import RECIPE, ROOT, free_port, metrics, recipe_args, run_recipe, train_rows

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
    return recipe_args(
        base_config,
        model,
        data,
        out,
        "train.micro_batch_size=2",
        *extra,
    )


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


def test_abort_keeps_the_last_good_checkpoint_and_saves_nothing_after(base_config, poisoned_model, cache_env, tmp_path):
    data = rows_with_poison(tmp_path / "d.jsonl", {13})
    out = tmp_path / "out"
    proc = run_recipe(
        args(
            base_config,
            poisoned_model,
            data,
            out,
            "train.on_nonfinite=abort",
            "checkpoint.every_steps=1",
            "checkpoint.keep_last=0",
        ),
        cache_env,
        nproc=2,
        check=False,
    )
    assert proc.returncode != 0  # the launcher reports 1 for a worker's 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    bad_step = [r for r in metrics(out) if "skipped" in r][0]["step"]
    assert re.match(
        rf"error: train: the loss or gradient norm was not finite \(loss nan.*\) at step {bad_step} ", errors[0]
    ), errors[0]
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
    proc = run_recipe(
        args(base_config, poisoned_model, data, out, "train.max_consecutive_skips=3"), cache_env, check=False
    )
    assert proc.returncode == 2
    assert ") at step 1 (3 skipped step(s) in a row" in proc.stderr
    assert len([r for r in metrics(out) if "skipped" in r]) == 3 and not train_rows(out)
    assert not (out / "final").exists() and not (out / "checkpoints").exists()


@pytest.fixture(scope="module")
def overflowing_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with an untied output layer 1,000 times too large: logits and the
    loss (~1e3) stay finite in fp16, but the gradients times the scaler's initial 65536
    pass fp16's 65504, so the first steps overflow until the scaler has halved its scale
    about ten times (measured with CPU fp16 autocast)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.get_input_embeddings().weight * 1e3)
    path = tmp_path_factory.mktemp("overflowing") / "model"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    return path


def assert_overflows_took_no_step(rows: list[dict]) -> None:
    """`rows` as in metrics.jsonl: a step taken (step, loss, lr) or a window skipped (step, skipped)."""
    overflows = [r for r in rows if r.get("skipped", "").startswith("fp16 gradient overflow")]
    assert overflows, f"the model was built to overflow fp16 at the scaler's initial scale; rows: {rows[:12]}"
    taken = [r for r in rows if "loss" in r]
    assert [r["step"] for r in taken] == list(range(1, 9))  # overflowed attempts took no step number
    assert {r["step"] for r in overflows} <= {r["step"] for r in taken}  # each was retried under the same number
    # Warm-up runs over steps taken, not attempts: step s trained at lr * s / 4.
    assert [r["lr"] for r in taken] == pytest.approx([1e-3 * min(s, 4) / 4 for s in range(1, 9)])
    assert all(math.isfinite(r["loss"]) for r in taken)
    assert not [r for r in rows if "not finite" in r.get("skipped", "")]  # the scaler's skip, not ours


@contextmanager
def loop_run(cfg, accelerator):
    """train.setup's Run of the finetune method for `cfg`, in this process: the loop itself,
    with no launcher and no recipe around it (the caller owns the Accelerator)."""
    from llmtrain.core.finetune import FINETUNE
    from llmtrain.data.build import build_datasets
    from llmtrain.distributed.stop import StopRequest
    from llmtrain.distributed.watchdog import Watchdog
    from llmtrain.model import attention_backend, check_model, load_model, load_tokenizer
    from llmtrain.output.checkpoint import position_settings
    from llmtrain.train import setup

    mcfg = check_model(cfg.model, cfg.data.max_seq_len)
    cfg.model.attn_implementation = attention_backend(cfg.model, mcfg, cfg.data.packing, accelerator.device).name
    tokenizer = load_tokenizer(cfg.model)
    train_set, eval_set = build_datasets(cfg, accelerator, tokenizer)
    model = load_model(cfg.model)
    with Watchdog(0, 0) as watchdog:
        parts = FINETUNE.parts(cfg, accelerator, model, tokenizer, train_set, eval_set)
        yield setup(cfg, accelerator, model, parts, None, StopRequest(), watchdog, position_settings(cfg, 1))


def test_fp16_overflow_skips_the_step_without_advancing_the_step_or_the_schedule(overflowing_model, tokenizer):
    """On CPU, in-process, with the training step itself. Accelerate creates the loss
    scaler only on a GPU; here a real torch GradScaler is set where Accelerate sets it
    there, under fp16 autocast on CPU, so the overflows and the scaler's skips are real.
    Windows are drawn and stepped, and their results recorded in the state, as the loop
    does. The GPU test below runs the recipe through accelerate launch."""
    from itertools import cycle

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    from llmtrain.config import DataConfig, TrainConfig
    from llmtrain.core.objective import TokenLoss
    from llmtrain.core.optim import build_optimizer, learning_rate
    from llmtrain.core.state import TrainState
    from llmtrain.core.step import train_step
    from llmtrain.core.window import draw_window
    from llmtrain.data.batches import Collator
    from llmtrain.data.rows import process_row
    from llmtrain.distributed.backend import Backend

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    assert accelerator.scaler is None  # Accelerate's CPU gate
    accelerator.native_amp, accelerator.scaler = True, torch.amp.GradScaler("cpu")
    t = TrainConfig(micro_batch_size=2, lr=1e-3, warmup_steps=4, schedule="constant", max_steps=8)
    model = AutoModelForCausalLM.from_pretrained(overflowing_model)
    objective = TokenLoss.for_model(model, t.loss_chunk_logits)
    model, optimizer = accelerator.prepare(model, build_optimizer(model, t, accelerator.device))
    examples = [process_row(r, "chat", tokenizer, DataConfig()) for r in make_rows(20, seed=3)]
    collate = Collator(tokenizer.pad_token_id)
    batches = cycle([collate(examples[i : i + 2]) for i in range(0, 20, 2)])
    state, rows = TrainState(), []
    try:
        while state.step < t.max_steps and len(rows) < 100:
            window = draw_window(batches, 1, accelerator, objective.count)
            result = train_step(
                model,
                optimizer,
                window,
                objective,
                Backend(accelerator, 1),
                state,
                lr=learning_rate(state.step, t.max_steps, t),
                max_grad_norm=t.max_grad_norm,
                empty=collate.empty_batch(packed=False),
            )
            attempted = state.step + 1
            rows.append(
                {
                    "step": attempted,
                    **({"skipped": result.reason} if result.skip else {"loss": result.loss, "lr": result.lr}),
                }
            )
            state.record(result)
    finally:
        AcceleratorState._reset_state(True)
    assert_overflows_took_no_step(rows)


@pytest.mark.parametrize("skip", ["nonfinite", "spike"])
def test_our_own_skip_under_the_fp16_scaler_leaves_the_next_step_able_to_run(
    poisoned_model, tokenizer, monkeypatch, skip
):
    """A skip the step decides itself comes after the gradients were unscaled for clipping;
    the scaler must be closed for that step, or the next one fails ("unscale_() has already
    been called"). The first window holds the poisoned character (a NaN loss), or is taken
    for a spike; the next two must train. A real GradScaler as in the test above."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    from llmtrain.config import DataConfig, TrainConfig
    from llmtrain.core.objective import TokenLoss
    from llmtrain.core.optim import build_optimizer
    from llmtrain.core.spike import SpikeGuard
    from llmtrain.core.state import Skip, TrainState
    from llmtrain.core.step import train_step
    from llmtrain.core.window import draw_window
    from llmtrain.data.batches import Collator
    from llmtrain.data.rows import process_row
    from llmtrain.distributed.backend import Backend

    rows = make_rows(6, seed=3)
    if skip == "nonfinite":
        rows[0]["messages"][-1]["content"] += POISON
    else:
        calls = iter([True])
        monkeypatch.setattr(SpikeGuard, "is_spike", lambda self, loss: next(calls, False))
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    accelerator.native_amp, accelerator.scaler = True, torch.amp.GradScaler("cpu", init_scale=1.0)
    t = TrainConfig(micro_batch_size=2, lr=1e-3, max_steps=3)
    model = AutoModelForCausalLM.from_pretrained(poisoned_model)
    objective = TokenLoss.for_model(model, t.loss_chunk_logits)
    model, optimizer = accelerator.prepare(model, build_optimizer(model, t, accelerator.device))
    examples = [process_row(r, "chat", tokenizer, DataConfig()) for r in rows]
    collate = Collator(tokenizer.pad_token_id)
    batches = iter([collate(examples[i : i + 2]) for i in range(0, 6, 2)])
    backend, state, skips = Backend(accelerator, 1), TrainState(), []
    state.nonfinite_weights = backend.nonfinite_weights(model)  # the poisoned row, as the loop counts at its start
    try:
        for _ in range(3):
            result = train_step(
                model,
                optimizer,
                draw_window(batches, 1, accelerator, objective.count),
                objective,
                backend,
                state,
                lr=1e-3,
                max_grad_norm=t.max_grad_norm,
                empty=collate.empty_batch(packed=False),
            )
            skips.append(result.skip)
            state.record(result)
    finally:
        AcceleratorState._reset_state(True)
    assert skips == [Skip.NONFINITE if skip == "nonfinite" else Skip.SPIKE, None, None]
    assert state.step == 2


def test_fp16_overflows_in_the_loop_write_skip_rows_and_take_no_step(
    base_config, overflowing_model, chat_file, tmp_path
):
    """The same through the loop itself (train.setup and train.train, in-process, with the
    scaler placed as above): metrics.jsonl holds the overflow rows, the steps taken and
    their warm-up rates, and the run finishes."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from llmtrain.config import load_config
    from llmtrain.core.window import Outcome
    from llmtrain.train import train

    out = tmp_path / "out"
    out.mkdir()
    cfg = load_config(
        base_config,
        args(
            base_config,
            overflowing_model,
            chat_file,
            out,
            "train.max_steps=8",
            "train.warmup_steps=4",
            "train.hang_timeout_s=0",
        )[2:],
    )
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="fp16")
        accelerator.native_amp, accelerator.scaler = True, torch.amp.GradScaler("cpu")
        with loop_run(cfg, accelerator) as run:
            assert train(run) is Outcome.FINISHED
    finally:
        AcceleratorState._reset_state(True)
    assert_overflows_took_no_step(metrics(out))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Accelerate has no fp16 scaler on CPU)")
def test_fp16_overflow_skips_the_step_through_accelerate_on_a_gpu(
    base_config, overflowing_model, chat_file, cache_env, tmp_path
):
    import subprocess
    import sys

    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / "single_gpu.yaml"),
        "--mixed_precision",
        "fp16",
        "--main_process_port",
        str(free_port()),
        str(RECIPE),
        *args(base_config, overflowing_model, chat_file, out, "train.max_steps=8", "train.warmup_steps=4"),
    ]
    proc = subprocess.run(cmd, env=cache_env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert_overflows_took_no_step(metrics(out))


def test_a_poisoning_update_stops_the_run_and_nothing_after_it_is_saved(
    base_config, tiny_model, chat_file, tmp_path, monkeypatch
):
    """The loop itself, in-process: step 3 is taken at an infinite rate (as a broken
    optimizer would), which the loss and gradient checks cannot see. The run stops with an
    error naming the step; the checkpoints of steps 1 and 2 are complete and finite, and
    nothing later (no checkpoint, no final/) exists."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from safetensors.torch import load_file

    import llmtrain.train as loop
    from llmtrain.config import load_config

    out = tmp_path / "out"
    out.mkdir()
    cfg = load_config(
        base_config,
        args(
            base_config,
            tiny_model,
            chat_file,
            out,
            "train.max_steps=6",
            "checkpoint.every_steps=1",
            "checkpoint.keep_last=0",
        )[2:],
    )
    real = loop.learning_rate
    monkeypatch.setattr(
        loop, "learning_rate", lambda step, total, t: float("inf") if step == 2 else real(step, total, t)
    )
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True)
        with loop_run(cfg, accelerator) as run, pytest.raises(TrainingError) as stopped:
            loop.train(run)
    finally:
        AcceleratorState._reset_state(True)
    assert str(stopped.value).startswith("train: the update made ")
    assert " weight values non-finite at step 3 (the loss and gradient norm were finite" in str(stopped.value)
    assert f"nothing after step 2 was saved; newest complete checkpoint: {out}/checkpoints/step-2" in str(stopped.value)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2"]
    for step in ("step-1", "step-2"):
        assert all(
            torch.isfinite(w).all() for w in load_file(out / "checkpoints" / step / "model.safetensors").values()
        )
    assert [r["step"] for r in train_rows(out)] == [1, 2] and not (out / "final").exists()

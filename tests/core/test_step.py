"""One optimizer step, run in-process on one process (no recipe, no launcher): its loss is
the mean over every trained token of the window whatever the micro-batch layout, and a
non-finite or spiking step leaves weights and optimizer as they were. The fp16 loss
scaler's skips are tested in tests/launch/test_nonfinite.py, with this same function."""

import copy
import math

import pytest
import torch

from llmtrain.config import DataConfig, TrainConfig
from llmtrain.core.objective import Loss, TokenLoss
from llmtrain.core.optim import build_optimizer
from llmtrain.core.spike import SpikeGuard
from llmtrain.core.state import Skip, TrainState
from llmtrain.core.step import train_step
from llmtrain.core.window import Outcome, draw_window
from llmtrain.data.batches import Collator
from llmtrain.data.rows import process_row
from llmtrain.demo import make_rows
from llmtrain.distributed.backend import Backend


@pytest.fixture
def accelerator():
    """A one-process CPU Accelerator, made afresh (Accelerate's state is process-wide)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model)


def micro_batches(tokenizer, rows: int, per_batch: int) -> list[dict]:
    """`rows` chat rows (trained-token counts differ from row to row), `per_batch` a batch."""
    examples = [process_row(r, "chat", tokenizer, DataConfig()) for r in make_rows(rows, seed=21)]
    collate = Collator(tokenizer.pad_token_id)
    return [collate(examples[i : i + per_batch]) for i in range(0, rows, per_batch)]


def step(model, accelerator, batches, objective=None, state=None, lr=1e-2, max_grad_norm=1.0):
    """(result, model after the step, optimizer) for one window of `batches`. AdamW's eps
    is 1, so that the update is proportional to the gradient: its first step is otherwise
    about lr x sign(gradient), which turns rounding in gradients near zero into lr."""
    model = copy.deepcopy(model)
    objective = objective or TokenLoss.for_model(model, 0)
    optimizer = build_optimizer(model, TrainConfig(lr=lr, adam_eps=1.0), accelerator.device)
    model, optimizer = accelerator.prepare(model, optimizer)
    window = draw_window(iter(batches), len(batches), accelerator, objective.count)
    assert window.outcome is Outcome.STEP and window.micro_steps == len(batches)
    empty = Collator(0).empty_batch(packed=False)
    result = train_step(
        model,
        optimizer,
        window,
        objective,
        Backend(accelerator, len(batches)),
        state or TrainState(),
        lr=lr,
        max_grad_norm=max_grad_norm,
        empty=empty,
    )
    return result, model, optimizer


def test_the_step_loss_is_the_mean_over_the_windows_trained_tokens(model, tokenizer, accelerator):
    """Four rows as 4 micro-batches of 1 and as 1 of 4: the same loss and the same update,
    both equal to the cross-entropy averaged over every trained token of the window (a
    mean per micro-batch divided by the accumulation count would weight short rows more)."""
    four = micro_batches(tokenizer, 4, 1)
    tokens = [int((b["labels"] != -100).sum()) for b in four]
    assert len(set(tokens)) > 1  # the rows train different numbers of tokens
    with torch.no_grad():
        summed = sum(float(TokenLoss()(model, b).total.double()) for b in four)
    accumulated, after_4x1, _ = step(model, accelerator, four)
    whole, after_1x4, _ = step(model, accelerator, micro_batches(tokenizer, 4, 4))
    assert accumulated.count == whole.count == sum(tokens)
    assert accumulated.loss == pytest.approx(summed / sum(tokens), rel=1e-6)
    assert whole.loss == pytest.approx(accumulated.loss, rel=1e-6)
    assert whole.grad_norm == pytest.approx(accumulated.grad_norm, rel=1e-5)
    assert accumulated.skip is None and accumulated.lr == 1e-2
    assert accumulated.seconds >= accumulated.data_wait >= 0
    moved = False
    for (name, a), (_, b), (_, before) in zip(
        after_4x1.named_parameters(), after_1x4.named_parameters(), model.named_parameters()
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8, msg=name)
        moved |= not torch.equal(a, before)
    assert moved


class NaNLoss(TokenLoss):
    def __call__(self, model, batch):
        out = super().__call__(model, batch)
        return Loss(out.total * float("nan"))


def test_a_non_finite_step_changes_nothing_and_counts_as_a_skip(model, tokenizer, accelerator):
    result, after, optimizer = step(model, accelerator, micro_batches(tokenizer, 4, 2), objective=NaNLoss())
    assert result.skip is Skip.NONFINITE and "not finite (loss nan" in result.reason
    for (name, a), (_, b) in zip(after.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), name
        assert a.grad is None, name  # cleared: nothing leaks into the next step
    assert not optimizer.state_dict()["state"]  # AdamW never stepped
    state = TrainState(step=3)
    state.record(result)
    assert (state.step, state.skips_in_a_row) == (3, 1)
    assert state.trained == 0 and state.seconds == result.seconds > 0  # its time spent, nothing trained


def test_a_spiking_loss_is_skipped_and_an_ordinary_one_joins_the_window(model, tokenizer, accelerator):
    batches = micro_batches(tokenizer, 2, 2)
    spiky = TrainState(spikes=SpikeGuard(1.5, 2, [0.5, 0.5]))  # the real loss (~5) is far above 1.5 x 0.5
    result, after, _ = step(model, accelerator, batches, state=spiky)
    assert (
        result.skip is Skip.SPIKE and "spiked above train.spike_factor=1.5 x the median of the last 2" in result.reason
    )
    assert all(torch.equal(a, b) for a, b in zip(after.parameters(), model.parameters()))

    calm = TrainState(skips_in_a_row=2, spikes=SpikeGuard(1.5, 2, [9.0, 9.0]))
    result, after, _ = step(model, accelerator, batches, state=calm)
    assert result.skip is None and math.isfinite(result.loss)
    calm.record(result)
    assert (calm.step, calm.skips_in_a_row, calm.spikes.recent) == (1, 0, [9.0, result.loss])
    assert calm.trained == result.count > 0
    again = TrainState()
    again.load_state_dict(calm.state_dict())  # a resume carries the totals on
    assert (again.trained, again.seconds) == (calm.trained, calm.seconds)


class EvenLabels(TokenLoss):
    """TokenLoss with a metric of its own: how many trained tokens have an even id (a
    batch with none leaves it out, as the rule allows)."""

    metric_names = ("even_share",)

    def __call__(self, model, batch):
        out = super().__call__(model, batch)
        even = ((batch["labels"] != -100) & (batch["labels"] % 2 == 0)).sum()
        return Loss(out.total, {"even_share": even} if even else {})


def test_an_objectives_metrics_are_averaged_over_the_global_count(model, tokenizer, accelerator):
    batches = micro_batches(tokenizer, 6, 2)
    even = sum(int(((b["labels"] != -100) & (b["labels"] % 2 == 0)).sum()) for b in batches)
    trained = sum(int((b["labels"] != -100).sum()) for b in batches)
    result, _, _ = step(model, accelerator, batches, objective=EvenLabels())
    assert 0 < even < trained and result.metrics == {"even_share": pytest.approx(even / trained, rel=1e-6)}


def test_empty_micro_batches_add_nothing(model, tokenizer, accelerator):
    """A process that has run out runs empty batches up to the most any process has: they
    add no loss, no count and no gradient (the update is that of its real batches)."""
    from llmtrain.core.window import Window

    batches = micro_batches(tokenizer, 2, 2)
    alone, after_alone, _ = step(model, accelerator, batches)
    objective = TokenLoss.for_model(copy.deepcopy(model), 0)
    padded_model = copy.deepcopy(model)
    optimizer = build_optimizer(padded_model, TrainConfig(lr=1e-2, adam_eps=1.0), accelerator.device)
    padded_model, optimizer = accelerator.prepare(padded_model, optimizer)
    window = Window(Outcome.STEP, batches=batches, micro_steps=3, count=objective.count(batches[0]))
    padded = train_step(
        padded_model,
        optimizer,
        window,
        TokenLoss(),
        Backend(accelerator, 3),
        TrainState(),
        lr=1e-2,
        max_grad_norm=1.0,
        empty=Collator(0).empty_batch(packed=False),
    )
    assert padded.loss == alone.loss and padded.grad_norm == pytest.approx(alone.grad_norm, rel=1e-6)
    for (name, a), (_, b) in zip(after_alone.named_parameters(), padded_model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=name)


def test_an_objectives_metric_may_not_overwrite_the_loops_fields():
    from llmtrain.train import check_metric_names

    class Clashing(TokenLoss):
        metric_names = ("accuracy", "loss")

    check_metric_names(EvenLabels())
    with pytest.raises(ValueError, match=r"Clashing.metric_names: \['loss'\] are the metrics row's own fields"):
        check_metric_names(Clashing())


def test_skips_in_a_row_count_only_our_skips_and_an_overflow_ends_them():
    from llmtrain.core.state import StepResult

    def result(skip=None):
        return StepResult(1.0, 1.0, 10, 1e-3, 0.1, 0.0, skip)

    state = TrainState(spikes=SpikeGuard(2.0, 2))
    for skip in (Skip.NONFINITE, Skip.SPIKE):
        state.record(result(skip))
    assert (state.step, state.skips_in_a_row) == (0, 2)
    state.record(result(Skip.OVERFLOW))  # the loss and gradients passed our checks: the scaler's business
    assert (state.step, state.skips_in_a_row) == (0, 0)
    state.record(result(Skip.NONFINITE))
    state.record(result())
    assert (state.step, state.skips_in_a_row, state.spikes.recent) == (1, 0, [1.0])


def test_an_update_that_makes_weights_non_finite_is_reported(model, tokenizer, accelerator):
    """Finite loss and gradients, but an infinite rate: the update cannot be undone, and
    the result says so (the loop then stops before anything is saved)."""
    result, after, _ = step(model, accelerator, micro_batches(tokenizer, 2, 2), lr=float("inf"))
    assert math.isfinite(result.loss) and math.isfinite(result.grad_norm)
    assert result.skip is Skip.POISONED and result.reason.startswith("the update made ")
    assert not all(torch.isfinite(p).all() for p in after.parameters())
    clean, _, _ = step(model, accelerator, micro_batches(tokenizer, 2, 2))
    assert clean.skip is None  # the count it starts from is the model's own (here 0)

"""The per-step agreement on one process: what a window holds, and how the iteration
ends (data exhausted, a stop signal, bad data). Several processes are covered by the
recipe tests (test_train.py, test_stream.py, test_deepspeed.py)."""

import signal
from types import SimpleNamespace

import pytest
import torch

from llmtrain.core.window import Outcome, Report, Window, draw_window
from llmtrain.data.batches import Collator
from llmtrain.errors import DataError


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)


def batch(*trained: int) -> dict:
    """A padded batch of rows with `trained` tokens each (and one untrained token)."""
    rows = [{"input_ids": list(range(n + 1)), "labels": [-100] + list(range(n))} for n in trained]
    return Collator(0)(rows)


def count(b: dict) -> int:
    return int((b["labels"] != -100).sum())


def test_a_window_holds_its_batches_and_the_global_counts(accelerator):
    batches = iter([batch(3, 5), batch(2), batch(4)])
    window = draw_window(batches, 2, accelerator, count)
    assert window.outcome is Outcome.STEP
    assert len(window.batches) == window.micro_steps == 2
    assert window.count == 10  # 3 + 5 + 2 trained tokens
    assert window.input_tokens == 4 + 6 + 3 and window.squared_lengths == 16 + 36 + 9
    window = draw_window(batches, 2, accelerator, count)  # one batch left: a short last window
    assert (len(window.batches), window.micro_steps, window.count) == (1, 1, 4)
    assert draw_window(batches, 2, accelerator, count).outcome is Outcome.EXHAUSTED


def test_a_process_that_ran_out_pads_with_empty_batches():
    window = Window(Outcome.STEP, batches=["a"], micro_steps=3)
    assert window.micro_batches("empty") == ["a", "empty", "empty"]


def test_a_stop_signal_ends_the_iteration_before_the_step(accelerator):
    stop = SimpleNamespace(signum=int(signal.SIGTERM))
    window = draw_window(iter([batch(3)]), 1, accelerator, count, stop=stop)
    assert window.outcome is Outcome.STOPPED and window.signal == signal.SIGTERM and not window.batches


def test_bad_data_ends_the_iteration_with_its_message(accelerator):
    def bad():
        yield batch(3)
        raise DataError("data.train: x.jsonl line 7: invalid JSON")

    window = draw_window(bad(), 2, accelerator, count, stop=SimpleNamespace(signum=0))
    assert window.outcome is Outcome.DATA_FAULT and window.fault == "data.train: x.jsonl line 7: invalid JSON"
    with pytest.raises(DataError, match="line 7"):  # no stop protocol (evaluation): the error itself
        draw_window(bad(), 2, accelerator, count)


def test_the_report_travels_as_one_tensor_read_back_by_name():
    """Two processes' reports through one gather: each field comes back as its own sum
    and maximum (a field read from the wrong column would mix counts and signals)."""
    other = Report(batches=0, count=0, input_tokens=0, squared_lengths=0, signal=int(signal.SIGUSR1), fault=0, due=1)

    class TwoProcesses:
        device = torch.device("cpu")

        def gather(self, local):
            return torch.cat([local, torch.tensor([list(vars(other).values())])])

    mine = Report(batches=2, count=7, input_tokens=9, squared_lengths=41, signal=0, fault=1, due=0)
    total, most = mine.exchange(TwoProcesses())
    assert total == Report(2, 7, 9, 41, int(signal.SIGUSR1), 1, 1)
    assert (most.batches, most.count, most.signal, most.fault, most.due) == (2, 7, int(signal.SIGUSR1), 1, 1)


@pytest.mark.parametrize("due", [False, True])
def test_a_checkpoint_due_by_the_clock_is_in_the_agreement(accelerator, due):
    """checkpoint.every_minutes: each process's clock says whether one is due; the window
    says so on every process if any says so (the max of the reports)."""
    window = draw_window(iter([batch(3)]), 1, accelerator, count, due=due)
    assert window.outcome is Outcome.STEP and window.checkpoint_due is due

"""train.profile_steps: a trace of exactly the chosen steps, and a table of the top
operators. (test_train.py profiles a two-process run: a trace per process.)"""

import json
from types import SimpleNamespace

import pytest
import torch

from llmtrain.observe.profiler import StepProfiler


def fake_accelerator(printed: list):
    return SimpleNamespace(device=torch.device("cpu"), process_index=0, print=printed.append)


def work(n: int) -> None:
    x = torch.randn(n, n)
    (x @ x).sum()


def test_the_chosen_steps_are_traced_and_the_top_operators_printed(tmp_path):
    printed = []
    profiler = StepProfiler((2, 3), str(tmp_path), fake_accelerator(printed))
    for step in range(1, 6):
        profiler.before(step)
        work(64 if step in (2, 3) else 8)  # steps 2 and 3 multiply 64 x 64 matrices
        profiler.after(step)
    profiler.close()
    out = tmp_path / "profile" / "steps-2-3"
    (trace,) = out.glob("rank0.*.pt.trace.json")  # one trace: Perfetto and TensorBoard's plugin read it
    events = json.loads(trace.read_text())["traceEvents"]
    shapes = [e["args"].get("Input Dims") for e in events if e.get("name") == "aten::mm"]
    assert shapes == [[[64, 64], [64, 64]]] * 2  # the two profiled steps, none of the others
    table = (out / "rank0-top-ops.txt").read_text()
    assert "aten::mm" in table and len(printed) == 1 and table.strip() in printed[0]


def test_a_run_that_ends_inside_the_range_still_writes_its_trace(tmp_path):
    profiler = StepProfiler((2, 9), str(tmp_path), fake_accelerator([]))
    profiler.before(1)
    profiler.before(2)
    work(8)
    profiler.close()  # the run ended (or stopped) at step 2
    assert list((tmp_path / "profile" / "steps-2-9").glob("rank0.*.pt.trace.json"))


def test_a_failing_run_writes_no_trace(tmp_path):
    profiler = StepProfiler((1, 3), str(tmp_path), fake_accelerator([]))
    profiler.before(1)
    work(8)
    profiler.abandon()  # the loop met an error inside the range
    profiler.close()
    assert not list((tmp_path / "profile").rglob("*.json"))


def test_off_by_default(tmp_path):
    profiler = StepProfiler(None, str(tmp_path), fake_accelerator([]))
    profiler.before(1)
    profiler.after(1)
    profiler.close()
    assert not (tmp_path / "profile").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_trace_has_kernels_and_a_memory_snapshot_is_written(tmp_path):
    import pickle

    profiler = StepProfiler(
        (1, 1), str(tmp_path), SimpleNamespace(device=torch.device("cuda"), process_index=0, print=lambda text: None)
    )
    profiler.before(1)
    x = torch.randn(256, 256, device="cuda")
    (x @ x).sum().item()
    profiler.after(1)
    out = tmp_path / "profile" / "steps-1-1"
    (trace,) = out.glob("rank0.*.pt.trace.json")
    assert any(e.get("cat") == "kernel" for e in json.loads(trace.read_text())["traceEvents"])
    snapshot = pickle.loads((out / "rank0-memory.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]

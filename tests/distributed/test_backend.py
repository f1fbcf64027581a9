"""What differs between backends within a step, on fake Accelerators (the real backends
run in test_train.py, test_deepspeed.py and the GPU tests)."""

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from llmtrain.distributed.backend import Backend


def fake(kind=DistributedType.MULTI_CPU, precision="no", world=2, skipped=False, zero_stage=2):
    calls = []

    @contextmanager
    def no_sync(model):
        calls.append("no_sync")
        yield

    acc = SimpleNamespace(
        distributed_type=kind,
        mixed_precision=precision,
        num_processes=world,
        device=torch.device("cpu"),
        sync_gradients=None,
        no_sync=no_sync,
        optimizer_step_was_skipped=skipped,
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage)),
    )
    return acc, calls


def test_each_micro_batch_loss_is_scaled_to_the_global_mean():
    """Backends average gradients over processes: x processes / global count. DeepSpeed
    also divides every backward by its accumulation count: x that count."""
    assert Backend(fake(world=2)[0], grad_accum_steps=4).loss_scale(10) == pytest.approx(2 / 10)
    assert Backend(fake(DistributedType.DEEPSPEED)[0], grad_accum_steps=4).loss_scale(10) == pytest.approx(8 / 10)


def test_gradients_are_reduced_on_the_last_micro_batch_only():
    acc, calls = fake()
    backend = Backend(acc, 2)
    with backend.micro_batch(None, last=False):
        assert acc.sync_gradients is False and calls == ["no_sync"]
    with backend.micro_batch(None, last=True):
        assert acc.sync_gradients is True and calls == ["no_sync"]  # DeepSpeed's boundary, DDP's all-reduce


@pytest.mark.parametrize(
    "kind, placed",
    [(DistributedType.MULTI_CPU, True), (DistributedType.DEEPSPEED, False), (DistributedType.FSDP, False)],
)
def test_only_plain_ddp_places_the_model_itself(kind, placed):
    class Model:
        moved = False

        def to(self, device):
            self.moved = True
            return self

    assert Backend(fake(kind)[0], 1).place(Model()).moved is placed


def test_who_owns_a_non_finite_step():
    """bf16/fp32 DeepSpeed has already skipped it inside backward; in fp16 an infinite
    gradient norm is the loss scaler's overflow, not ours."""
    assert Backend(fake(DistributedType.DEEPSPEED, skipped=True)[0], 1).engine_skipped()
    assert not Backend(fake(DistributedType.DEEPSPEED, "fp16", skipped=True)[0], 1).engine_skipped()
    assert not Backend(fake(skipped=True)[0], 1).engine_skipped()
    assert Backend(fake()[0], 1).grad_norm_is_ours() and not Backend(fake(precision="fp16")[0], 1).grad_norm_is_ours()


def test_non_finite_weights_are_counted_over_the_shards_each_process_holds():
    """ZeRO-3 and FSDP: each process counts its own shard and the counts are summed; DDP:
    every process holds the same whole weights and counts them alone."""
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
        model.bias[1] = float("inf")
    model.bias.requires_grad_(False)  # frozen weights do not change: not counted
    acc, _ = fake()
    assert Backend(acc, 1).nonfinite_weights(model) == 1

    sums = []
    acc, _ = fake(DistributedType.DEEPSPEED, zero_stage=3)
    acc.reduce = lambda t, reduction: sums.append(int(t)) or t * 2  # two processes, the same shard count
    model.weight.ds_tensor = torch.tensor([float("nan"), 1.0, float("-inf")])  # this process's partition
    assert Backend(acc, 1).nonfinite_weights(model) == 4 and sums == [2]


def test_the_non_finite_count_is_exact_whatever_the_dtypes_and_sizes():
    """The fused-norm shortcut answers 0 only when every value is finite: weights whose
    squares overflow a norm are counted value by value (0), mixed dtypes each get their
    own norm, and a sharded process with nothing non-finite still joins the reduce."""
    from llmtrain.distributed.backend import nonfinite_count

    big = torch.full((4,), 3e38)  # finite, but its norm is inf in float32
    half = torch.ones(5, dtype=torch.bfloat16)
    assert int(nonfinite_count([big, half, torch.ones(0)])) == 0
    half[2] = float("nan")
    assert int(nonfinite_count([big, half])) == 1
    assert int(nonfinite_count([torch.tensor([float("inf"), float("-inf"), 1.0]), big])) == 2
    assert int(nonfinite_count([])) == 0

    sums = []
    acc, _ = fake(DistributedType.DEEPSPEED, zero_stage=3)
    acc.reduce = lambda t, reduction: sums.append(int(t)) or t
    assert Backend(acc, 1).nonfinite_weights(torch.nn.Linear(3, 2)) == 0 and sums == [0]

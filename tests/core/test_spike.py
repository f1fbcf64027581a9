"""The spike guard (llmtrain/core/spike.py): a step's loss against the median of a full
window of recent ones, off at zero, its window restored from a checkpoint. In a real run:
tests/launch/test_spike.py."""

from llmtrain.core.spike import SpikeGuard


def test_guard_waits_for_a_full_window_then_compares_with_the_median():
    guard = SpikeGuard(2.0, 3)
    for loss in (5.0, 1.0, 1.2):
        assert not guard.is_spike(100.0)  # window not full yet: never a spike
        guard.accept(loss)
    assert guard.is_spike(2.5) and not guard.is_spike(2.4)  # median of (5.0, 1.0, 1.2) is 1.2
    guard.accept(4.0)  # the oldest (5.0) leaves the window: median of (1.0, 1.2, 4.0) is 1.2
    assert guard.recent == [1.0, 1.2, 4.0]


def test_guard_is_off_at_zero_and_restores_its_window():
    off = SpikeGuard(0.0, 1, [1.0])
    assert not off.is_spike(1e9)
    assert SpikeGuard(2.0, 2, [9.0, 1.0, 3.0]).recent == [1.0, 3.0]  # from a checkpoint, trimmed to the window

"""A dead or hung rank in a real two-process run ends the whole job within
train.hang_timeout_s, naming the rank, and the last checkpoint stays usable (the watchdog
itself: tests/distributed/test_watchdog.py)."""

import contextlib
import signal
import threading
import time

import pytest

from tests.support.runs import kill_tree, metrics, recipe_args, start_run, wait_for

pytestmark = pytest.mark.slow


def test_a_hung_rank_ends_the_job_within_the_timeout(base_config, tiny_model, chat_file, cache_env, tmp_path):
    """Rank 1 is frozen (SIGSTOP) mid-run: rank 0 waits in the next collective, its watchdog
    fires, and the launcher takes the job down; the last checkpoint stays usable."""
    import psutil

    from llmtrain.output.checkpoint import find_resume

    out = tmp_path / "run"
    proc = start_run(
        recipe_args(
            base_config,
            tiny_model,
            chat_file,
            out,
            "train.micro_batch_size=1",
            "train.epochs=1000",
            "log.every_steps=1",
            "checkpoint.every_steps=2",
            "train.hang_timeout_s=10",
        ),
        cache_env,
    )
    workers = []
    try:
        assert wait_for(
            lambda: (
                (out / "metrics.jsonl").exists() and any(r.get("step", 0) >= 3 and "loss" in r for r in metrics(out))
            ),
            proc,
        )
        time.sleep(3)  # the watchdogs post their state every 1.25 s here
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "RANK" in p.environ()]
        rank = {p.environ()["RANK"]: p for p in workers}
        rank["1"].send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        # Once the watchdog has ended rank 0, the frozen rank is let go, so that it takes the
        # launcher's SIGTERM at once rather than after the launcher's 30 s grace.
        thaw = threading.Thread(
            target=lambda: (rank["0"].wait(120), rank["1"].send_signal(signal.SIGCONT)), daemon=True
        )
        thaw.start()
        output, _ = proc.communicate(timeout=120)
        took = time.monotonic() - frozen
        print(f"job ended {took:.1f} s after the freeze")
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        for worker in workers:  # the frozen one, if the launcher left it behind
            with contextlib.suppress(psutil.Error):
                worker.kill()
    assert proc.returncode != 0
    assert "error: rank 0: no progress for 10 s" in output, output[-3000:]
    # ...and names the frozen rank, with the last state it posted (up to 1.25 s before the freeze)
    assert "; rank 1 stopped reporting" in output and "(dead or frozen), last at " in output, output[-3000:]
    # The timeout, then the launcher's teardown.
    assert took < 40, took
    assert find_resume(str(out), "auto") is not None

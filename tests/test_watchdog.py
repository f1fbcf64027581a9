"""A dead or hung rank ends the whole job within train.hang_timeout_s, with the rank named."""

import signal
import subprocess
import sys
import time

import pytest

from llmtrain.watchdog import EXIT_HUNG

from .conftest import metrics
from .test_train import kill_tree, start_run, wait_for

SCRIPT = """
import sys, time
from llmtrain.watchdog import Watchdog
dog = Watchdog(float(sys.argv[1]), rank=3).start()
for i in range(int(sys.argv[2])):
    dog.beat(f"beat {i}")
    time.sleep(0.1)
dog.beat("the last beat")
time.sleep(float(sys.argv[3]))
dog.stop()
"""


def watch(timeout: float, beats: int, then_sleep: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(timeout), str(beats), str(then_sleep)],
                          capture_output=True, text=True, timeout=60)


def test_no_progress_ends_the_process_naming_its_rank():
    proc = watch(0.5, 0, 10)
    assert proc.returncode == EXIT_HUNG
    assert "error: rank 3: no progress for 0.5 s, stuck at the last beat" in proc.stderr


def test_progress_keeps_it_alive_and_stop_disarms_it():
    proc = watch(0.5, 15, 0)  # 1.5 s of beats, each well inside the timeout
    assert proc.returncode == 0, proc.stderr


def test_zero_disables_it():
    assert watch(0, 0, 1).returncode == 0


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_within_the_timeout(base_config, tiny_model, chat_file, cache_env, tmp_path):
    """Rank 1 is frozen (SIGSTOP) mid-run: rank 0 waits in the next collective, its watchdog
    fires, and the launcher takes the job down; the last checkpoint stays usable."""
    import psutil

    from llmtrain.checkpoint import find_resume

    out = tmp_path / "run"
    proc = start_run(["--config", str(base_config), f"model.name_or_path={tiny_model}", f"data.train={chat_file}",
                      f"output_dir={out}", "train.micro_batch_size=1", "train.epochs=1000", "log.every_steps=1",
                      "checkpoint.every_steps=2", "train.hang_timeout_s=10"], cache_env)
    workers = []
    try:
        assert wait_for(lambda: (out / "metrics.jsonl").exists() and
                        any(r.get("step", 0) >= 3 and "loss" in r for r in metrics(out)), proc)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "RANK" in p.environ()]
        next(p for p in workers if p.environ()["RANK"] == "1").send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        took = time.monotonic() - frozen
        print(f"job ended {took:.1f} s after the freeze")
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        for worker in workers:  # the frozen one, if the launcher left it behind
            try:
                worker.kill()
            except psutil.Error:
                pass
    assert proc.returncode != 0
    assert "error: rank 0: no progress for 10 s" in output, output[-3000:]
    # The timeout, then torchrun's teardown (it waits 30 s for the frozen rank to take SIGTERM).
    assert took < 80, took
    assert find_resume(str(out), "auto") is not None

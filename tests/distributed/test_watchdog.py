"""A dead or hung rank ends the whole job within train.hang_timeout_s, with the rank named.
In a real two-process run: tests/launch/test_watchdog.py."""

import subprocess
import sys
import time

import pytest

from llmtrain.distributed.watchdog import EXIT_HUNG

SCRIPT = """
import sys, time
from llmtrain.distributed.watchdog import Watchdog
dog = Watchdog(float(sys.argv[1]), rank=3).start()
for i in range(int(sys.argv[2])):
    dog.beat(f"beat {i}")
    time.sleep(0.1)
dog.beat("the last beat")
time.sleep(float(sys.argv[3]))
dog.stop()
"""


def watch(timeout: float, beats: int, then_sleep: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(timeout), str(beats), str(then_sleep)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_no_progress_ends_the_process_naming_its_rank():
    proc = watch(0.5, 0, 10)
    assert proc.returncode == EXIT_HUNG
    assert "error: rank 3: no progress for 0.5 s, stuck at the last beat; the only process, so what runs" in proc.stderr


def test_progress_keeps_it_alive_and_stop_disarms_it():
    proc = watch(0.5, 15, 0)  # 1.5 s of beats, each well inside the timeout
    assert proc.returncode == 0, proc.stderr


def test_zero_disables_it():
    assert watch(0, 0, 1).returncode == 0


class FakeStore:
    """The three calls the watchdog makes on the process group's store. `post` stands in
    for another rank's watchdog, posting `age` seconds before each read."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode()

    def post(self, rank, where, idle_s, age):
        import json

        self.data[f"llmtrain/watchdog/{rank}"] = lambda: json.dumps(
            {"where": where, "idle_s": idle_s, "posted": time.time() - age}
        ).encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        value = self.data[key]
        return value() if callable(value) else value


def test_the_error_names_ranks_that_went_silent_or_are_stuck_elsewhere(capsys, monkeypatch):
    import json

    from llmtrain.distributed import watchdog

    store = FakeStore()
    store.post(1, "step 5, micro-batch 2 of 4", idle_s=1.0, age=60)  # dead or frozen: no post for a minute
    store.post(2, "writing the checkpoint of step 5", idle_s=40.0, age=0)  # alive, stuck longer, elsewhere
    store.post(3, "step 6, micro-batch 1 of 4", idle_s=40.0, age=0)  # alive, waiting where rank 0 waits
    dog = watchdog.Watchdog(0.4, rank=0, world=5, store=store)  # rank 4 never posted
    dog.beat("step 6, micro-batch 1 of 4")
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit) as exited:
        dog._watch()
    assert exited.value.code == EXIT_HUNG
    err = capsys.readouterr().err
    assert "error: rank 0: no progress for 0.4 s, stuck at step 6, micro-batch 1 of 4; " in err
    assert "rank 1 stopped reporting 60 s ago (dead or frozen), last at step 5, micro-batch 2 of 4" in err
    assert "rank 2 is alive but has made no progress for 40 s, at writing the checkpoint of step 5" in err
    assert "rank 3" not in err and "rank 4" not in err
    assert json.loads(store.get("llmtrain/watchdog/0"))["where"] == "step 6, micro-batch 1 of 4"  # it posts too


def test_stop_waits_for_a_post_in_progress():
    """A daemon thread still inside a store call when the interpreter exits is killed in
    C++ code, and the process aborts ("terminate called without an active exception"),
    failing a finished run: stop() must return only once the thread is out."""
    import threading

    from llmtrain.distributed.watchdog import Watchdog

    inside, calls = threading.Event(), []

    class SlowStore:
        def set(self, key, value):
            calls.append("enter")
            inside.set()
            time.sleep(0.3)
            calls.append("leave")

    dog = Watchdog(0.8, rank=0, world=2, store=SlowStore()).start()  # posts every 0.1 s
    inside.clear()
    assert inside.wait(5)
    dog.stop()
    assert calls[-1] == "leave" and not any(t.name == "llmtrain-watchdog" for t in threading.enumerate())
    time.sleep(0.3)
    assert calls[-1] == "leave"  # and it posts no more

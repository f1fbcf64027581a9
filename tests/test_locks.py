"""A lock file (llmtrain.locks): one holder at a time, which its file names; a second taker
is refused (Busy, naming it) or waits, told once for whom; closing the file frees it; a
link planted in its place is refused."""

import os
import threading

import pytest

from llmtrain import locks
from llmtrain.errors import LinkError


def test_a_second_taker_is_refused_naming_the_holder_until_it_lets_go(tmp_path):
    path = tmp_path / "x.lock"
    held = locks.take(path)
    with pytest.raises(locks.Busy) as busy:
        locks.take(path)
    assert busy.value.holder.startswith(f"pid {os.getpid()} on ") and "started 20" in busy.value.holder
    held.close()
    locks.take(path).close()


def test_a_waiting_taker_is_told_once_for_whom_and_takes_it_when_free(tmp_path):
    path = tmp_path / "x.lock"
    held, told, taken = locks.take(path), [], threading.Event()

    def take():
        locks.take(path, told.append).close()
        taken.set()

    waiter = threading.Thread(target=take)
    waiter.start()
    assert not taken.wait(0.5) and len(told) == 1 and told[0].startswith(f"pid {os.getpid()} on ")
    held.close()
    waiter.join(timeout=10)
    assert taken.is_set() and len(told) == 1


def test_a_link_in_place_of_the_lock_file_is_refused(tmp_path):
    (tmp_path / "target").write_text("keep")
    (tmp_path / "x.lock").symlink_to(tmp_path / "target")
    with pytest.raises(LinkError):
        locks.take(tmp_path / "x.lock")
    assert (tmp_path / "target").read_text() == "keep"

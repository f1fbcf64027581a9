"""User errors are reported once per job: by the main process, and by another process
only when the error was its alone; no process exits before the main one has reported."""

from types import SimpleNamespace

import pytest

from llmtrain import cli
from llmtrain.errors import DataError


class Store:
    def __init__(self):
        self.keys = {}

    def set(self, key, value):
        self.keys[key] = value

    def check(self, keys):
        return all(k in self.keys for k in keys)


@pytest.fixture
def store(monkeypatch):
    s = Store()
    monkeypatch.setattr(cli, "default_store", lambda: s)
    monkeypatch.setattr(cli, "REPORT_WAIT_S", 0.2)
    return s


def state(rank: int, world: int = 2):
    return SimpleNamespace(num_processes=world, is_main_process=rank == 0)


def test_the_main_process_reports_and_says_so(store, capsys):
    cli.report_once(DataError("data.train: a.jsonl line 3: bad\nsecond problem"), state(0))
    assert capsys.readouterr().err == "error: data.train: a.jsonl line 3: bad\nerror: second problem\n"
    assert store.check(["llmtrain/error-reported/0"])


def test_another_process_stays_silent_once_the_main_one_has_reported(store, capsys):
    store.set("llmtrain/error-reported/0", "1")
    cli.report_once(DataError("data.train: bad"), state(1))
    assert capsys.readouterr().err == ""


def test_an_error_of_another_process_alone_is_reported_by_it(store, capsys):
    cli.report_once(DataError("data.train: bad"), state(1))  # the main process never reports
    assert capsys.readouterr().err == "error: data.train: bad\n"


def test_one_process_reports_without_a_store(capsys):
    with pytest.raises(SystemExit) as exited, cli.user_errors(state(0, world=1)):
        raise DataError("data.train: bad")
    assert exited.value.code == 2 and capsys.readouterr().err == "error: data.train: bad\n"

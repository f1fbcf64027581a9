"""User code run contained (llmtrain/usercode.py): whatever it raises is one line naming it,
the stops the user asked for pass through, and what it changes in the process is put back
and named."""

import os
import signal
import sys
import threading
import warnings

import pytest
import torch

from llmtrain.distributed.stop import GRACEFUL, StopRequest
from llmtrain.errors import RewardError
from llmtrain.usercode import contained


@pytest.fixture
def process():
    """Whatever a test's user code changes, back as it was for the next test (on code
    without the containment too, where the test fails)."""
    cwd, grad, dtype, threads = os.getcwd(), torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads()
    handlers, filters, out = {s: signal.getsignal(s) for s in GRACEFUL}, list(warnings.filters), sys.stdout
    mask = os.umask(0o022)
    os.umask(mask)
    yield
    os.chdir(cwd)
    torch.set_grad_enabled(grad)
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    torch.set_default_device(None)
    torch.use_deterministic_algorithms(False)
    for s, h in handlers.items():
        signal.signal(s, h)
    warnings.filters[:] = filters
    sys.stdout = out
    os.umask(mask)


def run(fn, what="grpo.rewards: r.py:f"):
    with contained(what, RewardError, "fix the function", __file__):
        return fn()


def exits():
    exec("exit(3)")  # as a completion exec()ed by a code-running reward would


def test_an_exit_or_any_exception_is_one_line_naming_the_code_and_its_line():
    with pytest.raises(RewardError) as e:
        run(exits)
    line = exits.__code__.co_firstlineno + 1
    assert str(e.value) == (
        f"grpo.rewards: r.py:f exited (SystemExit(3), from exit() or sys.exit()) (test_usercode.py:{line}); code "
        "that llmtrain runs must return, not exit: a module's script part (sys.exit(main())) goes under `if "
        "__name__ == '__main__':`, and exec()ed code that may call exit() needs try/except SystemExit"
    )

    def cancelled():
        import asyncio

        raise asyncio.CancelledError()  # a BaseException, not an Exception

    with pytest.raises(RewardError, match=r"^grpo.rewards: r.py:f raised CancelledError \(test_usercode.py:\d+\); fix"):
        run(cancelled)
    with pytest.raises(RewardError, match=r"raised ZeroDivisionError: division by zero \(test_usercode.py:\d+\)"):
        run(lambda: 1 / 0)


def test_a_stop_the_user_asked_for_passes_through():
    """Ctrl-C (KeyboardInterrupt, a second one while training) and the SystemExit the stop
    handler raises outside training stop the run as they would anywhere."""

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(interrupted)
    with pytest.raises(SystemExit) as e:
        run(lambda: StopRequest()._handle(signal.SIGTERM, None))  # the signal came while the code ran
    assert e.value.code == 128 + signal.SIGTERM


def test_what_the_code_changes_in_the_process_is_put_back_and_named_once(process, tmp_path, capsys):
    def meddles():
        os.chdir(tmp_path)
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)
        torch.use_deterministic_algorithms(True)
        warnings.simplefilter("error")
        os.umask(0o077)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (left open, as careless code leaves it)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    before = (os.getcwd(), torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads())
    filters, handler, out = list(warnings.filters), signal.getsignal(signal.SIGTERM), sys.stdout
    for _ in range(2):
        run(meddles)
        assert (os.getcwd(), torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads()) == before
        assert not torch.are_deterministic_algorithms_enabled() and warnings.filters == filters
        assert signal.getsignal(signal.SIGTERM) == handler and sys.stdout is out
    err = capsys.readouterr().err
    for said in (
        f"warning: grpo.rewards: r.py:f changed the working directory (to '{tmp_path}'); llmtrain put it back; use "
        "absolute paths",
        "changed torch's grad mode (to False); llmtrain put it back; use `with torch.no_grad():`",
        "changed torch's default dtype (to torch.float64)",
        "changed torch.use_deterministic_algorithms (to (True, False))",
        "changed the warnings filters; llmtrain put it back; use `with warnings.catch_warnings():`",
        "changed the umask (to 63)",
        "changed sys.stdout;",
        "replaced the handler of a stop signal",
    ):
        assert err.count(said) == 1, (said, err)  # once, though the code did it twice


def test_the_stop_protocols_own_handler_change_is_kept(process):
    """A first Ctrl-C while training makes the next one interrupt (distributed/stop): a
    change the stop protocol makes while user code runs is not undone."""
    stop = StopRequest()
    signal.signal(signal.SIGINT, stop._handle)
    stop.deferring = True
    run(lambda: stop._handle(signal.SIGINT, None))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_thread_left_running_is_named_and_inference_mode_left_on_is_refused(capsys):
    done = threading.Event()
    run(lambda: threading.Thread(target=done.wait, name="poller").start())
    done.set()
    assert "r.py:f started thread(s) 'poller' that still run; the process will not wait for them" in (
        capsys.readouterr().err
    )
    left = []

    def enters():
        left.append(torch.inference_mode())
        left[0].__enter__()

    try:
        with pytest.raises(RewardError, match="left torch's inference mode on, which cannot be undone from outside"):
            run(enters)
    finally:
        if left:
            left[0].__exit__(None, None, None)
    assert not torch.is_inference_mode_enabled()


def test_a_working_directory_package_already_imported_is_that_import(monkeypatch):
    """Run from llmtrain's checkout, 'llmtrain.calculator:add' is the imported module's
    function: the package is not loaded again under a private name (its import would run
    twice, and change the process state the first import set)."""
    from pathlib import Path

    import llmtrain.calculator
    from llmtrain.errors import ToolError
    from llmtrain.usercode import load_function

    monkeypatch.chdir(Path(llmtrain.__file__).parents[1])  # the directory that holds llmtrain/
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second import's changes would be named as a warning
        fn, file = load_function("llmtrain.calculator:add", "grpo.tools", ToolError)
    assert fn is llmtrain.calculator.add and file == llmtrain.calculator.__file__

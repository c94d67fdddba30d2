"""Fail-fast hooks, driven in-process with a communicator whose abort only records."""
from __future__ import annotations

import io
import os
import signal
import sys
import threading

import pytest
import torch

from dtrain import CheckpointConfig, LocalLearner, MinibatchSource, training_session
from dtrain.comm import LocalCommunicator, add_signal_callback, install_fail_fast, remove_signal_callback
from dtrain.comm.failfast import exception_message, uninstall_fail_fast

from tests.helpers.toy_data import four_class_data


class RecordingComm(LocalCommunicator):
    """A LocalCommunicator whose abort records (message, exit code) instead of exiting."""

    def __init__(self) -> None:
        super().__init__()
        self.aborts: list[tuple[str, int]] = []
        self.aborted = threading.Event()

    def abort(self, message: str, exit_code: int = 1) -> None:  # type: ignore[override]
        self.aborts.append((message, exit_code))
        self.aborted.set()


@pytest.fixture
def comm():
    recording = RecordingComm()
    install_fail_fast(recording)
    yield recording
    uninstall_fail_fast()


def _raise_into_hook(error: BaseException) -> None:
    try:
        raise error
    except BaseException:
        sys.excepthook(*sys.exc_info())


def test_exception_message_is_one_line() -> None:
    assert exception_message(ValueError, ValueError("boom\n  C++ context\nmore")) == "ValueError: boom"
    assert exception_message(KeyError, KeyError()) == "KeyError"
    assert exception_message(OSError, OSError("x"), thread="loader") == "OSError: x (in thread loader)"


def test_uncaught_exception_aborts_with_one_line(comm: RecordingComm, monkeypatch, capsys) -> None:
    monkeypatch.delenv("DTRAIN_DEBUG", raising=False)
    _raise_into_hook(ValueError("bad shape (3, 4)"))
    assert comm.aborts == [("ValueError: bad shape (3, 4)", 1)]
    assert "Traceback" not in capsys.readouterr().err


def test_debug_adds_the_traceback(comm: RecordingComm, monkeypatch, capsys) -> None:
    monkeypatch.setenv("DTRAIN_DEBUG", "1")
    _raise_into_hook(ValueError("bad shape"))
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    assert comm.aborts == [("ValueError: bad shape", 1)]


def test_keyboard_interrupt_exits_130(comm: RecordingComm) -> None:
    _raise_into_hook(KeyboardInterrupt())
    assert comm.aborts == [("KeyboardInterrupt", 130)]


def test_exception_in_a_thread_aborts(comm: RecordingComm) -> None:
    def fail() -> None:
        raise RuntimeError("loader died")

    worker = threading.Thread(target=fail, name="loader")
    worker.start()
    worker.join()
    quiet = threading.Thread(target=sys.exit, name="quiet")  # SystemExit in a thread stays quiet
    quiet.start()
    quiet.join()
    assert comm.aborts == [("RuntimeError: loader died (in thread loader)", 1)]


def test_sigterm_aborts_with_143_unless_a_callback_claims_it(comm: RecordingComm) -> None:
    claimed = threading.Event()

    def claim(signum: int) -> bool:
        claimed.set()
        return True

    add_signal_callback(claim)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert claimed.wait(5)
        assert not comm.aborted.wait(0.3) and comm.aborts == []
    finally:
        remove_signal_callback(claim)
    os.kill(os.getpid(), signal.SIGTERM)
    assert comm.aborted.wait(5)
    assert comm.aborts == [("received SIGTERM; ending the job", 143)]


def test_a_failing_callback_does_not_keep_the_job_alive(comm: RecordingComm, capsys) -> None:
    def broken(signum: int) -> bool:
        raise OSError("cannot write flag")

    add_signal_callback(broken)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert comm.aborted.wait(5)
    finally:
        remove_signal_callback(broken)
    assert comm.aborts == [("received SIGINT; ending the job", 130)]
    assert "OSError: cannot write flag" in capsys.readouterr().err


def test_uninstall_restores_previous_hooks() -> None:
    before = (sys.excepthook, threading.excepthook, signal.getsignal(signal.SIGTERM))
    install_fail_fast(RecordingComm())
    assert sys.excepthook is not before[0]
    uninstall_fail_fast()
    assert (sys.excepthook, threading.excepthook, signal.getsignal(signal.SIGTERM)) == before


def test_install_needs_the_main_thread() -> None:
    errors: list[BaseException] = []

    def install() -> None:
        try:
            install_fail_fast(RecordingComm())
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_forked_child_gets_python_defaults_back(comm: RecordingComm) -> None:
    """A forked worker's SIGTERM kills only the worker, and never reaches the parent's handler."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    ready = context.Event()
    child = context.Process(target=_child_reports_defaults, args=(ready,))
    child.start()
    assert ready.wait(10), "the forked child did not start"
    os.kill(child.pid, signal.SIGTERM)
    child.join(10)
    assert child.exitcode == -signal.SIGTERM
    assert not comm.aborted.wait(0.3) and comm.aborts == []


def _child_reports_defaults(ready) -> None:
    import time

    from dtrain.comm import failfast

    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert sys.excepthook is not failfast._excepthook  # whatever hook was there before install
    assert threading.excepthook is not failfast._threading_excepthook
    ready.set()
    time.sleep(30)


def test_a_training_session_gives_the_preemption_signal_its_handler_back(tmp_path) -> None:
    """Run from a script or a notebook (no fail-fast), a session routes SIGTERM to its preemption flag only
    while it trains; after it, a SIGTERM does what it did before, not os._exit(143)."""
    def train(run_dir) -> None:  # checkpoints, so the preemption signal (SIGTERM) is handled while it trains
        model = torch.nn.Linear(6, 4)
        training_session(model, torch.nn.functional.cross_entropy, LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                         MinibatchSource(four_class_data()), 16, max_samples=32, progress_frequency=0,
                         checkpoint_config=CheckpointConfig("checkpoint.pt"), run_dir=run_dir, tensorboard=False,
                         stream=io.StringIO()).train()

    def own(signum, frame):  # the script's own handler
        pass

    before = signal.signal(signal.SIGTERM, own)
    try:
        train(tmp_path)
        assert signal.getsignal(signal.SIGTERM) is own
        install_fail_fast(RecordingComm())  # the command line: fail-fast owns SIGTERM, before and after the session
        try:
            train(tmp_path / "cli")
            assert signal.getsignal(signal.SIGTERM) is not own
        finally:
            uninstall_fail_fast()
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, before)

"""The suites' hang guards (dtrain/testing/processes.py): a run past its timeout is killed and its error says
where it was; every guard is scaled by DTRAIN_TEST_TIMEOUT_SCALE."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dtrain.testing import processes


def _kill(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)


def test_a_run_past_its_timeout_is_killed_and_its_error_ends_with_the_last_lines(monkeypatch) -> None:
    monkeypatch.setattr(processes, "TIMEOUT_SCALE", 1.0)
    program = ("import sys, time\nfor i in range(100): print('line', i)\n"
               "print('stuck here', file=sys.stderr, flush=True)\ntime.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        processes.run_in_new_session([sys.executable, "-u", "-c", program], dict(os.environ), 3, kill=_kill)
    message = str(raised.value)
    assert "timed out after 3" in message
    assert "line 99" in message and "line 60" not in message  # the last 30 lines of stdout, not all of it
    assert message.rstrip().endswith("stuck here")


def test_every_guard_is_scaled(monkeypatch) -> None:
    monkeypatch.setattr(processes, "TIMEOUT_SCALE", 2.5)
    assert processes.hang_guard(40) == 100
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        processes.run_in_new_session([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), 0.4,
                                     kill=_kill)
    assert raised.value.timeout == pytest.approx(1.0)


@pytest.mark.timeout(7)
def test_a_timeout_mark_is_scaled_too(request) -> None:
    assert request.node.get_closest_marker("timeout").args[0] == processes.hang_guard(7)

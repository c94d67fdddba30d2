"""Fail fast for real, through ``mpiexec -n N python -m dtrain``: any failure on any rank ends every rank.

A rank that raises (any exception type), is killed, or is stopped ends the whole job, with
the failing rank's one ``dtrain: error:`` line first and no traceback: exceptions and
deaths within 10 s, a stopped rank within ``comm.heartbeat_timeout_s``. A slow step is not
a hang. The failures come from ``tests.helpers.failing_model.FailingDigitsCNN`` (see its docstring).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.mpi import run_mpi


def run_failing(tmp_path: Path, nprocs: int, how: str, *overrides: str, rank: int = 1, after: int = 4,
                timeout: float = 240, env: dict | None = None):
    """Runs the digits recipe on ``nprocs`` ranks with rank ``rank`` failing ``how``; returns
    (result, seconds from the failure to the end of mpiexec)."""
    mark = tmp_path / "acted"
    environment = {"DTRAIN_TEST_FAIL_RANK": str(rank), "DTRAIN_TEST_FAIL_AFTER": str(after),
                   "DTRAIN_TEST_FAIL_HOW": how, "DTRAIN_TEST_MARK": str(mark), **(env or {})}
    result = run_mpi(nprocs, ["-m", "dtrain", "+recipe=digits", f"run_dir={tmp_path / 'run'}",
                              "model._target_=tests.helpers.failing_model.FailingDigitsCNN", "session.tensorboard=false",
                              "session.max_samples=30000", *overrides], timeout=timeout, env=environment)
    ended = time.time()
    assert mark.exists(), f"the failure was never injected\n{result.report()}"
    return result, ended - float(mark.read_text())


def error_lines(result) -> list[str]:
    return [line for line in (result.stderr + result.stdout).splitlines() if "dtrain: error:" in line]


def assert_no_traceback(result) -> None:
    assert "Traceback" not in result.stdout + result.stderr, result.report()


@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_an_exception_on_one_rank_ends_every_rank_within_10_s_with_its_line_first(tmp_path, nprocs):
    rank = nprocs - 1
    result, seconds = run_failing(tmp_path, nprocs, "raise", rank=rank)
    assert result.returncode == 1, result.report()
    lines = error_lines(result)
    assert lines and lines[0] == (f"[rank {rank}/{nprocs}] dtrain: error: RuntimeError: injected failure on rank "
                                  f"{rank} (DTRAIN_DEBUG=1 shows the traceback)"), result.report()
    assert len(lines) == 1, result.report()
    assert_no_traceback(result)
    assert seconds < 10, f"the job outlived the failure by {seconds:.1f} s\n{result.report()}"


@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_killed_rank_ends_every_rank_within_10_s(tmp_path, nprocs):
    result, seconds = run_failing(tmp_path, nprocs, "kill", rank=nprocs - 1)
    assert result.returncode != 0, result.report()
    assert_no_traceback(result)
    assert f"rank {nprocs - 1}" in result.stderr, result.report()  # mpiexec names the dead rank
    assert seconds < 10, f"the job outlived the death by {seconds:.1f} s\n{result.report()}"


def _assert_stopped_rank_ended_the_job(result, seconds: float, stopped: int, nprocs: int, bound: float) -> None:
    assert result.returncode == 1, result.report()
    lines = error_lines(result)
    assert lines, result.report()
    if stopped == 0:  # the store lives in rank 0: the others lose it
        assert "heartbeat store" in lines[0] and "rank 0, which serves it, is stopped" in lines[0], result.report()
    else:
        assert lines[0].startswith(f"[rank 0/{nprocs}] dtrain: error: rank {stopped} of {nprocs} has sent no heartbeat"), \
            result.report()
    assert f"comm.heartbeat_timeout_s={bound:g}" in lines[0]
    assert_no_traceback(result)
    assert seconds < bound + 3, f"the job outlived the stopped rank by {seconds:.1f} s (bound {bound} s)\n{result.report()}"


@pytest.mark.slow
@pytest.mark.parametrize("nprocs, stopped", [(2, 1), (4, 2), (4, 0)])
def test_a_stopped_rank_ends_every_rank_within_the_heartbeat_timeout(tmp_path, nprocs, stopped):
    result, seconds = run_failing(tmp_path, nprocs, "stop", "comm.heartbeat_timeout_s=10", rank=stopped)
    _assert_stopped_rank_ended_the_job(result, seconds, stopped, nprocs, 10)


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_60_s_by_default(tmp_path):
    result, seconds = run_failing(tmp_path, 2, "stop", rank=1)
    _assert_stopped_rank_ended_the_job(result, seconds, 1, 2, 60)


@pytest.mark.slow  # the default suite keeps to 10 minutes on 2 cores; CI runs the slow set too
def test_a_slow_step_is_not_taken_for_a_hang(tmp_path):
    # one minibatch takes 8 s, longer than the 4 s heartbeat bound: the heartbeat thread keeps beating
    result, _ = run_failing(tmp_path, 2, "slow", "comm.heartbeat_timeout_s=4", "session.max_samples=320",
                            rank=1, env={"DTRAIN_TEST_SLOW_S": "8"})
    assert result.returncode == 0, result.report()
    assert "test: accuracy" in result.stdout, result.report()


@pytest.mark.slow
def test_a_long_hold_of_the_interpreter_lock_under_heavy_cpu_load_is_not_taken_for_a_hang(tmp_path):
    """Rank 1's training thread holds the interpreter lock for 8 s, twice the 4 s heartbeat bound, while busy
    processes keep every core 5 times over: the beats come from a process of their own, so the job ends well."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(5 * (os.cpu_count() or 1))]
    try:
        result, _ = run_failing(tmp_path, 2, "gil", "comm.heartbeat_timeout_s=4", "session.max_samples=320",
                                rank=1, env={"DTRAIN_TEST_SLOW_S": "8"}, timeout=280)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert result.returncode == 0, result.report()
    assert "test: accuracy" in result.stdout, result.report()


@pytest.mark.slow
def test_ranks_that_finished_keep_beating_while_rank_0_writes_its_outputs(tmp_path):
    """Rank 0 alone writes the weights at the end, here for 8 s against a 4 s heartbeat bound: rank 1,
    done and waiting for it, beats until every rank has arrived (comm.finalize), so the job ends well."""
    result, _ = run_failing(tmp_path, 2, "slow_outputs", "comm.heartbeat_timeout_s=4", "session.max_samples=320",
                            "session.checkpoint.frequency=0", rank=0, env={"DTRAIN_TEST_SLOW_S": "8"})
    assert result.returncode == 0, result.report()
    assert "weights:" in result.stdout, result.report()

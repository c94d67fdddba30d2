"""The named-checks harness of the multi-process tests (``tests.helpers.checks``): a check that fails
or never ran must fail its own test, never pass silently."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.helpers.checks import RESULTS_DIR_VARIABLE, CheckLaunch, run_checks


def _run_ranks(checks_by_rank: list[dict]) -> None:
    """Run each rank's checks in turn, as the ranks of a 2-process job would."""
    for rank, checks in enumerate(checks_by_rank):
        try:
            run_checks(SimpleNamespace(rank=rank, size=len(checks_by_rank)), checks)
        except AssertionError:
            pass  # recorded, then raised again: under mpiexec this ends the job


def test_passed_checks_give_each_rank_its_figures(tmp_path, monkeypatch):
    monkeypatch.setenv(RESULTS_DIR_VARIABLE, str(tmp_path))
    _run_ranks([{"a": lambda comm: {"rank": comm.rank}, "b": lambda comm: None}] * 2)
    launch = CheckLaunch.read(tmp_path, 2, 0, "output")
    assert launch.results("a") == [{"rank": 0}, {"rank": 1}] and launch.result("a") == {"rank": 0}
    assert launch.results("b") == [None, None]


def test_a_failed_check_fails_naming_itself_and_later_checks_never_ran(tmp_path, monkeypatch):
    def fails_on_rank_1(comm):
        assert comm.rank == 0, "rank 1 disagrees"

    monkeypatch.setenv(RESULTS_DIR_VARIABLE, str(tmp_path))
    checks = {"first": lambda comm: 1, "second": fails_on_rank_1, "third": lambda comm: 3}
    _run_ranks([checks, checks])
    launch = CheckLaunch.read(tmp_path, 2, 1, "the launch's output")
    assert launch.results("first") == [1, 1]
    with pytest.raises(pytest.fail.Exception, match=r"check 'second' failed on rank 1/2: AssertionError: rank 1 "
                                                   r"disagrees(.|\n)*the launch's output"):
        launch.results("second")
    with pytest.raises(pytest.fail.Exception, match=r"check 'third' never finished on ranks \[1\] of 2: the launch "
                                                   r"ended with exit code 1"):
        launch.results("third")


def test_a_check_no_rank_reported_fails(tmp_path):
    launch = CheckLaunch.read(tmp_path, 2, None, "killed")
    with pytest.raises(pytest.fail.Exception, match=r"check 'anything' never finished on ranks \[0, 1\] of 2: the "
                                                   r"launch timed out"):
        launch.result("anything")


def test_without_a_results_directory_a_worker_prints_pass_and_fail(capsys, monkeypatch):
    monkeypatch.delenv(RESULTS_DIR_VARIABLE, raising=False)
    with pytest.raises(ZeroDivisionError):
        run_checks(SimpleNamespace(rank=0, size=1), {"fine": lambda comm: None, "broken": lambda comm: 1 / 0})
    assert capsys.readouterr().out == "PASS fine rank 0/1\nFAIL broken rank 0/1\n"

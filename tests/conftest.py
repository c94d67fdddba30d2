"""Fixtures and markers shared by the whole suite (layout and helpers: ``tests/helpers/__init__.py``).

Multi-process tests call :func:`tests.helpers.mpi.run_mpi` (it skips the test when no ``mpiexec``
is found) or, for a worker with several named checks, :func:`tests.helpers.checks.launch_checks`
from a module-scoped fixture.

Markers are registered in ``pyproject.toml``: ``slow`` (left out of the default run; ``pytest -m slow``),
``root`` (network namespaces) and ``gpu``. Test files run longest first, by the seconds recorded in
``tests/durations.json`` (:mod:`tests.helpers.durations`; ``--record-durations`` refreshes it).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from dtrain.testing.processes import hang_guard
from tests.helpers import durations
from tests.helpers.mpi import LAUNCHER_VARIABLES

_measured: dict[str, float] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", action="store_true",
                     help="write the seconds each test took into tests/durations.json (the order files run in)")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: a file counts only its selected tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    durations.longest_files_first(items, durations.recorded())
    for item in items:  # pytest-timeout's limits are hang guards too, scaled as the runs inside them are
        limit = item.get_closest_marker("timeout")
        if limit is not None and limit.args:
            item.add_marker(pytest.mark.timeout(hang_guard(limit.args[0])), append=False)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _measured[report.nodeid] = _measured.get(report.nodeid, 0.0) + report.duration  # setup, call and teardown


def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config.getoption("record_durations") and not hasattr(session.config, "workerinput"):
        durations.record(_measured)  # the controller (or the only process) writes, not each xdist worker


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory path for one test (``tmp_path/run``, not yet created: dtrain creates it)."""
    return tmp_path / "run"


@pytest.fixture
def plain_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This process's environment without any launcher's variables for one test (as in a plain
    shell, even when pytest itself runs under a launcher); returns ``monkeypatch`` to set more."""
    for name in list(os.environ):
        if LAUNCHER_VARIABLES.match(name):
            monkeypatch.delenv(name)
    return monkeypatch

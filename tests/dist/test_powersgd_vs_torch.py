"""dtrain's PowerSGD agrees with PyTorch's ``powerSGD_hook`` on the same gradients (same outputs, P
and Q after the same steps, to float tolerance), under a real ``mpiexec -n 2``; see the worker."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.mpi import run_mpi

WORKER = str(Path(__file__).with_name("_powersgd_torch_worker.py"))


@pytest.mark.timeout(240)
def test_powersgd_matches_torch_hook_under_mpiexec() -> None:
    result = run_mpi(2, [WORKER], timeout=200)
    assert result.returncode == 0, result.report()
    passes = re.findall(r"^PASS rank (\d)/2 compared=\{1: (\d+), 3: (\d+)\}$", result.stdout, re.MULTILINE)
    assert sorted(rank for rank, _, _ in passes) == ["0", "1"], result.report()
    assert all(int(one) >= 4 and int(three) >= 4 for _, one, three in passes), result.report()

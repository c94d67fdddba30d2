"""Block momentum under a real mpiexec: one model on all ranks after every sync, equal to the
single-process simulation of CNTK's formulas; and the CLI end to end.

Each launch starts torch in every rank (a few seconds on 2 cores), so one run of
``_bm_worker.py`` covers both learner configurations.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from launch import run_mpi

WORKER = str(Path(__file__).with_name("_bm_worker.py"))
CASES = ("defaults", "variants")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nprocs", [2, 4])
def test_ranks_agree_after_every_sync_and_match_the_simulation(nprocs: int) -> None:
    result = run_mpi(nprocs, [WORKER], timeout=120)
    assert result.returncode == 0, result.report()
    for case in CASES:
        passes = sorted(re.findall(rf"^PASS {case} rank (\d+)/{nprocs}$", result.stdout, re.MULTILINE))
        assert passes == [str(rank) for rank in range(nprocs)], result.report()
        differences = re.findall(rf"^SYNC {case} \d+ (\S+)$", result.stdout, re.MULTILINE)
        assert len(differences) >= 3 and all(float(d) == 0.0 for d in differences), result.report()


@pytest.mark.timeout(240)
def test_cli_trains_digits_with_block_momentum_on_two_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_mpi(2, ["-m", "dtrain", "+recipe=digits", "learner=block_momentum", "learner.block_size=640",
                         "session.max_samples=3000", f"run_dir={run_dir}"], timeout=200)
    assert result.returncode == 0, result.report()
    assert "finished: 3,000 samples" in result.stdout, result.report()
    assert (run_dir / "config.yaml").is_file()

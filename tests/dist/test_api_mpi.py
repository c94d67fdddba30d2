"""The Python API under a real ``mpiexec -n 2``: a one-process session is refused, the
distributed snippet trains one model across the ranks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.mpi import run_mpi

WORKER = Path(__file__).with_name("_api_worker.py")


@pytest.mark.slow
def test_the_one_process_api_under_mpiexec_is_refused_instead_of_training_copies(run_dir):
    result = run_mpi(2, [WORKER, "single", run_dir], timeout=180)
    assert result.returncode != 0, result.report()
    assert "mpiexec started 2 processes but this session's learner has a one-process communicator" in result.stderr
    assert "dtrain.create_communicator()" in result.stderr
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_the_distributed_api_under_mpiexec_trains_one_model(run_dir):
    result = run_mpi(2, [WORKER, "distributed", run_dir], timeout=240)
    assert result.returncode == 0, result.report()
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    outcome = json.loads(line[len("RESULT "):])
    assert outcome["size"] == 2 and outcome["same_parameters"] and outcome["samples_seen"] == 3000
    assert outcome["accuracy"] > 0.8
    assert sorted(p.name for p in run_dir.glob("checkpoint-*.pt")) == ["checkpoint-3000.pt"]

"""A Hydra sweep under a real ``mpiexec -n 2``: every job is one 2-rank run in its own directory."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.mpi import run_mpi


@pytest.mark.slow
def test_a_sweep_under_mpiexec_trains_each_job_on_all_ranks_in_its_own_directory(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_mpi(2, ["-m", "dtrain", "-m", "+recipe=digits", "optimizer.lr=0.02,0.05", "session.max_samples=640",
                         "session.tensorboard=false", "model.hidden=32", f"hydra.sweep.dir={sweep}"], timeout=240)
    assert result.returncode == 0, result.report()
    assert "restored" not in result.stdout and result.stdout.count("2 workers (mpi)") == 2  # one node: auto is mpi
    errors = []
    for job, lr in ((0, 0.02), (1, 0.05)):
        run = sweep / str(job)
        assert yaml.safe_load((run / "config.yaml").read_text())["optimizer"]["lr"] == lr
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        errors.append(next(r["error"] for r in records if r["kind"] == "test"))
    assert errors[0] != errors[1]
    assert sorted(p.name for p in Path(sweep).iterdir()) == ["0", "1", "multirun.yaml"]

"""A Hydra sweep under a real ``mpiexec -n 2``: every job is one 2-rank run in its own directory, and
a job that fails on every rank (a bad setting, a diverging loss) ends alone, the ranks agreeing."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.mpi import run_mpi


@pytest.mark.slow
def test_a_sweep_under_mpiexec_trains_each_job_on_all_ranks_and_goes_on_past_failed_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_mpi(2, ["-m", "dtrain", "-m", "+recipe=digits", "optimizer.lr=0.02,-1,1e9,0.05", "session.max_samples=640",
                         "session.progress_frequency=320", "session.tensorboard=false", "model.hidden=32",
                         f"hydra.sweep.dir={sweep}"], timeout=300)
    assert result.returncode == 2, result.report()  # every rank agrees: 2 jobs failed, both with code 2
    assert "restored" not in result.stdout and result.stdout.count("2 workers (mpi)") == 3  # one node: auto is mpi
    errors = []
    for job, lr in ((0, 0.02), (3, 0.05)):
        run = sweep / str(job)
        assert yaml.safe_load((run / "config.yaml").read_text())["optimizer"]["lr"] == lr
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        errors.append(next(r["error"] for r in records if r["kind"] == "test"))
    assert errors[0] != errors[1]
    # rank 0 alone names each job, reports each failure once, and sums up
    assert [line for line in result.stdout.splitlines() if line.startswith("dtrain: job ")] == [
        "dtrain: job 0/4: optimizer.lr=0.02", "dtrain: job 1/4: optimizer.lr=-1",
        "dtrain: job 2/4: optimizer.lr=1000000000.0", "dtrain: job 3/4: optimizer.lr=0.05"]
    bad_input, diverged, ending = [line for line in result.stderr.splitlines() if "dtrain: error:" in line]
    assert bad_input == "dtrain: error: optimizer.lr=-1.0: expected a positive finite number", result.report()
    assert diverged.startswith("dtrain: error: training diverged: the mean loss is "), result.report()
    assert ending == "dtrain: error: sweep: 2 of 4 jobs failed (jobs 1, 2)", result.report()
    with open(sweep / "sweep_summary.csv", newline="") as table:
        assert [row["status"] for row in csv.DictReader(table)] == ["finished", "failed", "diverged", "finished"]
    assert sorted(p.name for p in Path(sweep).iterdir()) == [".dtrain-sweep-jobs.jsonl", "0", "1", "2", "3",
                                                             "multirun.yaml", "sweep_summary.csv"]

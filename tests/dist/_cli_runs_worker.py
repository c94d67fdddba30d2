"""Worker of tests/helpers/cli_runs.py, run under mpiexec: ``python _cli_runs_worker.py JOBS.json``.

Runs many ``python -m dtrain`` command lines in one launch, as ``dtrain.cli.run`` runs one: every rank
composes each config from its overrides (``tests.helpers.config.compose_config``, the CLI's tree and
schemas), checks it with ``dtrain.config.validate`` and calls ``dtrain.build.train_from_config`` on
ONE communicator, created from the first config's ``comm`` section with fail-fast and the heartbeat
as the CLI sets them up. The start-up of Python, torch and the config (seconds per rank) is paid once
instead of once per command line.

``JOBS.json`` is a list of ``{"name": NAME, "runs": [{"name": RUN, "overrides": [...]}, ...]}``; each job is
one named check (``tests.helpers.checks``) whose runs go in their order (a resumed run after the run whose
checkpoint it restores). Each rank's stdout of each run goes to ``<JOBS dir>/<NAME>.<RUN>.rank<r>.out``
(what the command line would print, for the test to read); the check returns those paths by run name. A run
that fails prints its file's contents to the launch's stdout.

A run that fails ends the whole launch (fail-fast aborts every rank): after an exception on one rank the
others may wait in a collective that never completes, so the communicator is not safe to go on with.
The failed job's check is recorded as failed on the rank that raised; the later jobs' checks are missing,
and their tests report the launch's output.
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from dtrain.build import train_from_config
from dtrain.comm import create_communicator, install_fail_fast, start_heartbeat
from dtrain.config import validate

from tests.helpers.checks import run_checks
from tests.helpers.config import compose_config


def run_job(comm, job: dict, outputs: Path, comm_settings) -> dict[str, str]:
    """Every run of ``job`` in turn on ``comm``; this rank's stdout file of each, by run name."""
    printed = {}
    for run in job["runs"]:
        cfg = compose_config(*run["overrides"])
        problems = validate(cfg)  # just before the run: a resumed run's restore_from exists by now
        if cfg.comm != comm_settings:
            problems.append(f"comm settings {cfg.comm} differ from the launch's communicator's {comm_settings}")
        if problems:
            raise ValueError(f"{job['name']} {run['name']}: " + "; ".join(problems))
        path = outputs / f"{job['name']}.{run['name']}.rank{comm.rank}.out"
        try:
            with open(path, "w") as stream, contextlib.redirect_stdout(stream):
                train_from_config(comm, cfg)
        except BaseException:  # what the run printed joins the launch's output, which the tests report
            text = path.read_text() if path.exists() else ""
            sys.stdout.write(f"--- {job['name']} {run['name']}, rank {comm.rank} stdout ---\n{text}")
            sys.stdout.flush()
            raise
        printed[run["name"]] = str(path)
    return printed


def main(jobs_path: str) -> None:
    jobs_file = Path(jobs_path)
    jobs = json.loads(jobs_file.read_text())
    first = compose_config(*jobs[0]["runs"][0]["overrides"])
    comm = create_communicator(first.comm.backend, timeout_s=first.comm.timeout_s, hierarchical=first.comm.hierarchical,
                               ranks_per_host=first.comm.ranks_per_host)
    install_fail_fast(comm)
    start_heartbeat(comm, first.comm.heartbeat_timeout_s)  # comm.finalize() stops it
    run_checks(comm, {job["name"]: (lambda comm, job=job: run_job(comm, job, jobs_file.parent, first.comm))
                      for job in jobs})
    comm.finalize()


if __name__ == "__main__":
    main(sys.argv[1])

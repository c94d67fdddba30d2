"""Many ``python -m dtrain`` command lines in one ``mpiexec`` launch, for tests that compare whole runs.

``tests/dist/_cli_runs_worker.py`` runs the command lines one after the other in one process per rank, on one
communicator (Python's, torch's and the config's start-up paid once per rank, not once per command line), each
run's stdout by rank in a file of its own. Runs that share a launch must share their ``comm`` settings; a run
that fails ends the launch. What the command line itself does before training (Hydra's own flags, the run
directory's first lines) is the CLI tests'; these are for what training computes and writes.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.checks import CheckLaunch, launch_checks

WORKER = Path(__file__).resolve().parents[1] / "dist" / "_cli_runs_worker.py"


@dataclass
class RunOutput:
    """What one run printed: every rank's stdout, as ``python -m dtrain`` would have."""

    name: str
    by_rank: list[str]
    launch_output: str

    @property
    def stdout(self) -> str:
        return "".join(self.by_rank)

    def report(self) -> str:
        ranks = "".join(f"--- {self.name} run, rank {rank} stdout ---\n{text}" for rank, text in enumerate(self.by_rank))
        return f"{ranks}--- the launch ---\n{self.launch_output}"


@dataclass
class CliRuns:
    """The runs of one launch, by job and run name."""

    launch: CheckLaunch
    jobs: list[str]

    def run(self, job: str, run: str) -> RunOutput:
        """What run ``run`` of job ``job`` printed; fails the calling test, with the launch's output, unless every
        run of the job finished on every rank."""
        printed = self.launch.results(job)
        return RunOutput(f"{job} {run}", [Path(by_rank[run]).read_text() for by_rank in printed], self.launch.output)

    def run_ended(self, job: str, run: str) -> RunOutput:
        """:meth:`run`, and a failure when the launch itself ended badly after every run had finished (a run's
        failure is its own test's to report)."""
        output = self.run(job, run)
        records = self.launch.records
        finished = all(len(records.get(name, {})) == self.launch.nprocs
                       and all(record["passed"] for record in records[name].values()) for name in self.jobs)
        if self.launch.returncode != 0 and finished:
            import pytest

            pytest.fail(f"every run finished, but the launch ended with exit code {self.launch.returncode}\n"
                        f"{self.launch.output}", pytrace=False)
        return output


def launch_cli_runs(nprocs: int, jobs: Mapping[str, Sequence[tuple[str, Sequence[str]]]], base: Path,
                    timeout: float) -> CliRuns:
    """``mpiexec -n NPROCS`` running every job's command lines (``(run name, the arguments after python -m
    dtrain)``, in order: a resumed run after the run whose checkpoint it restores), one job after the other.
    ``base`` (new or empty: under a module fixture's ``tmp_path_factory.mktemp``) gets the job list, the records and
    the runs' stdout files."""
    listed = [{"name": name, "runs": [{"name": run, "overrides": list(overrides)} for run, overrides in runs]}
              for name, runs in jobs.items()]
    base.mkdir(parents=True, exist_ok=True)
    (base / "jobs.json").write_text(json.dumps(listed, indent=1))
    return CliRuns(launch_checks(nprocs, [WORKER, base / "jobs.json"], base, timeout=timeout), list(jobs))

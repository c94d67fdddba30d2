"""Shared by the two-level tests: a job's host view for the layout rules, an interrupted run resumed bit for bit
and onto other hosts, and one command line run on two network-namespace hosts compared with its one-machine
rehearsal (the uninterrupted run's checkpoint at the same sample count)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.cli_runs import CliRuns, launch_cli_runs
from tests.helpers.mpi import run_mpi

REPO = Path(__file__).resolve().parents[2]


class FakeJob:
    """A job's view for :func:`dtrain.learners.two_level.host_layout`: its size and the hosts its launcher reports."""

    launcher = "mpi"

    def __init__(self, hosts: list[list[int]], local_size: int = 1) -> None:
        self.hosts, self.size, self.local_size = hosts, sum(map(len, hosts)), local_size

    def host_ranks(self, ranks_per_host=None):
        return self.hosts


def namespace_run_equals_rehearsal(overrides: list[str], rehearsal: Path, tmp_path: Path) -> None:
    """``python -m dtrain OVERRIDES`` on 2 network-namespace hosts x 2 ranks (hostfile, --npernode 2: hosts from
    the launcher) ends with the model, bit for bit, of ``rehearsal``: a checkpoint at the same sample count of the
    same job on one machine with ``comm.ranks_per_host=2``. Skips where namespaces cannot be made (not root)."""
    from dtrain.session import checkpoint
    from dtrain.testing.netns import NamespaceCluster, available

    ok, reason = available()
    if not ok:
        pytest.skip(reason)
    env = {"PYTHONPATH": str(REPO)}
    with NamespaceCluster(num_hosts=2, rate="1gbit", slots=2) as cluster:
        command = cluster.mpiexec_args(npernode=2, export=list(env)) + [
            sys.executable, "-m", "dtrain", *overrides, f"run_dir={tmp_path / 'two_hosts'}"]
        multi = cluster.run(command, timeout=200, env=env)
    assert multi.returncode == 0, multi.report()
    assert "two levels over 2 hosts x 2 ranks (from the mpi launcher)" in multi.stdout, multi.report()
    found = re.findall(r"^checkpoint: (\S+)$", multi.stdout, re.MULTILINE)
    two_hosts, one_host = checkpoint.load(Path(found[-1]))["model"], checkpoint.load(rehearsal)["model"]
    assert [name for name in one_host if not torch.equal(two_hosts[name], one_host[name])] == []


#: one thread per rank over gloo: the same sums inside each rank on one machine as on the namespace hosts
SAME_SUMS = ["session.num_threads=1", "comm.backend=gloo"]
#: what every run of :func:`whole_and_split` adds: :data:`SAME_SUMS`, 2 hosts x 2 ranks on one machine
ONE_MACHINE = [*SAME_SUMS, "comm.ranks_per_host=2"]


def whole_and_split(overrides: list[str], base: Path) -> CliRuns:
    """``python -m dtrain OVERRIDES`` at 2 hosts x 2 ranks (:data:`ONE_MACHINE`) straight to 1,920 samples
    (``base/whole``), and again from that run's checkpoint at 1,280 (a periodic one, as an interruption leaves
    behind) in ``base/split``: job ``resume`` of one 4-rank launch (``tests.helpers.cli_runs``)."""
    saved = base / "whole" / "checkpoint-1280.pt"
    runs = [("whole", [*overrides, *ONE_MACHINE, f"run_dir={base / 'whole'}", "session.max_samples=1920"]),
            ("split", [*overrides, *ONE_MACHINE, f"run_dir={base / 'split'}", "session.max_samples=1920",
                       f"session.checkpoint.restore_from={saved}"])]
    return launch_cli_runs(4, {"resume": runs}, base / "launch", timeout=300)


def resume_then_relayout(overrides: list[str], runs: CliRuns, base: Path):
    """The two runs of :func:`whole_and_split` (``runs``, under ``base``) end with bit-identical models; then the
    resumed run goes on to 2,560 samples at 4 hosts x 1 rank. Returns (the resumed run's checkpoint, the 4 x 1
    run)."""
    from dtrain.session import checkpoint

    whole, split = runs.run_ended("resume", "whole"), runs.run_ended("resume", "split")
    assert "two levels over 2 hosts x 2 ranks (from comm.ranks_per_host=2)" in whole.stdout, whole.report()
    saved = base / "whole" / "checkpoint-1280.pt"
    assert f"restored {saved} at 1280 samples" in split.stdout, split.report()
    a = checkpoint.load(base / "whole" / "checkpoint-1920.pt")
    b = checkpoint.load(base / "split" / "checkpoint-1920.pt")
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{name} differs after resume"
    other = run_mpi(4, ["-m", "dtrain", *overrides, *SAME_SUMS, "comm.ranks_per_host=1", f"run_dir={base / 'split'}",
                        "session.max_samples=2560"], timeout=240)
    assert other.returncode == 0, other.report()
    return b, other

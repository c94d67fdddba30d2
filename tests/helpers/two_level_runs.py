"""Shared by the two-level tests: a job's host view for the layout rules, and one command line run on two
network-namespace hosts compared with its one-machine rehearsal."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.mpi import run_mpi

REPO = Path(__file__).resolve().parents[2]


class FakeJob:
    """A job's view for :func:`dtrain.learners.two_level.host_layout`: its size and the hosts its launcher reports."""

    launcher = "mpi"

    def __init__(self, hosts: list[list[int]], local_size: int = 1) -> None:
        self.hosts, self.size, self.local_size = hosts, sum(map(len, hosts)), local_size

    def host_ranks(self, ranks_per_host=None):
        return self.hosts


def namespace_run_equals_rehearsal(args: list[str], tmp_path: Path) -> None:
    """``python ARGS`` on 2 network-namespace hosts x 2 ranks (hostfile, --npernode 2: hosts from the launcher)
    ends with the model, bit for bit, of the same job on one machine with ``comm.ranks_per_host=2``.
    Skips where namespaces cannot be made (not root)."""
    from dtrain.session import checkpoint
    from dtrain.testing.netns import NamespaceCluster, available

    ok, reason = available()
    if not ok:
        pytest.skip(reason)
    env = {"PYTHONPATH": str(REPO)}
    with NamespaceCluster(num_hosts=2, rate="1gbit", slots=2) as cluster:
        command = cluster.mpiexec_args(npernode=2, export=list(env)) + [sys.executable, *args,
                                                                        f"run_dir={tmp_path / 'two_hosts'}"]
        multi = cluster.run(command, timeout=200, env=env)
    assert multi.returncode == 0, multi.report()
    assert "two levels over 2 hosts x 2 ranks (from the mpi launcher)" in multi.stdout, multi.report()
    rehearsal = run_mpi(4, [*args, "comm.ranks_per_host=2", f"run_dir={tmp_path / 'one_host'}"], timeout=200)
    assert rehearsal.returncode == 0, rehearsal.report()
    paths = [re.findall(r"^checkpoint: (\S+)$", run.stdout, re.MULTILINE) for run in (multi, rehearsal)]
    two_hosts, one_host = (checkpoint.load(Path(found[-1]))["model"] for found in paths)
    assert [name for name in one_host if not torch.equal(two_hosts[name], one_host[name])] == []


def resume_then_relayout(common: list[str], tmp_path: Path):
    """``python COMMON`` at 2 hosts x 2 ranks (``comm.ranks_per_host=2``) straight to 1,920 samples, and again
    from that run's checkpoint at 1,280 (a periodic one, as an interruption leaves behind) in another run
    directory: the two final models must be bit-identical. Then the resumed run goes on to 2,560 samples at
    4 hosts x 1 rank. Returns (the resumed run's checkpoint, the 4 x 1 run)."""
    from dtrain.session import checkpoint

    def job(run_dir: Path, *overrides: str):
        return run_mpi(4, [*common, f"run_dir={run_dir}", *overrides], timeout=240)

    whole = job(tmp_path / "whole", "comm.ranks_per_host=2", "session.max_samples=1920")
    assert whole.returncode == 0, whole.report()
    assert "two levels over 2 hosts x 2 ranks (from comm.ranks_per_host=2)" in whole.stdout, whole.report()
    saved = tmp_path / "whole" / "checkpoint-1280.pt"
    second = job(tmp_path / "split", "comm.ranks_per_host=2", "session.max_samples=1920",
                 f"session.checkpoint.restore_from={saved}")
    assert second.returncode == 0, second.report()
    assert f"restored {saved} at 1280 samples" in second.stdout, second.report()
    a = checkpoint.load(tmp_path / "whole" / "checkpoint-1920.pt")
    b = checkpoint.load(tmp_path / "split" / "checkpoint-1920.pt")
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{name} differs after resume"
    other = job(tmp_path / "split", "comm.ranks_per_host=1", "session.max_samples=2560")
    assert other.returncode == 0, other.report()
    return b, other

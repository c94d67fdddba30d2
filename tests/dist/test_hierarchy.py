"""Sub-communicators and the hierarchical all-reduce under ``mpiexec -n 4`` (2 'hosts' x 2 ranks through
``comm.ranks_per_host``); the real two-host case is in test_multihost.py.

One launch per backend runs the named checks of ``_hierarchy_worker.py``; the fail-fast cases kill or
stop a rank inside a host-local group and time how long the job takes to end.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.checks import launch_checks
from tests.helpers.mpi import plain_environment, run_mpi, with_repository_on_path

WORKER = Path(__file__).with_name("_hierarchy_worker.py")
CHECKS = ("host_groups", "sub_collectives", "split_order", "hierarchical_allreduce", "uneven_hosts")
FAIL_FAST_LIMIT_S = 30.0  # as tests/dist/test_comm.py: a failing rank ends the whole job within this


def _env(**extra: str) -> dict[str, str]:
    return with_repository_on_path(plain_environment(PYTHONUNBUFFERED="1", **extra))


@pytest.fixture(scope="module", params=[pytest.param("gloo", marks=pytest.mark.slow), pytest.param("mpi", marks=pytest.mark.slow)])
def launch(request, tmp_path_factory):
    """One 4-rank launch of every check on one backend."""
    results = tmp_path_factory.mktemp(f"hierarchy-{request.param}")
    return launch_checks(4, [WORKER, "checks"], results, timeout=120, env=_env(WORKER_BACKEND=request.param))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("check", CHECKS)
def test_sub_communicators(launch, check: str) -> None:
    """Each named check passed on all 4 ranks."""
    assert len(launch.results(check)) == 4


def _delay_after_event(result) -> float:
    event = re.search(r"^EVENT ([0-9.]+)$", result.stdout, re.MULTILINE)
    assert event, "rank 3 never reached its failure point\n" + result.report()
    return time.time() - float(event.group(1))


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_rank_killed_inside_a_host_group_ends_the_job(backend: str) -> None:
    """Rank 3 is SIGKILLed while rank 2 waits for it in their host's reduce (and ranks 0, 1 wait
    for rank 2): the whole job ends, non-zero, within the usual bound."""
    result = run_mpi(4, [str(WORKER), "kill"], timeout=FAIL_FAST_LIMIT_S + 40, env=_env(WORKER_BACKEND=backend))
    delay = _delay_after_event(result)
    assert result.returncode != 0, result.report()
    assert delay < FAIL_FAST_LIMIT_S, f"job ended {delay:.1f} s after the kill\n" + result.report()


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_stalled_rank_in_a_host_group_times_out(backend: str) -> None:
    """Rank 3 stays alive but silent: its host partner's collective times out (3 s) inside the
    sub-group, and that ends the whole job with one rank's line, not a hang."""
    result = run_mpi(4, [str(WORKER), "stall"], timeout=FAIL_FAST_LIMIT_S + 40,
                     env=_env(WORKER_BACKEND=backend, WORKER_TIMEOUT_S="3"))
    delay = _delay_after_event(result)
    assert result.returncode != 0, result.report()
    assert re.search(r"\[rank [0-2]/4\] RuntimeError", result.stderr), result.report()
    assert 2.5 <= delay < 20, f"job ended {delay:.1f} s after rank 3 stalled\n" + result.report()


def _digits(run_dir: Path, hierarchical: str) -> list[str]:
    # session.num_threads=1: the same summation inside each rank in both runs
    return ["-m", "dtrain", "+recipe=digits", "learner=data_parallel", "session.max_samples=640",
            "session.num_threads=1", "session.tensorboard=false", "comm.backend=gloo", "comm.ranks_per_host=2",
            f"comm.hierarchical={hierarchical}", f"run_dir={run_dir}"]


def _final_parameters(stdout: str) -> dict:
    from dtrain.session.checkpoint import load

    paths = re.findall(r"^checkpoint: (\S+)$", stdout, re.MULTILINE)
    assert len(paths) == 1, stdout
    return load(Path(paths[0]))["model"]


@pytest.fixture(scope="module")
def one_host_runs(tmp_path_factory) -> dict:
    """The digits job of :func:`_digits` on 4 ranks of this host, by ``comm.hierarchical`` setting (false, auto):
    each asserted to have finished. The auto run is also the two-host test's rehearsal. (``true`` takes the path
    that auto chooses here, with the same sums: the checks of ``launch`` build it explicitly.)"""
    base = tmp_path_factory.mktemp("one_host")
    runs = {}
    for setting in ("false", "auto"):
        result = run_mpi(4, _digits(base / setting, setting), timeout=130, env=_env())
        assert result.returncode == 0, result.report()
        runs[setting] = result
    return runs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hierarchical_data_parallel_equals_flat(one_host_runs: dict) -> None:
    """20 steps of digits on 2 'hosts' x 2 ranks: auto chooses the hierarchical all-reduce from the hosts
    alone, the start-up line says so, and its parameters equal the flat one's to float rounding (the sum is
    associated differently: (r0+r1)+(r2+r3))."""
    runs = one_host_runs
    assert re.search(r"^dtrain: hierarchical all-reduce over 2 hosts x 2 ranks: .*\(hosts from comm\.ranks_per_host=2; "
                     r"comm\.hierarchical=auto\)$", runs["auto"].stdout, re.MULTILINE), runs["auto"].report()
    assert "hierarchical all-reduce" not in runs["false"].stdout
    hierarchical, flat = (_final_parameters(runs[s].stdout) for s in ("auto", "false"))
    assert hierarchical.keys() == flat.keys()
    for name in flat:
        scale = float(flat[name].abs().max()) or 1.0
        gap = float((hierarchical[name] - flat[name]).abs().max())
        assert gap <= 1e-4 * scale, f"{name}: hierarchical and flat differ by {gap} (scale {scale})"


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(400)
def test_two_hosts_from_the_hostfile_equal_the_rehearsal_bit_for_bit(tmp_path: Path, request) -> None:
    """2 network-namespace hosts x 2 ranks (mpiexec with a hostfile, --npernode 2): comm.hierarchical=auto
    finds the hosts from the launcher (no override) and turns on; the parameters equal, bit for bit, the
    same job rehearsed on one host with comm.ranks_per_host=2 (the same sums in the same order)."""
    from dtrain.testing.netns import NamespaceCluster, available

    ok, reason = available()
    if not ok:
        pytest.skip(reason)
    args = [arg for arg in _digits(tmp_path / "two_hosts", "auto") if arg != "comm.ranks_per_host=2"]
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with NamespaceCluster(num_hosts=2, rate="1gbit", slots=2) as cluster:
        command = cluster.mpiexec_args(npernode=2, export=list(env)) + [sys.executable, *args]
        multi = cluster.run(command, timeout=200, env=env)
    assert multi.returncode == 0, multi.report()
    assert ("dtrain: hierarchical all-reduce over 2 hosts x 2 ranks" in multi.stdout
            and "(hosts from the mpi launcher; comm.hierarchical=auto)" in multi.stdout), multi.report()
    rehearsal = request.getfixturevalue("one_host_runs")["auto"]  # the same command line on one host, 2 "hosts"
    two_hosts, one_host = _final_parameters(multi.stdout), _final_parameters(rehearsal.stdout)
    assert [name for name in one_host if not torch.equal(two_hosts[name], one_host[name])] == []

"""Communicators under real launchers: mpiexec with 1, 2 and 4 ranks, torchrun, an emulated srun.

Each run starts Python + torch in every rank (about 2 s), so one run of ``_comm_worker.py ops``
per launcher covers its named checks, each asserted in its own test (``tests.helpers.checks``).
"""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.checks import RESULTS_DIR_VARIABLE, CheckLaunch, launch_checks
from tests.helpers.mpi import plain_environment, run_mpi, with_repository_on_path

WORKER = str(Path(__file__).with_name("_comm_worker.py"))
OPS_CHECKS = ("collectives", "signal_callback", "finalize")
FAIL_FAST_LIMIT_S = 30.0  # the promise: a failing rank ends the whole job within this


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables (as in a plain shell), with
    the repository root on ``PYTHONPATH`` for the worker's ``tests.helpers`` imports."""
    return with_repository_on_path(plain_environment(PYTHONUNBUFFERED="1", **extra))


def _seconds_after_event(result, ended: float) -> float:
    """Seconds from the worker's ``EVENT <time>`` line to the end of the job."""
    event = re.search(r"^EVENT ([0-9.]+)$", result.stdout, re.MULTILINE)
    assert event, "the worker never reached its failure point\n" + result.report()
    return ended - float(event.group(1))


def _ops_under_torchrun(results_dir: Path) -> CheckLaunch:
    """The env:// path: torchrun's RANK/WORLD_SIZE/LOCAL_RANK, no MPI."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER, "ops"]
    env = _clean_env(**{RESULTS_DIR_VARIABLE: str(results_dir)})
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=80, env=env)
    except subprocess.TimeoutExpired as error:
        return CheckLaunch.read(results_dir, 2, None, f"$ {' '.join(command)}\ntimed out\n{error.output}\n{error.stderr}")
    return CheckLaunch.read(results_dir, 2, result.returncode,
                            f"$ {' '.join(command)}\nexit code {result.returncode}\n{result.stdout}\n{result.stderr}")


def _ops_under_emulated_srun(results_dir: Path) -> CheckLaunch:
    """The Slurm path (tcp:// on a port derived from the job id), with srun's variables set by hand."""
    from dtrain.comm.launcher import slurm_port

    job_id = next(job for job in range(4242, 5242) if _port_is_free(slurm_port(job)))
    processes = []
    for rank in range(2):
        env = _clean_env(SLURM_JOB_ID=str(job_id), SLURM_STEP_ID="0", SLURM_PROCID=str(rank),
                         SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_STEP_NUM_TASKS="2",
                         SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NUM_NODES="1",
                         SLURM_STEP_NODELIST=socket.gethostname(), **{RESULTS_DIR_VARIABLE: str(results_dir)})
        processes.append(subprocess.Popen([sys.executable, WORKER, "ops"], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=80))
    except subprocess.TimeoutExpired:
        pass  # reported below: the ranks that did not finish have no return code
    finally:
        for process in processes:
            process.kill()
    codes = [process.returncode for process in processes]
    report = f"exit codes by rank {codes}\n" + "\n".join(out + err for out, err in outputs)
    returncode = None if None in codes or len(outputs) < 2 else max(codes, key=abs)
    return CheckLaunch.read(results_dir, 2, returncode, report)


@pytest.fixture(scope="module", params=[pytest.param("mpiexec-1", marks=pytest.mark.slow), "mpiexec-2",
                                        pytest.param("mpiexec-4", marks=pytest.mark.slow),
                                        pytest.param("mpiexec-2-mpi", marks=pytest.mark.slow),
                                        pytest.param("mpiexec-4-mpi", marks=pytest.mark.slow),
                                        pytest.param("torchrun-2", marks=pytest.mark.slow),
                                        pytest.param("srun-2", marks=pytest.mark.slow)])
def ops_launch(request, tmp_path_factory) -> CheckLaunch:
    """One run of ``_comm_worker.py ops`` under a launcher and world size (``LAUNCHER-N[-BACKEND]``,
    Gloo unless named)."""
    launcher, nprocs, *backend = request.param.split("-")
    results_dir = tmp_path_factory.mktemp(f"ops-{request.param}")
    if launcher == "mpiexec":
        return launch_checks(int(nprocs), [WORKER, "ops"], results_dir, timeout=100,
                             env=_clean_env(WORKER_BACKEND=backend[0] if backend else "gloo"))
    return _ops_under_torchrun(results_dir) if launcher == "torchrun" else _ops_under_emulated_srun(results_dir)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", OPS_CHECKS)
def test_communicator_under_a_launcher(ops_launch: CheckLaunch, check: str) -> None:
    """``collectives``: rank/size/local_rank, allreduce sum/mean/max/min, async, broadcast,
    allgather(+object), gather_object, barrier; with 1 rank: LocalCommunicator without mpi4py.
    ``signal_callback``: a callback that claims SIGTERM keeps the job alive. ``finalize``: twice is
    harmless and leaves no Gloo thread running."""
    ops_launch.results(check)


@pytest.mark.timeout(120)
def test_the_ops_launch_ends_cleanly(ops_launch: CheckLaunch) -> None:
    assert ops_launch.returncode == 0, ops_launch.output


FAILURES = [("raise", 1, "[rank 1/2] ValueError: boom from rank 1"),
            ("thread_raise", 1, "[rank 1/2] ZeroDivisionError: division by zero (in thread"),
            ("sigterm", 143, "[rank 1/2] received SIGTERM; ending the job")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scenario, exit_code, message, backend", [
    *((*failure, "gloo") for failure in FAILURES),
    # rank 0 blocked inside MPI instead of Gloo: the signal's watcher thread acts while it waits there;
    # the exceptions end the job by the same MPI_Abort with either transport (run with the slow cases)
    *(pytest.param(*failure, "mpi", marks=[pytest.mark.slow] if failure[0] != "sigterm" else [])
      for failure in FAILURES),
])
def test_failure_on_one_rank_ends_the_job(scenario: str, exit_code: int, message: str, backend: str) -> None:
    """An exception (main or other thread) or SIGTERM on rank 1, while rank 0 waits in an
    allreduce, ends the whole job at once with rank 1's one-line message and exit code."""
    result = run_mpi(2, [WORKER, scenario], timeout=FAIL_FAST_LIMIT_S + 20, env=_clean_env(WORKER_BACKEND=backend))
    delay = _seconds_after_event(result, time.time())
    assert result.returncode == exit_code, result.report()
    assert message in result.stderr, result.report()
    assert "Traceback" not in result.stderr, result.report()  # one line unless DTRAIN_DEBUG=1
    assert delay < 10, f"job ended {delay:.1f} s after the failure\n" + result.report()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["gloo", pytest.param("mpi", marks=pytest.mark.slow)])
def test_sigkilled_rank_ends_the_job(backend: str) -> None:
    """Rank 1 is SIGKILLed while rank 0 waits in an allreduce: the job ends, non-zero, well within 30 s."""
    result = run_mpi(2, [WORKER, "sigkill"], timeout=FAIL_FAST_LIMIT_S + 20, env=_clean_env(WORKER_BACKEND=backend))
    delay = _seconds_after_event(result, time.time())
    assert result.returncode != 0, result.report()
    assert delay < FAIL_FAST_LIMIT_S, f"job ended {delay:.1f} s after the kill\n" + result.report()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", [pytest.param("gloo", marks=pytest.mark.slow), "mpi"])  # where rank 0 waits
def test_stalled_peer_times_out_instead_of_hanging(backend: str) -> None:
    """Rank 1 stays alive but never joins: rank 0's allreduce times out (3 s here) and aborts the job
    (Gloo's own timeout; MPI has none, the communicator's wait watch ends the job)."""
    result = run_mpi(2, [WORKER, "stall"], timeout=FAIL_FAST_LIMIT_S + 20,
                     env=_clean_env(WORKER_TIMEOUT_S="3", WORKER_BACKEND=backend))
    delay = _seconds_after_event(result, time.time())
    assert result.returncode != 0, result.report()
    assert "[rank 0/2] RuntimeError:" in result.stderr, result.report()
    assert 3 <= delay < 15, f"job ended {delay:.1f} s after rank 0 blocked\n" + result.report()


@pytest.mark.timeout(60)
def test_single_process_never_imports_mpi4py() -> None:
    """A plain `python script.py` gets a LocalCommunicator and never loads mpi4py."""
    code = ("import sys; from dtrain.comm import create_communicator, LocalCommunicator; "
            "comm = create_communicator(); "
            "assert isinstance(comm, LocalCommunicator) and comm.size == 1, comm; "
            "assert 'mpi4py' not in sys.modules, 'mpi4py was imported'; print('single ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                            env=_clean_env())
    assert result.returncode == 0 and "single ok" in result.stdout, result.stderr


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True

"""Launcher detection and backend choice, from fake environments (no processes, no MPI)."""
from __future__ import annotations

import socket
import warnings
from types import SimpleNamespace

import pytest
import torch

from dtrain.comm import LaunchInfo, LocalCommunicator, create_communicator, detect_launcher, job_id_from_env
from dtrain.comm._address import LOOPBACK, choose_master_addr, outward_address
from dtrain.comm.bootstrap import resolve_backend
from dtrain.comm.launcher import first_slurm_host, master_override, slurm_port, slurm_tasks_on_node

OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": "prterun-vm-3112@1", "PMIX_RANK": "3"}
HYDRA = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node7",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "run-42"}
SRUN = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2", "SLURM_STEP_NUM_TASKS": "6", "SLURM_NTASKS": "6", "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_STEP_NODELIST": "gpu[07-09]", "SLURM_JOB_NODELIST": "gpu[07-09]"}


# -- detect_launcher ------------------------------------------------------------------------------
def test_nothing_is_a_local_process() -> None:
    assert detect_launcher({}) == LaunchInfo("local", 0, 1, 0, 1)
    assert detect_launcher({"PATH": "/bin", "HOME": "/root"}).kind == "local"


def test_open_mpi() -> None:
    assert detect_launcher(OPEN_MPI) == LaunchInfo("mpi", 3, 8, 1, 2, None, None)


def test_hydra_and_mvapich() -> None:
    assert detect_launcher(HYDRA) == LaunchInfo("mpi", 2, 4, 0, 2)
    mvapich = {"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2"}
    assert detect_launcher(mvapich) == LaunchInfo("mpi", 0, 2, None, None)


def test_mpi_rendezvous_override() -> None:
    info = detect_launcher({**OPEN_MPI, "DTRAIN_MASTER_ADDR": "10.0.0.5", "MASTER_ADDR": "ignored",
                            "MASTER_PORT": "29400"})
    assert (info.master_addr, info.master_port) == ("10.0.0.5", 29400)


def test_torchrun() -> None:
    assert detect_launcher(TORCHRUN) == LaunchInfo("torchrun", 1, 4, 1, 2, "node7", 29500)
    without_run_id = {name: value for name, value in TORCHRUN.items() if name != "TORCHELASTIC_RUN_ID"}
    assert detect_launcher(without_run_id).kind == "torchrun"
    # RANK + WORLD_SIZE alone (no MASTER_ADDR) is not a torchrun launch
    assert detect_launcher({"RANK": "0", "WORLD_SIZE": "2"}).kind == "local"


def test_srun() -> None:
    info = detect_launcher(SRUN)
    assert info == LaunchInfo("slurm", 5, 6, 1, 2, "gpu07", slurm_port(123456, 0), "slurm-node-2")
    one_node = {**SRUN, "SLURM_PROCID": "1", "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1",
                "SLURM_STEP_TASKS_PER_NODE": "6", "SLURM_STEP_NODELIST": "gpu07"}
    assert detect_launcher(one_node).master_addr == LOOPBACK
    assert detect_launcher({**SRUN, "MASTER_PORT": "1234"}).master_port == 1234


def test_batch_script_without_srun_is_local() -> None:
    batch = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
             "SLURM_JOB_NODELIST": "n[1-2]"}
    assert detect_launcher(batch).kind == "local"


def test_order_and_forcing() -> None:
    # torchrun inside an srun allocation: torchrun's variables describe this process
    assert detect_launcher({**SRUN, **TORCHRUN}).kind == "torchrun"
    # srun --mpi=pmi2 exports PMI_* too; mpi wins unless told otherwise
    srun_pmi = {**SRUN, "PMI_RANK": "5", "PMI_SIZE": "6"}
    assert detect_launcher(srun_pmi).kind == "mpi"
    assert detect_launcher({**srun_pmi, "DTRAIN_LAUNCHER": "slurm"}).kind == "slurm"
    assert detect_launcher({**OPEN_MPI, "DTRAIN_LAUNCHER": "local"}) == LaunchInfo("local", 0, 1, 0, 1)


@pytest.mark.parametrize("environ, match", [
    ({"DTRAIN_LAUNCHER": "pbs"}, "DTRAIN_LAUNCHER='pbs' is unknown"),
    ({"DTRAIN_LAUNCHER": "slurm"}, "DTRAIN_LAUNCHER=slurm but the slurm environment variables are missing"),
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK='x' is not an integer"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, "rank=2, size=2"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, "local_rank=2, local_size=2"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "master_port=70000 is not a TCP port"),
])
def test_malformed_environments_raise(environ: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        detect_launcher(environ)


# -- job ids and Slurm helpers ------------------------------------------------------------------------
def test_job_id_from_env() -> None:
    assert job_id_from_env({}) is None
    assert job_id_from_env(OPEN_MPI) == "prterun-vm-3112_1"
    assert job_id_from_env({"OMPI_MCA_orte_ess_jobid": "1234"}) == "1234"
    assert job_id_from_env(SRUN) == "123456.0"
    assert job_id_from_env({"SLURM_JOB_ID": "77"}) == "77"
    assert job_id_from_env({**SRUN, **TORCHRUN}) == "run-42"
    assert job_id_from_env({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}) == "77"


@pytest.mark.parametrize("nodelist, first", [
    ("gpu07", "gpu07"), ("a,b", "a"), ("gpu[07-09,12],cpu1", "gpu07"), ("n[3]", "n3"),
    ("rack[1-2]-n[01-04]", "rack1-n01"), ("x[10-11]y,z", "x10y"),
])
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["", "gpu[07", "gpu]1", "[,]"])
def test_first_slurm_host_rejects_malformed(nodelist: str) -> None:
    with pytest.raises(ValueError, match="is malformed"):
        first_slurm_host(nodelist)


def test_slurm_tasks_on_node() -> None:
    assert [slurm_tasks_on_node("2(x3),1", node) for node in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="no entry for node 4"):
        slurm_tasks_on_node("2(x3),1", 4)
    with pytest.raises(ValueError, match="malformed"):
        slurm_tasks_on_node("2x3", 0)


def test_slurm_port_range_and_spread() -> None:
    ports = {slurm_port(job, step) for job in range(1000, 2000) for step in range(15)}
    assert len(ports) == 15000 and min(ports) >= 15000 and max(ports) < 30000


def test_master_override() -> None:
    assert master_override({}) == (None, None)
    assert master_override({"MASTER_ADDR": "h", "MASTER_PORT": "1"}) == ("h", 1)
    assert master_override({"MASTER_ADDR": "h", "DTRAIN_MASTER_ADDR": "d", "DTRAIN_MASTER_PORT": "2",
                            "MASTER_PORT": "1"}) == ("d", 2)


# -- rendezvous address ----------------------------------------------------------------------------------
def test_master_address_choice() -> None:
    assert choose_master_addr(single_node=True) == LOOPBACK
    assert choose_master_addr(single_node=False, override="10.1.2.3") == "10.1.2.3"
    assert choose_master_addr(single_node=True, override="10.1.2.3") == "10.1.2.3"


def test_outward_address_is_never_loopback_when_a_route_exists() -> None:
    address = outward_address(peer_host="192.0.2.77")
    try:
        socket.inet_aton(address)
    except OSError:
        assert address == socket.getfqdn()  # no IPv4 route at all: the host name
    else:
        assert not address.startswith("127.")


# -- backend choice and create_communicator's errors ---------------------------------------------------------
def test_resolve_backend() -> None:
    assert resolve_backend("auto", cuda_available=True) == "nccl"
    assert resolve_backend("auto", cuda_available=False) == "gloo"
    # NCCL needs one GPU per rank: auto keeps to gloo when a node has more ranks than GPUs
    assert resolve_backend("auto", cuda_available=True, ranks_on_node=2, gpus=2) == "nccl"
    assert resolve_backend("auto", cuda_available=True, ranks_on_node=3, gpus=2) == "gloo"
    assert resolve_backend("nccl", cuda_available=True, ranks_on_node=3, gpus=2) == "nccl"  # asked for: its own error
    assert resolve_backend("gloo", cuda_available=True) == "gloo"
    assert resolve_backend("local", cuda_available=False) == "local"
    # an mpiexec job on one node: MPI's shared memory, unless every rank has a GPU of its own
    assert resolve_backend("auto", cuda_available=False, mpi_on_one_node=True) == "mpi"
    assert resolve_backend("auto", cuda_available=True, ranks_on_node=3, gpus=2, mpi_on_one_node=True) == "mpi"
    assert resolve_backend("auto", cuda_available=True, ranks_on_node=2, gpus=2, mpi_on_one_node=True) == "nccl"
    assert resolve_backend("mpi", cuda_available=True) == "mpi"
    with pytest.raises(ValueError, match=r"backend='tcp' is unknown; use one of auto, gloo, mpi, nccl, local"):
        resolve_backend("tcp", cuda_available=False)
    with pytest.raises(RuntimeError, match="backend='nccl' needs CUDA"):
        resolve_backend("nccl", cuda_available=False)


def test_single_process_gets_local_communicator(plain_env) -> None:
    comm = create_communicator(backend="gloo")
    assert isinstance(comm, LocalCommunicator) and comm.launcher == "local" and comm.device.type == "cpu"
    plain_env.setenv("OMPI_COMM_WORLD_RANK", "0")
    plain_env.setenv("OMPI_COMM_WORLD_SIZE", "1")  # mpiexec -n 1: still no MPI
    assert create_communicator().launcher == "mpi"


@pytest.mark.parametrize("gpus, chosen", [(1, "gloo"), (2, "nccl")])
def test_auto_backend_gives_nccl_only_when_each_rank_of_the_node_has_a_gpu(plain_env, gpus, chosen) -> None:
    """Two torchrun ranks on a node with ``gpus`` GPUs (CUDA simulated): one GPU for two ranks is Gloo on
    the CPU, with a warning from rank 0 that says why; two GPUs are NCCL."""
    import dtrain.comm.bootstrap as bootstrap

    plain_env.setattr(torch.cuda, "is_available", lambda: True)
    plain_env.setattr(torch.cuda, "device_count", lambda: gpus)
    chosen_backends = []
    plain_env.setattr(bootstrap, "_torch_dist", lambda info, backend, timeout_s, **kwargs: chosen_backends.append(backend) or SimpleNamespace())
    for name, value in {"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        plain_env.setenv(name, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        create_communicator(hierarchical=False)
    assert chosen_backends == [chosen]
    messages = [str(warning.message) for warning in caught]
    if chosen == "gloo":
        assert messages == ["comm.backend=auto chose gloo on the CPU: 2 ranks share this node's 1 GPU, and NCCL "
                            "needs one GPU per rank; start at most 1 ranks per node to train on the GPUs"]
    else:
        assert messages == []

@pytest.mark.parametrize("kwargs, error, match", [
    ({"backend": "tcp"}, ValueError, "backend='tcp' is unknown"),
    ({"timeout_s": 0}, ValueError, "timeout_s=0 must be a positive number of seconds"),
])
def test_create_communicator_rejects_bad_arguments(plain_env, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        create_communicator(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown when CUDA is missing")
def test_nccl_without_cuda_is_a_clear_error(plain_env) -> None:
    with pytest.raises(RuntimeError, match="backend='nccl' needs CUDA"):
        create_communicator(backend="nccl")


@pytest.mark.parametrize("local_size, chosen", [("2", "mpi"), ("1", "gloo")])
def test_auto_backend_under_mpiexec_is_mpi_on_one_node(plain_env, local_size, chosen) -> None:
    """Two mpiexec ranks without GPUs: MPI's shared memory when both are on this node, Gloo across nodes."""
    import dtrain.comm.bootstrap as bootstrap

    plain_env.setattr(torch.cuda, "is_available", lambda: False)
    chosen_backends = []
    plain_env.setattr(bootstrap, "_create_mpi", lambda info, backend, timeout_s: chosen_backends.append(backend) or SimpleNamespace())
    for name, value in {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                        "OMPI_COMM_WORLD_LOCAL_SIZE": local_size}.items():
        plain_env.setenv(name, value)
    create_communicator(hierarchical=False)
    assert chosen_backends == [chosen]


def test_mpi_backend_needs_mpiexec(plain_env) -> None:
    for name, value in {"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        plain_env.setenv(name, value)
    with pytest.raises(ValueError, match="backend='mpi' sends tensors through the MPI of mpiexec, but torchrun "
                                         "started this job; launch it with mpiexec, or use backend='gloo'"):
        create_communicator(backend="mpi")


def test_local_backend_with_several_processes_is_rejected(plain_env) -> None:
    plain_env.setenv("OMPI_COMM_WORLD_RANK", "0")
    plain_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="backend='local' runs one process but mpi started 2"):
        create_communicator(backend="local")


def test_outward_address_refuses_a_name_no_one_can_resolve(monkeypatch):
    """With no route and an unresolvable host name, rank 0 says what to set instead of waiting."""
    import socket

    from dtrain.comm import _address

    def no_resolution(*args, **kwargs):
        raise OSError("name not known")

    monkeypatch.setattr(_address, "_route_source", lambda host: None)
    monkeypatch.setattr(socket, "getaddrinfo", no_resolution)
    with pytest.raises(RuntimeError, match="set DTRAIN_MASTER_ADDR"):
        _address.outward_address("peer-host")

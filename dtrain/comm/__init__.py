"""Communicators: each rank's place in the job and the collectives between ranks.

Typical use, identical for one process and for ``mpiexec``/``torchrun``/``srun``::

    from dtrain.comm import create_communicator, install_fail_fast

    comm = create_communicator()          # "auto": NCCL with a GPU per rank, MPI for mpiexec on one node, else Gloo
    install_fail_fast(comm)               # an exception on any rank ends the whole job
    start_heartbeat(comm, timeout_s=60)   # so does a rank that stops (SIGSTOP, its host unreachable)
    comm.allreduce(grad, op="mean")

Importing this package neither imports mpi4py nor starts a torch.distributed process group.
"""
from dtrain.comm.base import REDUCE_OPS, AsyncHandle, Communicator, HostGroups
from dtrain.comm.bootstrap import BACKENDS, create_communicator, resolve_backend
from dtrain.comm.failfast import (
    add_signal_callback,
    install_fail_fast,
    install_signal_handlers,
    release_signal_handlers,
    remove_signal_callback,
    uninstall_fail_fast,
)
from dtrain.comm.heartbeat import Heartbeat, start_heartbeat
from dtrain.comm.hierarchical import HierarchicalCommunicator
from dtrain.comm.launcher import LaunchInfo, detect_launcher, job_id_from_env
from dtrain.comm.local import LocalCommunicator
from dtrain.comm.mpi_tensors import MPICommunicator
from dtrain.comm.torch_dist import TorchDistCommunicator

__all__ = [
    "BACKENDS", "REDUCE_OPS", "AsyncHandle", "Communicator", "Heartbeat", "HierarchicalCommunicator", "HostGroups",
    "LaunchInfo", "LocalCommunicator",
    "MPICommunicator", "TorchDistCommunicator", "add_signal_callback", "create_communicator", "detect_launcher",
    "install_fail_fast", "install_signal_handlers", "job_id_from_env", "release_signal_handlers",
    "remove_signal_callback",
    "resolve_backend", "start_heartbeat", "uninstall_fail_fast",
]


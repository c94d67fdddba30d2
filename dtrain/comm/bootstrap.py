"""create_communicator: find out how this process was launched and connect it to its peers.

Under ``mpiexec``, mpi4py bootstraps (rank, size, node-local rank, and rank 0's broadcast of the
rendezvous endpoint); tensors then travel through torch.distributed, or with ``backend="mpi"``
through MPI itself (:mod:`dtrain.comm.mpi_tensors`). A single process never imports mpi4py.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from dtrain import checks
from dtrain.comm._address import LOOPBACK, choose_master_addr
from dtrain.comm.base import Communicator, first_line, format_rank_message, terminate
from dtrain.comm.hierarchical import hierarchical_setting, make_hierarchical
from dtrain.comm.hosts import ranks_by_block
from dtrain.comm.launcher import LaunchInfo, detect_launcher, master_override
from dtrain.comm.local import LocalCommunicator
from dtrain.comm.mpi_tensors import MPICommunicator
from dtrain.comm.torch_dist import TorchDistCommunicator

BACKENDS = checks.COMM_BACKENDS
"""Values accepted for ``backend``: ``auto`` is ``nccl`` when CUDA gives each rank of a node a GPU, else
``mpi`` for an ``mpiexec`` job on one node, else ``gloo``; ``mpi`` (CPU tensors through MPI) needs a job
started by ``mpiexec``."""


def resolve_backend(backend: str, cuda_available: bool, ranks_on_node: int | None = None, gpus: int = 0,
                    mpi_on_one_node: bool = False) -> str:
    """Return the concrete backend (``gloo``, ``mpi``, ``nccl`` or ``local``) for a requested one.

    ``auto`` is ``nccl`` when CUDA is available and each of the ``ranks_on_node`` ranks of this node
    can have one of its ``gpus`` GPUs (NCCL needs one GPU per rank; None: not known, assumed so).
    Otherwise it is ``mpi`` when ``mpi_on_one_node`` (``mpiexec`` started every rank of the job on this
    node: MPI's shared memory moves a gradient bucket about 10 times faster than Gloo's loopback TCP,
    ``benchmarks/allreduce_throughput.py``), else ``gloo``. Raises ValueError for a name not in
    :data:`BACKENDS`, RuntimeError for ``nccl`` without CUDA.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if cuda_available and (ranks_on_node is None or ranks_on_node <= gpus):
            return "nccl"
        return "mpi" if mpi_on_one_node else "gloo"
    if backend == "nccl" and not cuda_available:
        raise RuntimeError("backend='nccl' needs CUDA but torch.cuda.is_available() is False; "
                           "use backend='gloo' or 'auto'")
    return backend


def create_communicator(backend: str = "auto", timeout_s: float = 60.0, hierarchical: Any = "auto",
                        ranks_per_host: int | None = None) -> Communicator:
    """Return this process's communicator, connected to every other rank of the job.

    The launcher is detected from the environment (see :func:`dtrain.comm.detect_launcher`):
    ``mpiexec`` (mpi4py bootstraps, rank 0 broadcasts the rendezvous endpoint),
    ``torchrun`` (``env://``), Slurm ``srun`` (first node, port derived from the job
    id), or none. A job of one process gets a :class:`LocalCommunicator` without
    touching MPI or torch.distributed. ``timeout_s`` (seconds) bounds the rendezvous
    and every collective. ``hierarchical`` (``auto``, True, False) and ``ranks_per_host`` choose a
    hierarchical all-reduce across hosts (:func:`dtrain.comm.hierarchical.make_hierarchical`; rank 0
    prints what was chosen when the job spans several hosts).

    Raises ValueError for an unknown ``backend``, a non-positive ``timeout_s``, or
    ``backend='local'`` with several processes; RuntimeError for ``nccl`` without CUDA
    or an mpi4py built for another MPI than the launcher's. Under MPI, a failure after
    MPI has started aborts the whole job with that rank's message instead of raising,
    because a raise on one rank would leave the others waiting for it.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s} must be a positive number of seconds")
    hierarchical_setting(hierarchical)
    info = detect_launcher(os.environ)
    if ranks_per_host is not None:
        ranks_by_block(info.size, ranks_per_host)  # refused before any process group exists
    world = _create_world(info, backend, timeout_s)
    try:
        communicator, line = make_hierarchical(world, hierarchical, ranks_per_host)
    except ValueError:  # every rank sees the same hosts, so every rank refuses: leave together
        world.finalize()
        raise
    if line and communicator.is_main:
        print(f"dtrain: {line}", flush=True)
    communicator.ranks_per_host = ranks_per_host
    return communicator


def _create_world(info: LaunchInfo, backend: str, timeout_s: float) -> Communicator:
    """The job's flat communicator (see :func:`create_communicator`)."""
    cuda_available = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda_available else 0
    resolved = resolve_backend(backend, cuda_available, info.local_size, gpus,
                               mpi_on_one_node=info.kind == "mpi" and info.local_size == info.size)
    if backend == "auto" and cuda_available and resolved != "nccl" and info.rank == 0:
        warnings.warn(f"comm.backend=auto chose {resolved} on the CPU: {info.local_size} ranks share this node's "
                      f"{gpus} GPU{'s' if gpus != 1 else ''}, and NCCL needs one GPU per rank; start at most "
                      f"{gpus} ranks per node to train on the GPUs", stacklevel=2)
    if info.size == 1:
        return LocalCommunicator(device="cuda:0" if resolved == "nccl" else "cpu", launcher=info.kind)
    if resolved == "local":
        raise ValueError(f"backend='local' runs one process but {info.kind} started {info.size}; "
                         "use backend='auto', 'gloo' or 'nccl'")
    if resolved == "mpi" and info.kind != "mpi":
        raise ValueError(f"backend='mpi' sends tensors through the MPI of mpiexec, but {info.kind} started this "
                         "job; launch it with mpiexec, or use backend='gloo'")
    if info.kind == "mpi":
        return _create_mpi(info, resolved, timeout_s)
    if info.kind == "torchrun":
        # env:// lets torchrun's agent share its own store (TORCHELASTIC_USE_AGENT_STORE).
        return _torch_dist(info, resolved, timeout_s, init_method="env://")
    if info.kind == "slurm":
        addr = _slurm_master_addr(info)
        if info.master_port is None:
            raise ValueError("srun launch without SLURM_JOB_ID: set MASTER_PORT to a free TCP port")
        return _torch_dist(info, resolved, timeout_s, init_method=f"tcp://{addr}:{info.master_port}")
    raise AssertionError(f"unhandled launcher {info.kind!r} of size {info.size}")


def _torch_dist(info: LaunchInfo, backend: str, timeout_s: float, **rendezvous: Any) -> Communicator:
    """The torch.distributed communicator of ``info``'s rank; ``mpi`` (its tensors through MPI, the rest
    through Gloo) needs ``mpi_comm`` among ``rendezvous``."""
    where = dict(rank=info.rank, size=info.size, local_rank=info.local_rank, local_size=info.local_size,
                 timeout_s=timeout_s, launcher=info.kind, node=info.node, **rendezvous)
    if backend == "mpi":
        return MPICommunicator(**where)
    return TorchDistCommunicator(backend=backend, **where)


def _slurm_master_addr(info: LaunchInfo) -> str:
    """The first node of the step; ``scontrol show hostnames`` settles host lists we cannot parse."""
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if master_override(os.environ)[0] is None and info.master_addr != LOOPBACK and nodelist \
            and shutil.which("scontrol"):
        try:
            shown = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                   text=True, timeout=30, check=True).stdout.split()
            if shown:
                return shown[0]
        except (OSError, subprocess.SubprocessError):
            pass  # keep the host parsed from the list itself
    if info.master_addr is None:
        raise ValueError(f"cannot tell the host of task 0 from the Slurm node list {nodelist!r}; "
                         "set MASTER_ADDR to it")
    return info.master_addr


def import_mpi() -> Any:
    """Import and initialise MPI through mpi4py (MPI_Init_thread), returning the ``MPI`` module.

    Thread level: ``MPI_THREAD_MULTIPLE`` (mpi4py's default, set explicitly here).
    MPI carries no tensors, only the start-up exchange, so thread locking costs nothing
    measurable; but :meth:`Communicator.abort` may call ``MPI_Abort`` from a thread
    other than the main one (``threading.excepthook``, the fail-fast signal watcher, a
    future watchdog), which ``rc.threads = False`` (MPI_THREAD_SINGLE) would make
    undefined behaviour.
    """
    import mpi4py

    mpi4py.rc.threads = True
    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI


def _create_mpi(info: LaunchInfo, backend: str, timeout_s: float) -> Communicator:
    """Bootstrap through MPI: node-local rank from a shared-memory split, endpoint by bcast."""
    MPI = import_mpi()  # MPI_Init happens here, before torch.distributed starts any thread
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if (rank, size) != (info.rank, info.size):
        raise RuntimeError(f"mpi4py's MPI sees rank {rank} of {size} but the launcher set rank {info.rank} "
                           f"of {info.size}: mpi4py is built for another MPI; launch with the mpiexec of "
                           "the MPI mpi4py was built with, or set DTRAIN_LAUNCHER=slurm under srun")
    store_timeout = datetime.timedelta(seconds=timeout_s)
    with _abort_job_on_error(world, rank, size):
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_rank, local_size = node.Get_rank(), node.Get_size()
        # the node's lowest rank names it: MPI's own answer to "which ranks share a host" (the hostfile's)
        node_label = f"mpi-node-of-rank-{node.allreduce(rank, op=MPI.MIN)}"
        node.Free()
        single_node = local_size == size  # the same answer on every rank
        hosts = None if single_node else world.gather(MPI.Get_processor_name(), root=0)
        endpoint = None
        if rank == 0:
            peer = next((host for host in hosts if host != hosts[0]), None) if hosts else None
            addr = choose_master_addr(single_node=single_node, override=info.master_addr, peer_host=peer)
            # Port 0: the kernel picks a free port as the store binds it, so no other
            # process can take it between choosing and binding.
            store = dist.TCPStore(addr, info.master_port or 0, size, is_master=True, timeout=store_timeout,
                                  wait_for_workers=False)
            endpoint = (addr, store.port)
        endpoint = world.bcast(endpoint, root=0)
        if rank != 0:
            store = dist.TCPStore(endpoint[0], endpoint[1], size, is_master=False, timeout=store_timeout)
        return _torch_dist(LaunchInfo("mpi", rank, size, local_rank, local_size, *endpoint, node_label), backend,
                           timeout_s, store=store, mpi_comm=world)


@contextlib.contextmanager
def _abort_job_on_error(world: Any, rank: int, size: int) -> Iterator[None]:
    """Turn an exception on one rank into an abort of the whole MPI job, with its message."""
    try:
        yield
    except Exception as error:
        terminate(format_rank_message(rank, size, f"communicator start-up failed: {type(error).__name__}: "
                                                  f"{first_line(error)}"), 1, world)

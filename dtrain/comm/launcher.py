"""Which launcher started this process, read from the environment alone (pure functions).

Nothing here imports MPI or opens a socket: :func:`detect_launcher` and
:func:`job_id_from_env` take an ``environ`` mapping, so they are tested with fake
environments and are safe to call before any communication.

Recognised launchers, checked in this order (``DTRAIN_LAUNCHER`` forces one):

* ``torchrun``: ``TORCHELASTIC_RUN_ID``, or ``RANK`` + ``WORLD_SIZE`` + ``MASTER_ADDR``.
* ``mpi``: Open MPI (``OMPI_COMM_WORLD_*``), MPICH / Intel MPI Hydra (``PMI_RANK``,
  ``PMI_SIZE``, ``MPI_LOCALRANKID``), MVAPICH2 (``MV2_COMM_WORLD_*``).
* ``slurm``: ``srun`` tasks (``SLURM_PROCID`` with a step of more than one task).
* ``local``: anything else.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Mapping

from dtrain.comm.hosts import node_label

LAUNCHERS = ("torchrun", "mpi", "slurm", "local")
"""Launcher kinds, in detection order."""

SLURM_PORT_BASE = 15000
"""Lowest rendezvous port derived from a Slurm job id (the range stays below Linux's ephemeral ports)."""

_MPI_VARIABLES = (  # (rank, size, local rank, local size) per MPI family
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as far as the environment tells.

    ``local_rank``/``local_size`` are None when the launcher does not say (they are then
    found at start-up). ``master_addr``/``master_port`` are the rendezvous address when
    the environment fixes it; for ``mpi`` they are None unless overridden, and rank 0
    picks them at start-up.
    """

    kind: str
    rank: int
    size: int
    local_rank: int | None = None
    local_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    node: str | None = None
    """What the launcher calls this rank's node (:func:`dtrain.comm.hosts.node_label`), None when it does not say."""

    def __post_init__(self) -> None:
        if self.kind not in LAUNCHERS:
            raise ValueError(f"launcher kind={self.kind!r} is unknown; use one of {', '.join(LAUNCHERS)}")
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"{self.kind} launch gives rank={self.rank}, size={self.size}; "
                             "need size >= 1 and 0 <= rank < size")
        if self.local_rank is not None and self.local_size is not None \
                and not 0 <= self.local_rank < self.local_size:
            raise ValueError(f"{self.kind} launch gives local_rank={self.local_rank}, "
                             f"local_size={self.local_size}; need 0 <= local_rank < local_size")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port} is not a TCP port; use 1..65535")


def detect_launcher(environ: Mapping[str, str]) -> LaunchInfo:
    """Return the :class:`LaunchInfo` that ``environ`` (e.g. ``os.environ``) describes.

    ``DTRAIN_LAUNCHER`` (``torchrun``, ``mpi``, ``slurm``, ``local``; ``auto`` or unset to
    detect) forces a kind, e.g. ``slurm`` under an ``srun`` that also exports PMI
    variables. Raises ValueError for malformed variables or a forced kind whose
    variables are missing.
    """
    forced = environ.get("DTRAIN_LAUNCHER", "auto").strip().lower() or "auto"
    if forced not in (*LAUNCHERS, "auto"):
        raise ValueError(f"DTRAIN_LAUNCHER={forced!r} is unknown; use auto, {', '.join(LAUNCHERS)}")
    parsers = {"torchrun": _torchrun, "mpi": _mpi, "slurm": _slurm}
    if forced == "local":
        return LaunchInfo("local", 0, 1, 0, 1)
    if forced != "auto":
        info = parsers[forced](environ)
        if info is None:
            raise ValueError(f"DTRAIN_LAUNCHER={forced} but the {forced} environment variables are missing")
        return info
    for parse in parsers.values():
        info = parse(environ)
        if info is not None:
            return info
    return LaunchInfo("local", 0, 1, 0, 1)


#: how a user calls each launcher kind that ``detect_launcher`` reports
_LAUNCHER_NAMES = {"mpi": "mpiexec", "slurm": "srun"}


def check_one_copy_wanted(comm, independent_processes: bool, environ: Mapping[str, str] | None = None) -> None:
    """Refuses a one-process communicator in a process that a launcher started among several: each process
    would train its own copy into the same files, almost always a forgotten communicator."""
    launch = detect_launcher(os.environ if environ is None else environ)
    if launch.size > 1 and comm.size == 1 and not independent_processes:
        launcher = _LAUNCHER_NAMES.get(launch.kind, launch.kind)
        raise ValueError(
            f"{launcher} started {launch.size} processes but this session's learner has a one-process "
            f"communicator, so each process would train its own copy; create the job's communicator with "
            f"comm = dtrain.create_communicator() and give it to a distributed learner, e.g. "
            f"dtrain.data_parallel_distributed_learner(optimizer, comm=comm) (independent_processes=True "
            f"if separate copies are really wanted)")


def job_id_from_env(environ: Mapping[str, str]) -> str | None:
    """Return an id shared by every rank of this launch, usable in a file name, or None.

    Sources, first found wins: ``TORCHELASTIC_RUN_ID`` (torchrun; its default ``none``
    does not count), ``PMIX_NAMESPACE`` or ``OMPI_MCA_orte_ess_jobid`` (Open MPI),
    ``SLURM_JOB_ID`` with ``.SLURM_STEP_ID`` appended when inside a step. Characters other
    than letters, digits, ``.``, ``_`` and ``-`` become ``_``.
    """
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id.lower() != "none":
        return _file_safe(run_id)
    for name in ("PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid"):
        if environ.get(name):
            return _file_safe(environ[name])
    if environ.get("SLURM_JOB_ID"):
        step = environ.get("SLURM_STEP_ID")
        return _file_safe(environ["SLURM_JOB_ID"] + (f".{step}" if step else ""))
    return None


def master_override(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    """Return the rendezvous (address, port) set by ``DTRAIN_MASTER_ADDR``/``MASTER_ADDR`` and
    ``DTRAIN_MASTER_PORT``/``MASTER_PORT`` (dtrain's names win), None where unset."""
    addr = environ.get("DTRAIN_MASTER_ADDR") or environ.get("MASTER_ADDR") or None
    port_name = "DTRAIN_MASTER_PORT" if environ.get("DTRAIN_MASTER_PORT") else "MASTER_PORT"
    port = _int(environ, port_name) if environ.get(port_name) else None
    return addr, port


def first_slurm_host(nodelist: str) -> str:
    """Return the first host of a Slurm host list, e.g. ``gpu[07-09,12],cpu1`` -> ``gpu07``.

    Handles the compressed bracket syntax Slurm prints (several bracket groups, zero
    padding). Raises ValueError for an empty or malformed list.
    """
    nodelist = nodelist.strip()
    text = re.match(r"[^,\[\]]*(\[[^\[\]]*\][^,\[\]]*)*", nodelist).group(0)  # up to the first top-level comma
    host = re.sub(r"\[([^\],\-]+)[^\]]*\]", lambda m: m.group(1), text)  # each bracket -> its first value
    if not host or "[" in host or "]" in host or nodelist[len(text):len(text) + 1] not in ("", ","):
        raise ValueError(f"Slurm node list {nodelist!r} is malformed; expected e.g. 'node[01-04],other'")
    return host


def slurm_tasks_on_node(tasks_per_node: str, node_index: int) -> int:
    """Return the task count of node ``node_index`` from Slurm's ``2(x3),1`` notation.

    Raises ValueError when the text is malformed or has no entry for that node.
    """
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if found is None:
            raise ValueError(f"Slurm tasks-per-node {tasks_per_node!r} is malformed; expected e.g. '2(x3),1'")
        counts += [int(found.group(1))] * int(found.group(2) or 1)
    if not 0 <= node_index < len(counts):
        raise ValueError(f"Slurm tasks-per-node {tasks_per_node!r} has no entry for node {node_index}")
    return counts[node_index]


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """Return a rendezvous port derived from the Slurm job and step ids, in [15000, 30000).

    All tasks of a step compute the same port; up to 15 steps of 1000 consecutive jobs
    get distinct ports.
    """
    return SLURM_PORT_BASE + (job_id % 1000) * 15 + step_id % 15


# -- one parser per launcher: LaunchInfo, or None when its variables are absent ---------------
def _torchrun(environ: Mapping[str, str]) -> LaunchInfo | None:
    if not ("TORCHELASTIC_RUN_ID" in environ
            or all(name in environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))):
        return None
    addr, port = master_override(environ)
    return LaunchInfo("torchrun", _int(environ, "RANK"), _int(environ, "WORLD_SIZE"),
                      _optional_int(environ, "LOCAL_RANK"), _optional_int(environ, "LOCAL_WORLD_SIZE"),
                      environ.get("MASTER_ADDR") or addr, _optional_int(environ, "MASTER_PORT") or port,
                      node_label("torchrun", environ))


def _mpi(environ: Mapping[str, str]) -> LaunchInfo | None:
    for rank_name, size_name, local_rank_name, local_size_name in _MPI_VARIABLES:
        if rank_name in environ and size_name in environ:
            addr, port = master_override(environ)
            return LaunchInfo("mpi", _int(environ, rank_name), _int(environ, size_name),
                              _optional_int(environ, local_rank_name), _optional_int(environ, local_size_name),
                              addr, port)
    return None


def _slurm(environ: Mapping[str, str]) -> LaunchInfo | None:
    # srun sets SLURM_STEP_*; a batch script (no srun) has SLURM_PROCID=0 and SLURM_NTASKS=N
    # too, but there it is the script's one process, not rank 0 of N: treat that as local.
    size_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    if "SLURM_PROCID" not in environ or not ("SLURM_STEP_NUM_TASKS" in environ or "SLURM_STEP_ID" in environ):
        return None
    size = _int(environ, size_name)
    rank = _int(environ, "SLURM_PROCID")
    local_rank = _optional_int(environ, "SLURM_LOCALID")
    local_size = None
    tasks_per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if tasks_per_node and "SLURM_NODEID" in environ:
        local_size = slurm_tasks_on_node(tasks_per_node, _int(environ, "SLURM_NODEID"))
    addr, port = master_override(environ)
    if addr is None:
        nodes = _optional_int(environ, "SLURM_STEP_NUM_NODES") or _optional_int(environ, "SLURM_NNODES")
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if nodes == 1 or (nodelist and "," not in nodelist and "[" not in nodelist):
            addr = "127.0.0.1"  # one node: loopback always works and needs no name service
        elif nodelist:
            # An unparsable list leaves None: bootstrap then asks `scontrol show hostnames`.
            with contextlib.suppress(ValueError):
                addr = first_slurm_host(nodelist)
    if port is None and "SLURM_JOB_ID" in environ:
        port = slurm_port(_int(environ, "SLURM_JOB_ID"), _optional_int(environ, "SLURM_STEP_ID") or 0)
    return LaunchInfo("slurm", rank, size, local_rank, local_size, addr, port, node_label("slurm", environ))


def _int(environ: Mapping[str, str], name: str) -> int:
    text = environ.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer; fix or unset it") from None


def _optional_int(environ: Mapping[str, str], name: str) -> int | None:
    return _int(environ, name) if environ.get(name, "") != "" else None


def _file_safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)

"""Where a session trains (``session.device``): ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, checked against
this machine and against the job's communicator, whose collectives need tensors of their own kind.

``auto`` keeps the communicator's device: the launcher's local rank's GPU when NCCL was chosen (CUDA
with a GPU per rank), else the CPU. CNTK's ``-device N`` is ``cuda:N`` for one process.
"""
from __future__ import annotations

import torch

from dtrain import checks


def machine_problem(name: str, setting: str) -> str | None:
    """Why this machine has no device ``setting`` (a valid word, see ``checks.device``), else ``None``."""
    if not setting.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return (f"{name}={setting!r}: expected a machine with CUDA (torch.cuda.is_available() is False here); "
                f"use {name}=cpu or auto")
    count = torch.cuda.device_count()
    index = int(setting.partition(":")[2] or 0)
    if index >= count:
        return (f"{name}={setting!r}: this machine has {count} GPU{'s' if count != 1 else ''}; expected cuda:0"
                + (f" to cuda:{count - 1}" if count > 1 else ""))
    return None


def resolve_device(setting: str | torch.device, comm, name: str = "session.device") -> torch.device:
    """The device to train on for ``setting`` in a job whose communicator is ``comm``.

    With several ranks the model must live where the communicator's collectives work: ``cpu`` needs
    a CPU backend (gloo, mpi), ``cuda`` is each rank's own GPU under NCCL, and ``cuda:N`` (every rank
    on one GPU) is refused. One process may train anywhere; ``cuda:N`` becomes the current CUDA device.

    Raises:
        ValueError: a malformed setting, a device this machine lacks, or one the communicator cannot
            exchange (one line naming ``name`` and what to use instead).
    """
    setting = checks.device(name, str(setting) if isinstance(setting, torch.device) else setting)
    if setting == "auto":
        return comm.device
    problem = machine_problem(name, setting)
    if problem:
        raise ValueError(problem)
    collective = comm.device  # where this job's collectives expect tensors
    if setting == "cpu":
        if comm.size > 1 and collective.type == "cuda":
            raise ValueError(f"{name}='cpu' with comm.backend {comm.backend}: NCCL exchanges CUDA tensors only; "
                             f"add comm.backend=gloo (or mpi under mpiexec) to train on the CPU")
        return torch.device("cpu")
    if comm.size > 1:
        if collective.type != "cuda":
            raise ValueError(f"{name}={setting!r} with comm.backend {comm.backend}: its collectives exchange CPU "
                             f"tensors; expected comm.backend=nccl (one GPU per rank) or {name}=auto")
        if setting not in ("cuda", str(collective)):
            raise ValueError(f"{name}={setting!r} with {comm.size} ranks: every rank would train on one GPU; "
                             f"expected {name}=cuda (each rank on its local rank's GPU, here {collective}) or auto")
        return collective
    device = torch.device(setting if setting != "cuda" else (str(collective) if collective.type == "cuda" else "cuda:0"))
    torch.cuda.set_device(device)
    return device


__all__ = ["machine_problem", "resolve_device"]

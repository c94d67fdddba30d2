"""The config schema of the ``comm`` section and its rules (checked against the launch this process is part of)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig

from dtrain import checks
from dtrain.rules import key_problems as _check


@dataclass
class CommConfig:
    backend: str = "auto"               # auto | gloo | mpi | nccl | local
    timeout_s: float = 300.0            # a collective waiting longer than this ends the job
    heartbeat_timeout_s: float = 60.0   # a rank silent this long (stopped, host unreachable) ends the job
    hierarchical: Any = "auto"          # auto | true | false: sum within each host first (docs/multi-host.md)
    ranks_per_host: Optional[int] = None  # null: hosts from the launcher; N: blocks of N consecutive ranks


def comm_problems(comm: DictConfig) -> list[str]:
    """One line per problem of the ``comm`` section: timeouts, backend, and the host layout against this launch."""
    def at_least_a_second(name, value):
        if checks.positive_number(name, value, unit="seconds") < 1:
            raise ValueError(f"{name}={value!r}: expected at least 1 second")
    problems = _check(comm, "comm", ("timeout_s", checks.positive_number, {"unit": "seconds"}),
                      ("heartbeat_timeout_s", at_least_a_second, {}))
    problems += _hierarchy_problems(comm)
    if comm.backend not in checks.COMM_BACKENDS:
        problems.append(f"comm.backend={comm.backend!r}: expected one of {', '.join(checks.COMM_BACKENDS)}")
    elif comm.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            problems.append("comm.backend='nccl': expected a machine with CUDA (torch.cuda.is_available() is "
                            "False here); use comm.backend=gloo or auto")
    return problems


def _hierarchy_problems(comm: DictConfig) -> list[str]:
    """``comm.hierarchical`` and ``comm.ranks_per_host`` against the launch this process is part of."""
    import os

    from dtrain.comm import detect_launcher
    from dtrain.comm.hierarchical import hierarchical_setting
    from dtrain.comm.hosts import ranks_by_block

    problems = checks.collect([lambda: hierarchical_setting(comm.hierarchical)])
    try:
        size = detect_launcher(os.environ).size
    except ValueError:  # the launcher's own variables are reported when the communicator starts
        return problems
    if comm.ranks_per_host is not None:
        problems += checks.collect([lambda: ranks_by_block(size, comm.ranks_per_host)])
    if comm.hierarchical is True and size == 1:
        problems.append("comm.hierarchical=true needs a job of several processes on several hosts; this one has "
                        "1 process: use comm.hierarchical=auto or false")
    return problems

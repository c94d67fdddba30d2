"""The first minibatch, read and checked on every rank before any of them trains or writes: a problem that only
one rank's share shows (a sample of another shape, a ``__getitem__`` that raises, NaN in the data) refuses the run
on every rank at once, in the same line naming that rank, so rank 0 never goes on to write into the run
directory and no rank waits in a collective for one that stopped."""
from __future__ import annotations

import builtins
from collections.abc import Callable

from dtrain.comm.base import first_line
from dtrain.data.errors import DataError


def read_agreed(comm, read: Callable[[], object]):
    """``read()`` (the first minibatch, read and checked) on every rank of ``comm``, which then agree: when it
    raised on any rank, every rank raises the lowest such rank's error as ``rank R of N: message``, of the same
    type (a DataError, a builtin such as ValueError or OSError; any other as RuntimeError naming its type), so
    the command line ends every rank with one line and the error's exit code. One process raises as it is."""
    try:
        batch, problem = read(), None
    except Exception as error:  # noqa: BLE001 - every rank must hear of it before any raises
        batch, problem = None, error
    if comm.size == 1:
        if problem is not None:
            raise problem
        return batch
    reports = comm.allgather_object(None if problem is None else _report(problem))
    for rank, report in enumerate(reports):
        if report is not None:
            raise _agreed_error(rank, comm.size, *report) from problem
    return batch


def _report(error: Exception) -> tuple[str, str, str]:
    """What the other ranks need to raise ``error`` as this rank did: its type's name and module, its line."""
    return type(error).__name__, type(error).__module__, first_line(error) or type(error).__name__


def _agreed_error(rank: int, size: int, type_name: str, module: str, line: str) -> Exception:
    """One rank's error on every rank: ``rank R of N: line``, a DataError or builtin by its type."""
    if type_name == DataError.__name__ and module == DataError.__module__:
        return DataError(f"rank {rank} of {size}: {line}")
    kind = getattr(builtins, type_name, None) if module == "builtins" else None
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(f"rank {rank} of {size}: {line}")
        except Exception:  # noqa: BLE001 - an exception type that needs other arguments
            pass
    return RuntimeError(f"rank {rank} of {size}: {module}.{type_name}: {line}")

"""One background thread per strategy, for exchanges that are several dependent collectives plus compute.

A strategy such as k-bit quantization or PowerSGD cannot be one asynchronous collective: it
computes, communicates, computes again. Run on the caller's thread it would block backward
until it finished. :class:`ExchangeWorker` runs each exchange on ONE background thread, in the
order the exchanges were started, so backward keeps computing while they run and every rank
still issues its collectives in the same order (the launch order is the bucket order, the same
everywhere). While work is pending the caller must issue no collective of its own; the
data-parallel learner waits every handle before it talks to the other ranks again.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch

from dtrain.comm.base import AsyncHandle


class _FutureHandle(AsyncHandle):
    """An exchange running on the worker thread; ``wait()`` returns its tensor or re-raises its error."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def wait(self) -> torch.Tensor:
        """Block until the exchange has finished; return its (in-place) result."""
        return self._future.result()


class ExchangeWorker:
    """A single FIFO thread that runs exchanges (created on first use, closed by :meth:`close`)."""

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, work: Callable[[], torch.Tensor]) -> AsyncHandle:
        """Queues ``work`` behind every earlier one; the handle's ``wait()`` returns its result."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtrain-exchange")
        return _FutureHandle(self._executor.submit(work))

    def drain(self) -> None:
        """Blocks until every exchange queued so far has finished (errors stay with their handles)."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result()

    def close(self) -> None:
        """Finishes queued work and stops the thread (a later ``submit`` starts a new one)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


__all__ = ["ExchangeWorker"]

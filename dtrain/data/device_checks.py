"""The finite-values check of streams that live on an accelerator, read back without waiting for the device.

A stream on the CPU is checked as it is read (``dtrain.data._checks.check_finite``). One on a GPU (DALI's GPU
pipeline, a transform that runs there) cannot be read back per minibatch without stalling the device, so its
check is queued instead: one ``isfinite`` per row on the device, a non-blocking copy of those flags to the host
and an event after it. The flags are looked at once the event has passed (:meth:`DeferredFiniteChecks.poll`,
every minibatch: free), or waited for (:meth:`DeferredFiniteChecks.flush`) before anything is judged or kept:
a checkpoint, a progress point, the end of the data or of training. A bad sample is named then, a few
minibatches after it was read, and before its NaN could be reported as a divergence or saved.
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from dtrain.data._checks import not_finite
from dtrain.data.errors import DataError


class _Queued(NamedTuple):
    """One minibatch's flags: per stream, whether each of its rows is finite (host tensors, ready once
    its ``events`` have passed), and how to name a row of the minibatch."""

    flags: list[tuple[str, torch.Tensor, torch.Tensor]]  # (stream, finite rows, any NaN per row)
    events: list  # one per device the streams are on
    describe: Callable[[int], str]


def device_event(device: torch.device):
    """A recorded event on ``device``'s current stream (``torch.Event``): it passes when the copies queued
    before it have finished."""
    event = torch.Event(device=device)
    event.record()
    return event


class DeferredFiniteChecks:
    """Queued finite checks of accelerator streams (module docstring), oldest first: the source queues a minibatch's
    as it hands it out, and polls or flushes them, all from the thread that reads it.

    Args:
        make_event: ``make_event(device)`` after the flags' copies are queued: an object with ``query()``
            (passed?) and ``synchronize()`` (wait for it); :func:`device_event` (looked up when a minibatch is
            queued) by default.
    """

    def __init__(self, make_event: Callable[[torch.device], Any] | None = None):
        self._make_event = make_event
        self._queued: collections.deque[_Queued] = collections.deque()

    def __len__(self) -> int:
        return len(self._queued)

    def __reduce__(self):
        """A copy (a source sent to another process) starts with nothing queued: the checks (and their device
        events, which do not pickle) are of this process's minibatches."""
        return DeferredFiniteChecks, (self._make_event,)

    def add(self, streams: list[tuple[str, torch.Tensor]], describe: Callable[[int], str]) -> None:
        """Queues the check of one minibatch's floating, strided ``(name, tensor)`` streams on accelerators,
        whose row ``i`` ``describe(i)`` names; nothing waits for the device here."""
        flags = []
        for name, data in streams:
            rows = data.reshape(data.shape[0], -1)
            finite = torch.isfinite(rows).all(dim=1).to("cpu", non_blocking=True)
            has_nan = torch.isnan(rows).any(dim=1).to("cpu", non_blocking=True)
            flags.append((name, finite, has_nan))
        if not flags:
            return
        make_event = self._make_event if self._make_event is not None else device_event
        events = [make_event(device) for device in {data.device for _, data in streams}]
        self._queued.append(_Queued(flags, events, describe))

    def poll(self) -> None:
        """Looks at the queued checks whose copies have finished, oldest first, without waiting.

        Raises:
            DataError: a stream holds NaN or an infinity, naming the first such sample.
        """
        if self._queued:
            self._check(wait=False)

    def flush(self) -> None:
        """Waits for every queued check and looks at them all (before a checkpoint or a judgement).

        Raises:
            DataError: as :meth:`poll`.
        """
        self._check(wait=True)

    def _check(self, wait: bool) -> None:
        while self._queued:
            queued = self._queued[0]
            if wait:
                for event in queued.events:
                    event.synchronize()
            elif not all(event.query() for event in queued.events):
                return
            self._queued.popleft()
            for name, finite, has_nan in queued.flags:
                if bool(finite.all()):
                    continue
                row = int((~finite).nonzero()[0, 0])
                self._queued.clear()  # reported: the run ends here
                raise DataError(not_finite(name, queued.describe(row), has_nan=bool(has_nan[row])))


__all__ = ["DeferredFiniteChecks", "device_event"]

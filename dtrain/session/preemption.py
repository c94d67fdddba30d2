"""Preemption: while training, the preemption signal (``SIGTERM`` by default) sets a flag that the loop
checks at a step boundary, where every rank agrees to save a checkpoint and stop (exit code 75)."""
from __future__ import annotations

import contextlib
import threading

import torch

from dtrain.comm.failfast import (add_signal_callback, install_signal_handlers, release_signal_handlers,
                                  remove_signal_callback)
from dtrain.session.configs import signal_from_name


class Preemption:
    """The session's preemption signal: claimed while training (:meth:`handling`), agreed on by the ranks
    where they meet (:meth:`requested`).

    Args:
        signal_name: the signal's name (``"SIGTERM"``); ``None``: no preemption handling (no checkpoints to save).
        comm: the job's communicator, over which the ranks agree.
    """

    def __init__(self, signal_name: str | None, comm):
        self.signal_name = signal_name
        self.comm = comm
        self._received = threading.Event()

    @contextlib.contextmanager
    def handling(self):
        """While training, the preemption signal sets a flag instead of ending the job (main thread only)."""
        if self.signal_name is None or threading.current_thread() is not threading.main_thread():
            yield
            return
        wanted = int(signal_from_name(self.signal_name))

        def claim(signum: int) -> bool:
            if signum != wanted:
                return False
            self._received.set()
            return True

        routed = install_signal_handlers([wanted])  # nothing when fail-fast routes it already (the command line)
        add_signal_callback(claim)
        try:
            yield
        finally:
            remove_signal_callback(claim)
            release_signal_handlers(routed)

    def requested(self) -> bool:
        """Whether any rank got the preemption signal (a collective when several ranks run)."""
        if self.signal_name is None:
            return False
        if self.comm.size == 1:
            return self._received.is_set()
        flag = torch.tensor([1.0 if self._received.is_set() else 0.0], device=self.comm.device)
        return bool(self.comm.allreduce(flag, op="max").item())

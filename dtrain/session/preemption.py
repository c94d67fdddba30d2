"""Preemption: while training, the preemption signal (``SIGTERM`` by default) sets a flag that the loop
checks at a step boundary, where every rank agrees to save a checkpoint and stop (exit code 75)."""
from __future__ import annotations

import contextlib
import threading

import torch

from dtrain.comm.failfast import (add_signal_callback, install_signal_handlers, release_signal_handlers,
                                  remove_signal_callback)
from dtrain.session.configs import signal_from_name


class PreemptionHandling:
    """The signal handling of :class:`~dtrain.session.TrainingSession` (mixed into it: it uses the session's
    ``checkpoint_config``, ``checkpoint_files``, ``comm`` and the ``_preemption`` event)."""

    @contextlib.contextmanager
    def _preemption_handler(self):
        """While training, the preemption signal sets a flag instead of ending the job."""
        name = self.checkpoint_config.preemption_signal if self.checkpoint_config else None
        if name is None or threading.current_thread() is not threading.main_thread():
            yield
            return
        wanted = int(signal_from_name(name))

        def claim(signum: int) -> bool:
            if signum != wanted:
                return False
            self._preemption.set()
            return True

        routed = install_signal_handlers([wanted])  # nothing when fail-fast routes it already (the command line)
        add_signal_callback(claim)
        try:
            yield
        finally:
            remove_signal_callback(claim)
            release_signal_handlers(routed)

    def _preemption_requested(self) -> bool:
        """Whether any rank got the preemption signal (a collective when several ranks run)."""
        if self.checkpoint_files is None or self.checkpoint_config.preemption_signal is None:
            return False
        if self.comm.size == 1:
            return self._preemption.is_set()
        flag = torch.tensor([1.0 if self._preemption.is_set() else 0.0], device=self.comm.device)
        return bool(self.comm.allreduce(flag, op="max").item())

"""A digits model that fails on purpose, for fail-fast tests of the command line.

``model._target_=tests.helpers.failing_model.FailingDigitsCNN`` (``run_mpi`` puts the repository
root on the ranks' ``PYTHONPATH``);
``DTRAIN_TEST_FAIL_RANK`` chooses the rank and ``DTRAIN_TEST_FAIL_AFTER`` the number of
training forward passes after which it acts; ``DTRAIN_TEST_FAIL_HOW`` is ``raise`` (a
RuntimeError), ``kill`` (SIGKILL to itself), ``stop`` (SIGSTOP to itself), ``slow``
(sleeps ``DTRAIN_TEST_SLOW_S`` seconds in one forward, a slow step that is not a hang),
``gil`` (the same, holding the interpreter lock: C's ``sleep`` called through ``ctypes.PyDLL``) or
``slow_outputs`` (sleeps that long in every ``state_dict()``: rank 0 writing its outputs at the end) or
``unstable`` (from then on a run that became unstable: every other training minibatch's logits are zeros, so
the running loss rises to about half of ln 10 without harming the weights, and in evaluation passes every other
sample's logits are negated and scaled by 10: the test loss far above ln 10 at about half the model's accuracy).
``DTRAIN_TEST_MARK`` names a file that gets the wall-clock time at which it acted.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time

from dtrain.comm import detect_launcher
from dtrain.models import DigitsCNN


class FailingDigitsCNN(DigitsCNN):
    """``DigitsCNN`` that fails as the environment says (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forwards = 0
        self.rank = detect_launcher(os.environ).rank

    def forward(self, images):
        if self._chosen() and os.environ.get("DTRAIN_TEST_FAIL_HOW") == "unstable":
            return self._unstable(images)
        if self.training:
            self.forwards += 1
            if (self._chosen() and self.forwards == int(os.environ.get("DTRAIN_TEST_FAIL_AFTER", "5"))):
                how = os.environ.get("DTRAIN_TEST_FAIL_HOW", "raise")
                self._mark(f"forward {self.forwards}")
                if how == "raise":
                    raise RuntimeError(f"injected failure on rank {self.rank}")
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if how == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                if how == "slow":
                    time.sleep(float(os.environ.get("DTRAIN_TEST_SLOW_S", "10")))
                if how == "gil":  # no other thread of this process runs Python meanwhile
                    ctypes.PyDLL(None).sleep(int(os.environ.get("DTRAIN_TEST_SLOW_S", "10")))
        return super().forward(images)

    def _unstable(self, images):
        """``unstable``: the model's logits until the chosen forward, then those of a run that became unstable."""
        logits = super().forward(images)
        after = int(os.environ.get("DTRAIN_TEST_FAIL_AFTER", "5"))
        if not self.training:
            if self.forwards < after:
                return logits
            flipped = logits.clone()
            flipped[::2] = logits[::2] * -10.0
            return flipped
        self.forwards += 1
        return logits * 0.0 if self.forwards > after and self.forwards % 2 else logits

    def state_dict(self, *args, **kwargs):
        if self._chosen() and os.environ.get("DTRAIN_TEST_FAIL_HOW") == "slow_outputs":
            self._mark("state_dict")
            time.sleep(float(os.environ.get("DTRAIN_TEST_SLOW_S", "10")))
        return super().state_dict(*args, **kwargs)

    def _chosen(self) -> bool:
        return self.rank == int(os.environ.get("DTRAIN_TEST_FAIL_RANK", "-1"))

    def _mark(self, where: str) -> None:
        """Says that (and, in ``DTRAIN_TEST_MARK``, when) this rank acts, for the test's time bound."""
        print(f"test model: rank {self.rank} acts ({os.environ.get('DTRAIN_TEST_FAIL_HOW')}) at {where}", flush=True)
        if os.environ.get("DTRAIN_TEST_MARK"):
            with open(os.environ["DTRAIN_TEST_MARK"], "w") as mark:
                mark.write(repr(time.time()))

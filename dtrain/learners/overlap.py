"""The overlapped outer step (``learner.overlap=true``): block t's exchange runs while block t+1 trains.

A block learner normally waits at each sync for the sum of the workers' model changes before the outer step, so a
slow link stops every worker for the exchange's whole duration. With ``overlap``, the exchange of block t starts
at its end and every worker goes on training from its own model; at the end of block t+1 the sum of block t arrives
(by then usually long since), the outer step is taken with it, and each worker's progress since is moved onto the
new model of the last sync. The outer step is one block late: the delayed outer step of Streaming DiLoCo's overlap
(Douillard et al. 2025, arXiv 2501.18512, with its delay of one block) and of eager updates (Kale et al. 2025, arXiv
2502.12996, without their eager local term). Per worker i, at the end of block t+1 (``docs/semantics.md#overlap``):

1. wait for ``D(t)``, the sum over workers of the changes sent at the end of block t; the outer optimizer steps
   ``W_prev`` with it (block t's learning rate for the momentum correction, block t's samples for BMUF's momentum);
2. ``p_i = W_i - B_i``, the worker's progress since the end of block t (``B_i`` its model then, rebased);
3. ``W_i <- W_prev + p_i`` and ``B_i <- W_i``;
4. start the exchange of ``d_i = -p_i``, whose sum is the next step's ``D(t+1)``.

The first block after the warm start takes ``B_i = W_prev``, and so sends ``W_prev - W_i`` as without overlap.
Before an evaluation, a checkpoint and the run's end (:meth:`~dtrain.learners.block.BlockLearner.synchronize`),
the pending step is taken (steps 1-3) and the workers' models are averaged: nothing is in flight in a
checkpoint, so a resumed run continues bit for bit, as the uninterrupted run synchronises at the same points.
BatchNorm statistics are averaged exactly at every sync, not delayed. The exchange runs on a communicator of its own
(a split of the learner's ``outer_comm``), so its collectives, in flight across many steps, never interleave with
those the session makes on the job's communicator meanwhile.
"""
from __future__ import annotations

import time

import torch

from dtrain.comm.base import AsyncHandle


class DelayedOuterStep:
    """The state of the overlapped outer step of one :class:`~dtrain.learners.block.BlockLearner` (its ``B_i``, the
    exchange in flight and the facts of the block it belongs to); the learner calls it at each sync."""

    def __init__(self, learner) -> None:
        self.learner = learner
        self.base: torch.Tensor | None = None          # B_i: the worker's model at the last rebase
        self.pending: AsyncHandle | None = None        # the exchange of the last block's changes
        self.pending_lr: float | None = None           # that block's inner learning rate
        self.pending_samples = 0                       # that block's global samples
        self._sending: torch.Tensor | None = None      # the buffer in flight

    def start_blocks(self) -> None:
        """The end of the warm start: the first block's progress is measured from ``W_prev``."""
        self.base = self.learner.prev_parameters.clone()

    def end_of_block(self, current: torch.Tensor) -> None:
        """Steps 1-4 of the module docstring on ``current``, this worker's flat model ``W_i`` (overwritten): the
        float buffers averaged exactly on the job's communicator first, the exchange on its own."""
        progress = self._rebase(current)
        learner = self.learner
        if self._sending is None:
            self._sending = torch.empty_like(progress)
        torch.neg(progress, out=self._sending)                               # d_i = -p_i
        learner.average_float_buffers()
        learner.exchange.begin_step()
        self.pending = learner.exchange.start("model", self._sending, [p.shape for p in learner.synced_tensors])
        self.pending_lr, self.pending_samples = learner.block_lr.mean(), learner.global_samples_in_block

    def _rebase(self, current: torch.Tensor) -> torch.Tensor:
        """Steps 1-3: the pending outer step taken, ``p_i = W_i - B_i`` (into ``current``, returned), and ``W_i =
        B_i = W_prev + p_i``."""
        self.apply_pending()
        progress = current.sub_(self.base)
        torch.add(self.learner.prev_parameters, progress, out=self.base)
        self.learner.load_flat(self.base)
        return progress

    def apply_pending(self) -> None:
        """Waits for the exchange in flight and takes its outer step (step 1); the time waited is the sync's
        exchange time, and the bytes are counted now."""
        if self.pending is None:
            return
        learner = self.learner
        started = time.perf_counter()
        total = self.pending.wait()
        self.pending = None
        learner.exchange_seconds_last_step += time.perf_counter() - started
        learner.count_exchanged_bytes(0)
        learner.set_sync_facts(self.pending_samples)
        learner.correct_outer_momentum(self.pending_lr)
        learner.previous_block_lr = self.pending_lr
        learner.outer_update(total)

    def flush(self) -> None:
        """Before an evaluation, a checkpoint or the end: the pending step taken and each worker's progress moved
        onto it (steps 1-3); the learner then averages the workers' models if any trained since."""
        if self.pending is None:
            return
        learner = self.learner
        self._rebase(learner.flat_parameters(out=learner._scratch[:learner._num_parameter_elements]))

    def after_average(self) -> None:
        """After the workers' models were averaged into ``W_prev``: progress is measured from it."""
        self.base.copy_(self.learner.prev_parameters)


__all__ = ["DelayedOuterStep"]

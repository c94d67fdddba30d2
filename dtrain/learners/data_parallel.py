"""The data-parallel learner: every minibatch, gradients are summed over workers in buckets.

``data_parallel_distributed_learner`` is CNTK's factory of the same name with ChainerMN's start
(rank 0's parameters are broadcast before training); see ``docs/semantics.md#data-parallel-learner``
and, for ``distributed_after``, ``docs/semantics.md#warm-start``.
The all-reduce overlaps backward: each bucket of gradients is sent as soon as it and every
earlier bucket are complete.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from dtrain import checks
from dtrain.compress.bitpack import check_bits
from dtrain.learners._buckets import GradientBucket, plan_gradient_buckets
from dtrain.learners.base import Learner
from dtrain.learners.replicated import ReplicatedLearner, unique_tensors


class DataParallelLearner(ReplicatedLearner):
    """Synchronous data-parallel SGD: the update of the mean loss over the GLOBAL minibatch.

    Each rank back-propagates the mean loss over its ``local_samples``; the learner scales that
    gradient by ``local_samples / global_samples`` and SUM-all-reduces it, which gives exactly the
    gradient of the mean loss over all ``global_samples`` (uneven shares and ranks with 0 samples
    included). N ranks with global minibatch B therefore make the update one process makes with B.

    Communication: gradients are packed into buckets of about ``bucket_size_mb`` MiB (the first at
    most 1 MiB, as DDP's), planned in reverse parameter order (the order backward produces them).
    A post-accumulate-grad hook on every parameter fills its bucket; a bucket's all-reduce starts
    as soon as it and all earlier buckets are full, so reduction overlaps the rest of backward and
    every rank issues the same collectives in the same order. ``step()`` launches whatever is
    left (zeros for parameters that got no gradient), waits, sets each ``.grad`` to its reduced
    gradient (a view into the bucket, valid until the next minibatch's backward) and calls the
    wrapped optimizer.

    Start and warm start: ``prepare`` broadcasts rank 0's parameters and buffers. While
    ``samples_seen < distributed_after`` each rank steps on its own gradient with no
    communication (every rank reads the full stream then); at the first distributed minibatch,
    and at any ``synchronize()`` in between, rank 0's parameters, buffers and optimizer state are
    broadcast so all ranks continue from one model.

    Buffers (e.g. BatchNorm running statistics): each rank updates them from its own share during
    training; ``synchronize()`` (called by the session before cross-validation, checkpoints and
    the end of training) replaces floating-point buffers by their mean over ranks and other
    buffers (``num_batches_tracked``) by rank 0's, so evaluation and checkpoints see one model.

    Args:
        optimizer: the torch optimizer of the model's parameters (learning rate per minibatch of
            the mean loss).
        comm: the job's communicator; with size 1 this is the local learner (no hooks).
        distributed_after: global samples of local-only training before synchronous steps begin.
        bucket_size_mb: bucket size limit in MiB (> 0); a parameter larger than it gets its own bucket.

    Raises:
        ValueError: ``bucket_size_mb`` is not a positive number, or ``distributed_after`` < 0.
        RuntimeError: a parameter gets two gradients in one minibatch (more than one backward).
    """

    kind = "data_parallel"

    def __init__(self, optimizer: torch.optim.Optimizer, comm=None, distributed_after: int = 0,
                 bucket_size_mb: float = 25.0):
        super().__init__(optimizer, comm, distributed_after, bucket_size_mb)
        self.buckets: list[GradientBucket] = []
        self._hook_handles: list[Any] = []
        self._next_bucket = 0          # state: the first bucket whose all-reduce has not been launched
        self._reducing = False         # state: this minibatch is a distributed one (hooks are live)
        self._scale = 1.0              # state: local_samples / global_samples of this minibatch

    # -- set-up -------------------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module) -> None:
        """Broadcasts rank 0's parameters and buffers, plans buckets and registers gradient hooks.

        A collective: every rank calls it once before training. Does nothing with one worker.
        """
        self.finalize()  # a second prepare replaces the hooks instead of doubling them
        super().prepare(model)
        if self.comm.size == 1:
            return
        trainable = [parameter for parameter in unique_tensors(self.parameters) if parameter.requires_grad]
        ready_order = trainable[::-1]  # backward produces the last layer's gradients first
        self.buckets = [GradientBucket([ready_order[index] for index in indices])
                        for indices in plan_gradient_buckets(ready_order, self.bucket_bytes)]
        for bucket_index, bucket in enumerate(self.buckets):
            for slot, parameter in enumerate(bucket.parameters):
                hook = functools.partial(self._on_gradient_ready, bucket_index, slot)
                self._hook_handles.append(parameter.register_post_accumulate_grad_hook(hook))

    def finalize(self) -> None:
        """Removes the gradient hooks (the model can then be used without this learner)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._reducing = False

    # -- one minibatch ------------------------------------------------------------------------------
    def begin_minibatch(self, local_samples: int, global_samples: int) -> None:
        """Clears gradients, records the sample counts and arms the hooks for a distributed step.

        At the first distributed minibatch after local steps (``distributed_after``), first
        broadcasts rank 0's model and optimizer state (a collective).
        """
        super().begin_minibatch(local_samples, global_samples)
        self._reducing = self.is_distributed()
        if not self._reducing:
            return
        self._scale = local_samples / global_samples / self.loss_scale  # unscaled before the exchange (fp16)
        self._next_bucket = 0
        for bucket in self.buckets:
            bucket.reset()

    def _on_gradient_ready(self, bucket_index: int, slot: int, parameter: torch.Tensor) -> None:
        """Post-accumulate-grad hook: packs this gradient and launches every bucket now ready, in order."""
        if not self._reducing or self._accumulating:
            return  # local steps, a backward outside training, or an earlier micro-batch (see no_sync)
        self.buckets[bucket_index].fill(slot, parameter.grad, self._scale)
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # strictly in index order: a full bucket waits for earlier ones, so ranks never disagree
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].missing == 0:
            bucket = self.buckets[self._next_bucket]
            bucket.handle = self.comm.allreduce_async(bucket.buffer, op="sum")
            self._next_bucket += 1

    def distributed_update(self) -> None:
        """Finishes the gradient all-reduce, writes the global-mean gradient into ``.grad`` and steps.

        Without communication (one worker, or before ``distributed_after``) ``step`` makes the
        local learner's update instead.
        """
        for bucket in self.buckets[self._next_bucket:]:
            for slot, parameter in enumerate(bucket.parameters):
                if not bucket.filled[slot] and parameter.grad is not None:
                    # accumulated under no_sync by an earlier micro-batch, untouched by the last one
                    bucket.fill(slot, parameter.grad, self._scale)
            bucket.fill_missing_with_zeros()
        self._launch_ready_buckets()
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.assign_grads()
        self._reducing = False
        self._step_optimizer(gradients_unscaled=True)


def data_parallel_distributed_learner(optimizer: torch.optim.Optimizer, comm=None, distributed_after: int | str = "auto",
                                      num_quantization_bits: int = 32, bucket_size_mb: float = 25.0,
                                      error_feedback: bool = True) -> Learner:
    """Wraps ``optimizer`` for synchronous data-parallel training (CNTK's factory of this name).

    Args:
        optimizer: the torch optimizer of the model's parameters.
        comm: the job's communicator (a size-1 local one when omitted).
        distributed_after: global samples trained with local updates before gradients are shared;
            ``"auto"`` (default): none for 32 bits, a warm start relative to the run for fewer
            (``dtrain.learners.quantized.auto_warm_start``, derived when the session plans the run).
        num_quantization_bits: 32 sends full-precision gradients (``DataParallelLearner``); 1..31
            sends k-bit quantized gradients with error feedback (``QuantizedDataParallelLearner``,
            which does not use ``bucket_size_mb``).
        bucket_size_mb: gradient bucket size in MiB for the full-precision all-reduce.
        error_feedback: quantized only: carry each step's quantization error into the next
            (``False`` is an ablation); must stay True with 32 bits, where nothing is quantized.

    Returns:
        A ``DataParallelLearner``, or a ``QuantizedDataParallelLearner`` for fewer than 32 bits.

    Raises:
        ValueError: a value out of range or of the wrong kind (one line ``name=value: expected ...``).
        TypeError: ``optimizer`` is not a torch optimizer.
    """
    num_quantization_bits = check_bits(num_quantization_bits, "num_quantization_bits")
    checks.positive_number("bucket_size_mb", bucket_size_mb, unit="MiB")  # refused even where quantized ignores it
    if distributed_after != "auto":
        distributed_after = checks.sample_count("distributed_after", distributed_after, allow_zero=True)
    error_feedback = checks.boolean("error_feedback", error_feedback)
    if not error_feedback and num_quantization_bits == 32:
        raise ValueError("error_feedback=False: expected True with num_quantization_bits=32, where nothing is "
                         "quantized; set num_quantization_bits below 32 (e.g. learner=quantized) or leave it True")
    if num_quantization_bits < 32:
        # imported here: the quantized learner is optional and pulls in the compressors
        from dtrain.learners.quantized import QuantizedDataParallelLearner

        return QuantizedDataParallelLearner(optimizer, comm, distributed_after=distributed_after,
                                            num_quantization_bits=int(num_quantization_bits),
                                            error_feedback=error_feedback)
    return DataParallelLearner(optimizer, comm, distributed_after=distributed_after, bucket_size_mb=bucket_size_mb)


__all__ = ["DataParallelLearner", "data_parallel_distributed_learner"]

"""The data-parallel learner: every minibatch, gradients are summed over workers in buckets.

``data_parallel_distributed_learner`` is CNTK's factory of the same name with ChainerMN's start
(rank 0's parameters are broadcast before training); see ``docs/semantics.md#data-parallel-learner``
and, for ``distributed_after``, ``docs/semantics.md#warm-start``.
The exchange overlaps backward: each bucket of gradients is handed to the exchange strategy
(:mod:`dtrain.exchange`: fp32 all-reduce by default, bf16/fp16, k-bit quantized, PowerSGD) as
soon as it and every earlier bucket are complete.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import replace
from typing import Any

import torch

from dtrain import checks
from dtrain.advice import Advice
from dtrain.exchange import AllReduce, Exchange, Quantized
from dtrain.learners._buckets import GradientBucket, InPlaceBucket, is_in_place, plan_gradient_buckets
from dtrain.learners.base import AUTO, RunFacts, auto_warm_start, bind_exchange, exchange_identity
from dtrain.learners.cntk_keywords import synchronous_update, wrapped_optimizer
from dtrain.learners.frozen_variance import FrozenVariance, keeps_variance
from dtrain.learners.replicated import ReplicatedLearner, unique_tensors
from dtrain.learners.settings import DATA_PARALLEL, QUANTIZATION_BITS, refuse_retired
from dtrain.rules import check_settings


class DataParallelLearner(ReplicatedLearner):
    """Synchronous data-parallel SGD: the update of the mean loss over the GLOBAL minibatch.

    Each rank back-propagates the mean loss over its ``local_samples``; the learner scales that
    gradient by ``local_samples / global_samples`` and SUM-all-reduces it, which gives exactly the
    gradient of the mean loss over all ``global_samples`` (uneven shares and ranks with 0 samples
    included). N ranks with global minibatch B therefore make the update one process makes with B.

    Communication: gradients are packed into buckets of about ``bucket_size_mb`` MiB (the first at
    most 1 MiB, as DDP's), planned in reverse parameter order (the order backward produces them). A post-accumulate-grad hook on
    every parameter fills its bucket; a bucket's exchange starts (``exchange.start(bucket_index,
    flat, shapes)``) as soon as it and all earlier buckets are full, so reduction overlaps the
    rest of backward and every rank issues the same collectives in the same order. ``step()``
    launches whatever is left (zeros for parameters that got no gradient), waits, sets each
    ``.grad`` to its reduced gradient (a view into the bucket, valid until the next minibatch's
    backward) and calls the wrapped optimizer. With the float32 all-reduce, a gradient of at least
    ``comm.reduce_alone_bytes`` (8 MiB with Gloo, 1 MiB with MPI) is not copied: it is all-reduced
    in place as a bucket of its own, its flag riding in the last bucket. The caller may fold the ``local_samples /
    global_samples`` scale into the loss (:meth:`fold_gradient_scale`, as ``training_session``
    does), which leaves such gradients untouched by the learner until the all-reduce.

    The exchange strategy (``exchange``; :class:`~dtrain.exchange.AllReduce`, float32, when
    None) does the transport. Each parameter's "has a gradient" flag stays exact whatever the
    strategy: with a lossless one it travels in the bucket (one all-reduce per bucket, as
    before); a lossy one gets gradient values only, and the flags of all buckets are summed
    in one small float32 all-reduce after the buckets are done. ``exchange_seconds_last_step``
    is the part of the last step spent on the exchange after backward (waiting for the buckets,
    the flags, unpacking). A strategy that asks for it (``needs_warm_start``, k-bit) gets a
    full-precision warm start with ``distributed_after="auto"``.

    Start and warm start: ``prepare`` broadcasts rank 0's parameters and buffers. While
    ``samples_seen < distributed_after``, with the float32 all-reduce, each rank steps on its own
    gradient with no communication (every rank reads the full stream then: CNTK's warm start); at
    the first distributed minibatch, and at any ``synchronize()`` in between, rank 0's parameters,
    buffers and optimizer state are broadcast so all ranks continue from one model. With a
    compressing strategy (k-bit, bf16/fp16, PowerSGD) the warm start instead all-reduces float32
    gradients (each rank reads its partition; ``warm_start_mode="allreduce"``, the default): the same
    exact update of the global minibatch that a single worker on the full stream makes, for 1/N
    of the compute per rank; the strategy takes over at ``distributed_after``.
    ``warm_start_mode="local"`` keeps CNTK's local warm start, faster where one float32 all-reduce
    costs more than N - 1 ranks' share of the compute (e.g. a 100 Mbit/s link).

    Buffers (e.g. BatchNorm running statistics): each rank updates them from its own share during
    training; ``synchronize()`` (called by the session before cross-validation, checkpoints and
    the end of training) replaces floating-point buffers by their mean over ranks and other
    buffers (``num_batches_tracked``) by rank 0's, so evaluation and checkpoints see one model.

    Args:
        optimizer: the torch optimizer of the model's parameters (learning rate per minibatch of
            the mean loss).
        comm: the job's communicator; with size 1 this is the local learner (no hooks).
        distributed_after: global samples of local-only training before synchronous steps begin; ``"auto"`` (the
            default, as ``data_parallel_distributed_learner``'s): :meth:`auto_distributed_after`, a warm start for an
            exchange that asks for one (k-bit), else 0.
        bucket_size_mb: bucket size limit in MiB (> 0); a parameter larger than it gets its own bucket.
        exchange: how buckets are summed over ranks (:mod:`dtrain.exchange`); None: float32 all-reduce.
        warm_start_mode: with a compressing exchange, how the steps before ``distributed_after`` train:
            ``"allreduce"`` (float32 gradients, each rank on its share; None: this) or ``"local"`` (CNTK's).
        freeze_variance: with an Adam-family optimizer (its groups have ``betas``) and a lossy strategy,
            hold the optimizer's bias-corrected variance where the float32 warm start left it, from the
            first step the strategy exchanges (1-bit Adam's rule: :mod:`dtrain.learners.frozen_variance`);
            ``"auto"`` (the default): where the strategy's sums are 1-bit values
            (``Exchange.holds_adam_variance``: 1-bit gradients up to 8 workers), not for 2 bits or more,
            PowerSGD, bf16/fp16 or float32; ``True``: for any lossy strategy; ``False``: never.
        overlap_backward: start each bucket's exchange during backward (the default); ``False``
            starts them all after backward, only to measure what the overlap saves.

    Raises:
        ValueError: ``bucket_size_mb`` is not a positive number, ``distributed_after`` < 0, or
            ``warm_start_mode`` is not one of ``checks.WARM_STARTS``.
        TypeError: ``exchange`` is not a :class:`dtrain.exchange.Exchange`, or a retired keyword
            (``num_quantization_bits``, ``error_feedback``, ``requantize_sum``, ``warm_start``: one line
            naming what to pass now, e.g. ``exchange=Quantized(k)``).
        RuntimeError: a parameter gets two gradients in one minibatch (more than one backward).
    """

    kind = "data_parallel"

    def __init__(self, optimizer: torch.optim.Optimizer, comm=None, distributed_after: int | str = AUTO,
                 bucket_size_mb: float = 25.0, exchange: Exchange | None = None, overlap_backward: bool = True,
                 warm_start_mode: str | None = None, freeze_variance: bool | str = AUTO, **retired: Any):
        refuse_retired(type(self).__name__, retired)
        super().__init__(optimizer, comm, distributed_after, bucket_size_mb)
        self.warm_start_mode = checks.warm_start_mode(warm_start_mode)
        freeze_variance = checks.boolean_or_auto("freeze_variance", freeze_variance)
        self.overlap_backward = checks.boolean("overlap_backward", overlap_backward)
        self.exchange = exchange = bind_exchange(exchange, self.comm)
        # a compressing strategy's warm start: float32 all-reduce steps until ``distributed_after``
        self.warm_start_exchange = None if exchange.lossless or self.warm_start_mode == "local" else AllReduce()
        if self.warm_start_exchange is not None:
            self.warm_start_exchange.bind(self.comm)
        self._active = self.exchange     # state: the strategy of this minibatch (the warm start's, or the strategy)
        self.freeze_variance_setting = freeze_variance  # True, False or "auto" (see :attr:`freeze_variance`)
        self.frozen_variance = FrozenVariance(optimizer)
        self._variance_held: bool | None = None  # state: :attr:`freeze_variance` as rank 0 saw it at the first lossy step
        self._restored_variance_held: bool | None = None  # the checkpoint's run's choice (None: none made, or unknown)
        self.buckets: list[GradientBucket | InPlaceBucket] = []
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
        self.buckets = self._make_buckets(ready_order)
        for bucket_index, bucket in enumerate(self.buckets):
            for slot, parameter in enumerate(bucket.parameters):
                hook = functools.partial(self._on_gradient_ready, bucket_index, slot)
                self._hook_handles.append(parameter.register_post_accumulate_grad_hook(hook))

    def _make_buckets(self, ready_order: list[torch.Tensor]) -> list[GradientBucket | InPlaceBucket]:
        """The planned buckets; with a lossless exchange, large gradients are reduced in place and their
        flags ride in the last (packed) bucket."""
        if not ready_order:
            return []
        in_place_bytes = min(self.comm.reduce_alone_bytes, self.bucket_bytes) if self.exchange.lossless else None
        plan = plan_gradient_buckets(ready_order, self.bucket_bytes, in_place_bytes)
        in_place = [is_in_place(ready_order, indices, in_place_bytes) for indices in plan]
        carrier = GradientBucket([ready_order[index] for index in plan[-1]], carried_flags=sum(in_place),
                                 device=ready_order[0].device)
        flags = iter(carrier.carried_flags.split(1))  # one slot of the last bucket per in-place bucket
        buckets: list[GradientBucket | InPlaceBucket] = [
            InPlaceBucket(ready_order[indices[0]], next(flags)) if alone
            else GradientBucket([ready_order[index] for index in indices])
            for indices, alone in zip(plan[:-1], in_place)]
        return [*buckets, carrier]

    def finalize(self) -> None:
        """Removes the gradient hooks and stops the exchange's thread (the model can then be used alone)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._reducing = False
        self.exchange.close()
        if self.warm_start_exchange is not None:
            self.warm_start_exchange.close()

    def plan(self, facts: RunFacts) -> None:
        """The base's plan, then the exchange's (a strategy may derive ``"auto"`` settings from the run):
        it is told the run's minibatches after the warm start, the steps it will exchange, and those made
        before the learning rate's warm-up ends."""
        super().plan(facts)
        warmup = self.exchange_steps_until(facts, facts.warmup_samples) if facts.warmup_samples else 0
        self.exchange.plan(replace(facts, warmup_exchange_steps=warmup),
                           steps=self.exchange_steps_until(facts, facts.max_samples), step_name="step")

    def exchange_steps_until(self, facts: RunFacts, samples: int | None) -> int | None:
        """The minibatches exchanged before ``samples`` global samples (after the warm start); None when unknown."""
        if not samples or not facts.minibatch_size:
            return None
        return math.ceil(max(samples - self.distributed_after, 0) / facts.minibatch_size)

    def auto_distributed_after(self, facts: RunFacts) -> int:
        """``distributed_after="auto"``: a warm start (:func:`auto_warm_start`) when the exchange asks for
        one (k-bit quantization), else none; 0 with one process."""
        return auto_warm_start(facts) if self.exchange.needs_warm_start and self.comm.size > 1 else 0

    def is_distributed(self) -> bool:
        """Whether gradients are exchanged this minibatch: past ``distributed_after``, or throughout with a
        compressing strategy (its warm start exchanges float32 gradients)."""
        if self.warm_start_exchange is not None:
            return self.comm.size > 1
        return super().is_distributed()

    def in_full_precision_warm_start(self) -> bool:
        """Whether this minibatch is a compressing strategy's float32 warm start (before ``distributed_after``)."""
        return self.warm_start_exchange is not None and self.samples_seen < self.distributed_after

    def describe(self) -> str:
        """The learner, its warm start, and the exchange strategy when it is not the float32 all-reduce."""
        if self.warm_start_exchange is not None and self.comm.size > 1 and self.distributed_after:
            auto = " (auto)" if self.distributed_after_is_auto else ""
            return (f"learner {self.kind}, warm start of {self.distributed_after:,} samples{auto} with float32 "
                    f"all-reduce, then gradients exchanged by {self.exchange.describe_plan()}{self._frozen_note()}")
        line = super().describe()
        if self.comm.size > 1 and not isinstance(self.exchange, AllReduce):
            line += f", gradients exchanged by {self.exchange.describe_plan()}{self._frozen_note()}"
        return line

    @property
    def freeze_variance(self) -> bool:
        """Whether Adam's variance is held while the lossy strategy exchanges: ``freeze_variance`` true, or
        ``"auto"`` where the strategy's sums are 1-bit values (``Exchange.holds_adam_variance``), with an
        Adam-family optimizer. Evaluated now: a restored run's sum form decides it."""
        setting = self.freeze_variance_setting
        wanted = self.exchange.holds_adam_variance if setting == AUTO else setting
        return bool(wanted) and not self.exchange.lossless and keeps_variance(self.optimizer)

    def _holds_variance(self) -> bool:
        """:attr:`freeze_variance` as rank 0 sees it: under ``"auto"`` agreed by every rank once (a collective, at
        the first lossy step), since a two-level exchange knows its sums' form on the host leaders only."""
        if self._variance_held is None:
            held = self.freeze_variance
            if self.freeze_variance_setting == AUTO and self.comm.size > 1:
                held = self.comm.broadcast_object(held)
            self._variance_held = bool(held)
            restored, self._restored_variance_held = self._restored_variance_held, None
            if restored is not None and restored != self._variance_held and self.comm.is_main:
                print(self._variance_change_line(restored), flush=True)
        return self._variance_held

    def _variance_change_line(self, restored: bool) -> str:
        """The one line saying a resumed run holds Adam's variance where its checkpoint's run did not, or the reverse
        (a checkpoint of another version's ``auto``, or a world size that changes the sums' form)."""
        was, now = ("held", "releases it") if restored else ("did not hold", "holds it")
        why = f"freeze_variance={str(self.freeze_variance_setting).lower()}"
        if self.freeze_variance_setting == AUTO:
            why += f", {self.comm.size} workers, {self.exchange.describe_plan()}"
        return (f"dtrain: the checkpoint's run {was} the optimizer's variance; this run {now} from here on: {why}; "
                f"learner.freeze_variance={str(restored).lower()} keeps the checkpoint's choice")

    def _frozen_note(self) -> str:
        return ", the optimizer's variance frozen from then on" if self.freeze_variance else ""

    def automatic_settings(self) -> list[str]:
        """The base's, and ``learner.freeze_variance`` where ``"auto"`` holds Adam's variance."""
        held = self.comm.size > 1 and self.freeze_variance_setting == AUTO and self.freeze_variance
        return super().automatic_settings() + (["learner.freeze_variance"] if held else [])

    def collapse_advice(self) -> Advice:
        """The base's, and letting Adam's variance follow the gradients where it is held (:attr:`freeze_variance`)."""
        advice = super().collapse_advice()
        if self.comm.size > 1 and self.freeze_variance:
            advice += Advice((), ("let the optimizer's variance follow the gradients (learner.freeze_variance=false)",))
        return advice

    # -- statistics --------------------------------------------------------------------------------
    @property
    def bytes_sent_last_step(self) -> int:
        """Bytes this rank sent in the last distributed step's gradient exchange (0 before any)."""
        return int(self._active.bytes_sent_last_step)

    @property
    def compression_ratio(self) -> float:
        """A float32 all-reduce's bytes over the bytes actually sent, last step (nan before any)."""
        return self._active.compression_ratio

    def progress_note(self) -> str:
        """For a compressing strategy: bytes this rank sent in the last exchange and the saving against float32
        (or that the float32 warm start is on)."""
        if not self.bytes_sent_last_step or self.exchange.lossless:
            return ""
        if self._active is not self.exchange:
            return f"float32 warm start until {self.distributed_after:,} samples"
        return (f"{self.exchange.describe()}: {self.bytes_sent_last_step / 1e3:,.0f} kB sent/step "
                f"({self.compression_ratio:.1f}x less than 32-bit)")

    def summary_note(self) -> str:
        """With the optimizer's variance held: how many of the held steps' tensor updates were clipped to a root
        mean square of one learning rate (:mod:`dtrain.learners.frozen_variance`), in this process."""
        frozen = self.frozen_variance
        if not frozen.held_updates:
            return ""
        clipped = frozen.clipped_updates
        return (f"variance held: {clipped:,} of {frozen.held_updates:,} tensor updates clipped to a root mean square "
                f"of one learning rate ({100 * clipped / frozen.held_updates:.1f}%)")

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
        self._active = self.warm_start_exchange if self.in_full_precision_warm_start() else self.exchange
        self._active.begin_step()
        self._active.loss_scaled = self.loss_scale != 1.0

    def fold_gradient_scale(self) -> float:
        """Hands this minibatch's gradient scale (``local_samples / global_samples``) to the caller, who
        multiplies the loss by it before backward; the hooks then take gradients as they are, and
        large ones are exchanged without a single pass over them. 1.0 when there is nothing to hand
        over (local steps, or fp16, whose loss scale is undone after backward)."""
        if not self._reducing or self.loss_scale != 1.0 or self._scale == 1.0:
            return 1.0
        scale, self._scale = self._scale, 1.0
        return scale

    def _on_gradient_ready(self, bucket_index: int, slot: int, parameter: torch.Tensor) -> None:
        """Post-accumulate-grad hook: packs this gradient and launches every bucket now ready, in order."""
        if not self._reducing or self._accumulating:
            return  # local steps, a backward outside training, or an earlier micro-batch (see no_sync)
        self.buckets[bucket_index].fill(slot, parameter.grad, self._scale)
        if self.overlap_backward:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # strictly in index order: a full bucket waits for earlier ones, so ranks never disagree
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].missing == 0:
            bucket = self.buckets[self._next_bucket]
            if self._active.lossless:  # the flags ride along: one collective per bucket
                bucket.handle = self._active.start(self._next_bucket, bucket.buffer, bucket.shapes_with_flags)
            else:
                bucket.handle = self._active.start(self._next_bucket, bucket.payload, bucket.shapes)
            self._next_bucket += 1

    def distributed_update(self) -> None:
        """Finishes the gradient all-reduce, writes the global-mean gradient into ``.grad`` and steps.

        Without communication (one worker, or before ``distributed_after``) ``step`` makes the
        local learner's update instead. Sets ``exchange_seconds_last_step``.
        """
        started = time.perf_counter()
        for bucket in self.buckets[self._next_bucket:]:
            for slot, parameter in enumerate(bucket.parameters):
                if not bucket.filled[slot] and parameter.grad is not None:
                    # accumulated under no_sync by an earlier micro-batch, untouched by the last one
                    bucket.fill(slot, parameter.grad, self._scale)
            bucket.fill_missing_with_zeros()
        self._launch_ready_buckets()
        for bucket in self.buckets:
            bucket.handle.wait()
        if not self._active.lossless and self.buckets:  # every exchange is done: the flags, exactly
            flags = self.comm.allreduce(torch.cat([bucket.flags for bucket in self.buckets]), op="sum")
            for bucket, summed in zip(self.buckets, flags.split([len(bucket.flags) for bucket in self.buckets])):
                bucket.flags.copy_(summed)
        for bucket in self.buckets:
            bucket.assign_grads()
        self.bytes_sent_total += self.bytes_sent_last_step
        self._reducing = False
        self.exchange_seconds_last_step = time.perf_counter() - started
        freezing = self._active is self.exchange and self._holds_variance()
        if freezing:
            self.frozen_variance.hold()
        self._step_optimizer(gradients_unscaled=True)
        if freezing:
            self.frozen_variance.restore()

    # -- checkpoints -------------------------------------------------------------------------------
    def checkpoint_identity(self) -> dict[str, Any]:
        """The kind, plus the exchange strategy's identity (name, bits, rank) unless it is the float32 all-reduce."""
        return exchange_identity(super().checkpoint_identity(), self.exchange)

    def state_dict(self) -> dict[str, Any]:
        """The replicated state, plus the world size the exchange's per-rank state belongs to."""
        held = self._variance_held if self._variance_held is not None else self._restored_variance_held
        return {**super().state_dict(), "exchange_world_size": self.comm.size,
                "frozen_variance": {**self.frozen_variance.state_dict(), "held": held}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the replicated state and resets the exchange's per-rank state.

        The per-rank state (residuals, P and Q, step counter) comes back with
        :meth:`load_local_state_dict` at the same world size; at another one it stays reset and a
        line on rank 0 says so.
        """
        super().load_state_dict(state)
        self.exchange.reset()
        # the optimizer's state is new: the next lossy step holds its variance, corrected as the saved run's was
        frozen = state.get("frozen_variance") or {}
        self.frozen_variance.load_state_dict(frozen)
        self._variance_held = None  # decided again: a restored exchange may form its sums as the saved run did
        # the saved run's choice, said again if this one differs (checkpoints without "held": held if a copy was kept)
        self._restored_variance_held = frozen.get("held", True if frozen.get("held_at_steps") else None)
        saved = state.get("exchange_world_size")
        if saved is not None and saved != self.comm.size and self.exchange.stateful \
                and self.comm.is_main:
            print(f"dtrain: the {self.exchange.name} exchange state (error feedback, factors, step counter) "
                  f"was saved by {saved} workers; starting it afresh on {self.comm.size}", flush=True)

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's exchange state (error-feedback residuals, PowerSGD's P and Q); {} for float32."""
        return self.exchange.state_dict()

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`local_state_dict`'s output (the session calls it only at the same world size)."""
        if state:
            self.exchange.load_state_dict(state)


def data_parallel_distributed_learner(optimizer: torch.optim.Optimizer | None = None, comm=None,
                                      distributed_after: int | str = "auto", num_quantization_bits: int = 32,
                                      bucket_size_mb: float = 25.0, exchange: Exchange | None = None,
                                      warm_start_mode: str | None = None, freeze_variance: bool | str = AUTO,
                                      use_async_buffered_parameter_update: bool = False,
                                      learner: torch.optim.Optimizer | None = None,
                                      **retired: Any) -> DataParallelLearner:
    """Wraps ``optimizer`` for synchronous data-parallel training (CNTK's factory of this name).

    Args:
        optimizer: the torch optimizer of the model's parameters (``learner=``, CNTK's name, in its place).
        comm: the job's communicator (a size-1 local one when omitted).
        distributed_after: global samples trained with local updates before gradients are shared;
            ``"auto"`` (default): none for a full-precision or low-rank exchange, a warm start
            relative to the run for k-bit quantization (``dtrain.learners.base.auto_warm_start``,
            derived when the session plans the run).
        num_quantization_bits: CNTK's keyword: 32 sends full-precision gradients; 1..31 builds the
            learner with ``exchange=Quantized(k)`` (k-bit gradients with error feedback; its other
            settings are the exchange's: pass ``exchange=Quantized(k, ...)`` for them).
        bucket_size_mb: gradient bucket size in MiB (every strategy exchanges bucket by bucket).
        exchange: the exchange strategy (:mod:`dtrain.exchange`, ``learner/exchange=...`` in a
            config); None: float32 all-reduce, or k-bit with ``num_quantization_bits`` below 32.
        warm_start_mode: with a compressing exchange, how the steps before ``distributed_after`` train:
            ``"allreduce"`` (float32 all-reduce on each rank's share; None: this) or ``"local"``
            (CNTK's: every rank on the full stream, no communication); the float32 all-reduce's
            own warm start is always local (all-reducing it would be no warm start at all).
        freeze_variance: with an Adam-family optimizer and a lossy exchange, hold its variance where the
            warm start left it (1-bit Adam's rule); ``"auto"`` (default): where the sums are 1-bit values.
        use_async_buffered_parameter_update: CNTK's keyword, accepted at its default ``False`` (as CNTK's own
            tests pass it); ``True`` is refused: dtrain's updates are synchronous.
        learner: CNTK's name for ``optimizer`` (its local learner), accepted in its place.

    Returns:
        A ``DataParallelLearner`` (with ``exchange=Quantized(num_quantization_bits)`` below 32 bits).

    Raises:
        ValueError: a value out of range or of the wrong kind (one line ``name=value: expected ...``),
            or both ``exchange`` (other than float32 all-reduce) and ``num_quantization_bits`` below 32.
        TypeError: ``optimizer`` is not a torch optimizer (or missing, or given twice: as ``learner`` too),
            ``exchange`` not an exchange strategy, or a retired keyword (``error_feedback``, ``requantize_sum``,
            ``warm_start``: one line naming what to pass now).
    """
    refuse_retired("data_parallel_distributed_learner", retired)
    optimizer = wrapped_optimizer("data_parallel_distributed_learner", optimizer, learner)
    synchronous_update(use_async_buffered_parameter_update)
    check_settings({**DATA_PARALLEL, **QUANTIZATION_BITS}, num_quantization_bits=num_quantization_bits,
                   bucket_size_mb=bucket_size_mb, distributed_after=distributed_after, freeze_variance=freeze_variance)
    num_quantization_bits = int(num_quantization_bits)
    if distributed_after != AUTO:
        distributed_after = int(distributed_after)
    if exchange is not None and not isinstance(exchange, AllReduce) and num_quantization_bits < 32:
        raise ValueError(f"num_quantization_bits={num_quantization_bits} and exchange={exchange.describe()} both choose "
                         f"the exchange; pass exchange=Quantized({num_quantization_bits}) alone, or drop "
                         f"num_quantization_bits")
    if num_quantization_bits < 32:
        exchange = Quantized(num_quantization_bits)
    return DataParallelLearner(optimizer, comm, distributed_after=distributed_after, bucket_size_mb=bucket_size_mb,
                               exchange=exchange, warm_start_mode=warm_start_mode, freeze_variance=freeze_variance)


__all__ = ["DataParallelLearner", "data_parallel_distributed_learner"]

"""The learner interface the training loop talks to: it wraps a torch optimizer by composition.

Every learner (local, data-parallel, quantized, block momentum, or one written outside the
package) implements the same small interface, so `training_session` never changes when a
distributed learner is chosen. :class:`Learner` is a template: its final :meth:`Learner.step`
calls the subclass's :meth:`Learner.apply_update` and then advances the sample clock
``samples_seen``, which is what ends training at ``max_samples``; a subclass cannot forget it.
See ``docs/writing-a-learner.md``.
"""
from __future__ import annotations

import abc
import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, final

import torch

from dtrain.advice import Advice
from dtrain.comm.local import LocalCommunicator
from dtrain.learners.settings import DISTRIBUTED_AFTER
from dtrain.rules import check_settings

if TYPE_CHECKING:  # the local learner never needs the strategies
    from dtrain.exchange import Exchange


@dataclass(frozen=True)
class RunFacts:
    """What a learner may derive its defaults from, told once before training by :meth:`Learner.plan`.

    Attributes:
        samples_per_sweep: unique training samples (one pass over the data); ``None`` when unknown.
        max_samples: global samples the run trains on; ``None`` when it runs until the data ends.
        minibatch_size: the global minibatch size at the start, in samples.
        warmup_samples: global samples over which the learning rate warms up from the start of the run
            (``session.lr_schedule``'s or ``session.lr_scaling``'s warm-up, the longer); 0: none.
        warmup_exchange_steps: what the learner tells its exchange strategy (:meth:`Exchange.plan
            <dtrain.exchange.Exchange.plan>`): its exchange steps made before the warm-up ends (None: not known).
    """

    samples_per_sweep: int | None = None
    max_samples: int | None = None
    minibatch_size: int | None = None
    warmup_samples: int = 0
    warmup_exchange_steps: int | None = None


#: the value of a setting a learner derives from the run's facts in :meth:`Learner.plan`
AUTO = "auto"

#: ``distributed_after="auto"`` (quantized, block momentum): this fraction of ``max_samples`` ...
WARM_START_FRACTION = 0.25
#: ... but never more than this many sweeps over the data (a long run needs no longer warm start)
WARM_START_MAX_SWEEPS = 5


def auto_warm_start(facts: RunFacts) -> int:
    """The full-precision, synchronous warm start the learners that communicate less get by
    default, in global samples: ``min(max_samples / 4, 5 sweeps)``, rounded up to whole global
    minibatches; one sweep when the run has no ``max_samples``; 0 when nothing is known.

    1-bit SGD started on a fresh model can collapse to chance (CNTK's docs ask for a warm start;
    Seide et al. 2014), and local SGD generalises as well as synchronous SGD when started from a
    warmed-up model (post-local SGD, Lin et al. 2020); measured on digits in
    ``docs/semantics.md#warm-start``.
    """
    sweep = facts.samples_per_sweep
    if facts.max_samples is not None:
        samples = math.ceil(facts.max_samples * WARM_START_FRACTION)
        if sweep:
            samples = min(samples, WARM_START_MAX_SWEEPS * sweep)
    elif sweep:
        samples = sweep
    else:
        return 0
    minibatch = facts.minibatch_size or 1
    return math.ceil(samples / minibatch) * minibatch


class Learner(abc.ABC):
    """Applies one minibatch's update to a model through a wrapped ``torch.optim.Optimizer``.

    Args:
        optimizer: the local optimizer whose ``step()`` performs the update.
        comm: the communicator of the job (a size-1 ``LocalCommunicator`` when omitted).
        distributed_after: samples (global) to train with local updates on the full data stream
            before distributed updates start (CNTK's warm start); 0 = distributed from the start;
            ``"auto"`` = the learner's own rule from the run's facts (:meth:`auto_distributed_after`,
            applied by :meth:`plan`; 0 until then).

    The loop calls, per minibatch: ``begin_minibatch(local_samples, global_samples)``, backward
    on the local mean loss, then ``step()``. ``samples_seen`` counts global samples trained on.

    Subclasses implement :meth:`apply_update` (and usually ``prepare``/``synchronize``); they
    must not override :meth:`step`, which is final: a class that does is refused with a
    ``TypeError`` when it is defined. ``kind`` names the learner in checkpoints (a subclass that
    sets none gets its class name).

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer.
        ValueError: ``distributed_after`` is not a non-negative whole number of samples.
    """

    #: short name written into checkpoints, so a checkpoint says which learner made it
    kind: str = ""
    #: seconds of the last ``step()`` spent on the exchange that did not overlap backward (waiting
    #: for it, and its compute after backward); learners that exchange set it, the session reads it
    exchange_seconds_last_step: float = 0.0
    #: bytes this rank sent in the last step's exchange, for the progress records (``None``: a learner that does not
    #: measure it; learners that exchange make it a property)
    bytes_sent_last_step: int | None = None
    #: of those, the bytes that crossed to other hosts (``None``: a learner that does not tell hosts apart)
    bytes_between_hosts_last_step: int | None = None
    #: the strategy this learner sums through (``None``: a learner that exchanges nothing); the collapse advice
    #: and the start-up note read it
    exchange: Exchange | None = None
    #: what travels through :attr:`exchange`, in the collapse advice's words (``"model changes"`` for block learners)
    exchanged: str = "gradients"
    #: whether the model's parameters are sharded over the ranks (``learner=fsdp``): checkpoints are then written by
    #: every rank (``dtrain.session.sharded_checkpoint``) and ``model.safetensors`` is gathered
    shards_model: bool = False
    #: whether every forward and backward is a collective: a rank without samples then makes an empty pass, and
    #: every rank evaluates every share (empty ones too)
    collective_forward: bool = False
    _kind_is_class_name = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "step" in cls.__dict__:
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__} overrides Learner.step(), which is final: step() applies the "
                f"update and then advances samples_seen, the clock that ends training at max_samples; "
                f"implement apply_update() instead (see docs/writing-a-learner.md)")
        if cls.__dict__.get("kind"):
            cls._kind_is_class_name = False
        elif not cls.kind or cls._kind_is_class_name:
            cls.kind = cls.__name__  # a base such as ReplicatedLearner does not lend its name to subclasses
            cls._kind_is_class_name = True

    def __init__(self, optimizer: torch.optim.Optimizer, comm=None, distributed_after: int = 0):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.comm = comm if comm is not None else LocalCommunicator()
        self.distributed_after_is_auto = distributed_after == AUTO
        check_settings(DISTRIBUTED_AFTER, distributed_after=distributed_after)
        self.distributed_after = 0 if self.distributed_after_is_auto else int(distributed_after)
        self.run_facts = RunFacts()
        self._planned = False  # whether plan() was called (training_session does); else step() says what "auto" became
        self.samples_seen = 0
        self.bytes_sent_total = 0  # bytes this rank sent in this job (not checkpointed): the summary's "exchange:" line
        self.local_samples = 0    # of the current minibatch, set by begin_minibatch
        self.global_samples = 0
        # -- micro-batch and optimizer-step seams (used by the session: micro_batch_size, clip_grad_norm)
        self._accumulating = False  # state: backward passes now only accumulate (no gradient exchange)
        self._before_optimizer_step: list[Callable[[Learner], bool | None]] = []
        # -- fp16 loss scaling seam: the factor the loss was multiplied by before backward (1: none);
        # gradients are divided by it before any exchange and before the optimizer step
        self.loss_scale = 1.0
        self.found_inf = False  # state: this minibatch's unscaled gradient had an inf/NaN (its step was skipped)
        self._in_optimizer_step = False  # state: optimizer.step() is running, called by _step_optimizer

    # -- what the loop asks -------------------------------------------------------------------
    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter the optimizer updates, in optimizer order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def is_distributed(self) -> bool:
        """Whether updates are aggregated across workers now (past ``distributed_after``)."""
        return self.comm.size > 1 and self.samples_seen >= self.distributed_after

    def data_partition(self) -> tuple[int, int]:
        """``(num_data_partitions, partition_index)`` this worker reads the next minibatch with.

        Before ``distributed_after`` every worker reads the full stream, as CNTK does.
        """
        if self.is_distributed():
            return self.comm.size, self.comm.rank
        return 1, 0

    def attach_source(self, source) -> None:
        """Told the training source by ``training_session`` before :meth:`prepare`; nothing here (an elastic block
        learner reads a discarded block again from it)."""

    def plan(self, facts: RunFacts) -> None:
        """Told the run's facts once before :meth:`prepare` (``training_session`` calls it).

        A learner whose defaults are relative to the run (``"auto"`` settings) derives them here;
        :meth:`describe` prints what was derived. The base keeps ``facts`` as ``self.run_facts``
        and resolves ``distributed_after="auto"`` through :meth:`auto_distributed_after`.
        """
        self.run_facts = facts
        self._planned = True
        if self.distributed_after_is_auto:
            # a resumed run keeps the warm start it was planned with, even if max_samples changed
            restored = getattr(self, "_restored_distributed_after", None)
            self.distributed_after = restored if restored is not None else self.auto_distributed_after(facts)

    def auto_distributed_after(self, facts: RunFacts) -> int:
        """The warm start ``distributed_after="auto"`` stands for, in global samples: 0 here
        (full-precision learners need none); the quantized learner derives one from the run."""
        return 0

    def prepare(self, model: torch.nn.Module) -> None:
        """Called once before training (after any restore): e.g. broadcast parameters, add hooks."""

    def shard(self, model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        """Called once by ``training_session`` with the model, before anything else reads its parameters (the
        checkpoint restore, the evaluation, the optimizer's steps): a learner that shards the model over its ranks
        (``learner=fsdp``) does it here. Nothing here."""

    def session_problems(self, *, precision: str, compile: bool, ema_decay: float | None,  # noqa: A002
                         batchnorm_statistics: str) -> list[str]:
        """The session settings this learner cannot honour, one line each (``training_session`` refuses the
        first); none here."""
        return []

    def is_sync_point(self) -> bool:
        """Whether the ranks met (communicated) in the step just made, on every rank alike.

        The session agrees on preemption only at such points (and where it meets the ranks
        anyway: progress, cross-validation, checkpoints), so a learner that talks once a block
        (block momentum) makes no collective between its syncs. True by default: learners that
        exchange every minibatch meet every minibatch.
        """
        return True

    def begin_minibatch(self, local_samples: int, global_samples: int) -> None:
        """Clears the gradients and records the sample counts of the minibatch about to be computed.

        Args:
            local_samples: samples this worker computes its mean loss over (may be 0).
            global_samples: samples in the whole global minibatch (all workers together).
        """
        self.optimizer.zero_grad(set_to_none=True)
        self.found_inf = False
        self.local_samples = local_samples
        self.global_samples = global_samples

    def fold_gradient_scale(self) -> float:
        """The factor by which the caller multiplies this minibatch's loss before backward, taking over
        a scaling the learner would otherwise apply to every gradient (the data-parallel learner's
        ``local_samples / global_samples``); 1.0 when there is none. Called once per minibatch,
        after :meth:`begin_minibatch` and before the first backward; a caller that does not call it
        gets the same update (the learner then scales the gradients itself)."""
        return 1.0

    # -- micro-batches: several backward passes, one exchange ----------------------------------------
    @property
    def accumulating(self) -> bool:
        """Whether backward passes now only accumulate into ``.grad`` (inside :meth:`no_sync`)."""
        return self._accumulating

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without starting any exchange (as DDP's).

        A minibatch computed in several micro-batches runs every backward but the last inside it,
        so gradient hooks (the data-parallel learner's bucket all-reduce) fire once per minibatch,
        on the accumulated gradient. Learners that exchange in :meth:`apply_update` need nothing more.
        """
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    # -- the optimizer step: the point between the gradient exchange and the update ---------------
    def add_before_optimizer_step(self, callback: Callable[[Learner], bool | None]) -> Callable[[], None]:
        """Registers ``callback(learner)``, run just before every ``optimizer.step()`` of this learner.

        It sees the gradient the optimizer will use: after the exchange (the global mean) for
        synchronous learners, the local gradient for local steps (block momentum, warm start).
        Returning ``False`` skips this optimizer step (it must then decide the same on every rank
        for synchronous learners). Used for gradient clipping. Returns a function that removes it.
        """
        self._before_optimizer_step.append(callback)
        return lambda: self._before_optimizer_step.remove(callback)

    @property
    def in_optimizer_step(self) -> bool:
        """Whether ``optimizer.step()`` is now running through :meth:`_step_optimizer` (the session checks,
        with clipping or fp16, that a learner does not call ``optimizer.step()`` around its callbacks)."""
        return self._in_optimizer_step

    def _step_optimizer(self, gradients_unscaled: bool = False) -> bool:
        """Runs the before-optimizer-step callbacks, then ``optimizer.step()`` unless one said ``False``.

        Every learner steps its optimizer through this. With loss scaling (``loss_scale`` != 1) the
        gradients are first divided by ``loss_scale`` (unless the exchange already did:
        ``gradients_unscaled``), and an inf or NaN among them skips the step and sets ``found_inf``
        (after a summing exchange every rank sees the same). Returns whether the optimizer stepped.
        """
        if self.loss_scale != 1.0:
            gradients = [parameter.grad for parameter in self.parameters if parameter.grad is not None]
            if not gradients_unscaled and gradients:
                torch._foreach_div_(gradients, self.loss_scale)
            self.found_inf = bool(gradients) and not bool(torch.stack(
                [torch.isfinite(gradient).all() for gradient in gradients]).all())
            if self.found_inf:
                return False
        for callback in self._before_optimizer_step:
            if callback(self) is False:
                return False
        self._in_optimizer_step = True
        try:
            self.optimizer.step()
        finally:
            self._in_optimizer_step = False
        return True

    @final
    def step(self) -> None:
        """Applies this minibatch's update (:meth:`apply_update`), then advances ``samples_seen``
        by the minibatch's global samples. Final: the clock advances for every learner."""
        if not self._planned:
            self._warn_unplanned()
        self.apply_update()
        self.samples_seen += self.global_samples

    def _warn_unplanned(self) -> None:
        """Once, on rank 0, for a learner driven by hand without :meth:`plan`: ``distributed_after="auto"`` then
        stands for no warm start, where ``training_session`` (which plans every run) would give one, so a hand-driven
        1-bit or block learner would otherwise train differently from the same learner in a session, silently."""
        self._planned = True
        if not self.distributed_after_is_auto or not self.comm.is_main:
            return
        if self.auto_distributed_after(RunFacts(max_samples=4, minibatch_size=1)) > 0:  # a run of any known length
            warnings.warn(f"{type(self).__name__}: distributed_after='auto' is derived from the run's facts, but "
                          f"learner.plan(RunFacts(...)) was not called, so it trains without the warm start "
                          f"training_session gives it; call learner.plan(RunFacts(samples_per_sweep=..., "
                          f"max_samples=..., minibatch_size=...)) before prepare(), or give distributed_after in "
                          f"samples (0: none)", RuntimeWarning, stacklevel=3)

    @abc.abstractmethod
    def apply_update(self) -> None:
        """Updates the parameters from this worker's gradient of its LOCAL mean loss.

        Called by :meth:`step` after backward, with ``local_samples``/``global_samples`` of this
        minibatch set and ``samples_seen`` still counting the samples BEFORE it (``step``
        advances it when this returns). Must not change ``samples_seen``.
        """

    def synchronize(self) -> None:
        """Brings every worker to one model (block momentum's final sync); a no-op here."""

    def describe(self) -> str:
        """One line of derived settings for the start-up summary (units: samples)."""
        auto = " (auto)" if self.distributed_after_is_auto else ""
        warm_start = f", local training on the full stream for the first {self.distributed_after:,} samples{auto}" \
            if self.distributed_after and self.comm.size > 1 else ""
        return f"learner {self.kind}{warm_start}"

    def label(self) -> str:
        """The learner as notes name it: its kind, and its exchange where that is not exact (``data_parallel
        (1-bit exchange)`` for ``learner=quantized``)."""
        if self.exchange is None or self.exchange.lossless:
            return self.kind
        return f"{self.kind} ({self.exchange.describe()} exchange)"

    def automatic_settings(self) -> list[str]:
        """This learner's settings derived from the run (``"auto"``), as ``learner.NAME``, where they make it
        communicate less than ``data_parallel``; the short-run note names them (``dtrain.session.short_run``).
        Here the warm start; subclasses add theirs. Empty on one worker."""
        if self.comm.size == 1:
            return []
        return ["learner.distributed_after"] if self.distributed_after_is_auto and self.distributed_after > 0 else []

    def collapse_advice(self) -> Advice:
        """What to change when training with this learner diverged or collapsed back to chance, naming only what
        this run uses: the learning rate; on several workers what :attr:`exchange` may have done to
        :attr:`exchanged`. Subclasses add their own causes (``super().collapse_advice() + Advice(...)``)."""
        advice = Advice(("a learning rate too high for this learner",), ("lower optimizer.lr",))
        if self.comm.size > 1 and self.exchange is not None:
            advice += self.exchange.collapse_advice(self.exchanged)
        return advice

    def progress_note(self) -> str:
        """A short note for progress lines (e.g. bytes sent per step); empty when there is nothing to say."""
        return ""

    def summary_note(self) -> str:
        """A line for the end-of-run summary (e.g. how often a safeguard acted); empty when there is nothing to say."""
        return ""

    def finalize(self) -> None:
        """Releases hooks or buffers at the end of training."""

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint_identity(self) -> dict[str, Any]:
        """Settings a checkpoint must match to be restored by this learner (its kind; subclasses add
        settings whose state would not fit another value)."""
        return {"kind": self.kind}

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state plus the learner's own counters (replicated on every worker)."""
        return {"kind": self.kind, "optimizer": self.optimizer.state_dict(), "samples_seen": self.samples_seen,
                "distributed_after": self.distributed_after}

    def local_state_dict(self) -> dict[str, Any]:
        """State that differs between workers (e.g. quantization residuals); gathered into checkpoints."""
        return {}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Restores this worker's entry of ``local_state_dict``; called only at the same world size."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` returned; refuses a checkpoint made by another learner."""
        if state.get("kind") != self.kind:
            raise ValueError(
                f"checkpoint was written by the {state.get('kind')!r} learner, this run uses {self.kind!r}; "
                f"use the same learner or start a new run directory"
            )
        if "optimizer" in state:  # a sharded learner's is in the sharded files
            self.optimizer.load_state_dict(state["optimizer"])
        self.samples_seen = int(state["samples_seen"])
        if state.get("distributed_after") is not None:
            self._restored_distributed_after = int(state["distributed_after"])



def bind_exchange(exchange, comm, step_name: str = "step"):
    """A learner's exchange strategy, bound to ``comm`` and told what its steps are (``step_name``: ``"step"``,
    a minibatch; ``"sync"``, a block learner's sync): ``exchange``, or a float32
    :class:`~dtrain.exchange.AllReduce` when None (the wiring every exchanging learner shares).

    Raises TypeError when ``exchange`` is not a :class:`~dtrain.exchange.Exchange`."""
    from dtrain.exchange import AllReduce, Exchange  # here: the local learner never needs the strategies

    if exchange is None:
        exchange = AllReduce()
    if not isinstance(exchange, Exchange):
        raise TypeError(f"exchange must be a dtrain.exchange.Exchange strategy (e.g. dtrain.exchange.Quantized), "
                        f"got {type(exchange).__name__}")
    exchange.bind(comm)
    exchange.count_steps_as(step_name)
    return exchange


def exchange_identity(identity: dict[str, Any], exchange) -> dict[str, Any]:
    """``identity`` plus the strategy's own when it is not the float32 all-reduce (whose checkpoints
    predate strategies): a checkpoint's residuals restore only into the same strategy and settings."""
    from dtrain.exchange import AllReduce

    if not isinstance(exchange, AllReduce):
        identity = {**identity, "exchange": exchange.identity()}
    return identity


class LocalLearner(Learner):
    """The torch optimizer alone, in one process (``learner=local``): every step is ``optimizer.step()``.

    Args: as :class:`Learner`; ``distributed_after`` has no effect with one process.

    Raises:
        ValueError: in ``prepare``, when the job has more than one process (choose a distributed
            learner instead: training N copies alone would silently waste N-1 of them).
    """

    kind = "local"

    def prepare(self, model: torch.nn.Module) -> None:
        """Refuses a job of several processes; nothing else to prepare."""
        if self.comm.size > 1:
            raise ValueError(
                f"the local learner trains one process but this job has {self.comm.size}; "
                f"choose a distributed learner: learner=data_parallel, learner=quantized or learner=block_momentum"
            )

    def apply_update(self) -> None:
        """``optimizer.step()`` on this process's gradient (skipped for an empty minibatch)."""
        if self.local_samples > 0:
            self._step_optimizer()

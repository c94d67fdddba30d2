"""One training minibatch: read it, forward and backward (in micro-batch passes, under the chosen
precision), the learner's step, and the time each phase took.

The training loop (``dtrain.session.session``) decides *when* things happen (progress,
cross-validation, checkpoints, the end); this module is *what* happens for every minibatch, the
hot path whose Python cost ``benchmarks/session_overhead.py`` measures against a hand-written loop.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from dtrain.data.errors import DataError
from dtrain.data.minibatch import Minibatch
from dtrain.data.streams import Sequences
from dtrain.learners.base import Learner
from dtrain.session.binding import StreamBinding, count_steps
from dtrain.session import compile_check
from dtrain.session.collapse import CollapseWatch
from dtrain.session.evaluate import metric_counts_sequences
from dtrain.session.first_minibatch import read_agreed
from dtrain.session.metrics import PhaseTimer
from dtrain.session.objective_call import ObjectiveCall
from dtrain.session.stream_checks import check_target_steps, ids_past_the_model
from dtrain.session.precision import LossScaler, autocast


#: outputs and labels a deferred metric keeps before it runs over them (a larger pass is measured at once)
DEFERRED_OUTPUT_BYTES = 4 << 20


class PeriodSums:
    """Loss and metric sums of one progress period, kept on the device (no host sync per step).

    Each pass's mean loss is kept as a tensor and folded into the float64 totals every
    ``fold_every`` passes with one ``stack`` and one ``sum``, instead of several tiny tensor
    operations per step: run right after a backward pass, each costs several microseconds
    (``benchmarks/README.md``). An *additive* metric (``metric.additive``: its value over several
    passes' outputs together is the sum of its values over each, as for the classification error)
    runs at the fold too, once over copies of the kept passes' outputs and labels
    (:meth:`add_outputs`); any other metric's sum is computed by the caller for every pass (:meth:`add`).
    """

    def __init__(self, device: torch.device, metric: Callable | None = None, fold_every: int = 64,
                 deferred_output_bytes: int = DEFERRED_OUTPUT_BYTES):
        self.device = device
        self.metric_function = metric
        self.fold_every = fold_every
        self.deferred_output_bytes = deferred_output_bytes
        self.reset()

    def reset(self) -> None:
        """Starts a new period: zero sums, zero samples."""
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.metric = torch.zeros((), dtype=torch.float64, device=self.device)
        self.samples = 0
        self.metric_samples = 0  # what the metric is averaged over: samples (steps), or sequences (``metric.per``)
        self.padded_positions = 0  # of the sequence streams read this period, for the padding fraction
        self.positions = 0
        self.figures: torch.Tensor | None = None  # an objective's figures, each summed times its pass's samples
        self._losses: list[torch.Tensor] = []   # detached mean losses of the passes not yet folded
        self._weights: list[int] = []           # their sample counts
        self._metrics: list[torch.Tensor] = []  # their metric sums (where already computed)
        self._outputs: list[torch.Tensor] = []  # copies of the outputs whose metric is deferred ...
        self._labels: list[torch.Tensor] = []   # ... and of their labels
        self._kept_shapes: tuple | None = None  # the per-sample shapes of both (passes concatenate along dim 0)
        self._kept_bytes = 0

    def add(self, mean_loss: torch.Tensor, metric_sum: torch.Tensor | float, samples: int,
            metric_samples: int | None = None) -> None:
        """Adds one pass: its mean loss (a detached tensor), its metric SUM, its sample count (steps of the
        target) and what its metric averages over (``samples`` unless a sequence-level metric counts sequences)."""
        self._metrics.append(metric_sum)
        self.metric_samples += samples if metric_samples is None else metric_samples
        self._add_loss(mean_loss, samples)

    def add_figures(self, figures: torch.Tensor, samples: int) -> None:
        """Adds an objective's figures of one pass (a float64 vector, each a mean over the pass's ``samples``),
        weighted by its samples as the loss is; the pass's loss is added with :meth:`add`."""
        weighted = figures * samples
        self.figures = weighted if self.figures is None else self.figures + weighted

    def add_padding(self, padded: int, positions: int) -> None:
        """Adds a minibatch's padded positions and all positions of its sequence streams."""
        self.padded_positions += padded
        self.positions += positions

    def add_outputs(self, mean_loss: torch.Tensor, output: torch.Tensor, labels: torch.Tensor, samples: int,
                    copy_output: bool = True, copy_labels: bool = True) -> None:
        """Adds one pass whose (additive) metric runs later, over many passes at once: its mean loss
        (a detached tensor), its detached output and its labels and its sample count. Each is copied unless
        the caller knows nothing writes into it later (``copy_*=False``: an eager model's new output, labels a
        source indexed out for this minibatch); a source or a compiled model may reuse its buffers. A pass too
        large to keep is measured at once; one whose per-sample shapes differ from the kept passes' first has
        those measured."""
        size = output.numel() * output.element_size() + labels.numel() * labels.element_size()
        if size > self.deferred_output_bytes:
            self.add(mean_loss, _measured(self.metric_function, output, labels), samples)
            return
        shapes = (output.shape[1:], labels.shape[1:])
        if shapes != self._kept_shapes:
            self._measure_kept_outputs()
            self._kept_shapes = shapes
        self._outputs.append(output.clone() if copy_output else output)
        self._labels.append(labels.clone() if copy_labels else labels)
        self._kept_bytes += size
        self.metric_samples += samples
        self._add_loss(mean_loss, samples)
        if self._kept_bytes > self.deferred_output_bytes:
            self._fold()

    def _add_loss(self, mean_loss: torch.Tensor, samples: int) -> None:
        self._losses.append(mean_loss)
        self._weights.append(samples)
        self.samples += samples
        if len(self._losses) >= self.fold_every:
            self._fold()

    def _measure_kept_outputs(self) -> None:
        """Runs the deferred metric once over the kept passes' outputs and labels."""
        if self._outputs:
            outputs = self._outputs[0] if len(self._outputs) == 1 else torch.cat(self._outputs)
            labels = self._labels[0] if len(self._labels) == 1 else torch.cat(self._labels)
            self._metrics.append(_measured(self.metric_function, outputs, labels))
        self._outputs, self._labels, self._kept_bytes = [], [], 0

    def _fold(self) -> None:
        """Adds the kept per-pass values into the float64 totals (losses weighted by their samples)."""
        self._measure_kept_outputs()
        if self._losses:
            losses = _stack_float64(self._losses, self.device)
            weights = torch.tensor(self._weights, dtype=torch.float64, device=losses.device)
            self.loss += (losses * weights).sum()
        if self._metrics:
            self.metric += _stack_float64(self._metrics, self.device).sum()
        self._losses, self._weights, self._metrics = [], [], []

    def as_tensor(self, num_figures: int = 0) -> torch.Tensor:
        """``[loss sum, metric sum, samples, metric samples, padded positions, positions, figure sums...]`` in
        float64, ready to all-reduce (``num_figures`` zeros for a period in which this rank had no pass)."""
        self._fold()
        counts = torch.tensor([float(self.samples), float(self.metric_samples), float(self.padded_positions),
                               float(self.positions)], dtype=torch.float64, device=self.device)
        figures = self.figures if self.figures is not None else torch.zeros(num_figures, dtype=torch.float64,
                                                                             device=self.device)
        return torch.cat([torch.stack([self.loss, self.metric]), counts, figures.to(self.device)])


def _measured(metric: Callable, output: torch.Tensor, labels: torch.Tensor):
    """``metric(output, labels)`` recording no autograd graph (a metric may use tensors that require grad)."""
    with torch.no_grad():
        return metric(output, labels)


def _stack_float64(values: list, device: torch.device) -> torch.Tensor:
    """One float64 vector of scalar tensors (or numbers a user's metric returned)."""
    if all(isinstance(value, torch.Tensor) for value in values) and len({value.dtype for value in values}) == 1:
        return torch.stack(values).reshape(len(values)).to(torch.float64)
    return torch.stack([torch.as_tensor(value, dtype=torch.float64, device=device).reshape(()) for value in values])


class MinibatchStep:
    """Trains the model on one minibatch at a time: the per-minibatch path of ``TrainingSession``.

    Args:
        model: the plain model (named in messages).
        forward_model: what the training forward calls: ``model`` or its ``torch.compile`` wrapper.
        loss: ``loss(output, target)``, the MEAN over the pass's samples (steps of a sequence target).
        metric: ``metric(output, target)``, a SUM over the pass's samples (or sequences: ``metric.per``);
            ``None`` with an objective.
        objective: the user's objective (``dtrain.session.objective_call``) in place of ``loss`` and the
            model's forward: ``objective(model, pass) -> (mean loss, figures)`` (``None``: ``loss``).
        learner: the session's learner (its step, ``no_sync`` and loss-scale seams).
        device: where the model trains (default: the learner's communicator's device).
        micro_batch_size: samples per rank per forward/backward pass (``None``: one pass).
        precision: ``"32"``, ``"bf16"`` or ``"fp16"`` (see ``dtrain.session.precision``).
        loss_scaler: fp16's dynamic loss scale (``None`` otherwise).
        collapse: the session's collapse watch, fed every pass's loss.
        check_compile: ``forward_model`` is compiled: the first minibatch compares its loss and gradients
            with eager PyTorch's (``dtrain.session.compile_check``) and a compiler failure or a difference
            becomes one clear ValueError.
        binding: which streams feed the model, and which is the target (default: features -> labels).
        check_first: called with the first non-empty minibatch before its forward (the session checks
            token ids against their vocabularies there); an error it raises on the first minibatch is
            raised on every rank, naming this one.
        count_padding: add each minibatch's padded positions to the period's sums (sequence data).
        batchnorm_sync: the model's synchronized BatchNorm layers' shared state (``None``: none). With
            ``sync_batchnorm`` every rank makes the same number of passes per distributed minibatch (empty
            ones where it has fewer samples), since each pass's BatchNorm layers reduce over all ranks.
    """

    def __init__(self, *, model: torch.nn.Module, forward_model: Callable[[torch.Tensor], torch.Tensor],
                 loss: Callable, metric: Callable, learner: Learner, micro_batch_size: int | None,
                 precision: str, loss_scaler: LossScaler | None, collapse: CollapseWatch, check_compile: bool,
                 binding: StreamBinding | None = None, check_first: Callable | None = None,
                 count_padding: bool = False, device: torch.device | None = None, batchnorm_sync=None,
                 objective: ObjectiveCall | None = None):
        self.model = model
        self.forward_model = forward_model
        self.loss = loss
        self.metric = metric
        self.objective = objective
        self._objective_agreed = objective is None or learner.comm.size == 1  # the first call's verdict, every rank
        self.learner = learner
        self.comm = learner.comm
        self.device = device if device is not None else learner.comm.device
        self.micro_batch_size = micro_batch_size
        self.precision = precision
        self.loss_scaler = loss_scaler
        self.collapse = collapse
        self.binding = binding if binding is not None else StreamBinding()
        self._check_first = check_first
        self.count_padding = count_padding
        self._forward_checked = not check_compile
        # an eager module's output is a new tensor every call; a compiled one's may live in a reused buffer
        self._outputs_are_new = forward_model is model
        self._compare_with_eager = check_compile
        self.skipped_steps = 0  # fp16: optimizer steps skipped for an overflow (on every rank alike)
        # an additive metric runs once over many passes (PeriodSums.add_outputs), after a first pass at once
        self._metric_is_additive = bool(getattr(metric, "additive", False))
        self._metric_per_sequence = metric_counts_sequences(metric)
        self._defer_metric = False
        self.batchnorm_sync = batchnorm_sync
        self._first_read = True
        self.last_loss: torch.Tensor | None = None  # this rank's detached mean loss of the last pass

    def read(self, source, size: int, timer: PhaseTimer):
        """The next minibatch of ``size`` global samples (this rank's share), or ``None`` at the end of
        the data; the wait counts as ``data`` time. The first is read and checked on every rank before any
        raises (``_read_first``)."""
        timer.mark()
        if self._first_read:
            batch = self._read_first(source, size)
        else:
            batch = source.next_minibatch(size, *self.learner.data_partition())
        timer.lap("data")
        return batch

    def _read_first(self, source, size: int):
        """The first minibatch, read and checked (``check_first``) on every rank, which then agree before any
        step: an error on any rank is raised on every rank, naming that rank (``dtrain.session.first_minibatch``)."""
        self._first_read = False
        return read_agreed(self.comm, lambda: self._read_and_check_first(source, size))

    def _read_and_check_first(self, source, size: int):
        """This rank's share of the first minibatch, checked by ``check_first`` where it holds samples."""
        batch = source.next_minibatch(size, *self.learner.data_partition())
        if batch is not None and batch.num_samples > 0 and self._check_first is not None:
            check, self._check_first = self._check_first, None
            check(batch)
        return batch

    def train(self, batch: Minibatch, sums: PeriodSums, timer: PhaseTimer) -> None:
        """Forward, backward on the local mean loss, learner step; adds the loss and metric to ``sums``
        and the compute and update (exchange, optimizer) times to ``timer``.

        The learner weights this rank by ``batch.num_samples`` of ``batch.global_num_samples`` (steps of
        the defining stream). With ``micro_batch_size`` the rank's share is computed in passes of whole
        sequences of at most that many samples (one sequence at least); pass ``i`` back-propagates its
        mean loss times ``n_i / n`` (``n_i``, ``n``: the target's samples in the pass and in the share),
        so the accumulated gradient is the gradient of the mean over all ``n``. Every pass but the last
        runs under ``learner.no_sync()``: the exchange happens once.
        """
        learner = self.learner
        if batch.num_samples > 0:
            batch = batch.to(self.device)
            if self._check_first is not None:
                check, self._check_first = self._check_first, None
                check(batch)
        if self._compare_with_eager:  # every rank, also one without samples: the verdict is a collective
            self._compare_with_eager = False
            with self._local_batchnorm():  # a rank without samples makes no forward here
                self._refuse_a_compiled_model_that_differs(batch)
        if self.loss_scaler is not None:
            learner.loss_scale = self.loss_scaler.scale  # the learner unscales with it
        learner.begin_minibatch(batch.num_samples, batch.global_num_samples)
        gradient_scale = learner.fold_gradient_scale()  # saves the learner a pass over every gradient
        synchronized = self.batchnorm_sync is not None and self._synchronize_batchnorm(batch, gradient_scale)
        synchronized = synchronized or learner.collective_forward  # every rank makes every pass (sharded models)
        passes: list = []
        if batch.num_samples > 0:
            if self.count_padding:
                sums.add_padding(*batch.padding)
            target, steps, sequences = self.binding.target_and_counts(batch)
            if self.micro_batch_size is None or steps <= self.micro_batch_size:  # one pass: the streams as read
                passes = [(batch, target, steps, sequences)]
            else:
                passes = self._passes(batch, target)
        if not passes and not self._objective_agreed:
            self._agree_on_the_objective(None)  # the ranks that call it wait for this one's word
        empty_passes = self._passes_to_match(len(passes)) if synchronized else 0
        if len(passes) == 1 and not empty_passes:  # the usual minibatch: one pass, straight through
            part, part_target, pass_steps, pass_sequences = passes[0]
            self._forward_backward(part, part_target, pass_steps, pass_sequences, pass_steps, gradient_scale, sums)
        else:
            self._several_passes(batch, passes, empty_passes, gradient_scale, sums)
        timer.lap("compute")
        learner.step()
        if self.loss_scaler is not None:
            self._update_loss_scale()
        timer.lap_update(learner.exchange_seconds_last_step)

    def _several_passes(self, batch: Minibatch, passes: list, empty_passes: int, gradient_scale: float,
                        sums: PeriodSums) -> None:
        """Micro-batches (and the empty passes of synchronized BatchNorm): every pass but the last inside
        ``learner.no_sync()``, so the exchange happens once, on the accumulated gradient."""
        local_steps = sum(pass_steps for _, _, pass_steps, _ in passes)
        last = len(passes) + empty_passes - 1
        for index, (part, part_target, pass_steps, pass_sequences) in enumerate(passes):
            with contextlib.nullcontext() if index == last else self.learner.no_sync():
                self._forward_backward(part, part_target, pass_steps, pass_sequences, local_steps,
                                       gradient_scale, sums)
        for index in range(len(passes), last + 1):
            with contextlib.nullcontext() if index == last else self.learner.no_sync():
                self._empty_pass(batch)

    def _synchronize_batchnorm(self, batch: Minibatch, gradient_scale: float) -> bool:
        """``sync_batchnorm``: whether this minibatch's BatchNorm layers reduce over the ranks (a distributed
        step of a replicated learner; not its warm-start local steps), and this rank's gradient factor."""
        sync = self.batchnorm_sync
        if sync is None or not sync.in_training:
            return False
        sync.active = self.comm.size > 1 and self.learner.is_distributed()
        if sync.active and batch.num_samples > 0:
            # this rank's loss relative to the global mean loss: 1 when the learner folds its weighting
            sync.gradient_factor = batch.global_num_samples * gradient_scale / batch.num_samples
        return sync.active

    @contextlib.contextmanager
    def _local_batchnorm(self):
        """Synchronized BatchNorm layers use this rank's statistics inside (no reduction)."""
        sync = self.batchnorm_sync
        was = sync.active if sync is not None else False
        if sync is not None:
            sync.active = False
        try:
            yield
        finally:
            if sync is not None:
                sync.active = was

    def _passes_to_match(self, passes: int) -> int:
        """Empty passes this rank adds so that every rank makes as many as the rank with the most: one
        collective per minibatch with micro-batches, none without (then every rank makes one pass)."""
        if self.micro_batch_size is None:
            return 1 - passes
        most = self.comm.allreduce(torch.tensor([float(passes)], device=self.comm.device), op="max")
        return int(most.item()) - passes

    def _empty_pass(self, batch: Minibatch) -> None:
        """A forward and backward over no samples, so that this rank takes part in every synchronized
        BatchNorm reduction of a pass it has no samples for; its gradients are zero."""
        empty = batch.select(0, 0, 0).to(self.device)
        with autocast(self.precision, self.device):
            output = self.binding.forward(self.forward_model, empty)
        (output.float().sum() * 0.0).backward()

    def _passes(self, batch: Minibatch, target) -> list[tuple[Minibatch, object, int, int]]:
        """``micro_batch_size``'s passes over ``batch``: ``(part, its target, samples, sequences)`` of whole
        sequences, at most ``micro_batch_size`` target samples each (one sequence at least)."""
        if isinstance(target, Sequences):
            counts = target.lengths.tolist()
        elif isinstance(target, torch.Tensor):
            counts = [1] * batch.num_sequences
        else:
            raise ValueError("micro_batch_size with target=minibatch: the passes are cut by the target's samples; "
                             "name the target stream (session.target) or drop micro_batch_size")
        passes, start, filled = [], 0, 0
        for index, count in enumerate(counts):
            if index > start and filled + count > self.micro_batch_size:
                passes.append((start, index, filled))
                start, filled = index, 0
            filled += count
        passes.append((start, len(counts), filled))
        parts = []
        for start, stop, steps in passes:
            part = batch.select(start, stop, steps)
            part_target = self.binding.target_of(part)
            parts.append((part, part_target, *count_steps(part_target)))
        return parts

    def _update_loss_scale(self) -> None:
        """fp16: one overflow verdict for all ranks (a collective when several run), then the new scale.

        Synchronous learners already reach the same verdict on every rank; local steps (block
        momentum, warm start) may not, and the scale must stay the same everywhere.
        """
        found_inf = self.learner.found_inf
        if self.comm.size > 1:
            flag = torch.tensor([1.0 if found_inf else 0.0], device=self.comm.device)
            found_inf = bool(self.comm.allreduce(flag, op="max").item())
        self.skipped_steps += int(found_inf)
        self.loss_scaler.update(found_inf)

    def _forward_backward(self, batch: Minibatch, target, samples: int, sequences: int, local_samples: int,
                          gradient_scale: float, sums: PeriodSums) -> None:
        """One pass over ``samples`` of this rank's ``local_samples``: forward (autocast in bf16/fp16),
        backward on the pass's mean loss weighted by its share and by the learner's ``gradient_scale``
        (``Learner.fold_gradient_scale``), loss and metric sums into ``sums``."""
        if self.objective is not None:
            self._objective_backward(batch, target, samples, local_samples, gradient_scale, sums)
            return
        forward = self.forward_model if self._forward_checked else self._checked_forward
        output = None
        try:
            if self.precision == "32":
                output = self.binding.forward(forward, batch)
                loss = self.loss(output, target)
            else:
                with autocast(self.precision, self.device):
                    output = self.binding.forward(forward, batch)
                    loss = self.loss(output, target)
        except IndexError as error:  # torch's embedding or loss on an id the model has no room for
            problem = ids_past_the_model(self.model, self.binding, batch, output)
            if problem is None:
                raise
            raise DataError(problem) from error
        if type(target) is Sequences:  # a per-step target: a step for every output step (no silent truncation)
            check_target_steps(output, target, batch, self.binding)
        weight = gradient_scale if samples == local_samples else samples / local_samples * gradient_scale
        weighted = loss if weight == 1.0 else loss * weight
        if self.loss_scaler is not None:
            weighted = weighted * self.learner.loss_scale
        weighted.backward()
        # detached tensors record no graph, so only the metric itself runs under no_grad (at a few µs a call)
        if isinstance(output, torch.Tensor):
            output = output.detach()
            if self.precision != "32" and output.is_floating_point() and output.dtype != torch.float32:
                output = output.float()  # the metric sees float32, as without autocast
        loss = loss.detach()
        self.last_loss = loss  # for the callbacks' on_step_end
        self.collapse.observe(output, target, loss, self.loss, sequences)
        if self._defer_metric:
            sums.add_outputs(loss, output, target, samples, copy_output=not self._outputs_are_new,
                             copy_labels=not batch.owns_tensors)
        else:  # every pass; an additive metric only the first (a metric that cannot run fails at once)
            sums.add(loss, _measured(self.metric, output, target), samples,
                     sequences if self._metric_per_sequence else samples)
            self._defer_metric = (self._metric_is_additive and isinstance(output, torch.Tensor)
                                  and isinstance(target, torch.Tensor))

    def _objective_backward(self, batch: Minibatch, target, samples: int, local_samples: int, gradient_scale: float,
                            sums: PeriodSums) -> None:
        """:meth:`_forward_backward` with an objective: ``objective(model, pass)`` (autocast in bf16/fp16) gives
        the pass's mean loss, weighted and back-propagated as a loss's, and its figures, summed like it."""
        try:
            with autocast(self.precision, self.device) if self.precision != "32" else contextlib.nullcontext():
                loss, figures = self._call_objective(batch)
        except ValueError as error:
            if not self._objective_agreed:
                self._agree_on_the_objective(str(error))
            raise
        if not self._objective_agreed:
            self._agree_on_the_objective(None)
        weight = gradient_scale if samples == local_samples else samples / local_samples * gradient_scale
        weighted = loss if weight == 1.0 else loss * weight
        if self.loss_scaler is not None:
            weighted = weighted * self.learner.loss_scale
        weighted.backward()
        loss = loss.detach()
        self.collapse.observe(None, target, loss, self.objective)
        sums.add(loss, 0.0, samples)
        if figures:
            sums.add_figures(self.objective.figure_vector(figures, self.device), samples)

    def _call_objective(self, batch: Minibatch) -> tuple[torch.Tensor, dict]:
        """The objective on ``batch`` with the training model; the first call through a compiled model turns a
        compiler failure into one clear line (:meth:`_checked_forward`)."""
        if self._forward_checked:
            return self.objective(self.forward_model, batch)
        return self._first_call_checked(lambda: self.objective(self.forward_model, batch))

    def _agree_on_the_objective(self, problem: str | None) -> None:
        """Several ranks, the first minibatch: every rank says whether the objective's first result passed its
        check (before any backward, where the gradient exchange may start), and all raise the first refusal."""
        self._objective_agreed = True
        found = [line for line in self.comm.allgather_object(problem) if line]
        if found and problem is None:
            raise ValueError(found[0])

    def _refuse_a_compiled_model_that_differs(self, batch: Minibatch) -> None:
        """The compile check on this rank's share of the first minibatch (its first micro-batch pass);
        raises ValueError on every rank when any rank's loss or gradients differ from eager PyTorch's, or when
        an objective's first result fails its check on any rank (the check is where it is first called)."""
        refused: ValueError | None = None
        if batch.num_samples == 0:
            names, differences = compile_check.no_differences(self.model, self.device)
        else:
            target, steps, _ = self.binding.target_and_counts(batch)
            if self.micro_batch_size is not None and steps > self.micro_batch_size:
                batch, target = self._passes(batch, target)[0][:2]

            def compute_loss(forward):
                with autocast(self.precision, self.device):
                    if self.objective is None:
                        return self.loss(self.binding.forward(forward, batch), target)
                    # an objective takes a module: the eager model, or the compiled one (failures rewritten)
                    return self.objective(self.model, batch)[0] if forward is self.model \
                        else self._call_objective(batch)[0]
            try:
                names, differences = compile_check.relative_differences(self.model, self._checked_forward,
                                                                        compute_loss, self.device, self.precision)
            except ValueError as error:
                if self._objective_agreed:
                    raise
                refused = error
        if not self._objective_agreed:  # every rank, also one without samples: the other ranks wait for its word
            self._agree_on_the_objective(None if refused is None else str(refused))
        if refused is not None:
            raise refused
        problem = compile_check.verdict(names, differences, self.precision, self.comm)
        if problem:
            raise ValueError(problem)

    def _checked_forward(self, *args, **kwargs):
        """The model's training forward; the first compiled one turns a compiler failure into one clear line."""
        return self._first_call_checked(lambda: self.forward_model(*args, **kwargs))

    def _first_call_checked(self, call: Callable[[], object]):
        """``call()``, the first through the training model: a compiler failure becomes one clear line
        (:meth:`_compile_failure`); once it returns, later calls go straight to the model."""
        try:
            result = call()
        except Exception as error:  # noqa: BLE001 - only torch.compile's own failures are rewritten
            problem = self._compile_failure(error)
            if problem is error:
                raise
            raise problem from error
        self._forward_checked = True
        return result

    def _compile_failure(self, error: Exception) -> Exception:
        """A compiler failure as one clear ValueError naming ``compile``; any other error as itself."""
        if not type(error).__module__.startswith(("torch._dynamo", "torch._inductor")):
            return error
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return ValueError(f"compile=True: torch.compile (inductor) could not compile {type(self.model).__name__} "
                          f"({type(error).__name__}: {first_line[:300]}); train without it (session.compile=false)")


__all__ = ["MinibatchStep", "PeriodSums"]

"""The training loop: read, forward, backward, learner step, then progress, cross-validation, checkpoints.

``training_session(...)`` has CNTK's meanings: every frequency and ``max_samples`` counts global
samples; an action fires whenever ``samples_seen // frequency`` changes, and once more at the end
for a partial period. Cross-validation and checkpoints need one model on every rank, so with a
learner whose ranks meet only at block ends (block momentum, DiLoCo) they wait for the next
block end: they never force an outer step on a partial block, which would change the training. The loop only talks to the learner interface, so the same loop runs a
single process or any distributed learner.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from dtrain import checks
from dtrain.comm.launcher import detect_launcher
from dtrain.data.errors import DataError
from dtrain.data.streams import WHOLE_MINIBATCH
from dtrain.learners.base import Learner, RunFacts
from dtrain.rules import check_settings
from dtrain.schedules import Schedule, momentum_from_time_constant, size_sweeps
from dtrain.session import checkpoint, checkpoint_state
from dtrain.session.collapse import CollapseWatch, training_advice
from dtrain.session.configs import CheckpointConfig, CrossValidationConfig, TestConfig, action_frequency
from dtrain.session.batchnorm import DEFAULT_RECOMPUTE_SAMPLES, prepare_batchnorm
from dtrain.session.binding import StreamBinding
from dtrain.session.objective_call import ObjectiveCall
from dtrain.session.checkpointing import CheckpointHandling
from dtrain.session.device import resolve_device
from dtrain.session.evaluate import Evaluation, classification_errors
from dtrain.session.evaluations import EvaluationPasses
from dtrain.session.stream_checks import (bind_sources, check_loss_takes_target, check_model_against_data,
                                          first_minibatch_check)
from dtrain.session.metrics import CSV_COLUMNS, MetricsWriter, PhaseTimer, resolve_tensorboard
from dtrain.session.objectives import metric_in_percent, metric_name
from dtrain.session.minibatch_step import MinibatchStep, PeriodSums
from dtrain.session.precision import LossScaler
from dtrain.session.preemption import PreemptionHandling
from dtrain.session.periodic import Periodic
from dtrain.session.profiling import ProfileConfig, StepProfiler
from dtrain.session.progress_report import ProgressReports
from dtrain.session.progress import ProgressPrinter, Throughput
from dtrain.session.startup import StartupLines
from dtrain.session.results import TrainingCollapsed, TrainingDiverged, TrainingResult
from dtrain.session.rundir import RunDirectoryLock
from dtrain.session.settings import TRAINING_SESSION
from dtrain.session.summary import RunSummary
from dtrain.session.lr_scaling import LearningRateScaling
from dtrain.session.weight_ema import WeightEMA


#: how a user calls each launcher kind that ``detect_launcher`` reports
_LAUNCHER_NAMES = {"mpi": "mpiexec", "slurm": "srun"}


class TrainingSession(CheckpointHandling, EvaluationPasses, ProgressReports, RunSummary, PreemptionHandling,
                      StartupLines):
    """Trains ``model`` with ``learner`` on ``minibatch_source`` (CNTK's ``training_session``); call ``.train()``.

    The names are the config's (``session.*`` on the command line): every size and frequency
    counts global samples, over all workers together.

    Args:
        model: the ``torch.nn.Module`` to train.
        loss: ``loss(output, target)`` returning the MEAN loss over the local minibatch's samples (the
            target's steps, for a sequence target). Give ``loss`` or ``objective``, exactly one.
        objective: your own objective in place of ``loss(model(inputs), target)`` (``docs/objectives.md``):
            ``objective(model, minibatch)`` returning the MEAN loss over the minibatch's samples (counted as with
            a loss: in ``target``'s steps) as a scalar tensor, or ``(loss, {name: figure})`` whose figures (means
            over the same samples) are averaged like the loss and logged under their names. It receives the
            whole minibatch (``inputs`` stays at its default) and exposes no output, so no ``metric`` is taken
            with it: the figures are its figures (``dtrain.session.Distillation`` is one).
        learner: a dtrain ``Learner`` wrapping the optimizer of ``model``'s parameters; its
            communicator decides how many processes train (see ``dtrain.create_communicator``).
        minibatch_source: a ``MinibatchSource`` for training.
        minibatch_size: global minibatch size in samples, or a ``Schedule`` of sizes by samples seen.
        max_samples: global samples to train on (``None``: until the source ends).
        progress_frequency: samples between progress lines (``None``: at the end only; 0: never).
        checkpoint_config, cv_config, test_config: see their classes (``None``: no checkpoints,
            no cross-validation, no test).
        metric: ``metric(output, labels)`` returning a SUM (default with a loss: classification errors; none
            with an objective); its ``name``
            (default: the function's name; ``error`` for classification errors) labels it in progress lines,
            metrics files and the summary, and ``percent=True`` shows it as a percentage (see
            ``dtrain.session.objectives``).
        lr_schedule: multipliers of each parameter group's configured lr, by samples seen.
        momentum_time_constant_schedule: momentum as time constants in samples (``exp(-mb/tc)`` per minibatch).
        unit_gain_momentum: set SGD's dampening to the momentum, so steps are ``lr``-sized (CNTK).
        lr_scaling: a ``LearningRateScaling`` multiplying every group's lr (with ``lr_schedule``'s multiplier)
            by ``minibatch / reference`` or its square root, warmed up from the unscaled lr
            (``dtrain.session.lr_scaling``); ``None``: no scaling.
        ema_decay: keep an exponential moving average of the weights with this decay in (0, 1), in
            checkpoints, tested beside the model and written to ``model_ema.safetensors``
            (``dtrain.session.weight_ema``); ``None``: none.
        run_dir: directory for metrics, TensorBoard events and relative checkpoint names; rank 0
            holds a lock on it while training, so a second job into it is refused.
        tensorboard: write TensorBoard events too (``None``: when the ``tensorboard`` package is installed;
            ``True`` without it raises ValueError).
        progress_bar: live progress bar (``None``: on a terminal, single process only).
        checkpoint_identity: plain settings of your own a checkpoint must match to be restored
            (the model's type, the learner, the optimizer's type and the training data are always checked).
        run_config: the run's whole resolved config as plain containers (the command line passes
            it); stored in checkpoints so that a resumed run lists the settings that changed.
        config_fingerprint: a short hash of the config, stored in checkpoints.
        micro_batch_size: samples per rank per forward/backward pass (``None``: no cap). A rank's share
            of the global minibatch is computed in passes of at most this many samples whose gradients
            accumulate locally and are exchanged once, so the update is the uncapped one (to float
            rounding; BatchNorm statistics are then per pass, with ``sync_batchnorm`` per pass of all ranks
            together: ``docs/batchnorm.md``) while activations fit in memory.
        clip_grad_norm: clip the gradient to this global L2 norm before every optimizer step
            (``None``: off): after the exchange, so on the global-mean gradient, the same on every
            rank; with block momentum (and warm-start local steps) on each local step's gradient.
        precision: ``"32"`` (float32), ``"bf16"`` (the forward and loss under ``torch.autocast`` in
            bfloat16, on CPU or GPU; parameters, gradients and optimizer state stay float32), or
            ``"fp16"`` (autocast in float16 with a dynamic loss scale: gradients unscaled before any
            exchange, a step with an inf/NaN gradient skipped on every rank, the scale in checkpoints).
        compile: train through ``torch.compile(model)`` (inductor). The compiled module shares the
            model's parameters, so checkpoints and ``model.safetensors`` keep the plain parameter
            names (a model the caller already compiled is unwrapped the same way); a model that
            cannot be compiled stops training at the first minibatch with a ValueError naming ``compile``,
            and so does one whose compiled loss or gradients differ from eager PyTorch's on the first
            minibatch (``dtrain.session.compile_check``).
        sync_batchnorm: BatchNorm layers normalise with the statistics of the whole global minibatch
            (``dtrain.nn.SyncBatchNorm``, reduced through the learner's communicator), so N ranks train as one
            process does; refused with learners whose ranks hold different models between syncs (``docs/batchnorm.md``).
        batchnorm_statistics: ``"running"`` (the running averages training kept) or ``"recomputed"``: before
            the test and ``model.safetensors``, every BatchNorm layer's statistics are measured exactly over
            ``batchnorm_recompute_samples`` global training samples with the final weights.
        device: where to train: ``"auto"`` (the communicator's device: the launcher's local rank's GPU
            under NCCL, else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (``dtrain.session.device``).
        profile: trace a few minibatches with ``torch.profiler`` into ``run_dir/profile/``
            (``dtrain.session.profiling``; ``None``: no profiling).
        independent_processes: allow a one-process session in a process that a launcher
            (``mpiexec``, ``torchrun``, ``srun``) started among several; refused by default, since
            each process would train its own copy.
        stream: where progress goes (default: standard output).
        inputs: the streams ``model.forward`` takes (CNTK's ``model_inputs_to_streams``): a list passed
            positionally (default ``["features"]``), a mapping ``argument -> stream`` passed by keyword,
            or ``"minibatch"`` for the whole minibatch; a stream may be a step slice (``text[:-1]``) or a
            part (``src.mask``, ``src.lengths``). See ``dtrain.session.binding``.
        target: the stream the loss and the metric take as their second argument (default ``"labels"``;
            ``text[1:]``; ``"minibatch"``). Samples are counted in its steps unless the source names a
            ``defining_stream`` (``docs/data.md#samples-are-steps``); with an objective, that is all it says.

    Raises:
        ValueError, TypeError: a bad argument (the message names it).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        learner: Learner | None = None,
        minibatch_source=None,
        minibatch_size: int | Schedule | None = None,
        *,
        objective: Callable | None = None,
        max_samples: int | None = None,
        progress_frequency: int | None = None,
        checkpoint_config: CheckpointConfig | None = None,
        cv_config: CrossValidationConfig | None = None,
        test_config: TestConfig | None = None,
        metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        lr_schedule: Schedule | None = None,
        momentum_time_constant_schedule: Schedule | None = None,
        unit_gain_momentum: bool = False,
        lr_scaling: LearningRateScaling | None = None,
        ema_decay: float | None = None,
        run_dir: str | Path = ".",
        tensorboard: bool | None = None,
        config_fingerprint: str = "",
        checkpoint_identity: dict | None = None,
        run_config: dict | None = None,
        progress_bar: bool | None = None,
        stream=None,
        independent_processes: bool = False,
        micro_batch_size: int | None = None,
        clip_grad_norm: float | None = None,
        precision: str | int = "32",
        compile: bool = False,  # noqa: A002 - the config's name (session.compile)
        sync_batchnorm: bool = False,
        batchnorm_statistics: str = "running",
        batchnorm_recompute_samples: int = DEFAULT_RECOMPUTE_SAMPLES,
        inputs=("features",),
        target: str = "labels",
        device: str | torch.device = "auto",
        profile: ProfileConfig | None = None,
    ):
        if not isinstance(learner, Learner):
            raise TypeError(f"learner must be a dtrain Learner (wrap your optimizer), got {type(learner).__name__}")
        if minibatch_source is None or minibatch_size is None:
            raise TypeError("training_session needs a minibatch_source and a minibatch_size")
        objective_call, metric = _loss_or_objective(loss, objective, metric, inputs, sync_batchnorm)
        sizes = {} if isinstance(minibatch_size, Schedule) else {"minibatch_size": minibatch_size}
        check_settings(TRAINING_SESSION, **sizes, max_samples=max_samples, progress_frequency=progress_frequency,
                       micro_batch_size=micro_batch_size, clip_grad_norm=clip_grad_norm, precision=precision,
                       compile=compile)
        self.micro_batch_size = None if micro_batch_size is None else int(micro_batch_size)
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.precision = checks.precision("precision", precision)  # 32 or "32" -> "32"
        self.device = resolve_device(device, learner.comm)
        self.loss_scaler = LossScaler(self.device) if self.precision == "fp16" else None
        self.minibatch_size = minibatch_size if isinstance(minibatch_size, Schedule) \
            else Schedule(int(minibatch_size))
        if momentum_time_constant_schedule is not None \
                and any("momentum" not in g for g in learner.optimizer.param_groups):
            raise ValueError(
                f"momentum_time_constant_schedule needs an optimizer with a 'momentum' setting, "
                f"{type(learner.optimizer).__name__} has none; drop the schedule or use SGD"
            )
        launch = detect_launcher(os.environ)
        if launch.size > 1 and learner.comm.size == 1 and not independent_processes:
            # each process would train its own copy into the same files: almost always a forgotten communicator
            launcher = _LAUNCHER_NAMES.get(launch.kind, launch.kind)
            raise ValueError(
                f"{launcher} started {launch.size} processes but this session's learner has a one-process "
                f"communicator, so each process would train its own copy; create the job's communicator with "
                f"comm = dtrain.create_communicator() and give it to a distributed learner, e.g. "
                f"dtrain.data_parallel_distributed_learner(optimizer, comm=comm) (independent_processes=True "
                f"if separate copies are really wanted)")
        self.compile = bool(compile)
        compiled = model if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else None
        if compiled is not None:  # checkpoints and weights name the parameters without the wrapper's _orig_mod.
            model = compiled._orig_mod
        # before the compiled wrapper is made: it must trace the converted layers
        self.batchnorm_sync = prepare_batchnorm(model, learner, sync_batchnorm, batchnorm_statistics,
                                                batchnorm_recompute_samples)
        self.sync_batchnorm, self.batchnorm_statistics = sync_batchnorm, batchnorm_statistics
        self.batchnorm_recompute_samples = batchnorm_recompute_samples
        self.model = model
        # what the training forward calls: the compiled module (sharing model's parameters) or the model
        self.forward_model = compiled if compiled is not None else (torch.compile(model) if self.compile else model)
        self.loss = loss
        self.objective = objective_call
        self.metric = metric
        # how the metric is reported: its key in progress lines, metrics.jsonl/csv and the summary (an objective:
        # none, its figures are reported instead)
        self.metric_name = metric_name(metric) if metric is not None else None
        self.metric_percent = metric_in_percent(metric) if metric is not None else False
        if self.metric_name in set(CSV_COLUMNS) - {"error"}:
            raise ValueError(f"metric name {self.metric_name!r} is a metrics column of its own; give the metric "
                             f"another name")
        self.learner = learner
        self.comm = learner.comm
        self.source = minibatch_source
        self.binding = StreamBinding(inputs if objective_call is None else WHOLE_MINIBATCH, target)
        self.sources = {"the training data": minibatch_source,
                        "the cross-validation data": cv_config.minibatch_source if cv_config else None,
                        "the test data": test_config.minibatch_source if test_config else None}
        self._defining_stream_note = bind_sources(self.binding, self.sources)
        check_model_against_data(model, self.binding, self.sources)
        if objective_call is None:
            check_loss_takes_target(loss, metric, self.binding, minibatch_source)
        size_sweeps((self.minibatch_size, lr_schedule, momentum_time_constant_schedule), minibatch_source)
        self.max_samples = max_samples
        self.checkpoint_config = checkpoint_config
        self.cv_config = cv_config
        self.test_config = test_config
        self.lr_schedule = lr_schedule
        self.momentum_time_constant_schedule = momentum_time_constant_schedule
        self.unit_gain_momentum = unit_gain_momentum
        if lr_scaling is not None and not isinstance(lr_scaling, LearningRateScaling):
            raise TypeError(f"lr_scaling must be a dtrain LearningRateScaling or None, got {type(lr_scaling).__name__}")
        self.lr_scaling = lr_scaling if lr_scaling is not None and lr_scaling.rule != "none" else None
        self.ema = WeightEMA(model, ema_decay) if ema_decay is not None else None
        self.run_dir = Path(run_dir)
        self.tensorboard = resolve_tensorboard(tensorboard)  # None: when the package is installed
        self._tensorboard_hint = tensorboard is None and not self.tensorboard  # said once, in the summary
        self._end_warnings: list[str] = []  # said in the summary, after the test lines they are about
        self.config_fingerprint = config_fingerprint
        # what a checkpoint must match (model, learner, data, and the caller's own) and what may change
        self.checkpoint_identity = checkpoint_state.identity(model, learner, minibatch_source, checkpoint_identity)
        self.settings = {"session": {
            "minibatch_size": minibatch_size if isinstance(minibatch_size, int) else repr(minibatch_size),
            "max_samples": max_samples, "progress_frequency": progress_frequency,
            "checkpoint_frequency": action_frequency("CheckpointConfig.frequency", checkpoint_config.frequency)
            if checkpoint_config else None,
            "cv_frequency": cv_config.frequency if cv_config else None,
            "lr_schedule": repr(lr_schedule) if lr_schedule else None,
            "momentum_time_constant_schedule": repr(momentum_time_constant_schedule)
            if momentum_time_constant_schedule else None,
            "optimizer": checkpoint_state.optimizer_hyperparameters(learner.optimizer),
            "micro_batch_size": self.micro_batch_size, "clip_grad_norm": self.clip_grad_norm,
            "precision": self.precision, "compile": self.compile,
            "sync_batchnorm": self.sync_batchnorm, "batchnorm_statistics": self.batchnorm_statistics,
            "batchnorm_recompute_samples": self.batchnorm_recompute_samples,
            "lr_scaling": repr(self.lr_scaling) if self.lr_scaling else None, "ema_decay": ema_decay,
        }}
        if run_config is not None:
            self.settings["config"] = run_config
        self.changed_settings: list[str] = []  # against the restored checkpoint, filled by restore()
        # a launcher (mpiexec) gives ranks a pseudo-terminal even when its own output goes to a file,
        # so the live bar is only automatic in a single process
        self.progress_bar = progress_bar if progress_bar is not None else (None if self.comm.size == 1 else False)
        self.stream = stream
        if profile is not None and not isinstance(profile, ProfileConfig):
            raise TypeError(f"profile must be a dtrain ProfileConfig or None, got {type(profile).__name__}")
        self.profile = profile
        # the configured learning rates; an lr schedule multiplies them
        self.base_learning_rates = [group["lr"] for group in learner.optimizer.param_groups]
        self.progress_period = Periodic(action_frequency("progress_frequency", progress_frequency))
        self.checkpoint_period = Periodic(action_frequency("CheckpointConfig.frequency", checkpoint_config.frequency)
                                          if checkpoint_config else 0)
        self.cv_period = Periodic(cv_config.frequency if cv_config else 0)
        self.minibatches = 0
        self.cv_index = 0
        self._last_cv: tuple[int, Evaluation] | None = None  # samples seen at the last cross-validation, its result
        self.checkpoint_files: checkpoint.CheckpointFiles | None = None
        self._restore_attempted = False
        self._restored_from: Path | None = None
        self._restore_note = ""  # which checkpoint the run starts from and why (or why none), for the start-up
        self._run_dir_lock: RunDirectoryLock | None = None
        self._last_training_error: float | None = None
        self._preemption = threading.Event()
        self._report_path: Path | None = None
        self._on_checks_passed: list[Callable[[], None]] = []
        self._outputs_started = False
        self._saved_checkpoint = False  # whether this run wrote a checkpoint (its run directory is then kept)
        self._metrics: MetricsWriter | None = None
        self._weights_path: Path | None = None
        self._profiler: StepProfiler | None = None
        self._figure_names_agreed = False  # an objective's figure names, agreed by the ranks at the first progress
        self._collapse = CollapseWatch(self.device)
        self._step = MinibatchStep(model=self.model, forward_model=self.forward_model, loss=loss, metric=metric,
                                   learner=learner, device=self.device, micro_batch_size=self.micro_batch_size,
                                   precision=self.precision, loss_scaler=self.loss_scaler, collapse=self._collapse,
                                   check_compile=self.forward_model is not self.model,
                                   binding=self.binding, check_first=first_minibatch_check(minibatch_source),
                                   batchnorm_sync=self.batchnorm_sync,
                                   count_padding=bool(getattr(minibatch_source, "has_sequences", False)),
                                   objective=objective_call)
        if checkpoint_config is not None:
            filename = Path(checkpoint_config.filename)
            self.checkpoint_files = checkpoint.CheckpointFiles(filename if filename.is_absolute() else self.run_dir / filename)

    @property
    def skipped_steps(self) -> int:
        """fp16: optimizer steps skipped for an inf/NaN gradient so far (the same on every rank)."""
        return self._step.skipped_steps

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> TrainingResult:
        """Runs training to ``max_samples`` (or the end of the data, or a CV callback's stop).

        Rank 0 holds the run directory's lock from ``restore()`` until this returns or raises. A run that
        fails before its first checkpoint, on bad data or before its first write, leaves the directory as it
        found it (``_abandon_run_dir``).
        """
        try:
            return self._train()
        except BaseException as error:
            self._abandon_run_dir(error)
            raise
        finally:
            self.release_run_dir()

    def _abandon_run_dir(self, error: BaseException) -> None:
        """Rank 0, on a failure: takes back what this run wrote into its run directory (the directory too,
        when this run created it) if it wrote nothing yet, or if the data failed before any checkpoint of this
        run; what the directory held before is kept, and so is a run that has checkpoints to resume from."""
        if self._run_dir_lock is None or self._saved_checkpoint:
            return
        if not self._outputs_started or isinstance(error, DataError):
            if self._metrics is not None:
                self._metrics.take_back()  # a resumed run's metrics.jsonl and metrics.csv as they were
            self._run_dir_lock.remove_this_jobs_files()

    def release_run_dir(self) -> None:
        """Lets another job use the run directory (done by ``train()``; idempotent)."""
        if self._run_dir_lock is not None:
            self._run_dir_lock.release()
            self._run_dir_lock = None

    def _train(self) -> TrainingResult:
        restored_from = self.restore()
        if self._run_dir_lock is not None:
            self._run_dir_lock.record_holder()
        self.model.to(self.device)
        if self.ema is not None:
            self.ema.to(self.device)
        self.learner.plan(RunFacts(samples_per_sweep=getattr(self.source, "samples_per_sweep", None),
                                   max_samples=self.max_samples, minibatch_size=int(self.minibatch_size(0)),
                                   warmup_samples=self._lr_warmup_samples()))
        self.learner.prepare(self.model)
        self.model.train()
        remove_clipping = self.learner.add_before_optimizer_step(self._clip_gradients) \
            if self.clip_grad_norm is not None else None
        # clipping and fp16 happen in the learner's _step_optimizer(); a learner calling optimizer.step()
        # itself would silently train without them, so such a step is refused
        seam_check = self.learner.optimizer.register_step_pre_hook(self._require_learner_seam) \
            if self.clip_grad_norm is not None or self.loss_scaler is not None else None
        try:
            return self._train_prepared(restored_from)
        finally:
            if remove_clipping is not None:
                remove_clipping()
            if seam_check is not None:
                seam_check.remove()
            self.learner.loss_scale = 1.0  # the learner may train again without loss scaling

    def _train_prepared(self, restored_from: Path | None) -> TrainingResult:
        metrics = MetricsWriter(self.run_dir, tensorboard=self.tensorboard, enabled=self.comm.is_main,
                                metric_name=self.metric_name)
        self._metrics = metrics  # taken back if the data fails (_abandon_run_dir)
        try:
            return self._train_with(restored_from, metrics)
        finally:
            metrics.close()  # also when training fails

    def _train_with(self, restored_from: Path | None, metrics: MetricsWriter) -> TrainingResult:
        is_main = self.comm.is_main
        self._outputs_started = False
        throughput = Throughput()
        timer = PhaseTimer(torch.cuda.synchronize if self.device.type == "cuda" else None)  # time split per period
        sums = PeriodSums(self.device, self.metric)  # loss and metric sums over this rank's samples of the period
        last_cv: Evaluation | None = None
        last_checkpoint: Path | None = None
        stopped_early = preempted = False
        alone = self.comm.size == 1  # a single process checks for preemption after every minibatch
        trained = False  # whether this run trained a minibatch (a resumed run may have none left)
        with ProgressPrinter(self.max_samples, enabled=is_main, stream=self.stream, live_bar=self.progress_bar) as printer, \
                self._preemption_handler(), self._profiling() as profiler:
            self._print_start(printer, restored_from)
            while self.max_samples is None or self.learner.samples_seen < self.max_samples:
                seen = self.learner.samples_seen
                size = int(self.minibatch_size(seen))
                if self.max_samples is not None:
                    size = min(size, self.max_samples - seen)
                batch = self._step.read(self.source, size, timer)
                if batch is None:
                    break
                self._apply_schedules(seen, size)
                self._step.train(batch, sums, timer)
                if self.ema is not None:  # taken in where every rank holds one model (dtrain.session.weight_ema)
                    self.ema.after_step(self.model, self.learner.is_sync_point())
                if not trained:  # the first minibatch passed every check: the run directory may change now
                    trained = True
                    self._start_outputs(metrics)
                self.minibatches += 1
                if profiler is not None:
                    profiler.step()
                seen = self.learner.samples_seen
                throughput.add(batch.global_num_samples)
                printer.advance(seen, throughput)

                # preemption is agreed only where the ranks meet anyway (block momentum: once a block)
                ranks_meet = self.learner.is_sync_point()
                one_model = ranks_meet  # synchronize() adds no outer step here (see the module docstring)
                if self.progress_period.due(seen):
                    ranks_meet = True
                    self._report_progress(printer, metrics, sums, throughput, timer)
                if self.cv_period.due(seen, ready=one_model):
                    ranks_meet = True
                    last_cv, keep_going = self._cross_validate(printer, metrics)
                    if not keep_going:
                        stopped_early = True
                        break
                if self.checkpoint_period.due(seen, ready=one_model):
                    ranks_meet = True
                    last_checkpoint = self._save_checkpoint(printer)
                if (ranks_meet or alone) and self._preemption_requested():
                    preempted = stopped_early = True
                    break

            # the end: one last synchronisation, then each action once more for a partial period
            self.learner.synchronize()
            if self.ema is not None and not preempted:  # a block learner's last, partial block
                self.ema.after_last_sync(self.model)
            seen = self.learner.samples_seen
            if self.progress_period.frequency and throughput.period_samples > 0:
                self._report_progress(printer, metrics, sums, throughput, timer)
            if self.cv_period.pending(seen) and not stopped_early:
                last_cv, _ = self._cross_validate(printer, metrics)
            if not trained and restored_from is not None:
                last_checkpoint = restored_from  # nothing left to train: the restored checkpoint is this run's last
            if self.checkpoint_files is not None and (
                    preempted or self.checkpoint_period.pending(seen)
                    or (last_checkpoint is None and self.checkpoint_period.frequency)):
                self._start_outputs(metrics)
                last_checkpoint = self._save_checkpoint(printer)
            if preempted:
                printer.line(f"preempted by {self.checkpoint_config.preemption_signal} at {seen} samples: checkpoint "
                             f"{last_checkpoint} saved; run the same command again to continue")

        test = test_ema = None  # the model was synchronised above
        if not preempted:
            self._judge_the_training_loss(tested=self.test_config is not None)  # after the checkpoint: it is kept
            self._note_a_rise_at_the_end()
            if self.batchnorm_statistics == "recomputed":
                self._recompute_batchnorm(printer, seen)
            if self.test_config is not None:
                test, test_ema = self._test(printer, metrics, seen)
            self._start_outputs(metrics)  # every check has passed, even with nothing left to train
        self.learner.finalize()
        seconds = throughput.elapsed()  # training and evaluation; the one-off outputs below are not training
        metrics.close()
        # a preempted job has seconds before the scheduler kills it: no weights, no drawing (the
        # resumed run writes both at its end, from every record)
        if is_main and not preempted:
            self._export_weights(seen)
            self._write_report(printer, metrics)
        result = TrainingResult(
            samples_seen=seen, minibatches=self.minibatches, seconds=seconds, stopped_early=stopped_early,
            test=test, last_cross_validation=last_cv, last_checkpoint=last_checkpoint,
            metrics_path=metrics.jsonl_path if is_main else None, restored_from=restored_from, preempted=preempted,
            last_training_error=self._last_training_error, test_ema=test_ema, by_loss=self.objective is not None,
        )
        self._print_summary(printer, result, metrics)
        return result

    def _advice(self) -> str:
        """What to change after a divergence or a collapse, naming only what this run uses."""
        return training_advice(self.learner, self.precision)

    # -- the run directory ----------------------------------------------------------------------
    def when_checks_pass(self, callback: Callable[[], None]) -> None:
        """Runs ``callback()`` on rank 0 once this run's checks have passed, just before its first write
        into the run directory: after the first minibatch trained (its data, model, loss and metric
        checks), or before the first output of a resumed run with nothing left to train. The command
        line saves the run's config there, so a run refused by any check leaves the directory as it was."""
        self._on_checks_passed.append(callback)

    def _start_outputs(self, metrics: MetricsWriter) -> None:
        """Rank 0, once: the run's first writes (the ``when_checks_pass`` callbacks', then the metrics files')."""
        if self._outputs_started:
            return
        self._outputs_started = True
        if self.comm.is_main:
            for callback in self._on_checks_passed:
                callback()
            metrics.open()

    # -- the learner's seams --------------------------------------------------------------------
    def _require_learner_seam(self, optimizer, args, kwargs) -> None:
        """Optimizer step pre-hook: refuses a step that bypassed ``Learner._step_optimizer``."""
        if not self.learner.in_optimizer_step:
            setting = "clip_grad_norm" if self.clip_grad_norm is not None else "precision=fp16"
            raise ValueError(
                f"{setting}: the {self.learner.kind} learner calls optimizer.step() itself, so the gradient would "
                f"not be clipped or unscaled; it must call self._step_optimizer() instead (see docs/writing-a-learner.md)")

    def _clip_gradients(self, learner: Learner) -> None:
        """Before-optimizer-step callback: clips the gradient the optimizer will use to ``clip_grad_norm``
        (its L2 norm over all parameters). After a synchronous exchange every rank holds the same
        gradient, so every rank computes the same norm and clips the same way."""
        gradients = [parameter for parameter in learner.parameters if parameter.grad is not None]
        if gradients:
            torch.nn.utils.clip_grad_norm_(gradients, self.clip_grad_norm)

    def _lr_warmup_samples(self) -> int:
        """The samples over which the learning rate warms up from the start: ``lr_schedule``'s or ``lr_scaling``'s
        warm-up, the longer (0: none; a plain callable as the schedule says nothing)."""
        return max(int(getattr(self.lr_schedule, "warmup_samples", 0) or 0),
                   int(getattr(self.lr_scaling, "warmup_samples", 0) or 0))

    def _apply_schedules(self, samples_seen: int, minibatch_size: int) -> None:
        """Sets each parameter group's lr (and momentum) for the next minibatch."""
        groups = self.learner.optimizer.param_groups
        if self.lr_schedule is not None or self.lr_scaling is not None:
            multiplier = (self.lr_schedule(samples_seen) if self.lr_schedule is not None else 1.0) \
                * (self.lr_scaling(samples_seen) if self.lr_scaling is not None else 1.0)
            for group, base in zip(groups, self.base_learning_rates):
                group["lr"] = base * multiplier
        if self.momentum_time_constant_schedule is not None:
            momentum = momentum_from_time_constant(self.momentum_time_constant_schedule(samples_seen), minibatch_size)
            for group in groups:
                group["momentum"] = momentum
                if self.unit_gain_momentum:
                    group["dampening"] = momentum
        set_samples_seen = getattr(self.learner.optimizer, "set_samples_seen", None)
        if callable(set_samples_seen):  # an optimizer that changes with the samples seen (RMSpropWarmupSGD)
            set_samples_seen(samples_seen)

    @contextlib.contextmanager
    def _profiling(self):
        """``profile``: a profiler over the training loop's first minibatches (``None`` without one)."""
        self._profiler = StepProfiler(self.profile, self.run_dir / "profile", self.comm.rank, self.device) \
            if self.profile is not None else None
        try:
            yield self._profiler
        finally:
            if self._profiler is not None:
                self._profiler.close()


def _loss_or_objective(loss, objective, metric, inputs, sync_batchnorm: bool) -> tuple[ObjectiveCall | None, object]:
    """The one rule for ``loss`` and ``objective``: exactly one of them. Returns the checked objective (``None``
    with a loss) and the metric (with a loss: classification errors by default; with an objective: none).

    Raises:
        ValueError: both or neither given; an objective with a ``metric``, non-default ``inputs`` or
            ``sync_batchnorm``; an objective that cannot be called as ``objective(model, minibatch)``.
    """
    if loss is not None and objective is not None:
        raise ValueError("training_session got both loss and objective; give one: loss(output, target), or "
                         "objective(model, minibatch) computing the loss itself")
    if objective is None:
        if loss is None:
            raise ValueError("training_session needs a loss, loss(output, target), or an objective, "
                             "objective(model, minibatch)")
        return None, classification_errors if metric is None else metric
    call = ObjectiveCall(objective)
    if metric is not None:
        raise ValueError(f"metric {metric_name(metric)} with objective {call.name}: a metric measures the model's "
                         f"output, which an objective does not hand out; return the figure from the objective "
                         f"instead (loss, {{name: figure}})")
    if inputs not in (("features",), ["features"], "features"):
        raise ValueError(f"session.inputs={inputs!r} with objective {call.name}: an objective receives the whole "
                         f"minibatch and calls the model itself; leave session.inputs at its default and read the "
                         f"streams in the objective")
    if sync_batchnorm:
        raise ValueError(f"sync_batchnorm with objective {call.name}: a rank without samples cannot take part in "
                         f"the objective's BatchNorm reductions; train it with a loss, or without sync_batchnorm")
    return call, None


#: CNTK's name for building a session: ``training_session(model, loss, learner, source, size, ...).train()``
training_session = TrainingSession


__all__ = ["TrainingCollapsed", "TrainingDiverged", "TrainingResult", "TrainingSession", "training_session"]

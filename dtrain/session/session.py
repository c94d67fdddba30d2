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
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from dtrain import checks
from dtrain.comm.launcher import check_one_copy_wanted
from dtrain.data.errors import DataError
from dtrain.data.streams import WHOLE_MINIBATCH
from dtrain.data.user_source import as_source
from dtrain.learners.base import Learner, RunFacts
from dtrain.rules import check_settings
from dtrain.schedules import Schedule, size_sweeps
from dtrain.session import checkpoint_state
from dtrain.session.collapse import CollapseWatch, training_advice
from dtrain.session.configs import CheckpointConfig, CrossValidationConfig, TestConfig, action_frequency
from dtrain.session.batchnorm import DEFAULT_RECOMPUTE_SAMPLES, prepare_batchnorm
from dtrain.session.callbacks import CallbackList, RunView, StepEnd
from dtrain.session.binding import StreamBinding
from dtrain.session.objective_call import loss_or_objective
from dtrain.session.checkpointing import Checkpointing
from dtrain.session.device import resolve_device
from dtrain.session.evaluate import Evaluation
from dtrain.session.evaluations import BatchNormStatistics, EvaluationPasses
from dtrain.session.stream_checks import (bind_sources, check_evaluations_end, check_loss_takes_target,
                                          check_model_against_data, first_minibatch_check)
from dtrain.session.tensorboard_logger import TensorBoardLogger
from dtrain.session.metrics import CSV_COLUMNS, MetricsWriter, PhaseTimer, resolve_tensorboard
from dtrain.session.record_files import split_record_files
from dtrain.session.measures import Measures
from dtrain.session.minibatch_step import MinibatchStep, PeriodSums
from dtrain.session.precision import LossScaler
from dtrain.session.preemption import Preemption
from dtrain.session.periodic import Periodic
from dtrain.session.profiling import ProfileConfig, StepProfiler
from dtrain.session.progress_report import ProgressReports
from dtrain.session.progress import ProgressPrinter, Throughput
from dtrain.session.startup import StartupLines, StartupSettings
from dtrain.session.results import TrainingCollapsed, TrainingDiverged, TrainingResult
from dtrain.session.rundir import RunDirectoryLock
from dtrain.safe_files import Originals
from dtrain.session.settings import TRAINING_SESSION
from dtrain.session.summary import RunSummary
from dtrain.session.lr_scaling import LearningRateScaling
from dtrain.session.optimizer_schedules import OptimizerSchedules
from dtrain.session.elastic_records import ElasticRecords
from dtrain.session.weights import save_weights
from dtrain.session.sharded_weight_ema import ShardedWeightEMA
from dtrain.session.weight_ema import WeightEMA


#: the callback event each kind of metrics record is given to
_RECORD_EVENTS = {"train": "on_progress", "cv": "on_cross_validation", "test": "on_test", "test_ema": "on_test"}

class TrainingSession:
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
            ``True`` without it raises ValueError); a ``TensorBoardLogger`` among the callbacks asks for them
            and says where (``False`` beside it raises ValueError).
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
        callbacks: objects with any of ``dtrain.Callback``'s events (``dtrain.session.callbacks``), called in
            this order on rank 0 (every rank for one with ``all_ranks = True``); loggers are callbacks too (a
            ``CsvLogger`` or ``TensorBoardLogger`` replaces the run's own file of its kind).

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
        callbacks=(),
    ):
        if not isinstance(learner, Learner):
            raise TypeError(f"learner must be a dtrain Learner (wrap your optimizer), got {type(learner).__name__}")
        if minibatch_source is None or minibatch_size is None:
            raise TypeError("training_session needs a minibatch_source and a minibatch_size")
        source_name = type(minibatch_source).__name__
        # read only through the declared interface from here on (a source of one's own is wrapped once)
        minibatch_source = as_source(minibatch_source)
        objective_call, metric = loss_or_objective(loss, objective, metric, inputs, sync_batchnorm)
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
        check_one_copy_wanted(learner.comm, independent_processes)
        refused = learner.session_problems(precision=self.precision, compile=bool(compile), ema_decay=ema_decay,
                                           batchnorm_statistics=batchnorm_statistics)
        if refused:
            raise ValueError(refused[0])
        if learner.collective_forward and getattr(metric, "decoded_counts", None) is not None:
            raise ValueError(f"metric {getattr(metric, '__name__', type(metric).__name__)} decodes on each rank's "
                             f"share, which is not collective; with learner={learner.kind} use a metric without "
                             f"decoding (e.g. metric=sequence_error)")
        self.compile = bool(compile)
        compiled = model if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else None
        if compiled is not None:  # checkpoints and weights name the parameters without the wrapper's _orig_mod.
            model = compiled._orig_mod
        # before the compiled wrapper is made: it must trace the converted layers
        self.batchnorm_sync = prepare_batchnorm(model, learner, sync_batchnorm, batchnorm_statistics,
                                                batchnorm_recompute_samples)
        learner.shard(model, self.device)  # before anything reads the parameters (learner=fsdp shards them here)
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
        self.measures = Measures(metric, objective_call, learner.comm)
        if self.metric_name in set(CSV_COLUMNS) - {"error"}:
            raise ValueError(f"metric name {self.metric_name!r} is a metrics column of its own; give the metric "
                             f"another name")
        self.learner = learner
        self.comm = learner.comm
        self.source = minibatch_source
        self.binding = StreamBinding(inputs if objective_call is None else WHOLE_MINIBATCH, target)
        self.sources = {"the training data": minibatch_source,
                        "the cross-validation data": as_source(cv_config.minibatch_source) if cv_config else None,
                        "the test data": as_source(test_config.minibatch_source) if test_config else None}
        defining_stream_note = bind_sources(self.binding, self.sources)
        check_evaluations_end(cv_config=cv_config, test_config=test_config, sources=self.sources)
        check_model_against_data(model, self.binding, self.sources)
        if objective_call is None:
            check_loss_takes_target(loss, metric, self.binding, minibatch_source)
        size_sweeps((self.minibatch_size, lr_schedule, momentum_time_constant_schedule),
                    minibatch_source.samples_per_sweep, source_name)
        self.max_samples = max_samples
        self.checkpoint_config = checkpoint_config
        self.cv_config = cv_config
        self.test_config = test_config
        if lr_scaling is not None and not isinstance(lr_scaling, LearningRateScaling):
            raise TypeError(f"lr_scaling must be a dtrain LearningRateScaling or None, got {type(lr_scaling).__name__}")
        self.lr_scaling = lr_scaling if lr_scaling is not None and lr_scaling.rule != "none" else None
        # kept in shards as the model is where the learner shards it (dtrain.session.sharded_weight_ema)
        self.ema = None if ema_decay is None else \
            (ShardedWeightEMA if learner.shards_model else WeightEMA)(model, ema_decay)
        self.run_dir = Path(run_dir)
        # logger=csv and logger=tensorboard are written with metrics.jsonl, in place of the run's own of their kind
        self.record_files, callbacks = split_record_files(callbacks)
        self.tensorboard = resolve_tensorboard(  # None: when the package is installed
            tensorboard, logger=any(isinstance(file, TensorBoardLogger) for file in self.record_files))
        self.config_fingerprint = config_fingerprint
        # what a checkpoint must match (model, learner, data, and the caller's own) and what may change
        self.checkpoint_identity = checkpoint_state.identity(model, learner, minibatch_source, checkpoint_identity)
        self.settings = {"session": checkpoint_state.session_settings(
            minibatch_size=minibatch_size, max_samples=max_samples, progress_frequency=progress_frequency,
            checkpoint_config=checkpoint_config, cv_config=cv_config, lr_schedule=lr_schedule,
            momentum_time_constant_schedule=momentum_time_constant_schedule, optimizer=learner.optimizer,
            micro_batch_size=self.micro_batch_size, clip_grad_norm=self.clip_grad_norm, precision=self.precision,
            compile=self.compile, sync_batchnorm=sync_batchnorm, batchnorm_statistics=batchnorm_statistics,
            batchnorm_recompute_samples=batchnorm_recompute_samples, lr_scaling=self.lr_scaling, ema_decay=ema_decay)}
        if self.objective is not None:  # named only when there is one: a checkpoint from before it has no such key
            self.settings["session"]["objective"] = self.objective.name
        if run_config is not None:
            self.settings["config"] = run_config
        # a launcher (mpiexec) gives ranks a pseudo-terminal even when its own output goes to a file,
        # so the live bar is only automatic in a single process
        self.progress_bar = progress_bar if progress_bar is not None else (None if self.comm.size == 1 else False)
        self.stream = stream
        if profile is not None and not isinstance(profile, ProfileConfig):
            raise TypeError(f"profile must be a dtrain ProfileConfig or None, got {type(profile).__name__}")
        self.profile = profile
        self.schedules = OptimizerSchedules(learner.optimizer, lr_schedule, self.lr_scaling,
                                            momentum_time_constant_schedule, unit_gain_momentum)
        self.progress_period = Periodic(action_frequency("progress_frequency", progress_frequency))
        self.checkpoint_period = Periodic(action_frequency("CheckpointConfig.frequency", checkpoint_config.frequency)
                                          if checkpoint_config else 0)
        self.cv_period = Periodic(cv_config.frequency if cv_config else 0)
        self.minibatches = 0
        self.start_samples = 0  # samples trained when train() started (a resumed run: its checkpoint's)
        self._restore_attempted = False
        self._restored_from: Path | None = None
        self._run_dir_lock: RunDirectoryLock | None = None
        self._on_checks_passed: list[Callable[[], None]] = []
        self._outputs_started = False
        self._metrics: MetricsWriter | None = None
        self._originals = Originals()  # what save_weights replaced, put back with the metrics (_abandon_run_dir)
        self._profiler: StepProfiler | None = None
        self._collapse = CollapseWatch(self.device)
        self._step = MinibatchStep(model=self.model, forward_model=self.forward_model, loss=loss, metric=metric,
                                   learner=learner, device=self.device, micro_batch_size=self.micro_batch_size,
                                   precision=self.precision, loss_scaler=self.loss_scaler, collapse=self._collapse,
                                   check_compile=self.forward_model is not self.model,
                                   binding=self.binding, check_first=first_minibatch_check(minibatch_source),
                                   batchnorm_sync=self.batchnorm_sync,
                                   count_padding=bool(minibatch_source.has_sequences),
                                   objective=objective_call)
        self.progress = ProgressReports(learner, self.measures, self._collapse, self._advice)
        self.evaluations = EvaluationPasses(
            model=model, loss=loss, measures=self.measures, learner=learner, device=self.device, binding=self.binding,
            cv_config=cv_config, test_config=test_config, ema=self.ema, collapse=self._collapse,
            batchnorm=BatchNormStatistics(batchnorm_statistics, batchnorm_recompute_samples, self.batchnorm_sync,
                                          self.precision),
            source=minibatch_source, minibatch_size=self.minibatch_size, advice=self._advice,
            start_outputs=self._start_outputs)
        self.summary = RunSummary(run_dir=self.run_dir, model=model, ema=self.ema, learner=learner,
                                  measures=self.measures, loss_scaler=self.loss_scaler,
                                  tensorboard_hint=tensorboard is None and not self.tensorboard)  # said once
        self.preemption = Preemption(checkpoint_config.preemption_signal if checkpoint_config else None, self.comm)
        self.callbacks = CallbackList(callbacks, self.comm.is_main)
        self.run_view = RunView(self)  # what callbacks see of this run
        self.callbacks.check(self.run_view)
        self.checkpointing = Checkpointing(
            checkpoint_config, self.run_dir, model=model, learner=learner, source=minibatch_source, comm=self.comm,
            identity=self.checkpoint_identity, settings=self.settings, fingerprint=config_fingerprint,
            parts={"loss_scaler": self.loss_scaler, "weight_ema": self.ema,
                   "callbacks": self.callbacks if self.callbacks.here else None},
            advice=self._advice, stream=stream)
        self.startup = StartupLines(
            StartupSettings(max_samples=max_samples, precision=self.precision, compile=self.compile,
                            micro_batch_size=self.micro_batch_size, clip_grad_norm=self.clip_grad_norm,
                            sync_batchnorm=sync_batchnorm, batchnorm_statistics=batchnorm_statistics,
                            batchnorm_recompute_samples=batchnorm_recompute_samples, lr_schedule=lr_schedule,
                            lr_scaling=self.lr_scaling, defining_stream_note=defining_stream_note),
            model=model, learner=learner, source=minibatch_source, device=self.device,
            minibatch_size=self.minibatch_size, binding=self.binding, objective=objective_call, ema=self.ema,
            base_learning_rates=self.schedules.base_learning_rates, checkpointing=self.checkpointing)

    @classmethod
    def from_settings(cls, model: torch.nn.Module, loss, learner: Learner, minibatch_source, settings, *,
                      cv_source=None, test_source=None, **arguments) -> TrainingSession:
        """A session from typed settings: ``settings`` is a ``SessionConfig`` (``dtrain.session.settings``), the
        ``session`` section the command line composes, so a run means the same from Python as from a config::

            TrainingSession.from_settings(model, loss, learner, source, SessionConfig(
                minibatch_size=64, max_samples=60_000, progress_frequency=6_000, precision="bf16",
                checkpoint=CheckpointConfig("checkpoint.pt", frequency=20_000)), cv_source=held_out)

        ``cv_source`` and ``test_source`` are what ``settings.cv`` and ``settings.test`` apply to (``None``: none);
        ``arguments`` are the constructor's arguments that are not settings (``metric``, ``run_dir``,
        ``callbacks``, ``stream``, ...). A setting given both ways is refused; the process settings
        (``num_threads``, ``keep_host_memory``, ``epoch_size``) are the command line's and are not applied here.

        Raises:
            TypeError: ``settings`` is not a SessionConfig, or an argument repeats a setting.
            ValueError: settings that break the ``session`` section's rules (all of them, in one message).
        """
        from dtrain.session.from_settings import session_arguments

        from_settings = session_arguments(settings, cv_source, test_source)
        repeated = sorted(set(arguments) & set(from_settings))
        if repeated:
            raise TypeError(f"{', '.join(repeated)}: given both in settings and as an argument; set "
                            f"{'it' if len(repeated) == 1 else 'them'} in the SessionConfig only")
        return cls(model, loss, learner, minibatch_source, **from_settings, **arguments)

    @property
    def metric_name(self) -> str | None:
        """The metric's key in progress lines, metrics files and the summary (``None``: an objective's run)."""
        return self.measures.metric_name

    @property
    def metric_percent(self) -> bool:
        """Whether the metric reads in percent."""
        return self.measures.percent

    @property
    def cv_index(self) -> int:
        """The next cross-validation's number (kept in checkpoints)."""
        return self.evaluations.cv_index

    @cv_index.setter
    def cv_index(self, index: int) -> None:
        self.evaluations.cv_index = index

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
            self._tell_callbacks_of(error)
            self._abandon_run_dir(error)
            raise
        finally:
            self._originals.release()
            self.release_run_dir()

    def _tell_callbacks_of(self, error: BaseException) -> None:
        """``on_exception``: a callback failing there is reported as a warning; the training error is raised."""
        for handler in self.callbacks.handlers("on_exception"):
            try:
                handler(self.run_view, error)
            except Exception as failure:  # noqa: BLE001 - the training error is the one to raise
                warnings.warn(f"a callback's on_exception failed ({failure!r}) while training failed with {error!r}",
                              RuntimeWarning, stacklevel=2)

    def _abandon_run_dir(self, error: BaseException) -> None:
        """Rank 0, on a failure: takes back what this run wrote into its run directory (the directory too,
        when this run created it) if it wrote nothing yet, or if the data failed before any checkpoint of this
        run; what the directory held before is kept, and so is a run that has checkpoints to resume from."""
        if self._run_dir_lock is None or self.checkpointing.saved:
            return
        if not self._outputs_started or isinstance(error, DataError):
            if self._metrics is not None:
                self._metrics.take_back()  # a resumed run's metrics.jsonl and metrics.csv as they were
            self._originals.put_back()  # and the files callbacks replaced through save_weights (best.safetensors)
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
        self.learner.plan(RunFacts(samples_per_sweep=self.source.samples_per_sweep,
                                   max_samples=self.max_samples, minibatch_size=int(self.minibatch_size(0)),
                                   warmup_samples=self.schedules.warmup_samples()))
        self.learner.attach_source(self.source)
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
                                metric_name=self.metric_name, files=self.record_files,
                                listener=self._record_to_callbacks if self.callbacks.here else None)
        self._metrics = metrics  # taken back if the data fails (_abandon_run_dir)
        elastic = getattr(self.learner, "elastic", None)
        recorder = ElasticRecords(elastic, metrics, self.learner) if elastic is not None else None
        try:
            return self._train_with(restored_from, metrics)
        finally:
            if recorder is not None:
                recorder.detach()
            metrics.close()  # also when training fails

    def _train_with(self, restored_from: Path | None, metrics: MetricsWriter) -> TrainingResult:
        is_main = self.comm.is_main
        self.start_samples = self.learner.samples_seen
        self._outputs_started = False
        throughput = Throughput()
        timer = PhaseTimer(torch.cuda.synchronize if self.device.type == "cuda" else None)  # time split per period
        sums = PeriodSums(self.device, self.metric)  # loss and metric sums over this rank's samples of the period
        last_cv: Evaluation | None = None
        last_checkpoint: Path | None = None
        stopped_early = preempted = False
        alone = self.comm.size == 1  # a single process checks for preemption after every minibatch
        step_callbacks = self.callbacks.wants("on_step_end")
        stop_reason: str | None = None  # a callback's agreed stop
        trained = False  # whether this run trained a minibatch (a resumed run may have none left)
        with ProgressPrinter(self.max_samples, enabled=is_main, stream=self.stream, live_bar=self.progress_bar) as printer, \
                self.preemption.handling(), self._profiling() as profiler:
            self.startup.print_lines(printer, restored_from, profiler)
            next_period_end = self._next_period_end()
            fixed_size = self.minibatch_size.constant()  # None: the minibatch size follows its schedule
            fixed_size = None if fixed_size is None else int(fixed_size)
            schedules = self.schedules.in_use
            live_bar, has_callbacks = printer.interactive, bool(self.callbacks)
            while self.max_samples is None or self.learner.samples_seen < self.max_samples:
                seen = self.learner.samples_seen
                size = fixed_size if fixed_size is not None else int(self.minibatch_size(seen))
                if self.max_samples is not None:
                    size = min(size, self.max_samples - seen)
                batch = self._step.read(self.source, size, timer)
                if batch is None:
                    break
                if schedules:
                    self.schedules.apply(seen, size)
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
                if step_callbacks:
                    self.callbacks.fire("on_step_end", self.run_view, StepEnd(
                        samples_seen=seen, minibatches=self.minibatches, num_samples=batch.global_num_samples,
                        learning_rate=self.learner.optimizer.param_groups[0]["lr"], loss=self._step.last_loss))
                throughput.add(batch.global_num_samples)
                if live_bar:
                    printer.advance(seen, throughput)

                # preemption is agreed only where the ranks meet anyway (block momentum: once a block)
                ranks_meet = self.learner.is_sync_point()
                one_model = ranks_meet  # synchronize() adds no outer step here (see the module docstring)
                acted = False  # a progress, cross-validation or checkpoint point: callbacks' stops are agreed here
                if seen >= next_period_end:  # a progress, cross-validation or checkpoint period may have ended
                    self.source.check_pending_values()  # a sample's NaN named before any figure or checkpoint
                    if self.progress_period.due(seen):
                        ranks_meet = acted = True
                        self.progress.report(printer, metrics, sums, throughput, timer)
                    if self.cv_period.due(seen, ready=one_model):
                        ranks_meet = acted = True
                        last_cv, keep_going = self.evaluations.cross_validate(printer, metrics)
                        if not keep_going:
                            stopped_early = True
                            break
                    if self.checkpoint_period.due(seen, ready=one_model):
                        ranks_meet = acted = True
                        last_checkpoint = self.checkpointing.save(self.minibatches, self.cv_index, printer)
                        self.callbacks.fire("on_checkpoint_save", self.run_view, last_checkpoint)
                    next_period_end = self._next_period_end()
                if (ranks_meet or alone) and self.preemption.requested():
                    preempted = stopped_early = True
                    break
                if has_callbacks and (acted or alone):
                    stop_reason = self._agreed_stop()
                    if stop_reason is not None:
                        stopped_early = True
                        printer.line(f"stopped early at {seen} samples: {stop_reason}")
                        break

            # the end: one last synchronisation, then each action once more for a partial period
            self.source.check_pending_values()
            self.learner.synchronize()
            if self.ema is not None and not preempted:  # a block learner's last, partial block
                self.ema.after_last_sync(self.model)
            seen = self.learner.samples_seen
            if self.progress_period.frequency and throughput.period_samples > 0:
                self.progress.report(printer, metrics, sums, throughput, timer)
            if self.cv_period.pending(seen) and not stopped_early:
                last_cv, _ = self.evaluations.cross_validate(printer, metrics)
            if not trained and restored_from is not None:
                last_checkpoint = restored_from  # nothing left to train: the restored checkpoint is this run's last
            if self.checkpointing.files is not None and (
                    preempted or self.checkpoint_period.pending(seen)
                    or (last_checkpoint is None and self.checkpoint_period.frequency)):
                self._start_outputs(metrics)
                last_checkpoint = self.checkpointing.save(self.minibatches, self.cv_index, printer)
                self.callbacks.fire("on_checkpoint_save", self.run_view, last_checkpoint)
            if preempted:
                printer.line(f"preempted by {self.checkpoint_config.preemption_signal} at {seen} samples: checkpoint "
                             f"{last_checkpoint} saved; run the same command again to continue")
                self.callbacks.fire("on_preemption", self.run_view, last_checkpoint)

        test = test_ema = None  # the model was synchronised above
        if not preempted:
            self.evaluations.judge_the_training_loss(tested=self.test_config is not None)  # after the checkpoint: kept
            self.evaluations.note_a_rise_at_the_end()
            if self.batchnorm_statistics == "recomputed":
                self.evaluations.recompute_batchnorm(printer, seen)
            if self.test_config is not None:
                test, test_ema = self.evaluations.test(printer, metrics, seen)
            self._start_outputs(metrics)  # every check has passed, even with nothing left to train
        self.learner.finalize()
        seconds = throughput.elapsed()  # training and evaluation; the one-off outputs below are not training
        metrics.close()
        # a preempted job has seconds before the scheduler kills it: no weights, no drawing (the
        # resumed run writes both at its end, from every record)
        if not preempted and self.learner.shards_model:
            self.summary.export_sharded_weights(seen)  # every rank: the shards are gathered one tensor at a time
        if is_main and not preempted:
            self.summary.export_weights(seen)
            self.summary.write_report(printer, metrics)
        result = TrainingResult(
            samples_seen=seen, minibatches=self.minibatches, seconds=seconds, stopped_early=stopped_early,
            test=test, last_cross_validation=last_cv, last_checkpoint=last_checkpoint,
            metrics_path=metrics.jsonl_path if is_main else None, restored_from=restored_from, preempted=preempted,
            last_training_error=self.progress.last_training_error, test_ema=test_ema, stop_reason=stop_reason,
            by_loss=self.objective is not None,
        )
        self.summary.print_lines(printer, result, metrics, warnings=self.evaluations.warnings,
                                 skipped_steps=self.skipped_steps, profiler=self._profiler)
        self.callbacks.fire("on_run_end", self.run_view, result)
        return result

    # -- checkpoints ----------------------------------------------------------------------------
    def restore(self) -> Path | None:
        """Locks the run directory (rank 0), then loads the newest good checkpoint when restore is on,
        or refuses to overwrite one when it is off.

        Called by ``train()``; call it earlier to find a bad checkpoint or a busy run directory before
        anything is written. Settings that may change (optimizer hyper-parameters, sizes, frequencies,
        schedules) keep their configured values; ``changed_settings`` lists them against the checkpoint.
        Returns the file restored from (``None``: starting fresh). Idempotent.

        Raises:
            CheckpointError: another job holds the run directory, no checkpoint is readable, or the newest
                belongs to another model or configuration.
        """
        if self._restore_attempted:
            return self._restored_from
        self._restore_attempted = True

        def lock_run_dir() -> None:  # rank 0, before any checkpoint is read
            self._run_dir_lock = RunDirectoryLock.acquire(self.run_dir)

        try:
            restored = self.checkpointing.restore(self.max_samples, lock_run_dir)
        except BaseException as error:
            self._abandon_run_dir(error)  # a directory the lock created goes again
            self.release_run_dir()
            raise
        if restored is not None:
            self.minibatches, self.cv_index = restored.minibatches, restored.cv_index
            for period in (self.progress_period, self.checkpoint_period, self.cv_period):
                period.reset(restored.samples_seen)
            self._restored_from = restored.path
        return self._restored_from

    @property
    def changed_settings(self) -> list[str]:
        """The settings that changed since the restored checkpoint (``key: old -> new``), now in effect."""
        return self.checkpointing.changed_settings

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
        """Once: the callbacks' ``on_run_start``, then the run's first writes (rank 0: the ``when_checks_pass``
        callbacks', then the metrics files'), then ``on_checkpoint_restore`` for a resumed run. A tracker that
        cannot start its run fails it before those writes, and what it wrote is taken back (``_abandon_run_dir``)."""
        if self._outputs_started:
            return
        self.callbacks.fire("on_run_start", self.run_view)
        self._outputs_started = True
        if self.comm.is_main:
            for callback in self._on_checks_passed:
                callback()
            metrics.open()
        if self._restored_from is not None:
            self.callbacks.fire("on_checkpoint_restore", self.run_view, self._restored_from)

    # -- what callbacks see ---------------------------------------------------------------------
    @property
    def metrics_writer(self) -> MetricsWriter | None:
        """This run's metrics writer (``None`` before training starts)."""
        return self._metrics

    def produced_metrics(self) -> dict[str, list[str]]:
        """The keys of the records this run writes to ``metrics.jsonl``, by kind (a kind it never writes is absent)."""
        measured = ["loss", self.metric_name] if self.metric is not None else ["loss"]  # an objective: + its figures
        produced: dict[str, list[str]] = {}
        if self.progress_period.frequency != 0:
            produced["train"] = [*measured, "samples_per_second", "lr"]
        if self.cv_config is not None and self.cv_config.minibatch_source is not None and self.cv_period.frequency != 0:
            produced["cv"] = list(measured)  # a cross-validation of a callback alone (no source) writes no record
        if self.test_config is not None:
            produced["test"] = list(measured)
            if self.ema is not None:
                produced["test_ema"] = list(measured)
        return produced

    def save_weights(self, path: Path, metadata: dict[str, str] | None = None) -> Path:
        """Writes the model's weights to ``path`` as ``model.safetensors`` is written (rank 0 calls it); the file it
        replaces is put back if this run's writes are taken back."""
        self._originals.keep(path)
        return save_weights(self.model, path, metadata={"samples_seen": str(self.learner.samples_seen),
                                                        **(metadata or {})})

    def _record_to_callbacks(self, record: dict) -> None:
        """The metrics writer's listener: each record to its event (train: progress, cv, test and test_ema: test)."""
        event = _RECORD_EVENTS.get(record["kind"])
        if event is not None:
            self.callbacks.fire(event, self.run_view, record)

    def _agreed_stop(self) -> str | None:
        """Rank 0's callbacks' stop reason, given to every rank (``None``: go on)."""
        reason = self.run_view.stop_reason
        if self.comm.size > 1:
            reason = self.comm.broadcast_object(reason if self.comm.is_main else None, root=0)
        return reason

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

    def _next_period_end(self) -> int | float:
        """The samples seen at which the first of the progress, cross-validation and checkpoint periods ends (or
        has ended, waiting for the ranks to hold one model): the loop asks the periods nothing before it."""
        return min(period.next_end() for period in (self.progress_period, self.cv_period, self.checkpoint_period))

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


#: CNTK's name for building a session: ``training_session(model, loss, learner, source, size, ...).train()``
training_session = TrainingSession


__all__ = ["TrainingCollapsed", "TrainingDiverged", "TrainingResult", "TrainingSession", "training_session"]


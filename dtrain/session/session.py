"""The training loop: read, forward, backward, learner step, then progress, cross-validation, checkpoints.

``training_session(...)`` has CNTK's meanings: every frequency and ``max_samples`` counts global
samples; an action fires whenever ``samples_seen // frequency`` changes, and once more at the end
for a partial period. The loop only talks to the learner interface, so the same loop runs a
single process or any distributed learner.
"""
from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtrain.comm.failfast import add_signal_callback, install_signal_handlers, remove_signal_callback
from dtrain.learners.base import Learner, RunFacts
from dtrain.schedules import Schedule, momentum_from_time_constant
from dtrain.session import checkpoint
from dtrain.session.collapse import COLLAPSE_ADVICE, CollapseWatch
from dtrain.session.configs import CheckpointConfig, CrossValidationConfig, TestConfig, signal_from_name
from dtrain.session.evaluate import Evaluation, classification_errors, evaluate
from dtrain.session.metrics import MetricsWriter
from dtrain.session.progress import ProgressPrinter, Throughput, format_duration


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite (raised on every rank at a progress point)."""


class TrainingCollapsed(TrainingDiverged):
    """A classifier's training loss (or test accuracy) returned to chance after it had learned
    (``docs/semantics.md#collapse``); raised on every rank."""


_DIVERGED_ADVICE = "lower optimizer.lr, or with 1-bit gradients start distributed training later (learner.distributed_after)"


@dataclass
class TrainingResult:
    """What a finished ``train()`` reports."""

    samples_seen: int
    minibatches: int
    seconds: float
    stopped_early: bool
    test: Evaluation | None
    last_cross_validation: Evaluation | None
    last_checkpoint: Path | None
    metrics_path: Path | None
    restored_from: Path | None
    preempted: bool = False   # stopped by the preemption signal after saving a checkpoint


class _PeriodSums:
    """Loss and metric sums of one progress period, kept on the device (no sync per step)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.metric = torch.zeros((), dtype=torch.float64, device=self.device)
        self.samples = 0

    def add(self, loss_sum: torch.Tensor, metric_sum: torch.Tensor, samples: int) -> None:
        self.loss += loss_sum
        self.metric += metric_sum
        self.samples += samples

    def as_tensor(self) -> torch.Tensor:
        """``[loss sum, metric sum, samples]`` in float64, ready to all-reduce."""
        return torch.stack([self.loss, self.metric, torch.tensor(float(self.samples), dtype=torch.float64,
                                                                  device=self.device)])


class _Periodic:
    """Fires when ``samples_seen // frequency`` changes (frequency 0: never; ``sys.maxsize``: at the end)."""

    def __init__(self, frequency: int):
        self.frequency = frequency
        self.last_index = 0
        self.fired_at = 0  # samples seen when it last fired (or was restored)

    def reset(self, samples_seen: int) -> None:
        if self.frequency:
            self.last_index = samples_seen // self.frequency
        self.fired_at = samples_seen

    def pending(self, samples_seen: int) -> bool:
        """Whether samples were seen since it last fired (the end-of-training partial period)."""
        return bool(self.frequency) and samples_seen != self.fired_at

    def due(self, samples_seen: int) -> bool:
        if not self.frequency:
            return False
        index = samples_seen // self.frequency
        if index != self.last_index:
            self.last_index = index
            self.fired_at = samples_seen
            return True
        return False


class TrainingSession:
    """Trains ``model`` with ``learner`` on ``mb_source``; see ``training_session`` for the arguments."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        learner: Learner,
        mb_source,
        mb_size: int | Schedule,
        max_samples: int | None = None,
        progress_frequency: int | None = None,
        checkpoint_config: CheckpointConfig | None = None,
        cv_config: CrossValidationConfig | None = None,
        test_config: TestConfig | None = None,
        metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = classification_errors,
        lr_schedule: Schedule | None = None,
        momentum_schedule: Schedule | None = None,
        unit_gain_momentum: bool = False,
        run_dir: str | Path = ".",
        tensorboard: bool = True,
        config_fingerprint: str = "",
        checkpoint_identity: dict | None = None,
        progress_bar: bool | None = None,
        stream=None,
    ):
        if not isinstance(learner, Learner):
            raise TypeError(f"learner must be a dtrain Learner (wrap your optimizer), got {type(learner).__name__}")
        if max_samples is not None and (not isinstance(max_samples, int) or max_samples <= 0):
            raise ValueError(f"max_samples must be a positive number of samples or None, got {max_samples!r}")
        self.mb_size = mb_size if isinstance(mb_size, Schedule) else Schedule(_positive("mb_size", mb_size))
        if momentum_schedule is not None and any("momentum" not in g for g in learner.optimizer.param_groups):
            raise ValueError(
                f"momentum_schedule needs an optimizer with a 'momentum' setting, "
                f"{type(learner.optimizer).__name__} has none; drop the schedule or use SGD"
            )
        self.model = model
        self.loss = loss
        self.metric = metric
        self.learner = learner
        self.comm = learner.comm
        self.source = mb_source
        self.max_samples = max_samples
        self.checkpoint_config = checkpoint_config
        self.cv_config = cv_config
        self.test_config = test_config
        self.lr_schedule = lr_schedule
        self.momentum_schedule = momentum_schedule
        self.unit_gain_momentum = unit_gain_momentum
        self.run_dir = Path(run_dir)
        self.tensorboard = tensorboard
        self.config_fingerprint = config_fingerprint
        self.checkpoint_identity = checkpoint_identity or {}
        # a launcher (mpiexec) gives ranks a pseudo-terminal even when its own output goes to a file,
        # so the live bar is only automatic in a single process
        self.progress_bar = progress_bar if progress_bar is not None else (None if self.comm.size == 1 else False)
        self.stream = stream
        self.device = self.comm.device
        # the configured learning rates; an lr schedule multiplies them
        self.base_learning_rates = [group["lr"] for group in learner.optimizer.param_groups]
        self.progress_period = _Periodic(_frequency(progress_frequency))
        self.checkpoint_period = _Periodic(checkpoint_config.frequency if checkpoint_config else 0)
        self.cv_period = _Periodic(cv_config.frequency if cv_config else 0)
        self.minibatches = 0
        self.cv_index = 0
        self.checkpoint_files: checkpoint.CheckpointFiles | None = None
        self._restore_attempted = False
        self._restored_from: Path | None = None
        self._preemption = threading.Event()
        self._collapse = CollapseWatch(self.device)
        if checkpoint_config is not None:
            filename = Path(checkpoint_config.filename)
            self.checkpoint_files = checkpoint.CheckpointFiles(filename if filename.is_absolute() else self.run_dir / filename)

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> TrainingResult:
        """Runs training to ``max_samples`` (or the end of the data, or a CV callback's stop)."""
        restored_from = self.restore()
        self.model.to(self.device)
        self.learner.plan(RunFacts(samples_per_sweep=getattr(self.source, "samples_per_sweep", None),
                                   max_samples=self.max_samples, minibatch_size=int(self.mb_size(0))))
        self.learner.prepare(self.model)
        self.model.train()
        is_main = self.comm.is_main
        metrics = MetricsWriter(self.run_dir, tensorboard=self.tensorboard, enabled=is_main)
        throughput = Throughput()
        sums = _PeriodSums(self.device)  # loss and metric sums over this rank's samples of the period
        last_cv: Evaluation | None = None
        last_checkpoint: Path | None = None
        stopped_early = preempted = False
        with ProgressPrinter(self.max_samples, enabled=is_main, stream=self.stream, live_bar=self.progress_bar) as printer, \
                self._preemption_handler():
            self._print_start(printer, restored_from)
            while self.max_samples is None or self.learner.samples_seen < self.max_samples:
                seen = self.learner.samples_seen
                size = int(self.mb_size(seen))
                if self.max_samples is not None:
                    size = min(size, self.max_samples - seen)
                batch = self.source.next_minibatch(size, *self.learner.data_partition())
                if batch is None:
                    break
                self._apply_schedules(seen, size)
                self._train_minibatch(batch, sums)
                self.minibatches += 1
                seen = self.learner.samples_seen
                throughput.add(batch.global_num_samples)
                printer.advance(seen, throughput.rate())

                # preemption is agreed only where the ranks meet anyway (block momentum: once a block)
                ranks_meet = self.learner.is_sync_point()
                if self.progress_period.due(seen):
                    ranks_meet = True
                    self._report_progress(printer, metrics, sums, throughput)
                if self.cv_period.due(seen):
                    ranks_meet = True
                    last_cv, keep_going = self._cross_validate(printer, metrics)
                    if not keep_going:
                        stopped_early = True
                        break
                if self.checkpoint_period.due(seen):
                    ranks_meet = True
                    last_checkpoint = self._save_checkpoint(printer)
                if (ranks_meet or self.comm.size == 1) and self._preemption_requested():
                    preempted = stopped_early = True
                    break

            # the end: one last synchronisation, then each action once more for a partial period
            self.learner.synchronize()
            seen = self.learner.samples_seen
            if self.progress_period.frequency and throughput.period_samples > 0:
                self._report_progress(printer, metrics, sums, throughput)
            if self.cv_period.pending(seen) and not stopped_early:
                last_cv, _ = self._cross_validate(printer, metrics)
            if self.checkpoint_files is not None and (
                    preempted or self.checkpoint_period.pending(seen)
                    or (last_checkpoint is None and self.checkpoint_period.frequency)):
                last_checkpoint = self._save_checkpoint(printer)
            if preempted:
                printer.line(f"preempted by {self.checkpoint_config.preemption_signal} at {seen} samples: checkpoint "
                             f"{last_checkpoint} saved; run the same command again to continue")

        test = None  # the model was synchronised above
        if self.test_config is not None and not preempted:
            test = evaluate(self.model, self.test_config.minibatch_source, self.test_config.minibatch_size,
                            self.loss, self.metric, self.comm, self.device)
            metrics.write("test", seen, loss=test.loss, error=test.error, accuracy=test.accuracy, num_samples=test.num_samples)
            if self._collapse.evaluation_collapsed(test.loss, test.accuracy, self.comm):
                raise TrainingCollapsed(
                    f"training collapsed: test accuracy {100 * test.accuracy:.2f}% is chance for "
                    f"{self._collapse.num_classes} classes after the training loss had fallen; {COLLAPSE_ADVICE}")
        self.learner.finalize()
        metrics.close()
        result = TrainingResult(
            samples_seen=seen, minibatches=self.minibatches, seconds=throughput.elapsed(), stopped_early=stopped_early,
            test=test, last_cross_validation=last_cv, last_checkpoint=last_checkpoint,
            metrics_path=metrics.jsonl_path if is_main else None, restored_from=restored_from, preempted=preempted,
        )
        self._print_summary(printer, result, metrics)
        return result

    # -- one minibatch --------------------------------------------------------------------------
    def _train_minibatch(self, batch, sums: _PeriodSums) -> None:
        """Forward, backward on the local mean loss, learner step; adds the loss and metric to ``sums``."""
        self.learner.begin_minibatch(batch.num_samples, batch.global_num_samples)
        if batch.num_samples > 0:
            features, labels = batch.features.to(self.device), batch.labels.to(self.device)
            output = self.model(features)
            loss = self.loss(output, labels)
            loss.backward()
            with torch.no_grad():
                self._collapse.observe(output, labels, loss, self.loss)
                sums.add(loss.detach() * batch.num_samples, self.metric(output.detach(), labels), batch.num_samples)
        self.learner.step()

    def _apply_schedules(self, samples_seen: int, minibatch_size: int) -> None:
        """Sets each parameter group's lr (and momentum) for the next minibatch."""
        groups = self.learner.optimizer.param_groups
        if self.lr_schedule is not None:
            multiplier = self.lr_schedule(samples_seen)
            for group, base in zip(groups, self.base_learning_rates):
                group["lr"] = base * multiplier
        if self.momentum_schedule is not None:
            momentum = momentum_from_time_constant(self.momentum_schedule(samples_seen), minibatch_size)
            for group in groups:
                group["momentum"] = momentum
                if self.unit_gain_momentum:
                    group["dampening"] = momentum

    # -- actions --------------------------------------------------------------------------------
    def _report_progress(self, printer, metrics, sums: _PeriodSums, throughput: Throughput) -> None:
        totals = self.comm.allreduce(sums.as_tensor().to(self.comm.device), op="sum").cpu()
        samples = float(totals[2])
        loss = float(totals[0]) / samples if samples else float("nan")
        error = float(totals[1]) / samples if samples else float("nan")
        if samples and not math.isfinite(loss):
            # the same on every rank (the sums were all-reduced); no checkpoint of this state is written
            raise TrainingDiverged(
                f"training diverged: the mean loss is {loss} over the last {int(samples)} samples (at "
                f"{self.learner.samples_seen} samples); {_DIVERGED_ADVICE}")
        if samples and self._collapse.loss_collapsed(loss, self.comm):
            raise TrainingCollapsed(
                f"training collapsed: the mean loss {loss:.4f} over the last {int(samples)} samples is back at chance "
                f"(ln {self._collapse.num_classes} = {self._collapse.chance_loss:.4f}) at {self.learner.samples_seen} "
                f"samples after having fallen; {COLLAPSE_ADVICE}")
        rate = throughput.rate()
        learning_rate = self.learner.optimizer.param_groups[0]["lr"]
        printer.progress(self.learner.samples_seen, loss, error, rate, learning_rate, throughput.elapsed(),
                         note=self.learner.progress_note())
        metrics.write("train", self.learner.samples_seen, loss=loss, error=error, samples_per_second=rate, lr=learning_rate)
        sums.reset()
        throughput.new_period()

    def _cross_validate(self, printer, metrics) -> tuple[Evaluation | None, bool]:
        config = self.cv_config
        result = None
        if config.minibatch_source is not None:
            self.learner.synchronize()  # evaluate the one model every worker agrees on
            result = evaluate(self.model, config.minibatch_source, config.minibatch_size, self.loss, self.metric,
                              self.comm, self.device, max_samples=config.max_samples)
            printer.line(f"cross-validation {self.cv_index} at {self.learner.samples_seen} samples: "
                         f"loss {result.loss:.4f} | error {100 * result.error:.2f}% over {result.num_samples} samples")
            metrics.write("cv", self.learner.samples_seen, loss=result.loss, error=result.error, num_samples=result.num_samples)
        keep_going = True
        if config.callback is not None:
            answer = config.callback(self.cv_index, result.error if result else float("nan"),
                                     result.num_samples if result else 0, result.num_minibatches if result else 0)
            keep_going = answer is not False
            if not keep_going:
                printer.line(f"cross-validation callback stopped training at {self.learner.samples_seen} samples")
        self.cv_index += 1
        return result, keep_going

    # -- preemption ---------------------------------------------------------------------------
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

        install_signal_handlers([wanted])
        add_signal_callback(claim)
        try:
            yield
        finally:
            remove_signal_callback(claim)

    def _preemption_requested(self) -> bool:
        """Whether any rank got the preemption signal (a collective when several ranks run)."""
        if self.checkpoint_files is None or self.checkpoint_config.preemption_signal is None:
            return False
        if self.comm.size == 1:
            return self._preemption.is_set()
        flag = torch.tensor([1.0 if self._preemption.is_set() else 0.0], device=self.comm.device)
        return bool(self.comm.allreduce(flag, op="max").item())

    # -- checkpoints ----------------------------------------------------------------------------
    def _checkpoint_state(self) -> dict[str, Any]:
        """Everything a bit-exact resume needs; per-rank parts are gathered (a collective)."""
        per_rank = self.comm.gather_object({"rng": torch.get_rng_state(), "learner": self.learner.local_state_dict()})
        return {
            "samples_seen": self.learner.samples_seen,
            "minibatches": self.minibatches,
            "cv_index": self.cv_index,
            "model": self.model.state_dict(),
            "learner": self.learner.state_dict(),
            "source": self.source.get_checkpoint_state(),
            "per_rank": per_rank,
            "world_size": self.comm.size,
            "learner_kind": self.learner.kind,
            "identity": self.checkpoint_identity,
            "config_fingerprint": self.config_fingerprint,
            "versions": {"dtrain": _dtrain_version(), "torch": str(torch.__version__)},
        }

    def _save_checkpoint(self, printer) -> Path:
        self.learner.synchronize()
        # every rank holds the same model now, so every rank reaches the same verdict
        if not all(bool(torch.isfinite(parameter).all()) for parameter in self.model.parameters()):
            raise TrainingDiverged(
                f"training diverged: the model has NaN or infinite parameters at {self.learner.samples_seen} samples "
                f"(not saved; the previous checkpoint is kept); {_DIVERGED_ADVICE}")
        state = self._checkpoint_state()
        path = self.checkpoint_files.path(self.learner.samples_seen)
        if self.comm.is_main:
            checkpoint.save_atomic(state, path)
            self.checkpoint_files.prune(0 if self.checkpoint_config.preserve_all else self.checkpoint_config.keep_last)
            printer.line(f"checkpoint saved at {self.learner.samples_seen} samples: {path}")
        self.comm.barrier()
        return path

    def restore(self) -> Path | None:
        """Loads the newest good checkpoint when restore is on; refuses to overwrite one when it is off.

        Called by ``train()``; call it earlier to find a bad checkpoint before anything is written.
        Returns the file restored from (``None``: starting fresh). Idempotent.

        Raises:
            CheckpointError: no checkpoint is readable, or the newest belongs to another model or config.
        """
        if self._restore_attempted:
            return self._restored_from
        self._restore_attempted = True
        self._restored_from = self._load_latest()
        return self._restored_from

    def _load_latest(self) -> Path | None:
        if self.checkpoint_files is None:
            return None
        # rank 0 reads and every rank receives: no shared file system needed, and one error for all
        outcome = None
        if self.comm.is_main:
            try:
                outcome = self._read_checkpoint()
            except checkpoint.CheckpointError as error:
                outcome = str(error)
        outcome = self.comm.broadcast_object(outcome, root=0)
        if isinstance(outcome, str):
            raise checkpoint.CheckpointError(outcome)
        if outcome is None:
            return None
        path, state = outcome
        self.model.load_state_dict(state["model"])
        self.learner.load_state_dict(state["learner"])
        self.source.restore_from_checkpoint(state["source"])
        if state["world_size"] == self.comm.size:
            own = state["per_rank"][self.comm.rank]
            torch.set_rng_state(own["rng"])
            self.learner.load_local_state_dict(own["learner"])
        elif self.comm.is_main:
            print(f"dtrain: restoring a checkpoint of {state['world_size']} workers on {self.comm.size}: the data "
                  f"position is re-partitioned, replicated state reused, per-rank state (random numbers, "
                  f"quantization residuals) reset", file=self.stream or sys.stdout, flush=True)
        self.minibatches = int(state["minibatches"])
        self.cv_index = int(state["cv_index"])
        seen = self.learner.samples_seen
        for period in (self.progress_period, self.checkpoint_period, self.cv_period):
            period.reset(seen)
        return path

    def _read_checkpoint(self) -> tuple[Path, dict[str, Any]] | None:
        """Rank 0: the newest readable checkpoint, checked against this run; ``None`` when there is none."""
        if not self.checkpoint_config.restore:
            existing = self.checkpoint_files.existing()
            if existing:
                raise checkpoint.CheckpointError(
                    f"checkpoint {existing[-1][1]} already exists and restore is off; set session.checkpoint.restore=true "
                    f"to continue it, or use a new run directory so it is not overwritten")
            return None
        found = checkpoint.load_latest_valid(self.checkpoint_files)
        if found is None:
            return None
        path, state = found
        for key in ("model", "learner", "learner_kind", "source", "per_rank", "world_size", "samples_seen", "minibatches",
                    "cv_index"):
            if key not in state:
                raise checkpoint.CheckpointError(f"checkpoint {path} lacks '{key}': it was not written by this dtrain")
        mismatch = checkpoint.describe_model_mismatch(self.model, state["model"])
        if mismatch:
            raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this model: {mismatch}")
        if state["learner_kind"] != self.learner.kind:
            raise checkpoint.CheckpointError(
                f"checkpoint {path} was written by the {state['learner_kind']!r} learner, this run uses "
                f"{self.learner.kind!r}; restore with the same learner or use a new run directory")
        difference = checkpoint.describe_config_mismatch(state.get("identity", {}), self.checkpoint_identity)
        if difference:
            raise checkpoint.CheckpointError(f"checkpoint {path} belongs to another configuration: {difference}; "
                                             f"restore with the same settings or use a new run directory")
        return path, state

    # -- printing -------------------------------------------------------------------------------
    def _print_start(self, printer, restored_from: Path | None) -> None:
        size = self.comm.size
        mb = int(self.mb_size(self.learner.samples_seen))
        parts = [f"training {sum(p.numel() for p in self.model.parameters()):,} parameters",
                 f"{size} worker{'s' if size > 1 else ''}",
                 f"global minibatch {mb} ({mb // size}-{-(-mb // size)} per worker)"]
        if self.max_samples is not None:
            sweeps = self.max_samples / self.source.samples_per_sweep
            parts.append(f"{self.max_samples:,} samples ({sweeps:.3g} sweeps of {self.source.samples_per_sweep:,})")
        printer.line("dtrain: " + ", ".join(parts))
        printer.line("dtrain: " + self.learner.describe())
        if restored_from is not None:
            printer.line(f"restored {restored_from} at {self.learner.samples_seen} samples")

    def _print_summary(self, printer, result: TrainingResult, metrics: MetricsWriter) -> None:
        if not self.comm.is_main:
            return
        lines = [f"finished: {result.samples_seen:,} samples in {result.minibatches:,} minibatches, "
                 f"{format_duration(result.seconds)} ({result.samples_seen / max(result.seconds, 1e-9):,.0f} samples/s overall)"]
        if result.test is not None:
            lines.append(f"test: accuracy {100 * result.test.accuracy:.2f}% (error {100 * result.test.error:.2f}%, "
                         f"loss {result.test.loss:.4f}) on {result.test.num_samples:,} samples")
        if result.last_checkpoint is not None:
            lines.append(f"checkpoint: {result.last_checkpoint}")
        lines.append(f"metrics: {metrics.jsonl_path}" + (f", TensorBoard: {metrics.tensorboard_dir}" if metrics.tensorboard_dir else ""))
        for line in lines:
            printer.line(line)


def training_session(model, loss, learner, mb_source, mb_size, **options) -> TrainingSession:
    """Builds a ``TrainingSession`` (CNTK's ``training_session``); call ``.train()`` on it.

    Args:
        model: the ``torch.nn.Module`` to train.
        loss: ``loss(output, labels)`` returning the MEAN loss over the local minibatch.
        learner: a dtrain ``Learner`` wrapping the optimizer of ``model``'s parameters.
        mb_source: a ``MinibatchSource`` for training.
        mb_size: global minibatch size in samples, or a ``Schedule`` of sizes by samples seen.
        max_samples: global samples to train on (``None``: until the source ends).
        progress_frequency: samples between progress lines (``None``: at the end only; 0: never).
        checkpoint_config, cv_config, test_config: see their classes.
        metric: ``metric(output, labels)`` returning a SUM (default: classification errors).
        lr_schedule: multipliers of each parameter group's configured lr, by samples seen.
        momentum_schedule: momentum time constants in samples (``exp(-mb/tc)`` per minibatch).
        unit_gain_momentum: set SGD's dampening to the momentum, so steps are ``lr``-sized (CNTK).
        run_dir: directory for metrics, TensorBoard events and relative checkpoint names.
        tensorboard: write TensorBoard events too.
        checkpoint_identity: plain settings a checkpoint must match to be restored (model, data, ...).
        progress_bar: live progress bar (``None``: on a terminal, single process only).
    """
    return TrainingSession(model, loss, learner, mb_source, mb_size, **options)


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive number of samples, got {value!r}")
    return value


def _frequency(frequency: int | None) -> int:
    if frequency is None:
        return sys.maxsize
    if not isinstance(frequency, int) or frequency < 0:
        raise ValueError(f"progress_frequency must be a non-negative number of samples or None, got {frequency!r}")
    return frequency


def _dtrain_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dtrain")
    except PackageNotFoundError:
        return "unknown"


__all__ = ["TrainingCollapsed", "TrainingDiverged", "TrainingResult", "TrainingSession", "training_session"]

"""The end of a training run for people: the weights written, ``report.png`` drawn, and the summary lines
(with the metric formatted as progress lines show it)."""
from __future__ import annotations

from pathlib import Path

import torch

from dtrain.session.measures import Measures
from dtrain.session.metrics import MetricsWriter
from dtrain.session.precision import LossScaler
from dtrain.session.profiling import StepProfiler
from dtrain.session.progress import format_duration
from dtrain.session.report import write_report
from dtrain.session.results import TrainingResult
from dtrain.session.weights import save_sharded_weights, save_weights


class RunSummary:
    """The end-of-run outputs of a training session: its weights, ``report.png`` and the summary lines.

    Args:
        run_dir: where the weights and the report go.
        model, ema: the trained model and its weight EMA (``None``: none).
        learner: what trained (its communicator, the bytes it sent and its note).
        measures: the metric or the objective's figures, as the reports name them.
        loss_scaler: fp16's loss scale (``None``: another precision).
        tensorboard_hint: whether to say how to get the TensorBoard events the run did not write.
    """

    def __init__(self, *, run_dir: Path, model: torch.nn.Module, ema, learner, measures: Measures,
                 loss_scaler: LossScaler | None, tensorboard_hint: bool):
        self.run_dir, self.model, self.ema = run_dir, model, ema
        self.learner, self.comm, self.measures = learner, learner.comm, measures
        self.loss_scaler, self.tensorboard_hint = loss_scaler, tensorboard_hint
        self.weights_path: Path | None = None  # written by export_weights
        self.report_path: Path | None = None  # drawn by write_report

    def write_report(self, printer, metrics: MetricsWriter) -> None:
        """Rank 0: ``report.png`` from every metric record of the run; a finished run never fails here."""
        path = self.run_dir / "report.png"
        try:
            write_report(metrics.records, path, metric_name=self.measures.metric_name,
                         title=f"dtrain: {self.run_dir.name}", percent=self.measures.percent,
                         more_metrics=self.measures.panels())
        except ImportError:
            printer.line("no report.png: matplotlib is not installed (pip install matplotlib)")
        except ValueError as error:
            printer.line(f"no report.png: {error}")
        except Exception as error:  # noqa: BLE001 - a drawing problem must not fail a finished run
            printer.line(f"no report.png: drawing it failed ({type(error).__name__}: {error}); metrics.csv has the data")
        else:
            self.report_path = path

    def export_sharded_weights(self, samples_seen: int) -> None:
        """Every rank, where the learner shards the model (``learner=fsdp``): the whole model gathered tensor by
        tensor into ``run_dir/model.safetensors``, written by rank 0 (``save_sharded_weights``), and the weight EMA's
        into ``model_ema.safetensors`` likewise."""
        self.weights_path = save_sharded_weights(self.model, self.run_dir / "model.safetensors", self.comm,
                                                 metadata={"samples_seen": str(samples_seen)})
        if self.ema is not None:  # its shards in the live model for the gather
            with self.ema.evaluated(self.model) as averaged:
                save_sharded_weights(averaged, self.run_dir / "model_ema.safetensors", self.comm,
                                     metadata=self._ema_metadata(samples_seen))

    def export_weights(self, samples_seen: int) -> None:
        """Rank 0: the trained (synchronised) model's weights to ``run_dir/model.safetensors`` (already written by
        :meth:`export_sharded_weights` when the learner shards the model)."""
        if not getattr(self.learner, "shards_model", False):
            self.weights_path = save_weights(self.model, self.run_dir / "model.safetensors",
                                              metadata={"samples_seen": str(samples_seen)})
        if self.ema is not None and not self.ema.sharded:
            save_weights(self.ema.module, self.run_dir / "model_ema.safetensors",
                         metadata=self._ema_metadata(samples_seen))

    def _ema_metadata(self, samples_seen: int) -> dict[str, str]:
        return {"samples_seen": str(samples_seen), "ema_decay": repr(self.ema.decay),
                "ema_updates": str(self.ema.updates),
                # dtrain.generate's auto choice skips an average below its horizon
                "ema_below_horizon": self.ema.too_few_steps() or ""}

    def print_lines(self, printer, result: TrainingResult, metrics: MetricsWriter, *, warnings: list[str],
                    skipped_steps: int, profiler: StepProfiler | None) -> None:
        """Rank 0: the summary lines, with the evaluations' ``warnings`` after the test lines they are about, fp16's
        ``skipped_steps`` and where the ``profiler``'s trace went."""
        if not self.comm.is_main:
            return
        metric_name, format_metric = self.measures.metric_name, self.measures.format
        lines = [f"finished: {result.samples_seen:,} samples in {result.minibatches:,} minibatches, "
                 f"{format_duration(result.seconds)} ({result.samples_seen / max(result.seconds, 1e-9):,.0f} samples/s overall)"]
        if result.test is not None and metric_name == "error":
            lines.append(f"test: accuracy {100 * result.test.accuracy:.2f}% (error {100 * result.test.error:.2f}%, "
                         f"loss {result.test.loss:.4f}) on {result.test.num_samples:,} samples")
        elif result.test is not None:
            lines.append(f"test: {format_metric(result.test.error, result.test.details)} (loss "
                         f"{result.test.loss:.4f}) on {result.test.num_samples:,} samples")
        if result.test_ema is not None:
            lines.append(f"test of the weight EMA (decay {self.ema.decay:g}): " + (
                f"accuracy {100 * result.test_ema.accuracy:.2f}% (error {100 * result.test_ema.error:.2f}%, "
                if metric_name == "error" else f"{format_metric(result.test_ema.error, result.test_ema.details)} (")
                + f"loss {result.test_ema.loss:.4f})")
        if self.comm.size > 1 and self.learner.bytes_sent_total:  # a learner of the user's own may not count
            lines.append(f"exchange: rank 0 sent {self.learner.bytes_sent_total / 1e6:,.1f} MB to the other ranks in "
                         f"this job ({self.learner.kind})")
        note = self.learner.summary_note()
        if note:
            lines.append(f"learner: {note}")
        lines.extend(warnings)
        if self.loss_scaler is not None:
            lines.append(f"fp16: {skipped_steps:,} optimizer steps skipped for an inf/NaN gradient, "
                         f"loss scale now {self.loss_scaler.scale:g}")
        if result.last_checkpoint is not None:
            lines.append(f"checkpoint: {result.last_checkpoint}")
        if self.weights_path is not None:
            lines.append(f"weights: {self.weights_path}" + (f" (weight EMA: {self.weights_path.parent / 'model_ema.safetensors'})"
                                                              if self.ema is not None else ""))
        if self.report_path is not None:
            lines.append(f"report: {self.report_path}")
        if profiler is not None:
            lines.append(_profile_line(profiler))
        rows = metrics.csv_path  # beside metrics.jsonl unless logger=csv put it elsewhere
        lines.append(f"metrics: {metrics.jsonl_path}, {rows.name if rows.parent == metrics.jsonl_path.parent else rows}"
                     + (f", TensorBoard: {metrics.tensorboard_dir}" if metrics.tensorboard_dir else "")
                     + (" (no TensorBoard events: pip install 'dtrain[tensorboard]')" if self.tensorboard_hint else ""))
        for line in lines:
            printer.line(line)


def _profile_line(profiler: StepProfiler) -> str:
    """Where rank 0's trace went, or why there is none."""
    traces = profiler.traces()
    if traces:
        return f"profile: {', '.join(str(path) for path in traces)} (chrome://tracing, ui.perfetto.dev, TensorBoard)"
    first, _ = profiler.config.window
    return (f"profile: none written, the run ended after {profiler.steps} minibatches, before minibatch "
            f"{first} (lower session.profile.wait or session.profile.warmup)")

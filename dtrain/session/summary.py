"""The end of a training run for people: the weights written, ``report.png`` drawn, and the summary lines
(with the metric formatted as progress lines show it)."""
from __future__ import annotations

from dtrain.session.metrics import MetricsWriter
from dtrain.session.progress import format_duration
from dtrain.session.report import write_report
from dtrain.session.results import TrainingResult
from dtrain.session.weights import save_weights


class RunSummary:
    """The end-of-run outputs of :class:`~dtrain.session.TrainingSession` (mixed into it: it reads the session's
    metric, run directory, weight EMA, loss scaler and profiler)."""

    def _write_report(self, printer, metrics: MetricsWriter) -> None:
        """Rank 0: ``report.png`` from every metric record of the run; a finished run never fails here."""
        path = self.run_dir / "report.png"
        try:
            write_report(metrics.records, path, metric_name=self.metric_name, title=f"dtrain: {self.run_dir.name}",
                         percent=self.metric_percent, more_metrics=self.measures.panels())
        except ImportError:
            printer.line("no report.png: matplotlib is not installed (pip install matplotlib)")
        except ValueError as error:
            printer.line(f"no report.png: {error}")
        except Exception as error:  # noqa: BLE001 - a drawing problem must not fail a finished run
            printer.line(f"no report.png: drawing it failed ({type(error).__name__}: {error}); metrics.csv has the data")
        else:
            self._report_path = path

    def _export_weights(self, samples_seen: int) -> None:
        """Rank 0: the trained (synchronised) model's weights to ``run_dir/model.safetensors``."""
        self._weights_path = save_weights(self.model, self.run_dir / "model.safetensors",
                                          metadata={"samples_seen": str(samples_seen)})
        if self.ema is not None:
            save_weights(self.ema.module, self.run_dir / "model_ema.safetensors",
                         metadata={"samples_seen": str(samples_seen), "ema_decay": repr(self.ema.decay),
                                   "ema_updates": str(self.ema.updates),
                                   # dtrain.generate's auto choice skips an average below its horizon
                                   "ema_below_horizon": self.ema.too_few_steps() or ""})

    def _profile_line(self) -> str:
        """Where rank 0's trace went, or why there is none."""
        traces = self._profiler.traces()
        if traces:
            return f"profile: {', '.join(str(path) for path in traces)} (chrome://tracing, ui.perfetto.dev, TensorBoard)"
        first, _ = self.profile.window
        return (f"profile: none written, the run ended after {self._profiler.steps} minibatches, before minibatch "
                f"{first} (lower session.profile.wait or session.profile.warmup)")

    def _print_summary(self, printer, result: TrainingResult, metrics: MetricsWriter) -> None:
        if not self.comm.is_main:
            return
        lines = [f"finished: {result.samples_seen:,} samples in {result.minibatches:,} minibatches, "
                 f"{format_duration(result.seconds)} ({result.samples_seen / max(result.seconds, 1e-9):,.0f} samples/s overall)"]
        if result.test is not None and self.metric_name == "error":
            lines.append(f"test: accuracy {100 * result.test.accuracy:.2f}% (error {100 * result.test.error:.2f}%, "
                         f"loss {result.test.loss:.4f}) on {result.test.num_samples:,} samples")
        elif result.test is not None:
            lines.append(f"test: {self.measures.format(result.test.error, result.test.details)} (loss "
                         f"{result.test.loss:.4f}) on {result.test.num_samples:,} samples")
        if result.test_ema is not None:
            lines.append(f"test of the weight EMA (decay {self.ema.decay:g}): " + (
                f"accuracy {100 * result.test_ema.accuracy:.2f}% (error {100 * result.test_ema.error:.2f}%, "
                if self.metric_name == "error" else f"{self.measures.format(result.test_ema.error, result.test_ema.details)} (")
                + f"loss {result.test_ema.loss:.4f})")
        if self.comm.size > 1 and self.learner.bytes_sent_total:  # a learner of the user's own may not count
            lines.append(f"exchange: rank 0 sent {self.learner.bytes_sent_total / 1e6:,.1f} MB to the other ranks in "
                         f"this job ({self.learner.kind})")
        note = self.learner.summary_note()
        if note:
            lines.append(f"learner: {note}")
        lines.extend(self.evaluations.warnings)
        if self.loss_scaler is not None:
            lines.append(f"fp16: {self.skipped_steps:,} optimizer steps skipped for an inf/NaN gradient, "
                         f"loss scale now {self.loss_scaler.scale:g}")
        if result.last_checkpoint is not None:
            lines.append(f"checkpoint: {result.last_checkpoint}")
        if self._weights_path is not None:
            lines.append(f"weights: {self._weights_path}" + (f" (weight EMA: {self._weights_path.parent / 'model_ema.safetensors'})"
                                                              if self.ema is not None else ""))
        if self._report_path is not None:
            lines.append(f"report: {self._report_path}")
        if self._profiler is not None:
            lines.append(self._profile_line())
        lines.append(f"metrics: {metrics.jsonl_path}, {metrics.csv_path.name}" + (f", TensorBoard: {metrics.tensorboard_dir}" if metrics.tensorboard_dir else "")
                     + (" (no TensorBoard events: pip install 'dtrain[tensorboard]')" if self._tensorboard_hint else ""))
        for line in lines:
            printer.line(line)

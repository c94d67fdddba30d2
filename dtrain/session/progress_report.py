"""The training loop's progress points: the period's loss and metric summed over every rank, checked for a
divergence or a collapse, then printed and written to the metrics."""
from __future__ import annotations

import math
from collections.abc import Callable

from dtrain.session.collapse import CollapseWatch
from dtrain.session.evaluate import metric_average
from dtrain.session.measures import Measures
from dtrain.session.metrics import PhaseTimer
from dtrain.session.minibatch_step import PeriodSums
from dtrain.session.progress import Throughput
from dtrain.session.results import TrainingCollapsed, TrainingDiverged


class ProgressReports:
    """The training loop's progress points; ``last_training_error`` is the metric at the last one (``None``: none).

    Args:
        learner: what trains (its samples seen, learning rate, notes and bytes sent); its communicator sums the ranks.
        measures: the metric or the objective's figures, as the reports name them.
        collapse: the training loss's watch, which refuses a collapsed run.
        advice: what to change after a divergence or a collapse.
    """

    def __init__(self, learner, measures: Measures, collapse: CollapseWatch, advice: Callable[[], str]):
        self.learner, self.comm = learner, learner.comm
        self.measures, self.collapse, self.advice = measures, collapse, advice
        self.last_training_error: float | None = None

    def report(self, printer, metrics, sums: PeriodSums, throughput: Throughput, timer: PhaseTimer) -> None:
        """Rank totals of the period's sums: refuses a diverged or collapsed run, else prints the progress line
        and writes the ``train`` metrics record, then starts the next period."""
        measures = self.measures
        names = measures.figure_names()
        totals = self.comm.allreduce(sums.as_tensor(len(names)).to(self.comm.device), op="sum").cpu()
        samples = float(totals[2])
        loss = float(totals[0]) / samples if samples else float("nan")
        figures = {name: float(value) / samples if samples else float("nan")
                   for name, value in zip(names, totals[6:].tolist())}  # an objective's, averaged like the loss
        if measures.metric is None:
            error = float("nan")
        else:
            error = metric_average(measures.metric, float(totals[1]) / float(totals[3])) if float(totals[3]) else float("nan")
        padding = float(totals[4]) / float(totals[5]) if float(totals[5]) else None
        if samples and not math.isfinite(loss):
            # the same on every rank (the sums were all-reduced); no checkpoint of this state is written
            raise TrainingDiverged(
                f"training diverged: the mean loss is {loss} over the last {int(samples)} samples (at "
                f"{self.learner.samples_seen} samples); {self.advice()}")
        if samples and measures.metric is not None:
            self.last_training_error = error
        if samples and self.collapse.loss_collapsed(loss, self.comm):
            raise TrainingCollapsed(
                f"training collapsed: the mean loss {loss:.4f} over the last {int(samples)} samples is "
                f"{self.collapse.against_chance(loss)}, at {self.learner.samples_seen} samples after having fallen; "
                f"{self.advice()}")
        rate = throughput.rate()
        learning_rate = self.learner.optimizer.param_groups[0]["lr"]
        extra = timer.take(throughput.period_elapsed())
        note = self.learner.progress_note()
        if padding is not None:
            note = f"padding {100 * padding:.0f}%" + (f" | {note}" if note else "")
            extra["padding"] = padding
        printer.progress(self.learner.samples_seen, loss, error, rate, learning_rate, throughput.elapsed(),
                         note=note, metric_name=measures.metric_name, percent=measures.percent,
                         time_split=extra, figures=figures)
        bytes_sent = self.learner.bytes_sent_last_step  # None: a learner that does not measure it (Learner's)
        if bytes_sent is not None:
            extra["bytes_sent_per_step"] = int(bytes_sent)
        between = self.learner.bytes_between_hosts_last_step  # two levels: what crossed hosts
        if between is not None:
            extra["bytes_between_hosts_per_step"] = int(between)
        measured = {measures.metric_name: error} if measures.metric is not None else figures
        metrics.write("train", self.learner.samples_seen, loss=loss, **measured, samples_per_second=rate,
                      lr=learning_rate, **extra)
        sums.reset()
        throughput.new_period()


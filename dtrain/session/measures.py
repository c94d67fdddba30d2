"""What a run measures besides its loss, as every report names it: the metric (its name and whether it reads in
percent) or an objective's figures. One object, built by the session, serves the progress points, the evaluation
passes and the summary, so the three say the same."""
from __future__ import annotations

from dtrain.session.evaluate import Evaluation
from dtrain.session.objective_call import ObjectiveCall
from dtrain.session.objectives import metric_in_percent, metric_name
from dtrain.session.progress import figures_line


class Measures:
    """The metric or the objective's figures of one run.

    Args:
        metric: ``metric(output, labels)`` (``None`` with an objective: its figures are reported instead).
        objective: the checked objective (``None`` with a loss).
        comm: the job's communicator, over which the ranks agree on an objective's figure names.
    """

    def __init__(self, metric, objective: ObjectiveCall | None, comm):
        self.metric = metric
        self.objective = objective
        self.comm = comm
        # the metric's key in progress lines, metrics.jsonl/csv and the summary (an objective: none)
        self.metric_name: str | None = metric_name(metric) if metric is not None else None
        self.percent = metric_in_percent(metric) if metric is not None else False
        self._names_agreed = False  # an objective's figure names, agreed by the ranks at the first report

    def figure_names(self) -> tuple[str, ...]:
        """The figures an objective returns (none with a loss), named at its first call on any rank: a rank
        whose share of the first minibatches was empty has not called it, and adds zeros in their place."""
        objective = self.objective
        if objective is None:
            return ()
        if self.comm.size > 1 and not self._names_agreed:
            self._names_agreed = True
            named = [names for names in self.comm.allgather_object(objective.figure_names) if names is not None]
            if objective.figure_names is None and named:
                objective.figure_names = named[0]
        return objective.figure_names or ()

    def panels(self) -> tuple[str, ...]:
        """What ``report.png`` draws beside the metric: a metric's other rates, or each of an objective's figures."""
        if self.metric is not None:
            return tuple(getattr(self.metric, "names", ()))
        return tuple(self.objective.figure_names or ())

    def format(self, value: float, details: dict[str, float] | None = None) -> str:
        """``top5_error 3.20%`` or ``mean_abs_error 0.0412``: the metric by its name, then a decoding
        metric's other rates (``wer 28.10%, per 6.90%``)."""
        if self.metric_name is None:  # an objective's figures (the loss alone without any)
            return figures_line(details or {}, (details or {}).values()) or "no metric"
        pairs = [(self.metric_name, value), *(details or {}).items()]
        return ", ".join(f"{name} {100 * v:.2f}%" if self.percent else f"{name} {v:.4g}" for name, v in pairs)

    def entries(self, result: Evaluation) -> dict[str, float]:
        """An evaluation's record entries beside its loss: the metric and a decoding metric's other rates, or an
        objective's figures."""
        if self.metric_name is None:
            return dict(result.details)
        return {self.metric_name: result.error, **result.details}

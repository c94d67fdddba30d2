"""The run's measures: the metric or an objective's figures, named and formatted alike by every report."""
from __future__ import annotations

import torch

from dtrain.comm import LocalCommunicator
from dtrain.session.evaluate import Evaluation, classification_errors
from dtrain.session.measures import Measures
from dtrain.session.objective_call import ObjectiveCall

from tests.helpers.thread_world import FakeWorld


def mean_abs_error(output, labels):
    return (output - labels).abs().sum()


def distill(model, minibatch):
    return torch.tensor(0.0), {"kd": torch.tensor(0.0)}


def test_a_metric_is_formatted_by_its_name_in_percent_or_as_a_number():
    errors = Measures(classification_errors, None, LocalCommunicator())
    assert errors.format(0.032, {"wer": 0.281}) == "error 3.20%, wer 28.10%"
    assert Measures(mean_abs_error, None, LocalCommunicator()).format(0.04123) == "mean_abs_error 0.04123"
    result = Evaluation(loss=0.5, error=0.25, num_samples=8, num_minibatches=1, details={"wer": 0.5})
    assert errors.entries(result) == {"error": 0.25, "wer": 0.5}


def test_an_objective_is_reported_by_its_figures_or_as_no_metric():
    measures = Measures(None, ObjectiveCall(distill), LocalCommunicator())
    assert measures.metric_name is None and not measures.percent
    assert measures.format(float("nan")) == "no metric"
    result = Evaluation(loss=0.5, error=float("nan"), num_samples=8, num_minibatches=1, details={"kd": 0.125})
    assert measures.entries(result) == {"kd": 0.125}
    assert measures.figure_names() == ()  # not called yet


def test_a_rank_whose_objective_was_never_called_takes_the_other_ranks_figure_names():
    def names(comm):
        objective = ObjectiveCall(distill)
        if comm.rank == 1:
            objective.figure_names = ("kd", "ce")  # only rank 1's share of the first minibatches held samples
        measures = Measures(None, objective, comm)
        return measures.figure_names(), measures.panels()

    assert FakeWorld(2).run(names) == [(("kd", "ce"), ("kd", "ce"))] * 2

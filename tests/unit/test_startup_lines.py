"""The start-up lines of a one-process session say what the learner really does there."""
from __future__ import annotations

import torch
from torch import nn

from dtrain import LocalLearner, MinibatchSource, create_communicator, data_parallel_distributed_learner, training_session
from dtrain.schedules import Schedule

from tests.helpers.toy_data import four_class_data


def start_up_lines(tmp_path, make_learner, max_samples=32, **session_args) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    learner = make_learner(torch.optim.SGD(model.parameters(), lr=0.1))
    session = training_session(model, nn.functional.cross_entropy, learner, MinibatchSource(four_class_data(64, 0)),
                               minibatch_size=16, max_samples=max_samples, run_dir=tmp_path / "run", progress_bar=False,
                               tensorboard=False, **session_args)
    lines = []
    session._print_start(type("Printer", (), {"line": staticmethod(lines.append)}), None)
    return lines


def test_one_process_data_parallel_says_it_makes_plain_local_steps(tmp_path):
    lines = start_up_lines(tmp_path, lambda optimizer: data_parallel_distributed_learner(optimizer, create_communicator()))
    assert ", 1 worker, " in lines[0]
    assert "dtrain: learner data_parallel (one process: plain local optimizer steps, nothing is exchanged)" in lines


def test_the_local_learner_needs_no_such_note(tmp_path):
    lines = start_up_lines(tmp_path, LocalLearner)
    assert "dtrain: learner local" in lines


def lr_schedule_lines(tmp_path, values, max_samples) -> list[str]:
    lines = start_up_lines(tmp_path, LocalLearner, max_samples, lr_schedule=Schedule(values, epoch_size=64))
    return [line for line in lines if "lr_schedule" in line]


def test_a_run_that_ends_before_the_lr_schedule_changes_is_told(tmp_path):
    # a recipe shortened on the command line: 2 epochs of a schedule whose first drop comes after 3
    (line,) = lr_schedule_lines(tmp_path, [[1, 1.0], [2, 1.0], [1, 0.1]], max_samples=128)
    assert line.startswith("dtrain: note: the run ends at 128 samples, before session.lr_schedule's first change "
                           "(x1 to x0.1 at 192)")


def test_no_note_when_the_run_reaches_the_change_or_the_schedule_is_constant(tmp_path):
    assert lr_schedule_lines(tmp_path, [[3, 1.0], [1, 0.1]], max_samples=256) == []
    assert lr_schedule_lines(tmp_path, [[1, 0.5], [2, 0.5]], max_samples=64) == []

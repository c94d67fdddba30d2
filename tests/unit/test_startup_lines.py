"""The start-up lines of a one-process session say what the learner really does there."""
from __future__ import annotations

import torch
from torch import nn

from dtrain import LocalLearner, MinibatchSource, create_communicator, data_parallel_distributed_learner, training_session

from tests.helpers.toy_data import four_class_data


def start_up_lines(tmp_path, make_learner) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    learner = make_learner(torch.optim.SGD(model.parameters(), lr=0.1))
    session = training_session(model, nn.functional.cross_entropy, learner, MinibatchSource(four_class_data(64, 0)),
                               minibatch_size=16, max_samples=32, run_dir=tmp_path / "run", progress_bar=False,
                               tensorboard=False)
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

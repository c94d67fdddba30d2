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
    session.startup.print_lines(type("Printer", (), {"line": staticmethod(lines.append)}), None, None)
    return lines


def test_one_process_data_parallel_says_it_makes_plain_local_steps(tmp_path):
    lines = start_up_lines(tmp_path, lambda optimizer: data_parallel_distributed_learner(optimizer, create_communicator()))
    assert ", 1 worker, " in lines[0]
    assert "dtrain: learner data_parallel (one process: plain local optimizer steps, nothing is exchanged)" in lines


def test_the_local_learner_needs_no_such_note(tmp_path):
    lines = start_up_lines(tmp_path, LocalLearner)
    assert "dtrain: learner local" in lines


def lr_schedule_lines(tmp_path, values, max_samples, warmup_samples=0, **session_args) -> list[str]:
    lines = start_up_lines(tmp_path, LocalLearner, max_samples,
                           lr_schedule=Schedule(values, epoch_size=64, warmup_samples=warmup_samples), **session_args)
    return [line for line in lines if "lr_schedule" in line]


def test_a_run_that_ends_before_the_lr_schedule_changes_is_told(tmp_path):
    # a recipe shortened on the command line: 2 epochs of a schedule whose first drop comes after 3
    (line,) = lr_schedule_lines(tmp_path, [[1, 1.0], [2, 1.0], [1, 0.1]], max_samples=128)
    assert line.startswith("dtrain: note: the run ends at 128 samples, before session.lr_schedule's first change "
                           "(x1 to x0.1 at 192)")


def test_no_note_when_the_run_reaches_the_change_or_the_schedule_is_constant(tmp_path):
    assert lr_schedule_lines(tmp_path, [[3, 1.0], [1, 0.1]], max_samples=256) == []
    assert lr_schedule_lines(tmp_path, [[1, 0.5], [2, 0.5]], max_samples=64) == []


def test_a_run_that_ends_inside_the_warm_up_is_told_its_rate_rises_all_run(tmp_path):
    # the language model's recipe shortened: it ends at 80% of its warm-up, long before its first drop
    (line,) = lr_schedule_lines(tmp_path, [[6, 1.0], [2, 0.3]], max_samples=128, warmup_samples=160)
    assert line == ("dtrain: note: the run ends at 128 samples, inside the learning-rate warm-up of 160 samples: the "
                    "learning rate rises all run, to x0.8 of its peak at the end, and session.lr_schedule's first change "
                    "(x1 to x0.3 at 384) is not reached; shorten session.lr_schedule.warmup_samples with "
                    "session.max_samples if it should")
    assert "does not change" not in line
    (constant,) = lr_schedule_lines(tmp_path, 1.0, max_samples=96, warmup_samples=128)  # a warm-up alone
    assert "inside the learning-rate warm-up of 128 samples: the learning rate rises all run, to x0.75 of its peak " \
           "at the end; shorten" in constant


def test_a_run_past_the_warm_up_but_before_the_first_change_is_told_its_rate_rises_then_stays(tmp_path):
    (line,) = lr_schedule_lines(tmp_path, [[6, 1.0], [2, 0.3]], max_samples=320, warmup_samples=160)
    assert line.startswith("dtrain: note: the run ends at 320 samples, before session.lr_schedule's first change (x1 to "
                           "x0.3 at 384): the learning rate rises over the warm-up's first 160 samples, then stays at its "
                           "peak to the end;"), line
    assert lr_schedule_lines(tmp_path, 1.0, max_samples=160, warmup_samples=160) == []  # warmed up: a constant


def test_the_warm_up_of_lr_scaling_is_the_one_told_when_it_has_it(tmp_path):
    from dtrain.session.lr_scaling import LearningRateScaling

    scaling = LearningRateScaling("linear", minibatch_size=64, reference_minibatch_size=16, warmup_samples=256)
    (line,) = lr_schedule_lines(tmp_path, [[6, 1.0], [2, 0.3]], max_samples=128, lr_scaling=scaling)
    # x(1 + 3 * 128 / 256) = x2.5 of x4 at the end
    assert "inside the learning-rate warm-up of 256 samples: the learning rate rises all run, to x0.62 of its peak" \
           in line, line


def test_a_resumed_run_names_its_checkpoint_and_the_settings_changed_since(tmp_path):
    from types import SimpleNamespace

    from dtrain.session.binding import StreamBinding
    from dtrain.session.startup import StartupLines, StartupSettings

    model = nn.Linear(6, 4)
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1))
    checkpointing = SimpleNamespace(note="the newest of 2", changed_settings=["session.max_samples: 64 -> 128"])
    startup = StartupLines(StartupSettings(max_samples=128, precision="bf16"), model=model, learner=learner,
                           source=MinibatchSource(four_class_data(64, 0)), device=torch.device("cpu"),
                           minibatch_size=Schedule(16), binding=StreamBinding(("features",), "labels"), objective=None,
                           ema=None, base_learning_rates=[0.1], checkpointing=checkpointing)
    lines = []
    startup.print_lines(type("Printer", (), {"line": staticmethod(lines.append)}), tmp_path / "checkpoint_64.pt", None)
    assert lines[0] == ("dtrain: training 28 parameters on the CPU, 1 worker, global minibatch 16 (16-16 per worker), "
                        "128 samples (2 sweeps of 64)")
    assert "dtrain: precision bf16" in lines
    assert lines[-2:] == [f"restored {tmp_path / 'checkpoint_64.pt'} at 0 samples (the newest of 2)",
                          "dtrain: settings changed since the checkpoint, now in effect: session.max_samples: 64 -> 128"]

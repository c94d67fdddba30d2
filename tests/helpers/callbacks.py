"""For the callback tests: a short training session on the four-class toy data (16-sample minibatches, a progress
report every 32 samples, cross-validation and a checkpoint every 64, a test) and a callback that logs its events
to a file per rank."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dtrain import (Callback, CheckpointConfig, CrossValidationConfig, LocalLearner, MinibatchSource, TestConfig,
                    training_session)
from dtrain.failures import launch_position

from tests.helpers.toy_data import four_class_data


def toy_session(run_dir: Path, max_samples: int, callbacks, **options):
    """The session (``options`` replace its keywords: ``cv_config=None``, ``progress_frequency=0``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options.setdefault("cv_config", CrossValidationConfig(
        MinibatchSource(four_class_data(40, 1), randomize=False, max_sweeps=1), frequency=64, minibatch_size=20))
    options.setdefault("progress_frequency", 32)
    return training_session(
        model=model, loss=nn.functional.cross_entropy, learner=LocalLearner(optimizer),
        minibatch_source=MinibatchSource(four_class_data(200, 0), randomize=True, randomization_seed=3),
        minibatch_size=16, max_samples=max_samples,
        checkpoint_config=CheckpointConfig("ckpt.pt", frequency=64),
        test_config=TestConfig(MinibatchSource(four_class_data(40, 2), randomize=False, max_sweeps=1), 20),
        run_dir=run_dir, tensorboard=False, callbacks=callbacks, **options)


class EventLog(Callback):
    """Writes every event it sees as a line ``EVENT SAMPLES`` of ``directory/events.RANK.txt``.

    The file is created empty when the callback is built, on every rank (the launcher's rank names it), so a rank
    whose callbacks are not called leaves an empty file. Name it in a run as
    ``+callbacks.events._target_=tests.helpers.callbacks.EventLog +callbacks.events.directory=DIR``.
    """

    def __init__(self, directory: str, all_ranks: bool = False):
        self.all_ranks = all_ranks
        rank, _ = launch_position()
        self.path = Path(directory) / f"events.{rank}.txt"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    def _note(self, event: str, run) -> None:
        with self.path.open("a") as log:
            log.write(f"{event} {run.samples_seen}\n")

    def on_run_start(self, run):
        self._note("run_start", run)

    def on_checkpoint_restore(self, run, path):
        self._note("checkpoint_restore", run)

    def on_step_end(self, run, step):
        self._note("step_end", run)

    def on_progress(self, run, record):
        self._note("progress", run)

    def on_cross_validation(self, run, record):
        self._note("cross_validation", run)

    def on_checkpoint_save(self, run, path):
        self._note("checkpoint_save", run)

    def on_preemption(self, run, path):
        self._note("preemption", run)

    def on_test(self, run, record):
        self._note("test", run)

    def on_run_end(self, run, result):
        self._note("run_end", run)

    def on_exception(self, run, error):
        self._note("exception", run)


def logged_events(path: Path) -> list[tuple[str, int]]:
    """The ``(event, samples)`` lines an :class:`EventLog` wrote."""
    return [(event, int(samples)) for event, samples in (line.split() for line in path.read_text().splitlines())]

"""docs/writing-a-learner.md's Local-SGD learner, plugged in from outside the package with
--config-dir, trains under mpiexec to max_samples with one model on every worker."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch

from dtrain.session import checkpoint

from tests.helpers.mpi import run_mpi
from tests.helpers.thread_world import FakeWorld

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "local_sgd"


def _example_module():
    """The page's ``local_sgd.py``, imported from its file (as ``PYTHONPATH`` makes dtrain import it)."""
    spec = importlib.util.spec_from_file_location("local_sgd", EXAMPLE / "local_sgd.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_shows_the_tested_example_unchanged():
    page = (ROOT / "docs" / "writing-a-learner.md").read_text()
    assert (EXAMPLE / "local_sgd.py").read_text() in page
    assert (EXAMPLE / "conf" / "learner" / "local_sgd.yaml").read_text() in page
    assert len((EXAMPLE / "local_sgd.py").read_text().splitlines()) <= 35  # short enough to read at once


def test_local_sgd_from_a_config_dir_trains_to_max_samples_under_mpiexec(run_dir):
    result = run_mpi(2, ["-m", "dtrain", "--config-dir", str(EXAMPLE / "conf"), "+recipe=digits",
                         "learner=local_sgd", "learner.period=3", "session.max_samples=3000",
                         "session.tensorboard=false", f"run_dir={run_dir}"],
                     timeout=240, env={"PYTHONPATH": str(EXAMPLE)})
    assert result.returncode == 0, result.report()
    assert "learner local_sgd" in result.stdout
    state = checkpoint.load(run_dir / "checkpoint-3000.pt")
    assert state["samples_seen"] == 3000 and state["learner_kind"] == "local_sgd"
    assert state["minibatches"] == 94  # ceil(3000 / 32): it stopped, not thousands of minibatches
    accuracy = float(re.search(r"test: accuracy ([\d.]+)%", result.stdout).group(1))
    assert accuracy >= 90.0, result.stdout


def test_local_sgd_averages_every_period_and_synchronize_leaves_one_model():
    LocalSGDLearner = _example_module().LocalSGDLearner

    def work(comm):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        learner = LocalSGDLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm, period=2)
        learner.prepare(model)
        snapshots = []
        for step in range(3):
            learner.begin_minibatch(4, 8)
            model(torch.full((4, 3), float(comm.rank + step))).sum().backward()  # different data per rank
            learner.step()
            snapshots.append(model.weight.detach().clone())
        learner.synchronize()
        snapshots.append(model.weight.detach().clone())
        return learner.samples_seen, snapshots

    (seen0, rank0), (seen1, rank1) = FakeWorld(2).run(work)
    assert seen0 == seen1 == 24
    assert not torch.equal(rank0[0], rank1[0])  # step 1: each worker alone
    assert torch.equal(rank0[1], rank1[1])      # step 2: averaged (period 2)
    assert not torch.equal(rank0[2], rank1[2])  # step 3: alone again
    assert torch.equal(rank0[3], rank1[3])      # synchronize: one model for checkpoints and evaluation

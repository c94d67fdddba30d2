"""docs/writing-a-learner.md's block learner (outer SGD on the BlockLearner base), plugged in from
outside the package with --config-dir, trains under mpiexec to max_samples with one model on every
worker, and its outer step matches the formula."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dtrain.exchange import Quantized
from dtrain.session import checkpoint

from tests.helpers.bmuf_reference import flat
from tests.helpers.examples import EXAMPLES, import_example
from tests.helpers.mpi import run_mpi
from tests.helpers.thread_world import FakeWorld

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = EXAMPLES / "outer_sgd"


def _example_module():
    """The page's ``outer_sgd.py``, imported from its file (as ``PYTHONPATH`` makes dtrain import it)."""
    return import_example("outer_sgd", "outer_sgd")


def test_the_page_shows_the_tested_example_unchanged():
    page = (ROOT / "docs" / "writing-a-learner.md").read_text()
    assert (EXAMPLE / "outer_sgd.py").read_text() in page
    assert (EXAMPLE / "conf" / "learner" / "outer_sgd.yaml").read_text() in page
    assert len((EXAMPLE / "outer_sgd.py").read_text().splitlines()) <= 35  # short enough to read at once


@pytest.mark.slow
def test_outer_sgd_from_a_config_dir_trains_to_max_samples_under_mpiexec(run_dir):
    result = run_mpi(2, ["-m", "dtrain", "--config-dir", str(EXAMPLE / "conf"), "+recipe=digits",
                         "learner=outer_sgd", "learner.outer_learning_rate=0.8", "learner.block_size=320",
                         "learner/exchange=quantized", "learner.exchange.num_bits=4",
                         "session.max_samples=3000", "session.tensorboard=false", f"run_dir={run_dir}"],
                     timeout=240, env={"PYTHONPATH": str(EXAMPLE)})
    assert result.returncode == 0, result.report()
    assert "learner outer_sgd" in result.stdout and "outer SGD lr 0.8" in result.stdout, result.stdout
    state = checkpoint.load(run_dir / "checkpoint-3000.pt")
    assert state["samples_seen"] == 3000 and state["learner_kind"] == "outer_sgd"
    assert state["minibatches"] == 94  # ceil(3000 / 32): it stopped, not thousands of minibatches
    accuracy = float(re.search(r"test: accuracy ([\d.]+)%", result.stdout).group(1))
    assert accuracy >= 90.0, result.stdout


def test_outer_sgd_moves_every_rank_by_lr_times_the_mean_change():
    OuterSGDLearner = _example_module().OuterSGDLearner

    def work(comm, make_exchange):
        model = torch.nn.Linear(3, 2)
        # the same start on every rank and in both runs (the threads share torch's global generator)
        torch.nn.utils.vector_to_parameters(torch.linspace(-1.0, 1.0, 8), model.parameters())
        learner = OuterSGDLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm, outer_learning_rate=0.5,
                                  block_size=16, distributed_after=0, exchange=make_exchange())
        learner.prepare(model)
        start = flat(model.parameters())
        for step in range(2):  # 4 samples per worker per step: the block of 16 ends after step 2
            learner.begin_minibatch(4, 8)
            model(torch.full((4, 3), float(comm.rank + step))).sum().backward()  # different data per rank
            learner.step()
        learner.finalize()
        return start, (learner.syncs, learner.exchange.name, learner.bytes_sent_last_step), flat(model.parameters())

    (start, (syncs, _, _), rank0), (_, _, rank1) = FakeWorld(2).run(lambda comm: work(comm, lambda: None))
    assert syncs == 1 and torch.equal(rank0, rank1)
    # the reference: each worker's two plain SGD steps, computed here, then W_prev - 0.5 * mean(W_prev - W_i)
    workers = []
    for rank in range(2):
        model = torch.nn.Linear(3, 2)
        torch.nn.utils.vector_to_parameters(start.clone(), model.parameters())  # every worker starts from rank 0's model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            optimizer.zero_grad()
            model(torch.full((4, 3), float(rank + step))).sum().backward()
            optimizer.step()
        workers.append(flat(model.parameters()))
    expected = start - 0.5 * torch.stack([start - w for w in workers]).mean(0)
    assert torch.allclose(rank0, expected, atol=1e-6)
    (_, (syncs, name, sent), lossy0), (_, _, lossy1) = FakeWorld(2).run(
        lambda comm: work(comm, lambda: Quantized(num_bits=4)))
    assert syncs == 1 and name == "quantized" and sent > 0  # the deltas went through the 4-bit strategy
    assert torch.equal(lossy0, lossy1) and torch.allclose(lossy0, expected, atol=1e-2)

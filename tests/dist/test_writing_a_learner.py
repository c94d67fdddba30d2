"""docs/writing-a-learner.md's block learners: outer SGD on the BlockLearner base, plugged in from
outside the package with --config-dir, trains under mpiexec to max_samples with one model on every
worker, and its outer step matches the formula; an outer optimizer (torch's Adam) on a block learner
steps as torch's Adam does, resumes from its checkpoint as if never stopped, restores its state onto the
model's device, and the page's own Lion trains DiLoCo from a config file under mpiexec."""
from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import pytest
import torch

from dtrain.exchange import Quantized
from dtrain.learners import DiLoCoLearner, LocalSGDLearner
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


def test_the_page_shows_the_tested_examples_unchanged():
    page = (ROOT / "docs" / "writing-a-learner.md").read_text()
    for name, config, longest in (("outer_sgd", "learner/outer_sgd.yaml", 35),
                                  ("outer_lion", "learner/outer_optimizer/lion.yaml", 30)):
        assert (EXAMPLES / name / f"{name}.py").read_text() in page, name
        assert (EXAMPLES / name / "conf" / config).read_text() in page, name
        assert len((EXAMPLES / name / f"{name}.py").read_text().splitlines()) <= longest  # read at once


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


# -- outer optimizers: torch's Adam, and the page's Lion ------------------------------------------------
def _outer_adam(model, comm=None, lr=0.05, **settings):
    """Local SGD with torch's Adam as its outer optimizer (``learner/outer_optimizer=adam``), syncing every 4
    samples per worker, with outer steps large enough to tell apart."""
    return LocalSGDLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm, block_size=8 if comm else 4,
                           distributed_after=0, outer_optimizer=partial(torch.optim.Adam, lr=lr, **settings))


def _train(learner, model, rank: int, steps: range) -> None:
    """Steps of 4 samples per worker (a sync after each: the block is 4 per worker), other data on each rank."""
    for step in steps:
        learner.begin_minibatch(4, 4 * learner.comm.size)
        model(torch.full((4, 3), float(rank + step))).sum().backward()
        learner.step()


def _linear(start: torch.Tensor, **where) -> torch.nn.Linear:
    model = torch.nn.Linear(3, 2, **where)
    if start.device.type != "meta":
        torch.nn.utils.vector_to_parameters(start.clone().to(**where), model.parameters())  # views of its own
    return model


def test_an_outer_adam_steps_as_torchs_adam_on_the_mean_change_of_two_workers():
    start = torch.linspace(-1.0, 1.0, 8)

    def work(comm):
        model = _linear(start)
        learner = _outer_adam(model, comm, lr=0.05, betas=(0.8, 0.9), eps=1e-6)
        learner.prepare(model)
        models = []
        for step in range(3):
            _train(learner, model, comm.rank, range(step, step + 1))
            models.append(flat(model.parameters()))
        return models

    got, other = FakeWorld(2).run(work)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(got, other))  # one model on every worker
    reference = start.clone().requires_grad_()
    adam = torch.optim.Adam([reference], lr=0.05, betas=(0.8, 0.9), eps=1e-6)
    for step in range(3):
        workers = []
        for rank in range(2):  # each worker's one inner SGD step from the last sync's model
            model = _linear(reference.detach())
            model(torch.full((4, 3), float(rank + step))).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            workers.append(flat(model.parameters()))
        reference.grad = torch.stack([reference.detach() - w for w in workers]).mean(0)
        adam.step()
        assert torch.allclose(got[step], reference.detach(), atol=1e-6), step
    assert not torch.allclose(got[-1], start, atol=1e-2)  # the steps moved the model


def test_an_outer_adam_resumed_from_its_checkpoint_continues_as_if_never_stopped(tmp_path):
    start = torch.linspace(-1.0, 1.0, 8)

    def work(comm, resume: str):
        model = _linear(start)
        learner = _outer_adam(model, comm)
        learner.prepare(model)
        _train(learner, model, comm.rank, range(1 if resume else 3))
        if resume:
            learner.synchronize()  # as the session does before a checkpoint
            path = tmp_path / f"{resume}-rank{comm.rank}.pt"  # the checkpoint file format, read as weights only
            checkpoint.save_atomic(learner.state_dict(), path)
            state, saved = checkpoint.load(path), flat(model.parameters())
            model = _linear(saved)
            learner = _outer_adam(model, comm)
            if resume == "restored":
                learner.load_state_dict(state)  # before prepare(), as the session restores
            learner.prepare(model)
            _train(learner, model, comm.rank, range(1, 3))
        return flat(model.parameters()), int(learner.outer_optimizer.state[learner.prev_parameters]["step"])

    (straight, steps), _ = FakeWorld(2).run(lambda comm: work(comm, ""))
    (resumed, resumed_steps), (other_rank, _) = FakeWorld(2).run(lambda comm: work(comm, "restored"))
    (forgotten, _), _ = FakeWorld(2).run(lambda comm: work(comm, "fresh"))
    assert steps == resumed_steps == 3 and torch.equal(resumed, other_rank)
    assert torch.equal(resumed, straight)  # bit for bit
    assert not torch.allclose(forgotten, straight, atol=1e-3)  # the moments are what the checkpoint carried


def test_an_outer_optimizers_restored_state_moves_to_the_models_device_and_dtype_and_keeps_its_configured_lr():
    start = torch.linspace(-1.0, 1.0, 8)
    model = _linear(start)
    learner = _outer_adam(model)
    learner.prepare(model)
    _train(learner, model, 0, range(2))
    state = learner.state_dict()  # CPU copies
    saved = state["block"]["outer_optimizer"]["state"][0]
    for where in ({"dtype": torch.float64}, {"device": "meta"}):  # meta: a device other than the checkpoint's
        model = _linear(start, **where)
        restored = _outer_adam(model, lr=0.01)
        restored.load_state_dict(state)
        restored.prepare(model)
        moments = restored.outer_optimizer.state[restored.prev_parameters]
        assert restored.outer_optimizer.param_groups[0]["lr"] == 0.01  # this run's setting, not the checkpoint's
        for key in ("exp_avg", "exp_avg_sq"):
            moment = moments[key]
            assert moment.device == restored.prev_parameters.device == next(model.parameters()).device, where
            assert moment.dtype == next(model.parameters()).dtype, where
            if moment.device.type != "meta":
                assert torch.equal(moment, saved[key].to(moment.dtype)) and moment.abs().sum() > 0


def test_another_outer_optimizers_checkpoint_and_a_replaced_setting_are_refused_in_one_line():
    model = _linear(torch.linspace(-1.0, 1.0, 8))
    learner = _outer_adam(model)
    learner.prepare(model)
    _train(learner, model, 0, range(1))
    state = learner.state_dict()
    plain = LocalSGDLearner(torch.optim.SGD(model.parameters(), lr=0.1), None, block_size=4, distributed_after=0)
    with pytest.raises(ValueError, match=r"outer optimizer is torch\.optim\.adam\.Adam, this run's is "
                                         r"torch\.optim\.sgd\.SGD"):
        plain.load_state_dict(state)
    with pytest.raises(ValueError, match=r"learner\.outer_learning_rate=0\.5 sets the learner's own outer step"):
        DiLoCoLearner(torch.optim.SGD(model.parameters(), lr=0.1), None, block_size=4, outer_learning_rate=0.5,
                      outer_optimizer=partial(torch.optim.Adam, lr=0.01))
    with pytest.raises(TypeError, match="built list, not a torch.optim.Optimizer"):
        LocalSGDLearner(torch.optim.SGD(model.parameters(), lr=0.1), None, block_size=4, outer_optimizer=list)
    with pytest.raises(ValueError, match="learner.outer_optimizer: Invalid learning rate: -1"):
        LocalSGDLearner(torch.optim.SGD(model.parameters(), lr=0.1), None, block_size=4,
                        outer_optimizer=partial(torch.optim.Adam, lr=-1.0))


def test_the_pages_lion_steps_by_its_formula():
    Lion = import_example("outer_lion", "outer_lion").Lion
    parameter = torch.linspace(-1.0, 1.0, 8)
    lion = Lion([parameter], lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)
    expected, m = parameter.clone(), torch.zeros(8)
    for gradient in (torch.linspace(0.5, -0.5, 8), torch.linspace(-0.2, 0.3, 8)):
        parameter.grad = gradient
        lion.step()
        expected = expected * (1 - 0.01 * 0.1) - 0.01 * torch.sign(0.8 * m + 0.2 * gradient)
        m = 0.9 * m + 0.1 * gradient
        assert torch.allclose(parameter, expected, atol=1e-7)


@pytest.mark.slow
def test_the_pages_lion_from_a_config_dir_trains_diloco_under_mpiexec_and_resumes_bit_for_bit(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    common = ["-m", "dtrain", "--config-dir", str(EXAMPLES / "outer_lion" / "conf"), "+recipe=digits",
              "learner=diloco", "learner/outer_optimizer=lion", "learner.outer_optimizer.lr=0.003",
              "session.max_samples=3000", "session.checkpoint.frequency=1504", "session.tensorboard=false"]
    env = {"PYTHONPATH": str(EXAMPLES / "outer_lion")}
    first = run_mpi(2, common + [f"run_dir={whole}"], timeout=240, env=env)
    assert first.returncode == 0, first.report()
    assert "outer optimizer Lion (lr 0.003, betas [0.9, 0.99], weight_decay 0)" in first.stdout, first.stdout
    accuracy = float(re.search(r"test: accuracy ([\d.]+)%", first.stdout).group(1))
    assert accuracy >= 90.0, first.stdout  # measured 92.59%; DiLoCo's own outer SGD 87.88% at this length
    # a block learner checkpoints at the first block end past the frequency's multiple
    middle = next(path for path in sorted(whole.glob("checkpoint-*.pt")) if path.name != "checkpoint-3000.pt")
    saved = checkpoint.load(middle)["learner"]["block"]
    assert saved["outer_optimizer_type"] == "outer_lion.Lion"
    assert saved["outer_optimizer"]["state"][0]["exp_avg"].abs().sum() > 0
    second = run_mpi(2, common + [f"run_dir={resumed}", f"session.checkpoint.restore_from={middle}"],
                     timeout=240, env=env)
    assert second.returncode == 0, second.report()
    a, b = checkpoint.load(whole / "checkpoint-3000.pt"), checkpoint.load(resumed / "checkpoint-3000.pt")
    assert all(torch.equal(a["model"][name], b["model"][name]) for name in a["model"])
    assert torch.equal(a["learner"]["block"]["outer_optimizer"]["state"][0]["exp_avg"],
                       b["learner"]["block"]["outer_optimizer"]["state"][0]["exp_avg"])

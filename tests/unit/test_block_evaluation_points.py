"""Cross-validation and checkpoints wait for a block end with block learners, so they never change training.

An evaluation or checkpoint needs one model, i.e. a sync; at a point inside a block that sync would be
an extra outer step on a partial block (for DiLoCo as large as a full block's: its outer momentum
and learning rate do not shrink with the block), and the run would train differently from the same
run without them.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain import CheckpointConfig, CrossValidationConfig, MinibatchSource, training_session
from dtrain.learners import BlockMomentumLearner, DiLoCoLearner

from tests.helpers.bmuf_reference import flat, train_learner_shares
from tests.helpers.thread_world import FakeWorld
from tests.helpers.toy_data import four_class_data

BLOCK = 64
MINIBATCH = 16


def train(run_dir, every: int | None):
    """DiLoCo in one process, 320 samples; checkpoints and cross-validation ``every`` samples (None: at the end)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    learner = DiLoCoLearner(torch.optim.AdamW(model.parameters(), lr=0.01), None, block_size=BLOCK,
                            distributed_after=0)
    cv = CrossValidationConfig(MinibatchSource(four_class_data(40, seed=1), randomize=False, max_sweeps=1),
                               frequency=every, minibatch_size=20)
    session = training_session(model=model, loss=nn.functional.cross_entropy, learner=learner,
                               minibatch_source=MinibatchSource(four_class_data(200, 0), randomization_seed=3),
                               minibatch_size=MINIBATCH, max_samples=320,
                               checkpoint_config=CheckpointConfig("ckpt.pt", frequency=every, preserve_all=True),
                               cv_config=cv, run_dir=run_dir, tensorboard=False)
    session.train()
    return torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()]), learner


def test_checkpoints_and_cv_inside_a_block_wait_for_its_end_and_leave_training_unchanged(tmp_path):
    plain, plain_learner = train(tmp_path / "plain", None)
    evaluated, learner = train(tmp_path / "evaluated", 80)  # 80 = 1.25 blocks: every due point is inside a block
    assert learner.syncs == plain_learner.syncs == 320 // BLOCK
    assert torch.equal(evaluated, plain)
    saved = sorted(int(path.stem.split("-")[-1]) for path in (tmp_path / "evaluated").glob("ckpt-*.pt"))
    assert saved and all(samples % BLOCK == 0 for samples in saved), saved


# -- the sync at the end of a run, on a partial block ------------------------------------------------

def _double_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()


@pytest.mark.parametrize("learner_class", [BlockMomentumLearner, DiLoCoLearner])
def test_the_sync_at_the_end_of_a_partial_block_averages_the_workers_and_keeps_the_outer_state(learner_class):
    """Two blocks and a third 3/8 done, then ``synchronize()`` (what the session calls at the end):
    every worker holds the mean of the two workers' models, not an outer step, and the outer state
    (BMUF's ``sg``, DiLoCo's velocity) is what the last full block left; an outer step there would
    move the model by a whole block's momentum after three local steps."""
    generator = torch.Generator().manual_seed(4)
    features = torch.randn(400, 6, generator=generator, dtype=torch.float64)
    targets = torch.randn(400, 4, generator=generator, dtype=torch.float64)

    def local_loss(model, start, stop):
        return nn.functional.mse_loss(model(features[start:stop]), targets[start:stop])

    def worker(comm):
        model = _double_model()
        learner = learner_class(torch.optim.AdamW(model.parameters(), lr=0.02), comm, block_size=64,
                                distributed_after=0)
        learner.prepare(model)
        train_learner_shares(learner, model, local_loss, [8] * 19)  # 2 blocks of 8 minibatches, then 3
        assert learner.syncs == 2 and learner.global_samples_in_block == 24
        outer_state = learner.smoothed_gradient.clone()
        assert outer_state.abs().max() > 0
        mine = flat(model.parameters())
        learner.synchronize()
        return mine, flat(model.parameters()), outer_state, learner.smoothed_gradient.clone(), learner.syncs

    results = FakeWorld(2).run(worker)
    mean = (results[0][0] + results[1][0]) / 2
    assert not torch.allclose(results[0][0], results[1][0])  # the workers had drifted apart
    for _, synced, before, after, syncs in results:
        assert torch.allclose(synced, mean, atol=1e-14, rtol=0)
        assert torch.equal(after, before)
        assert syncs == 3

"""Cross-validation and checkpoints wait for a block end with block learners, so they never change training.

An evaluation or checkpoint needs one model, i.e. a sync; at a point inside a block that sync would be
an extra outer step on a partial block (for DiLoCo as large as a full block's: its outer momentum
and learning rate do not shrink with the block), and the run would train differently from the same
run without them.
"""
from __future__ import annotations

import torch
from torch import nn

from dtrain import CheckpointConfig, CrossValidationConfig, MinibatchSource, training_session
from dtrain.learners import DiLoCoLearner

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

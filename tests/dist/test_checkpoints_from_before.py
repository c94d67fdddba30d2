"""Checkpoints written before the block-learner base and the exchange reshaping still restore, and
the resumed run ends bit-identical to the uninterrupted run of that code.

The fixtures (tests/fixtures/checkpoints_before_block_base) were written at 2 ranks by the code
before that change: ``NAME-640.pt`` is the checkpoint at 640 samples of a run of
``COMMON + LEARNERS[NAME]``, ``NAME-1280-model.pt`` the model of the same run uninterrupted to 1280.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.mpi import run_mpi

from dtrain.session import checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints_before_block_base"
COMMON = ["-m", "dtrain", "+recipe=digits", "session.minibatch_size=64", "session.checkpoint.frequency=640",
          "session.progress_frequency=640", "session.tensorboard=false", "model.hidden=16", "session.max_samples=1280"]
LEARNERS = {
    "quantized": ["learner=quantized", "learner.num_quantization_bits=2", "learner.distributed_after=0"],
    "bm_quantized": ["learner=block_momentum", "learner.block_size=320", "learner.distributed_after=0",
                     "learner/exchange=quantized", "learner.exchange.num_bits=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LEARNERS))
def test_a_checkpoint_from_before_restores_and_resumes_bit_identically(name, tmp_path):
    saved = FIXTURES / f"{name}-640.pt"
    result = run_mpi(2, [*COMMON, *LEARNERS[name], f"run_dir={tmp_path}", f"session.checkpoint.restore_from={saved}"],
                     timeout=300)
    assert result.returncode == 0, result.report()
    assert f"restored {saved} at 640 samples" in result.stdout, result.report()
    expected = torch.load(FIXTURES / f"{name}-1280-model.pt", weights_only=True)
    resumed = checkpoint.load(tmp_path / "checkpoint-1280.pt")["model"]
    assert expected.keys() == resumed.keys()
    for key in expected:
        assert torch.equal(expected[key], resumed[key]), f"{key} differs from the uninterrupted run before the change"

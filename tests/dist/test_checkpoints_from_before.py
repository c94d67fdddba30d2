"""Checkpoints written before the block-learner base and the exchange reshaping still restore, and
the resumed run ends bit-identical to the uninterrupted run of that code.

The fixtures (tests/fixtures/checkpoints_before_block_base) were written at 2 ranks by the code
before that change (commit 2ac7ebb): ``NAME-640.pt`` is the checkpoint at 640 samples of a run of
``COMMON + LEARNERS[NAME]``, ``NAME-1280-model.pt`` the model of the same run at 1280 samples, and
``written_on.json`` the machine's float facts. Bit-identical is asserted on a machine with the same
facts; on another the resumed run agrees to rounding grown over 10 steps (measured: 2e-7 and 1e-4 of
each tensor's largest value), while a resume that lost a state is far off (measured: 0.36 without the
momentum, 0.75-0.90 without the error-feedback residuals, 3.6 without the block's state).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.float_machine import float_machine
from tests.helpers.learners import learners
from tests.helpers.mpi import run_mpi

from dtrain.session import checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints_before_block_base"
COMMON = ["-m", "dtrain", "+recipe=digits", "session.minibatch_size=64", "session.checkpoint.frequency=640",
          "session.progress_frequency=640", "session.tensorboard=false", "model.hidden=16", "session.max_samples=1280"]
#: the runs that wrote the fixtures (their overrides must stay as they were then)
LEARNERS = learners("quantized", "bm_quantized")

#: the largest difference accepted on a machine other than the fixtures', relative to the tensor's largest value
ROUNDING_ON_OTHER_MACHINES = 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LEARNERS))
def test_a_checkpoint_from_before_restores_and_resumes_bit_identically(name, tmp_path):
    saved = FIXTURES / f"{name}-640.pt"
    result = run_mpi(2, [*COMMON, *LEARNERS[name], f"run_dir={tmp_path}", f"session.checkpoint.restore_from={saved}"],
                     timeout=300)
    assert result.returncode == 0, result.report()
    assert f"restored {saved} at 640 samples" in result.stdout, result.report()
    expected = torch.load(FIXTURES / f"{name}-1280-model.pt", weights_only=True)
    written_on = json.loads((FIXTURES / "written_on.json").read_text())
    same_machine = all(written_on[key] == value for key, value in float_machine().items())
    resumed = checkpoint.load(tmp_path / "checkpoint-1280.pt")["model"]
    assert expected.keys() == resumed.keys()
    for key in expected:
        if same_machine:
            assert torch.equal(expected[key], resumed[key]), f"{key} differs from the uninterrupted run before the change"
        else:
            scale = float(expected[key].abs().max())
            difference = float((expected[key] - resumed[key]).abs().max())
            assert difference <= ROUNDING_ON_OTHER_MACHINES * scale, (key, difference, scale, float_machine())

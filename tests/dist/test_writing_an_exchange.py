"""docs/writing-an-exchange.md's top-k strategy, plugged in from outside the package with --config-dir:
the page shows the tested code, the sum and the error feedback match an independent reference, and
data_parallel trains with it under mpiexec, saving each rank's residuals in its checkpoint."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dtrain.session import checkpoint

from tests.helpers.examples import EXAMPLES, import_example
from tests.helpers.mpi import run_mpi
from tests.helpers.thread_world import FakeWorld

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = EXAMPLES / "topk"


def _topk_class():
    """The page's ``topk.py``, imported from its file (as ``PYTHONPATH`` makes dtrain import it)."""
    return import_example("topk", "topk").TopK


def test_the_page_shows_the_tested_example_unchanged():
    page = (ROOT / "docs" / "writing-an-exchange.md").read_text()
    assert (EXAMPLE / "topk.py").read_text() in page
    assert (EXAMPLE / "conf" / "learner" / "exchange" / "topk.yaml").read_text() in page


def test_topk_sums_the_largest_values_with_error_feedback_against_a_reference():
    TopK = _topk_class()
    inputs = [torch.tensor([[0.5, -4.0, 0.1, 2.0, 0.0, -0.2], [3.0, 0.1, -0.3, 0.2, -1.5, 0.05]][rank])
              for rank in range(2)]

    def reference_step(values, errors, k=2):
        """Each rank sends its k largest |x + e|; the sum of what was sent, and what each keeps."""
        total, kept = torch.zeros(6), []
        for value, error in zip(values, errors):
            corrected = value + error
            chosen = corrected.abs().argsort(descending=True)[:k]
            sent = torch.zeros(6)
            sent[chosen] = corrected[chosen]
            total += sent
            kept.append(corrected - sent)
        return total, kept

    def work(comm):
        strategy = TopK(fraction=1 / 3)  # 2 of 6 values
        strategy.bind(comm)
        results = []
        for _ in range(2):
            strategy.begin_step()
            results.append(strategy.allreduce_("bucket", inputs[comm.rank].clone(), [torch.Size([6])]).clone())
        state = strategy.state_dict()
        strategy.close()
        return results, state, strategy.bytes_sent_last_step

    (first, state0, sent0), (second, state1, _) = FakeWorld(2).run(work)
    errors = [torch.zeros(6), torch.zeros(6)]
    for step in range(2):
        expected, errors = reference_step(inputs, errors)
        assert torch.equal(first[step], second[step])  # bit-identical on every rank
        assert torch.allclose(first[step], expected, atol=1e-7), (step, first[step], expected)
    assert torch.allclose(state0["errors"]["bucket"], errors[0]) and torch.allclose(state1["errors"]["bucket"], errors[1])
    assert sent0 == 2 * (4 + 8)  # one peer, 2 float32 values and 2 int64 indices
    with pytest.raises(ValueError, match="fraction=0: expected"):
        TopK(fraction=0)


@pytest.mark.slow
def test_topk_from_a_config_dir_trains_data_parallel_under_mpiexec(run_dir):
    result = run_mpi(2, ["-m", "dtrain", "--config-dir", str(EXAMPLE / "conf"), "+recipe=digits",
                         "learner=data_parallel", "learner/exchange=topk", "learner.exchange.fraction=0.1",
                         "session.max_samples=3000", "session.tensorboard=false", f"run_dir={run_dir}"],
                     timeout=300, env={"PYTHONPATH": str(EXAMPLE)})
    assert result.returncode == 0, result.report()
    assert "gradients exchanged by top-0.1" in result.stdout, result.stdout
    state = checkpoint.load(run_dir / "checkpoint-3000.pt")
    assert state["identity"]["learner"]["exchange"] == {"name": "topk", "fraction": 0.1}
    residuals = [entry["learner"]["errors"] for entry in state["per_rank"]]
    assert len(residuals) == 2 and all(errors for errors in residuals)
    assert not torch.equal(residuals[0][0], residuals[1][0])  # each rank's own error feedback
    accuracy = float(re.search(r"test: accuracy ([\d.]+)%", result.stdout).group(1))
    assert accuracy >= 80.0, result.stdout

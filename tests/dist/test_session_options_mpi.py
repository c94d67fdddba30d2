"""Session settings under a real ``mpiexec -n 2``: micro-batches (one exchange per minibatch),
gradient clipping on the global gradient and fp16 overflow skipping, for every learner, and the
compile check's one verdict for all ranks.

One launch runs every check of ``_session_options_worker.py``; each is asserted in its own test.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checks import CheckLaunch, launch_checks

WORKER = Path(__file__).with_name("_session_options_worker.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> CheckLaunch:
    """One run of every check of ``_session_options_worker.py`` on 2 ranks."""
    run_dir = tmp_path_factory.mktemp("session_options")
    return launch_checks(2, [WORKER, run_dir / "runs"], run_dir / "checks", timeout=180)


def test_micro_batches_exchange_once_per_minibatch_and_equal_one_pass(launch: CheckLaunch) -> None:
    micro = launch.result("micro_batches")
    assert micro["largest_pass"] == 2 and micro["passes"] > micro["minibatches"]
    # every bucket all-reduced exactly once per minibatch, however many passes computed it
    assert micro["bucket_allreduces"] == micro["num_buckets"] * micro["minibatches"], micro
    assert micro["moved"] > 0.1
    assert micro["difference_to_uncapped"] < 1e-5 and micro["difference_to_one_process"] < 1e-5, micro
    assert micro["differing_parameters"] == [], micro


def test_clipping_clips_the_global_gradient_for_every_learner(launch: CheckLaunch) -> None:
    clipping = launch.result("clipping")
    assert clipping["clip_changes_the_result"] > 0.01  # the clip is active in this run
    for learner in ("data_parallel", "quantized"):
        assert clipping[learner]["difference_to_one_process"] < 1e-5, clipping
        assert clipping[learner]["differing_parameters"] == [], clipping
    block = clipping["block_momentum"]
    assert block["local_steps"] > 0 and block["largest_norm_stepped"] <= 0.05 * (1 + 1e-5), block
    assert block["differing_parameters"] == [], block


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(launch: CheckLaunch) -> None:
    # fp16: rank 1's overflow skips the step on both ranks, and both halve the loss scale
    fp16 = launch.result("fp16")
    for learner in ("data_parallel", "quantized", "block_momentum"):
        record = fp16[learner]
        assert record["skipped_and_scale_per_rank"] == [[1, 32768.0], [1, 32768.0]], (learner, record)
        assert record["finite"] and record["differing_parameters"] == [], (learner, record)


def test_a_compiled_model_that_differs_from_eager_on_one_rank_is_refused_on_every_rank(launch: CheckLaunch) -> None:
    record = launch.result("compile_check")
    first, second = record["refusals"]
    assert first is not None and first == second, record  # the same line on both ranks
    assert first.startswith("session.compile=true: torch.compile computes the gradient of 0.weight 100% away"), first
    assert record["unchanged"] == [True, True], record


def test_the_launch_ends_cleanly(launch: CheckLaunch) -> None:
    assert launch.returncode == 0, launch.output

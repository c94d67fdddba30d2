"""Sequences under a real mpiexec: samples are tokens, and N ranks equal one process on the token mean.

One launch per world size runs every check of ``_sequence_worker.py``; each check is asserted in a
test of its own (``tests.helpers.checks``).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checks import CheckLaunch, launch_checks

WORKER = Path(__file__).with_name("_sequence_worker.py")

pytestmark = pytest.mark.timeout(200)


@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"nprocs={n}")
def launch(request, tmp_path_factory) -> CheckLaunch:
    run_dir = tmp_path_factory.mktemp(f"sequences{request.param}")
    return launch_checks(request.param, [WORKER, run_dir / "runs"], run_dir / "checks", timeout=190)


def test_language_model_on_n_ranks_equals_one_process_on_the_token_mean(launch: CheckLaunch) -> None:
    """A causal attention LM (text[:-1] -> text[1:]) on uneven sequences: N ranks weighted by their tokens give
    one process's update, with and without micro-batches, and every rank holds the same parameters."""
    figures = launch.result("language_model")
    assert figures["size"] == launch.nprocs
    assert figures["minibatches_with_uneven_shares"] >= 5, figures  # the ranks' token counts really differ
    assert figures["parameters_moved_by"] > 0.1, figures  # the comparison is not vacuous
    for micro in ("None", "9"):
        assert figures[f"max_difference_to_one_process_micro{micro}"] <= 1e-5, figures
        assert figures[f"differing_parameters_micro{micro}"] == [], figures
        assert figures[f"samples_seen_micro{micro}"] >= 700, figures  # whole sequences: at least max_samples


def test_sequences_near_the_per_rank_share_are_dealt_evenly_and_the_update_stays_one_process(launch: CheckLaunch) -> None:
    """Sequences of 1..3B/2N tokens, where shares cut by cumulative steps left ranks empty (6 shares at 2 ranks, 10
    at 4; rank 0 trained 22 of 300 tokens at 2): every rank's tokens stay within B/N plus the minibatch's longest
    sequence, none is empty while the minibatch has N sequences, the ranks' totals are even, and the parameters
    equal one process's."""
    figures = launch.result("dealt_shares")
    assert figures["with_n_sequences"] >= 5 and figures["minibatches_with_uneven_shares"] >= 5, figures
    assert figures["empty_shares_with_n_sequences"] == 0, figures
    assert figures["max_tokens_above_share_plus_longest"] <= 0, figures
    tokens = figures["tokens_per_rank"]
    assert min(tokens) >= 0.5 * sum(tokens) / len(tokens), figures
    assert figures["parameters_moved_by"] > 0.05, figures
    assert figures["max_difference_to_one_process"] <= 1e-5, figures
    assert figures["differing_parameters"] == [], figures


def test_seq2seq_on_n_ranks_equals_one_process_in_training_and_evaluation(launch: CheckLaunch) -> None:
    """A GRU encoder-decoder with keyword inputs (source, target[:-1]) and target[1:]: the same parameters as
    one process, and cross-validation and test figures (token loss, sequence error) equal to float rounding."""
    figures = launch.result("seq2seq")
    assert figures["max_difference_to_one_process"] <= 1e-5, figures
    assert figures["differing_parameters"] == [], figures
    assert figures["test"][2] == figures["test_one_process"][2] > 0, figures
    for mine, reference in ((figures["test"], figures["test_one_process"]), (figures["cv"], figures["cv_one_process"])):
        assert abs(mine[0] - reference[0]) <= 1e-5 and abs(mine[1] - reference[1]) <= 1e-9, figures


def test_the_launch_ends_cleanly(launch: CheckLaunch) -> None:
    assert launch.returncode == 0, launch.output

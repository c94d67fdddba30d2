"""PowerSGD's automatic rank: the smallest power of two whose best approximation of the last all-reduced
gradient leaves at most ``AUTO_RANK_ERROR`` of it out, chosen once, the same on every rank, kept in checkpoints."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.config import compose_config
from tests.helpers.thread_world import FakeWorld
from dtrain.compress.lowrank import CANDIDATE_RANKS, choose_rank, tail_energies
from dtrain.exchange import PowerSGD


def matrix_with_singular_values(values, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """``U diag(values) V^T`` with random orthonormal ``U`` (rows) and ``V`` (cols)."""
    generator = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(values), generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, len(values), generator=generator, dtype=torch.float64))
    return (u * torch.tensor(values, dtype=torch.float64)) @ v.T


def test_tail_energies_are_the_squares_beyond_the_rank_and_zero_for_a_matrix_sent_whole():
    values = [8.0, 4.0, 2.0, 1.0, 0.5, 0.25]
    big = matrix_with_singular_values(values, 40, 30)
    small = matrix_with_singular_values([3.0, 1.0], 4, 3, seed=1)  # (4 + 3) * r * 2 >= 12 for every r: sent whole
    tails, total = tail_energies([big, small], min_compression_rate=2.0)
    squares = [value ** 2 for value in values]
    assert total == pytest.approx(sum(squares) + 10.0)
    for rank in (1, 2, 4):
        assert tails[rank] == pytest.approx(sum(squares[rank:]), rel=1e-9)
    # rank 8: (40 + 30) * 8 * 2 = 1,120 < 1,200, compressed, with all 6 values kept
    assert tails[8] == pytest.approx(0.0, abs=1e-9)
    assert all(tails[rank] == 0.0 for rank in CANDIDATE_RANKS if rank >= 16)  # sent whole at 16 and beyond


def test_choose_rank_takes_the_smallest_power_of_two_within_the_error():
    tails = {1: 64.0, 2: 16.0, 4: 3.0, 8: 0.0}
    total = 100.0
    assert choose_rank(tails, total, max_error=0.2) == (4, pytest.approx(math.sqrt(0.03)))
    assert choose_rank(tails, total, max_error=0.4) == (2, pytest.approx(0.4))
    assert choose_rank(tails, 0.0) == (1, 0.0)  # a zero gradient: nothing to keep


def exchange_steps(comm, gradients, shapes, exchange=None, state=None, **settings):
    """Runs one bucket through ``exchange`` (a new auto-rank PowerSGD unless given) for each of ``gradients``;
    returns the exchange and the results."""
    if exchange is None:
        exchange = PowerSGD(matrix_approximation_rank="auto", use_error_feedback=False, **settings)
        exchange.bind(comm)
        if state is not None:
            exchange.load_state_dict(state)
    results = []
    for gradient in gradients:
        exchange.begin_step()
        results.append(exchange.start(0, gradient.clone(), shapes).wait().clone())
    return exchange, results


SHAPES = [torch.Size([48, 40]), torch.Size([40])]


def gradient_of(values, seed: int) -> torch.Tensor:
    """A flat bucket: a 48x40 matrix of the given singular values, and a bias."""
    return torch.cat([matrix_with_singular_values(values, 48, 40, seed).float().reshape(-1),
                      torch.full((40,), 0.01)])


def test_the_rank_comes_from_the_last_all_reduce_step_and_compression_follows():
    full_rank = gradient_of([1.0] * 40, seed=0)    # needs rank 32 to keep within 0.2
    rank_three = gradient_of([3.0, 2.0, 1.0, 0.1, 0.1], seed=1)  # rank 4 leaves about 0.027 out
    # seen by 2 ranks, each with half: the all-reduced sum is the gradient above
    halves = [full_rank / 2, rank_three / 2, rank_three / 2]

    def run(comm):
        exchange, results = exchange_steps(comm, halves, SHAPES, start_powersgd_iter=2)
        return exchange, results

    (first, results), (second, _) = FakeWorld(2).run(run)
    assert first.matrix_approximation_rank == second.matrix_approximation_rank == 4  # step 2's, not step 1's
    assert torch.allclose(results[1], rank_three, atol=1e-6)  # the measured step is a plain all-reduce
    assert first.bytes_sent_last_step < first.full_precision_bytes_last_step / 2
    assert "powersgd rank 4 (auto)" in first.describe()


def test_every_rank_takes_rank_zeros_choice():
    """The ranks measure the same all-reduced numbers; should they ever decide otherwise, P and Q must
    still fit: rank 0's choice is broadcast."""
    gradient = gradient_of([3.0, 2.0, 1.0, 0.1, 0.1], seed=1)

    def run(comm):
        exchange, _ = exchange_steps(comm, [gradient / 2], SHAPES, start_powersgd_iter=1)
        if comm.rank == 1:  # pretend rank 1 measured a full-rank gradient
            exchange._spectrum["tails"] = [1.0] * len(CANDIDATE_RANKS)
        exchange, results = exchange_steps(comm, [gradient / 2], SHAPES, exchange=exchange)
        return exchange.matrix_approximation_rank, results[0]

    (rank_a, result_a), (rank_b, result_b) = FakeWorld(2).run(run)
    assert rank_a == rank_b == 4
    assert torch.equal(result_a, result_b)


def test_start_zero_all_reduces_one_step_to_measure_it():
    gradient = gradient_of([3.0, 2.0, 1.0, 0.1, 0.1], seed=1)

    def run(comm):
        return exchange_steps(comm, [gradient / 2, gradient / 2], SHAPES, start_powersgd_iter=0)

    exchange, results = FakeWorld(2).run(run)[0]
    assert torch.equal(results[0], gradient)  # measured: exact
    assert exchange.matrix_approximation_rank == 4
    assert exchange.bytes_sent_last_step < exchange.full_precision_bytes_last_step / 2  # compressed at once after


def test_a_checkpoint_between_the_measured_step_and_the_choice_resumes_to_the_same_result():
    gradients = [gradient_of([3.0, 2.0, 1.0, 0.5, 0.2], seed=seed) for seed in range(5)]

    def straight(comm):
        return exchange_steps(comm, gradients, SHAPES, start_powersgd_iter=2)[1]

    def resumed(comm):
        exchange, first = exchange_steps(comm, gradients[:2], SHAPES, start_powersgd_iter=2)
        assert exchange.matrix_approximation_rank is None  # measured, not yet chosen
        state = exchange.state_dict()
        exchange.close()
        again, rest = exchange_steps(comm, gradients[2:], SHAPES, state=state, start_powersgd_iter=2)
        saved_later = again.state_dict()
        assert saved_later["auto_rank"]["rank"] == 4
        return first + rest

    expected = FakeWorld(1).run(straight)[0]
    got = FakeWorld(1).run(resumed)[0]
    for want, have in zip(expected, got):
        assert torch.equal(want, have)


def test_identity_says_auto_and_the_presets_choose_it():
    assert PowerSGD(matrix_approximation_rank="auto").identity()["matrix_approximation_rank"] == "auto"
    assert PowerSGD(matrix_approximation_rank=4).identity()["matrix_approximation_rank"] == 4
    for learner in ("powersgd", "two_level_powersgd"):
        cfg = compose_config("+recipe=digits", f"learner={learner}")
        assert cfg.learner.exchange.matrix_approximation_rank == "auto"


def test_a_rank_that_is_neither_a_number_nor_auto_is_refused():
    with pytest.raises(ValueError, match=r"matrix_approximation_rank='most'.*whole number of at least 1 or auto"):
        PowerSGD(matrix_approximation_rank="most")

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
from dtrain.learners.base import RunFacts


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


# -- re-checks while the learning rate warms up ------------------------------------------------------------
LOW_RANK = gradient_of([3.0, 2.0, 1.0, 0.1, 0.1], seed=1)   # rank 4
FULL_RANK = gradient_of([1.0] * 40, seed=0)                 # rank 16: sent whole


def planned(comm, warmup_steps: int | None, steps: int = 12, start: int = 2) -> PowerSGD:
    """An auto-rank PowerSGD bound to ``comm`` and planned as a learner plans it (``warmup_exchange_steps``)."""
    exchange = PowerSGD(matrix_approximation_rank="auto", use_error_feedback=False, start_powersgd_iter=start)
    exchange.bind(comm)
    exchange.plan(RunFacts(warmup_exchange_steps=warmup_steps), steps=steps)
    return exchange


def test_a_rank_measured_inside_the_warm_up_is_measured_again_after_it_and_only_raised():
    """Measured at step 2 of a warm-up of 8 steps: re-measured at step 4 (twice as many steps) and at step 9
    (the first past the warm-up), each on a plain all-reduce step; the later, higher-rank gradient raises the
    rank, a later lower-rank one does not lower it."""
    gradients = [LOW_RANK, LOW_RANK, LOW_RANK, FULL_RANK, LOW_RANK, LOW_RANK, LOW_RANK, LOW_RANK, LOW_RANK, LOW_RANK]

    def run(comm):
        exchange = planned(comm, warmup_steps=8)
        ranks = []
        results = []
        for gradient in gradients:
            results.append(exchange_steps(comm, [gradient / 2], SHAPES, exchange=exchange)[1][0])
            ranks.append(exchange.matrix_approximation_rank)
        return exchange, ranks, results

    exchange, ranks, results = FakeWorld(2).run(run)[0]
    assert exchange._recheck_steps == (3, 8)
    assert "re-checked at steps 4 and 9, as the learning rate warms up over the first 8" in exchange.describe_plan()
    assert exchange.describe() == "powersgd rank 16 (auto), error feedback off"  # progress lines stay short
    assert ranks == [None, None, 4, 4, 16, 16, 16, 16, 16, 16]  # chosen at the compressed step after a measurement
    assert torch.equal(results[3], FULL_RANK) and torch.equal(results[8], LOW_RANK)  # re-checks: exact sums


def test_no_re_check_when_the_rank_is_measured_past_the_warm_up_or_there_is_none():
    def run(comm):
        return [planned(comm, warmup_steps=warmup, start=start)._recheck_steps
                for warmup, start in ((4, 5), (4, 6), (0, 2), (None, 2))]

    assert FakeWorld(1).run(run)[0] == [(), (), (), ()]


def test_a_run_that_ends_inside_the_warm_up_re_checks_until_its_last_compressed_step_and_says_so():
    def run(comm):
        return planned(comm, warmup_steps=20, steps=10, start=1)

    exchange = FakeWorld(1).run(run)[0]
    assert exchange._recheck_steps == (3, 7)  # after 4 and 8 steps; a re-check needs a compressed step after it
    assert "this run of 10 ends inside the warm-up" in exchange.describe_plan()


def test_a_checkpoint_between_a_re_check_and_the_rank_it_raises_resumes_to_the_same_result():
    gradients = [LOW_RANK, LOW_RANK, FULL_RANK, FULL_RANK, LOW_RANK, FULL_RANK, LOW_RANK]

    def straight(comm):
        exchange = planned(comm, warmup_steps=8)
        return exchange_steps(comm, gradients, SHAPES, exchange=exchange)[1]

    def resumed(comm):
        exchange = planned(comm, warmup_steps=8)
        first = exchange_steps(comm, gradients[:4], SHAPES, exchange=exchange)[1]
        assert exchange.matrix_approximation_rank == 4 and exchange._spectrum["step"] == 3  # re-measured, not applied
        state = exchange.state_dict()
        exchange.close()
        again = planned(comm, warmup_steps=8)
        again.load_state_dict(state)
        rest = exchange_steps(comm, gradients[4:], SHAPES, exchange=again)[1]
        assert again.matrix_approximation_rank == 16
        return first + rest

    for want, have in zip(FakeWorld(1).run(straight)[0], FakeWorld(1).run(resumed)[0]):
        assert torch.equal(want, have)


def test_the_learner_tells_its_exchange_the_steps_the_learning_rate_warms_up_over():
    """The language model shortened to a tenth (512,000 samples, minibatch 2,048, warm-up 409,600): the rank is
    measured at step 25 of 250, inside the warm-up of 200 steps, so re-checked at steps 50, 100 and 201."""
    from dtrain.learners import DataParallelLearner
    from tests.helpers.thread_world import FakeComm

    learner = DataParallelLearner(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                                  FakeComm(FakeWorld(2), 0), exchange=PowerSGD(matrix_approximation_rank="auto",
                                                                               start_powersgd_iter="auto"))
    learner.plan(RunFacts(max_samples=512_000, minibatch_size=2048, warmup_samples=409_600))
    assert learner.exchange._recheck_steps == (49, 99, 200)
    assert "re-checked at steps 50, 100 and 201, as the learning rate warms up over the first 200" in learner.describe()
    full_run = DataParallelLearner(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                                   FakeComm(FakeWorld(2), 0), exchange=PowerSGD(matrix_approximation_rank="auto",
                                                                                start_powersgd_iter="auto"))
    full_run.plan(RunFacts(max_samples=5_120_000, minibatch_size=2048, warmup_samples=409_600))
    assert full_run.exchange._recheck_steps == ()  # measured at step 250, past the warm-up: as before


def test_the_session_tells_the_learner_its_learning_rate_warm_up(tmp_path):
    import io

    from dtrain import LocalLearner, MinibatchSource, Schedule, training_session
    from tests.helpers.toy_data import four_class_data

    model = torch.nn.Linear(6, 4)
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1))
    training_session(model, torch.nn.functional.cross_entropy, learner, MinibatchSource(four_class_data(64, 0)),
                     minibatch_size=16, max_samples=32, lr_schedule=Schedule(1.0, warmup_samples=48),
                     progress_frequency=0, run_dir=tmp_path, tensorboard=False, stream=io.StringIO()).train()
    assert learner.run_facts.warmup_samples == 48


def test_a_block_learner_tells_its_exchange_the_warm_up_in_syncs():
    """Under block momentum the exchange's steps are syncs: 63 of them (4 minibatches each), the rank measured at
    sync 7, the warm-up's 200 minibatches over after 50 syncs."""
    from dtrain.learners import BlockMomentumLearner
    from tests.helpers.thread_world import FakeComm

    learner = BlockMomentumLearner(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                                   FakeComm(FakeWorld(2), 0), block_size=4 * 2048, distributed_after=0,
                                   exchange=PowerSGD(matrix_approximation_rank="auto"))
    learner.plan(RunFacts(max_samples=512_000, minibatch_size=2048, warmup_samples=409_600))
    assert learner.exchange._recheck_steps == (13, 27, 50)
    assert "re-checked at syncs 14, 28 and 51, as the learning rate warms up over the first 50" in learner.describe()

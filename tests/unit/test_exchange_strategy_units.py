"""Exchange strategies of the data-parallel learner, in one process (threads stand in for ranks):
configuration and its one-line errors, checkpoint identities, the fp16 overflow and loss-scaling
guards, PowerSGD's auto start, and the seam's timing attribute. Multi-process behaviour (identical
ranks, resume) is in tests/dist/test_exchange_strategies.py."""
from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.helpers.config import compose_config
from tests.helpers.thread_world import FakeComm, FakeWorld
from dtrain.comm import HostGroups, LocalCommunicator
from dtrain.config import validate
from dtrain.exchange import AllReduce, BetweenHosts, CompressedAllReduce, PowerSGD, Quantized
from dtrain.learners import DataParallelLearner, data_parallel_distributed_learner
from dtrain.learners.base import Learner, RunFacts


def sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(4, 3).parameters(), lr=0.1)


# -- configuration ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, expected", [
    (["learner=data_parallel"], AllReduce),
    (["learner=data_parallel", "learner/exchange=bf16"], CompressedAllReduce),
    (["learner=data_parallel", "learner/exchange=fp16"], CompressedAllReduce),
    (["learner=data_parallel", "learner/exchange=quantized"], Quantized),
    (["learner=data_parallel", "learner/exchange=powersgd"], PowerSGD),
    (["learner=powersgd"], PowerSGD),
])
def test_every_exchange_option_builds_its_strategy(overrides, expected):
    cfg = compose_config("+recipe=digits", *overrides)
    assert validate(cfg, check_run_dir=False) == []
    learner = instantiate(cfg.learner, optimizer=sgd(), comm=LocalCommunicator())
    assert type(learner) is DataParallelLearner and type(learner.exchange) is expected


def test_the_quantized_preset_is_the_data_parallel_learner_with_the_k_bit_exchange():
    cfg = compose_config("+recipe=digits", "learner=quantized", "learner.exchange.num_bits=2")
    learner = instantiate(cfg.learner, optimizer=sgd(), comm=LocalCommunicator())
    assert type(learner) is DataParallelLearner and type(learner.exchange) is Quantized
    assert learner.exchange.num_bits == 2 and learner.distributed_after_is_auto
    same = compose_config("+recipe=digits", "learner=data_parallel", "learner/exchange=quantized",
                          "learner.exchange.num_bits=2")
    assert OmegaConf.to_container(same.learner) == OmegaConf.to_container(cfg.learner)


def test_powersgd_preset_starts_compression_after_a_tenth_of_the_run():
    cfg = compose_config("+recipe=digits", "learner=powersgd")
    learner = instantiate(cfg.learner, optimizer=sgd(), comm=LocalCommunicator())
    learner.plan(RunFacts(samples_per_sweep=1500, max_samples=30000, minibatch_size=32))
    assert learner.exchange.rank_is_auto and learner.exchange.matrix_approximation_rank is None  # chosen at the start
    assert learner.exchange.start_powersgd_iter == math.ceil(0.1 * math.ceil(30000 / 32)) == 94
    unknown = PowerSGD(start_powersgd_iter="auto")
    unknown.plan(RunFacts())
    assert unknown.start_powersgd_iter == 1000  # the hook's default when the run's length is unknown


DIGITS_RUN = RunFacts(samples_per_sweep=1500, max_samples=30000, minibatch_size=32)


@pytest.mark.parametrize("learner, syncs", [("block_momentum", 51), ("diloco", 21)])
def test_powersgd_under_a_block_learner_counts_syncs_and_compresses_after_its_start(learner, syncs):
    """``learner=block_momentum learner/exchange=powersgd`` (and diloco) as a user gets it: the start counts
    syncs, 10% of the run's (digits at 2 workers after the warm start: block momentum's 448-sample blocks
    make 51 syncs, so 6; DiLoCo's 1,120-sample blocks 21, so 3), says so at start-up, and every sync after
    it sends far less than the float32 all-reduce of the ones before."""
    cfg = compose_config("+recipe=digits", f"learner={learner}", "learner/exchange=powersgd")
    features = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 4, (512,), generator=torch.Generator().manual_seed(1))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4)))

    def work(comm):
        model = models[comm.rank]
        built = instantiate(cfg.learner, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), comm=comm)
        built.plan(DIGITS_RUN)
        built.prepare(model)
        description, sent_per_sync, position = built.describe(), [], 0
        while built.syncs < built.exchange.start_powersgd_iter + 2:
            start, stop = (position + share for share in (0, 32)) if not built.is_distributed() else \
                (position + 16 * comm.rank, position + 16 * (comm.rank + 1))
            position += 32
            built.begin_minibatch(stop - start, 32)
            torch.nn.functional.cross_entropy(model(features[start % 512:][:stop - start]),
                                              targets[start % 512:][:stop - start]).backward()
            syncs = built.syncs
            built.step()
            if built.syncs != syncs:
                sent_per_sync.append((built.bytes_sent_last_step, built._full_precision_bytes_last_sync))
        built.finalize()
        return built.exchange.start_powersgd_iter, description, sent_per_sync

    for start, description, sent_per_sync in FakeWorld(2).run(work):
        assert start == math.ceil(0.1 * syncs), start
        # error feedback off for syncs: with it, block momentum and DiLoCo collapsed on digits
        assert (f"powersgd rank 1 (all-reduce for the first {start} syncs, auto: 10% of the run's {syncs}), error "
                f"feedback off") in description
        before, after = sent_per_sync[:start], sent_per_sync[start:]
        assert all(sent == full for sent, full in before), before
        assert after and all(sent * 10 < full for sent, full in after), after


def test_a_powersgd_start_beyond_the_run_is_named_in_one_warning():
    cfg = compose_config("+recipe=digits", "learner=block_momentum", "learner/exchange=powersgd",
                         "learner.exchange.start_powersgd_iter=1000")
    learner = instantiate(cfg.learner, optimizer=sgd(), comm=FakeComm(FakeWorld(2), 0))
    with pytest.warns(RuntimeWarning, match=r"start_powersgd_iter=1000 syncs of plain all-reduce, but this run makes "
                                            r"only 51 syncs: PowerSGD would never compress"):
        learner.plan(DIGITS_RUN)
    minibatch_steps = PowerSGD()
    with pytest.warns(RuntimeWarning, match=r"start_powersgd_iter=1000 steps .* only 938 steps"):
        minibatch_steps.plan(DIGITS_RUN)  # torch's 1000 minibatches outlast the digits run too
    assert minibatch_steps.use_error_feedback  # the hook's default for minibatch steps


@pytest.mark.parametrize("overrides, fragment", [
    (["learner/exchange=bf16", "learner.exchange.dtype=int8"], "learner.exchange.dtype='int8': expected bf16 or fp16"),
    (["learner/exchange=powersgd", "learner.exchange.matrix_approximation_rank=0"],
     "learner.exchange.matrix_approximation_rank=0: expected a whole number"),
    (["learner/exchange=powersgd", "learner.exchange.start_powersgd_iter=-1"],
     "learner.exchange.start_powersgd_iter=-1: expected"),
    (["learner/exchange=powersgd", "learner.exchange.min_compression_rate=0"],
     "learner.exchange.min_compression_rate=0"),
    (["learner/exchange=quantized", "learner.exchange.num_bits=33"], "learner.exchange.num_bits=33"),
    (["learner/exchange=powersgd", "+learner.num_quantization_bits=1"],
     "learner.num_quantization_bits=1: no longer a learner setting; write learner/exchange=quantized "
     "learner.exchange.num_bits=1"),
    (["+learner.error_feedback=false"], "learner.error_feedback=false: no longer a learner setting; write "
                                        "learner/exchange=quantized learner.exchange.error_feedback=false"),
    (["+learner.requantize_sum=true"], "learner.requantize_sum=true: no longer a learner setting; write "
                                       "learner/exchange=quantized learner.exchange.requantize_sum=true"),
])
def test_bad_exchange_values_are_one_line_each(overrides, fragment):
    problems = validate(compose_config("+recipe=digits", "learner=data_parallel", *overrides), check_run_dir=False)
    assert len(problems) == 1 and fragment in problems[0], problems
    assert "\n" not in problems[0]


def test_factory_refuses_two_exchange_choices_and_keeps_cntk_bits():
    with pytest.raises(ValueError, match="num_quantization_bits=1 and exchange=powersgd rank 1.*both choose"):
        data_parallel_distributed_learner(sgd(), num_quantization_bits=1, exchange=PowerSGD(start_powersgd_iter=0))
    one_bit = data_parallel_distributed_learner(sgd(), num_quantization_bits=1, exchange=AllReduce())
    assert type(one_bit) is DataParallelLearner and one_bit.exchange.num_bits == 1
    with pytest.raises(TypeError, match="exchange must be a dtrain.exchange.Exchange"):
        DataParallelLearner(sgd(), exchange="powersgd")


# -- checkpoints ------------------------------------------------------------------------------------


def test_checkpoint_identity_names_the_strategy_so_state_never_lands_in_another():
    assert DataParallelLearner(sgd()).checkpoint_identity() == {"kind": "data_parallel"}  # as before the seam
    one_bit = data_parallel_distributed_learner(sgd(), num_quantization_bits=1).checkpoint_identity()
    assert one_bit == {"kind": "data_parallel", "exchange": {"name": "quantized", "num_bits": 1}}
    rank_one = DataParallelLearner(sgd(), exchange=PowerSGD(1)).checkpoint_identity()
    rank_two = DataParallelLearner(sgd(), exchange=PowerSGD(2)).checkpoint_identity()
    bf16 = DataParallelLearner(sgd(), exchange=CompressedAllReduce("bf16")).checkpoint_identity()
    assert rank_one["exchange"] == {"name": "powersgd", "matrix_approximation_rank": 1}
    assert len({str(identity) for identity in (rank_one, rank_two, bf16, one_bit)}) == 4


# -- guards -----------------------------------------------------------------------------------------


def test_fp16_overflow_without_loss_scaling_is_an_error_not_an_inf_step():
    exchange = CompressedAllReduce("fp16")
    exchange.bind(LocalCommunicator())
    flat = torch.tensor([1.0, 1e6])
    with pytest.raises(RuntimeError, match="fp16 gradient exchange produced inf or NaN.*learner/exchange=bf16"):
        exchange.start(0, flat, [flat.shape]).wait()
    exchange.loss_scaled = True  # the loss scaler skips the step instead
    assert math.isinf(exchange.start(0, torch.tensor([1.0, 1e6]), [flat.shape]).wait()[1])
    bf16 = CompressedAllReduce("bf16")
    bf16.bind(LocalCommunicator())
    assert bf16.start(0, torch.tensor([1.0, 1e6]), [flat.shape]).wait()[1] == pytest.approx(1e6, rel=2 ** -8)  # in range


@pytest.mark.parametrize("make", [lambda: PowerSGD(start_powersgd_iter=0), lambda: Quantized(1)])
def test_an_inf_under_loss_scaling_reaches_every_rank_but_not_the_state(make):
    def work(comm):
        exchange = make()
        exchange.bind(comm)
        exchange.loss_scaled = True
        shapes = [torch.Size([6, 5])]
        exchange.begin_step()
        good = torch.randn(30, generator=torch.Generator().manual_seed(comm.rank))
        exchange.start(0, good, shapes).wait()
        state_before = repr(exchange.state_dict())
        exchange.begin_step()
        bad = torch.randn(30, generator=torch.Generator().manual_seed(comm.rank))
        if comm.rank == 1:
            bad[3] = float("inf")
        result = exchange.start(0, bad, shapes).wait()
        state_after = repr(exchange.state_dict())
        exchange.close()
        return bool(torch.isinf(result).all()), state_before.replace("steps_begun': 1", "steps_begun': 2") \
            == state_after
    for all_inf, state_kept in FakeWorld(2).run(work):
        assert all_inf and state_kept


def test_the_learner_reports_exchange_seconds_for_the_session():
    assert Learner.exchange_seconds_last_step == 0.0

    def work(comm):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm, exchange=Quantized(2))
        learner.prepare(model)
        learner.begin_minibatch(4, 8)
        model(torch.randn(4, 8)).sum().backward()
        learner.step()
        learner.finalize()
        strategy = learner.exchange  # its buckets' time split, which benchmarks/netns_cluster.py prints
        split = (strategy.seconds_last_step, strategy.transport_seconds_last_step, strategy.compute_seconds_last_step)
        return learner.exchange_seconds_last_step, learner.bytes_sent_last_step, learner.progress_note(), split
    for seconds, sent, note, (total, transport, compute) in FakeWorld(2).run(work):
        assert seconds > 0 and sent > 0 and note.startswith("2-bit: ")
        assert transport > 0 and 0 <= compute < total and abs(compute + transport - total) < 1e-9


def test_powersgd_state_survives_a_weights_only_checkpoint_round_trip():
    import io

    def work(comm):
        exchange = PowerSGD(start_powersgd_iter=0)
        exchange.bind(comm)
        shapes = [torch.Size([6, 5]), torch.Size([5])]
        for step in range(2):
            exchange.begin_step()
            exchange.start(0, torch.randn(35, generator=torch.Generator().manual_seed(step + comm.rank)), shapes).wait()
        buffer = io.BytesIO()
        torch.save(exchange.state_dict(), buffer)  # the session reads checkpoints with weights_only=True
        restored = PowerSGD(start_powersgd_iter=0)
        restored.bind(comm)
        restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
        results = []
        for strategy in (exchange, restored):
            strategy.begin_step()
            results.append(strategy.start(0, torch.randn(35, generator=torch.Generator().manual_seed(9)), shapes).wait())
            strategy.close()
        return torch.equal(*results) and restored.rng.randint(1000) == exchange.rng.randint(1000)
    assert all(FakeWorld(2).run(work))


@pytest.mark.parametrize("with_feedback, without_feedback, setting", [
    (lambda: Quantized(1), lambda: Quantized(1, error_feedback=False), "error_feedback"),
    (lambda: PowerSGD(start_powersgd_iter=0), lambda: PowerSGD(start_powersgd_iter=0, use_error_feedback=False),
     "use_error_feedback"),
])
def test_a_resume_with_error_feedback_off_says_in_one_line_that_the_residuals_are_dropped(
        with_feedback, without_feedback, setting):
    def work(comm):
        exchange = with_feedback()
        exchange.bind(comm)
        exchange.begin_step()
        exchange.start(0, torch.randn(30, generator=torch.Generator().manual_seed(comm.rank)), [torch.Size([6, 5])]).wait()
        state = exchange.state_dict()
        exchange.close()
        return state
    saved = FakeWorld(2).run(work)[0]
    resumed = without_feedback()
    resumed.bind(LocalCommunicator())
    with pytest.warns(RuntimeWarning, match=rf"^{setting}=false: the error-feedback residuals of the .* exchange saved "
                                            rf"in the checkpoint are dropped") as caught:
        resumed.load_state_dict(saved)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert "per_key" not in resumed.state_dict() or not resumed.state_dict()["per_key"]
    assert not resumed.state_dict().get("errors")


def test_residuals_restored_before_a_block_learners_plan_turns_error_feedback_off_are_named_too():
    """A checkpoint restores before the plan; unset error feedback then turns off for syncs, and says so."""
    def work(comm):
        exchange = PowerSGD(start_powersgd_iter=0, use_error_feedback=True)
        exchange.bind(comm)
        exchange.begin_step()
        exchange.start(0, torch.randn(30, generator=torch.Generator().manual_seed(comm.rank)), [torch.Size([6, 5])]).wait()
        state = exchange.state_dict()
        exchange.close()
        return state
    resumed = PowerSGD(start_powersgd_iter=0)
    resumed.bind(LocalCommunicator())
    resumed.load_state_dict(FakeWorld(2).run(work)[0])
    with pytest.warns(RuntimeWarning, match="^use_error_feedback=false: the error-feedback residuals"):
        resumed.plan(DIGITS_RUN, steps=44, step_name="sync")
    assert not resumed.use_error_feedback and not resumed.state_dict()["errors"]


def test_powersgds_first_q_comes_from_its_own_seed_and_never_reseeds_the_global_generator(monkeypatch):
    """The exchange runs on a worker thread while the training thread may draw (dropout): reseeding the
    global generator there raced two threads (a flaky two-level test) and could hand the training thread
    the exchange's numbers. The draw equals torch's hook (global generator seeded from the same
    ``RandomState``) without touching the global one."""
    import numpy as np

    shapes = [torch.Size([12, 10])]  # compressed: rank 2 sends 44 numbers for 120
    gradient = torch.randn(120, generator=torch.Generator().manual_seed(3))

    def compressed(comm):
        exchange = PowerSGD(matrix_approximation_rank=2, start_powersgd_iter=0, use_error_feedback=False,
                            random_seed=4)
        exchange.bind(comm)
        exchange.begin_step()
        result = exchange.start(0, gradient.clone(), shapes).wait().clone()
        exchange.close()
        return result

    with torch.random.fork_rng(devices=[]):  # the hook's draw, written out: the expected value
        torch.manual_seed(int(np.random.RandomState(4).randint(1_000_000_000)))
        q = torch.randn(10, 2)
    from dtrain.exchange.powersgd import orthogonalize_
    orthogonalize_(q.unsqueeze(0), 0.0)
    matrix = gradient.view(12, 10)
    p = matrix @ q
    orthogonalize_(p.unsqueeze(0), 0.0)
    expected = (p @ (matrix.t() @ p).t()).reshape(-1)

    def refuse(*_args, **_kwargs):
        raise AssertionError("the exchange reseeded the global generator")
    monkeypatch.setattr(torch, "manual_seed", refuse)
    before = torch.get_rng_state()
    got = FakeWorld(1).run(compressed)[0]
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.allclose(got, expected, atol=1e-6), float((got - expected).abs().max())


def test_an_inf_under_loss_scaling_skips_the_step_on_every_rank_through_a_lossless_threaded_exchange():
    """Two hosts of one rank, float32 between them (``BetweenHosts(AllReduce())``: a two-level learner's
    warm start): the "has a gradient" flags ride in the same buffer as the gradients. One rank's inf
    must skip the step everywhere, not turn the flags into "no gradient" and step on nothing."""
    def work(comm):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        exchange = BetweenHosts(AllReduce(), HostGroups(LocalCommunicator(), comm))
        learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm, exchange=exchange)
        learner.prepare(model)
        learner.loss_scale = 1024.0
        before = [parameter.detach().clone() for parameter in model.parameters()]
        learner.begin_minibatch(4, 8)
        loss = model(torch.randn(4, 8)).sum() * 1024.0
        if comm.rank == 1:
            loss = loss * float("inf")
        loss.backward()
        learner.step()
        skipped = learner.found_inf and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        learner.begin_minibatch(4, 8)
        (model(torch.randn(4, 8)).sum() * 1024.0).backward()
        learner.step()
        stepped = not learner.found_inf and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        learner.finalize()
        return skipped, stepped
    assert FakeWorld(2).run(work) == [(True, True), (True, True)]

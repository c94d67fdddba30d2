"""The two-phase quantized exchange and the quantized learner, with N workers simulated in threads.

``FakeWorld`` gives each thread a communicator whose collectives meet at a barrier, so the real
``QuantizedExchange`` code runs end to end (phase 1 then takes the all-gather fallback, since
``torch.distributed`` is not involved). Results are compared with a direct computation.
"""
from __future__ import annotations

import copy

import pytest
import torch

from dtrain.comm import LocalCommunicator
from dtrain.compress import StripeLayout, decode_message, dequantize, encode_message, quantize, stripe_bounds
from dtrain.exchange import Quantized, full_precision_allreduce_bytes
from dtrain.exchange.quantized import QuantizedExchange
from dtrain.learners import DataParallelLearner, data_parallel_distributed_learner

from tests.helpers.quantized_reference import ReferenceExchange
from tests.helpers.thread_world import FakeWorld

SHAPES = [(10, 40), (10,), (7, 3, 2, 3), (33,), (5, 16)]


def make_gradients(step: int, rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(shape, generator=generator) * (1 + rank) for shape in SHAPES]


# -- layout ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_columns, num_stripes", [(10, 3), (1, 4), (7, 7), (0, 2), (657, 4)])
def test_stripes_tile_the_columns_and_the_first_ones_get_the_extra(num_columns, num_stripes):
    bounds = [stripe_bounds(num_columns, stripe, num_stripes) for stripe in range(num_stripes)]
    assert bounds[0][0] == 0 and bounds[-1][1] == num_columns
    assert all(end == start for (_, end), (start, _) in zip(bounds, bounds[1:]))
    sizes = [end - start for start, end in bounds]
    extra = num_columns % num_stripes
    assert sizes == [num_columns // num_stripes + (stripe < extra) for stripe in range(num_stripes)]


def test_stripe_major_buffer_round_trips_and_each_stripe_is_contiguous():
    layout = StripeLayout(SHAPES, 3)
    tensors = make_gradients(0, 0)
    flat = layout.flatten(tensors)
    assert flat.numel() == layout.numel == sum(t.numel() for t in tensors)
    copies = [torch.zeros_like(t) for t in tensors]
    layout.unflatten_(flat, copies)
    assert all(torch.equal(a, b) for a, b in zip(tensors, copies))
    # stripe 1 holds columns [4, 7) of the [10, 40] weight first
    start, end = layout.stripe_values[1]
    assert torch.equal(flat[start:start + 3 * 40], tensors[0][4:7].reshape(-1))
    ends = [layout.stripe_values[stripe][1] for stripe in range(3)]
    assert ends == [layout.stripe_values[stripe + 1][0] for stripe in range(2)] + [flat.numel()]
    # 1-column tensors (biases, the [7,3,2,3] weight with 18-long columns is 7 columns) go to stripe 0
    assert layout.stripe(2).num_columns == 3 + 2 + 1


@pytest.mark.parametrize("bits", [1, 3, 8, 32])
def test_message_round_trip_and_size(bits):
    layout = StripeLayout(SHAPES, 2)
    stripe = layout.stripe(1)
    values = torch.randn(stripe.numel)
    quantized = quantize(values, stripe, bits)
    message = encode_message(quantized)
    assert message.dtype == torch.uint8 and message.numel() == layout.message_sizes(bits)[1]
    assert message.numel() == 8 * stripe.num_columns + -(-stripe.numel * bits // 8)
    decoded = decode_message(message, stripe, bits)
    assert torch.equal(dequantize(decoded, stripe), dequantize(quantized, stripe))


# -- the exchange against a direct computation -------------------------------------------------------


def reference_exchange(num_workers: int, bits: int, steps: int, requantize_sum: bool = True,
                       owner_bits: int | None = None):
    """The two phases (or the gathered sum) written out directly on whole buffers: results and final residuals."""
    layout = StripeLayout(SHAPES, num_workers)
    reference = ReferenceExchange(layout, bits, requantize_sum, owner_bits)
    results = [reference.step([make_gradients(step, rank) for rank in range(num_workers)]) for step in range(steps)]
    return layout, results, reference.worker_residuals, reference.owner_residuals


# CNTK's two phases, the gathered sum, and the two phases with the owner's sum at one bit more (auto beyond 8 at 1 bit)
SUM_FORMS = [(True, 0), (False, 0), (True, 1)]


@pytest.mark.parametrize("requantize_sum, owner_extra_bits", SUM_FORMS)
@pytest.mark.parametrize("num_workers, bits", [(2, 1), (3, 1), (4, 2), (3, 3), (2, 8)])
def test_threaded_exchange_equals_the_direct_computation(num_workers, bits, requantize_sum, owner_extra_bits):
    steps = 3
    owner_bits = bits + owner_extra_bits if owner_extra_bits else None
    layout, expected, worker_residuals, owner_residuals = reference_exchange(num_workers, bits, steps, requantize_sum,
                                                                             owner_bits)

    def work(comm):
        exchange = QuantizedExchange(comm, bits, requantize_sum=requantize_sum, owner_bits=owner_bits)
        outputs = []
        for step in range(steps):
            gradients = make_gradients(step, comm.rank)
            exchange.allreduce_(gradients)
            outputs.append(layout.flatten(gradients))
        return outputs, exchange

    per_rank = FakeWorld(num_workers).run(work)
    for rank, (outputs, exchange) in enumerate(per_rank):
        for step in range(steps):
            assert torch.equal(outputs[step], expected[step]), f"rank {rank} step {step}"
        assert torch.equal(exchange.worker_residual, worker_residuals[rank])
        assert torch.equal(exchange.owner_residual, owner_residuals[rank])


@pytest.mark.parametrize("requantize_sum, owner_extra_bits", SUM_FORMS)
def test_error_feedback_invariant_across_both_residuals(requantize_sum, owner_extra_bits):
    """Σ_t result_t + Σ_ranks worker residual + owner residuals == Σ_t Σ_ranks gradient_t."""
    num_workers, steps = 3, 6

    def work(comm):
        exchange = QuantizedExchange(comm, 1, requantize_sum=requantize_sum, owner_bits=1 + owner_extra_bits)
        results, inputs = 0, 0
        for step in range(steps):
            gradients = make_gradients(step, comm.rank)
            inputs = inputs + torch.cat([g.reshape(-1) for g in gradients])
            exchange.allreduce_(gradients)
            results = results + torch.cat([g.reshape(-1) for g in gradients])
        state = exchange.state_dict()
        return results, inputs, state["worker_residual"], state["owner_residual"]

    per_rank = FakeWorld(num_workers).run(work)
    results = per_rank[0][0]
    inputs = sum(item[1] for item in per_rank)
    pending = sum(item[2] + item[3] for item in per_rank)
    torch.testing.assert_close(results + pending, inputs, rtol=1e-5, atol=1e-4)
    assert all(torch.equal(item[0], results) for item in per_rank)  # every rank decoded the same


def test_thirty_two_bits_is_the_exact_sum_and_scale_applies_before_the_sum():
    def work(comm):
        exchange = QuantizedExchange(comm, 32)
        gradients = make_gradients(0, comm.rank)
        exchange.allreduce_(gradients, scale=0.5)
        return gradients

    per_rank = FakeWorld(3).run(work)
    for index in range(len(SHAPES)):
        expected = sum(0.5 * make_gradients(0, rank)[index] for rank in range(3))
        torch.testing.assert_close(per_rank[1][index], expected)


@pytest.mark.parametrize("requantize_sum, owner_extra_bits", SUM_FORMS)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_bytes_sent_are_counted_and_smaller_than_full_precision(bits, requantize_sum, owner_extra_bits):
    num_workers = 3
    layout = StripeLayout(SHAPES, num_workers)
    sizes, owner_sizes = layout.message_sizes(bits), layout.message_sizes(bits + owner_extra_bits)

    def work(comm):
        exchange = QuantizedExchange(comm, bits, requantize_sum=requantize_sum, owner_bits=bits + owner_extra_bits)
        exchange.allreduce_(make_gradients(0, comm.rank))
        return exchange.bytes_sent_last_step, exchange.full_precision_bytes_last_step, exchange.compression_ratio

    for sent, full, ratio in FakeWorld(num_workers).run(work):
        # all-gather fallback for phase 1 (every rank's N messages to everyone), padded all-gather for phase 2;
        # the gathered sum: one all-gather of every rank's N messages
        phase2 = (num_workers - 1) * max(owner_sizes) if requantize_sum else 0
        assert sent == (num_workers - 1) * sum(sizes) + phase2
        assert full == full_precision_allreduce_bytes(layout.numel, num_workers) == round(2 * 2 / 3 * 4 * layout.numel)
        assert ratio == pytest.approx(full / sent)


def test_one_worker_only_scales():
    exchange = QuantizedExchange(LocalCommunicator(), 1)
    gradients = make_gradients(0, 0)
    expected = [g * 0.25 for g in gradients]
    exchange.allreduce_(gradients, scale=0.25)
    assert all(torch.equal(a, b) for a, b in zip(gradients, expected))
    assert exchange.bytes_sent_last_step == 0


def test_bad_arguments_and_changed_shapes_are_rejected():
    with pytest.raises(ValueError, match="all_to_all='torch' needs a TorchDistCommunicator"):
        QuantizedExchange(LocalCommunicator(), 1, all_to_all="torch")
    with pytest.raises(ValueError, match="num_bits=0: expected a whole number of bits from 1 to 32"):
        QuantizedExchange(LocalCommunicator(), 0)

    def work(comm):
        exchange = QuantizedExchange(comm, 1)
        exchange.allreduce_(make_gradients(0, comm.rank))
        with pytest.raises(ValueError, match="create a new QuantizedExchange"):
            exchange.allreduce_(make_gradients(0, comm.rank)[:2])
        return True

    assert FakeWorld(2).run(work) == [True, True]


def test_residual_state_round_trips_and_loads_at_another_world_size():
    def run_steps(world_size: int, state_by_rank=None, steps: int = 2):
        def work(comm):
            exchange = QuantizedExchange(comm, 1, requantize_sum=True)
            if state_by_rank is not None:
                exchange.load_state_dict(state_by_rank[comm.rank])
            for step in range(steps):
                exchange.allreduce_(make_gradients(step, comm.rank))
            return exchange.state_dict()
        return FakeWorld(world_size).run(work)

    states = run_steps(2)
    assert states[0]["shapes"] == [list(shape) for shape in SHAPES]
    # loading and taking no step gives the same state back
    assert all(torch.equal(a["worker_residual"], b["worker_residual"]) and
               torch.equal(a["owner_residual"], b["owner_residual"])
               for a, b in zip(states, run_steps(2, states, steps=0)))
    # at 3 workers, owner residuals are cut to the new stripes: nonzero only on each rank's own stripe
    moved = run_steps(3, [states[0], states[1], states[0]], steps=0)
    layout = StripeLayout(SHAPES, 3)
    for rank, state in enumerate(moved):
        start, end = layout.stripe_values[rank]
        stripe_only = torch.zeros(layout.numel)
        stripe_only[start:end] = 1
        owner = layout.flatten(_split(state["owner_residual"]))
        assert torch.equal(owner * (1 - stripe_only), torch.zeros(layout.numel))


def _split(flat: torch.Tensor) -> list[torch.Tensor]:
    tensors, offset = [], 0
    for shape in SHAPES:
        count = torch.Size(shape).numel()
        tensors.append(flat[offset:offset + count].reshape(shape))
        offset += count
    return tensors


# -- the learner ----------------------------------------------------------------------------------------


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 3))


def train_steps(comm, bits: int, steps: int, distributed_after: int = 0, local_sizes=(8, 5, 0, 3)):
    model = make_model(seed=comm.rank)  # different on purpose: prepare must broadcast rank 0's
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    learner = DataParallelLearner(optimizer, comm, distributed_after=distributed_after, exchange=Quantized(bits))
    learner.prepare(model)
    snapshots = []
    generator = torch.Generator().manual_seed(comm.rank)
    for _ in range(steps):
        local = local_sizes[comm.rank % len(local_sizes)]
        total = sum(local_sizes[rank % len(local_sizes)] for rank in range(comm.size))
        learner.begin_minibatch(local, total)
        if local:
            features = torch.randn(local, 20, generator=generator)
            labels = torch.randint(0, 3, (local,), generator=generator)
            torch.nn.functional.cross_entropy(model(features), labels).backward()
        learner.step()
        snapshots.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    learner.synchronize()
    return snapshots, learner, [b.clone() for b in model.buffers()]


def test_learner_keeps_ranks_identical_and_reports_bytes():
    per_rank = FakeWorld(3).run(lambda comm: train_steps(comm, bits=1, steps=4))
    for step in range(4):
        assert all(torch.equal(item[0][step], per_rank[0][0][step]) for item in per_rank)
    learner = per_rank[0][1]
    assert learner.kind == "data_parallel" and learner.samples_seen == 4 * (8 + 5 + 0)
    # the fake comm's phase 1 is the all-gather fallback (N times the bytes), so the ratio is modest
    assert 0 < learner.bytes_sent_last_step and learner.compression_ratio > 2
    # BatchNorm statistics averaged by synchronize()
    assert all(torch.equal(a, b) for item in per_rank for a, b in zip(item[2], per_rank[0][2]))
    assert set(learner.local_state_dict()["per_key"][0]) >= {"worker_residual", "owner_residual"}  # per bucket
    assert learner.checkpoint_identity()["exchange"] == {"name": "quantized", "num_bits": 1}


def test_learner_warm_start_all_reduces_float32_then_quantizes():
    def work(comm):  # the 2-bit learner (warm start: 32 samples) and the float32 one, side by side
        model = make_model(seed=comm.rank)  # different on purpose: prepare must broadcast rank 0's
        reference = copy.deepcopy(model)
        learners = [DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm,
                                        distributed_after=32, exchange=Quantized(2)),
                    DataParallelLearner(torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), comm)]
        for learner, net in zip(learners, (model, reference)):
            learner.prepare(net)
        generator, local_sizes, snapshots = torch.Generator().manual_seed(comm.rank), (8, 5), []
        for _ in range(5):  # 13 samples a step: steps 1-3 are the warm start
            features = torch.randn(local_sizes[comm.rank], 20, generator=generator)
            labels = torch.randint(0, 3, (local_sizes[comm.rank],), generator=generator)
            for learner, net in zip(learners, (model, reference)):
                learner.begin_minibatch(local_sizes[comm.rank], sum(local_sizes))
                torch.nn.functional.cross_entropy(net(features), labels).backward()
                learner.step()
            snapshots.append([torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
                              for net in (model, reference)])
        return snapshots, learners[0].optimizer.state_dict()["state"]

    (first, state0), (second, state1) = FakeWorld(2).run(work)
    for step in range(5):
        assert torch.equal(first[step][0], second[step][0])  # one model on both ranks throughout
    for step in range(3):
        assert torch.equal(first[step][0], first[step][1])  # the warm start is the float32 update, exactly
    assert not torch.equal(first[3][0], first[3][1])  # then the 2-bit exchange takes over
    for key in state0:
        assert torch.equal(state0[key]["momentum_buffer"], state1[key]["momentum_buffer"])


def test_the_run_total_of_bytes_sent_adds_every_steps_float32_warm_start_and_quantized_exchange():
    def work(comm):
        model = make_model(seed=0)
        learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                      distributed_after=32, exchange=Quantized(1))
        learner.prepare(model)
        generator, per_step = torch.Generator().manual_seed(comm.rank), []
        for _ in range(5):  # 13 samples a step: steps 1-3 are the float32 warm start
            learner.begin_minibatch(8 if comm.rank == 0 else 5, 13)
            features = torch.randn(8 if comm.rank == 0 else 5, 20, generator=generator)
            torch.nn.functional.cross_entropy(model(features), torch.zeros(len(features), dtype=torch.long)).backward()
            learner.step()
            per_step.append(learner.bytes_sent_last_step)
        return per_step, learner.bytes_sent_total

    for per_step, total in FakeWorld(2).run(work):
        assert per_step[0] == per_step[2] > per_step[3] == per_step[4] > 0  # float32, then 1-bit
        assert total == sum(per_step)


def test_one_worker_learner_is_the_plain_optimizer():
    model, reference = make_model(0), make_model(0)
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1), LocalCommunicator(),
                                  exchange=Quantized(1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    learner.prepare(model)
    features, labels = torch.randn(8, 20), torch.randint(0, 3, (8,))
    for net, step in ((model, learner), (reference, None)):
        if step is None:
            optimizer.zero_grad()
        else:
            learner.begin_minibatch(8, 8)
        torch.nn.functional.cross_entropy(net(features), labels).backward()
        (learner.step if step is not None else optimizer.step)()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize("bits", [0, 33, "1"])
def test_learner_rejects_bad_bits(bits):
    model = make_model(0)
    with pytest.raises(ValueError, match="num_quantization_bits=.*: expected a whole number of bits from 1 to 32"):
        data_parallel_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.1), num_quantization_bits=bits)


def test_error_feedback_that_is_not_a_bool_is_refused_not_taken_as_true():
    with pytest.raises(ValueError, match="error_feedback='no': expected true or false"):
        Quantized(1, error_feedback="no")


# -- Adam's variance frozen under k-bit gradients (1-bit Adam) -------------------------------------------


#: one initial model for every run (threads share torch's global generator, so none is drawn in them)
ADAM_START = make_model(seed=0).state_dict()


def train_adam_steps(comm, steps: int, freeze_variance="auto", resume_after: int | None = None,
                     warm_start_mode: str = "allreduce", resume_freeze_variance=None, resume_bits: int = 1,
                     edit_checkpoint=None):
    """Adam under the 1-bit learner (warm start: 3 steps of 13 samples); the variances and parameters after
    each step. ``resume_after``: a checkpoint's state loaded into a new learner there, as a resumed job does
    (with ``resume_freeze_variance`` and ``resume_bits`` if given, the state first passed to ``edit_checkpoint``)."""
    def build(model, freeze_variance=freeze_variance, bits=1):
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, 0.99))
        learner = DataParallelLearner(optimizer, comm, distributed_after=32, exchange=Quantized(bits),
                                      freeze_variance=freeze_variance, warm_start_mode=warm_start_mode)
        learner.prepare(model)
        return learner

    model = make_model(seed=0)
    model.load_state_dict(ADAM_START)
    learner = build(model)
    generator, local_sizes, variances, parameters = torch.Generator().manual_seed(comm.rank), (8, 5), [], []
    for step in range(steps):
        if step == resume_after:
            saved, local = copy.deepcopy(learner.state_dict()), copy.deepcopy(learner.local_state_dict())
            learner.finalize()
            learner = build(model, freeze_variance if resume_freeze_variance is None else resume_freeze_variance,
                            resume_bits)
            if edit_checkpoint is not None:
                edit_checkpoint(saved)
            learner.load_state_dict(saved)
            learner.load_local_state_dict(local)
        features = torch.randn(local_sizes[comm.rank], 20, generator=generator)
        labels = torch.randint(0, 3, (local_sizes[comm.rank],), generator=generator)
        learner.begin_minibatch(local_sizes[comm.rank], sum(local_sizes))
        torch.nn.functional.cross_entropy(model(features), labels).backward()
        learner.step()
        variances.append(torch.cat([learner.optimizer.state[p]["exp_avg_sq"].reshape(-1).clone()
                                    for p in model.parameters()]))
        parameters.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    learner.finalize()
    return variances, parameters, learner.describe()


@pytest.mark.parametrize("warm_start_mode", ["allreduce", "local"])
def test_adams_variance_stays_where_the_float32_warm_start_left_it_under_1_bit_gradients(warm_start_mode):
    frozen = FakeWorld(2).run(lambda comm: train_adam_steps(comm, steps=6, warm_start_mode=warm_start_mode))
    moving = FakeWorld(2).run(lambda comm: train_adam_steps(comm, steps=6, freeze_variance=False,
                                                            warm_start_mode=warm_start_mode))
    # CNTK's local warm start: each rank steps alone, then rank 0's model and optimizer state go to all
    together_from = 0 if warm_start_mode == "allreduce" else 3
    for variances, parameters, describe in frozen:
        assert not torch.equal(variances[1], variances[2])  # the warm start's steps move it
        # then held where rank 0's warm start left it, on both ranks
        assert all(torch.equal(variance, frozen[0][0][2]) for variance in variances[3:])
        assert all(torch.equal(a, b) for a, b in zip(parameters[together_from:], frozen[0][1][together_from:]))
        assert "variance frozen" in describe
    variances, parameters, describe = moving[0]
    assert torch.equal(variances[2], frozen[0][0][2])  # the same warm start ...
    assert not torch.equal(variances[4], variances[2]) and "variance frozen" not in describe  # ... never held
    assert not torch.equal(parameters[5], frozen[0][1][5])  # and the updates differ


def test_a_resumed_job_holds_the_same_frozen_variance_bit_for_bit():
    straight = FakeWorld(2).run(lambda comm: train_adam_steps(comm, steps=6))
    resumed = FakeWorld(2).run(lambda comm: train_adam_steps(comm, steps=6, resume_after=4))
    for (variances, parameters, _), (variances_again, parameters_again, _) in zip(straight, resumed):
        assert all(torch.equal(a, b) for a, b in zip(parameters, parameters_again))
        assert all(torch.equal(a, b) for a, b in zip(variances, variances_again))


def forget_the_held_flag(state):
    """A checkpoint as written before it said whether the variance was held (a kept copy's steps only)."""
    del state["frozen_variance"]["held"]


@pytest.mark.parametrize("freeze, resume_freeze, resume_bits, edit, line", [
    ("auto", None, 1, None, None),                   # the same choice: nothing said
    (True, False, 1, None, "the checkpoint's run held the optimizer's variance; this run releases it from here on: "
                           "freeze_variance=false; learner.freeze_variance=true keeps the checkpoint's choice"),
    (False, True, 1, None, "the checkpoint's run did not hold the optimizer's variance; this run holds it from here on: "
                           "freeze_variance=true; learner.freeze_variance=false keeps the checkpoint's choice"),
    # another version's auto held it at 2 bits, this one does not: said, though the setting is the same
    (True, "auto", 2, forget_the_held_flag, "the checkpoint's run held the optimizer's variance; this run "
                                            "releases it from here on: freeze_variance=auto, 2 workers, 2-bit"),
])
def test_a_resumed_job_says_when_it_holds_adams_variance_otherwise_than_its_checkpoints_run(
        capsys, freeze, resume_freeze, resume_bits, edit, line):
    runs = FakeWorld(2).run(lambda comm: train_adam_steps(comm, steps=6, freeze_variance=freeze, resume_after=4,
                                                          resume_freeze_variance=resume_freeze,
                                                          resume_bits=resume_bits, edit_checkpoint=edit))
    said = [text for text in capsys.readouterr().out.splitlines() if "variance" in text]
    if line is None:
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith("dtrain: " + line), said  # once, from rank 0
    held_after_resume = torch.equal(runs[0][0][5], runs[0][0][4])
    assert held_after_resume is (resume_freeze is True or (resume_freeze is None and freeze == "auto"))


@pytest.mark.parametrize("optimizer, exchange, freeze, expected", [
    ("adamw", None, "auto", False),             # float32 all-reduce: nothing to freeze against
    ("adamw", "quantized", "auto", True),       # 1-bit sums: on by default
    ("adamw", "quantized2", "auto", False),     # 2-bit sums: off (most values at the middle level)
    ("adamw", "quantized2", True, True),
    ("sgd", "quantized", "auto", False),        # no variance to hold
    ("adamw", "powersgd", "auto", False),       # not measured to help PowerSGD: off unless asked
    ("adamw", "powersgd", True, True),
    ("adamw", "bf16", True, True),
    ("adamw", "quantized", False, False),
])
def test_freeze_variance_auto_is_on_for_1_bit_sums_and_adam_family_optimizers(optimizer, exchange, freeze, expected):
    from dtrain.exchange import CompressedAllReduce, PowerSGD, Quantized
    from dtrain.learners import data_parallel_distributed_learner

    model = make_model(0)
    torch_optimizer = (torch.optim.AdamW(model.parameters()) if optimizer == "adamw"
                       else torch.optim.SGD(model.parameters(), lr=0.1))
    strategy = {None: None, "quantized": Quantized(1), "quantized2": Quantized(2), "powersgd": PowerSGD(1),
                "bf16": CompressedAllReduce("bf16")}[exchange]
    learner = data_parallel_distributed_learner(torch_optimizer, exchange=strategy, freeze_variance=freeze)
    assert learner.freeze_variance is expected


@pytest.mark.parametrize("bits, workers, requantize_sum, held", [
    (1, 2, "auto", True), (1, 8, "auto", True),       # every worker's 1-bit codes summed
    (1, 9, "auto", False), (1, 16, "auto", False),    # the owner's sum at 2 bits: sparse
    (1, 16, False, True), (1, 4, True, True),         # gathered, or CNTK's owner at 1 bit
    (2, 2, "auto", False), (4, 4, "auto", False), (8, 4, False, False),
])
def test_the_variance_is_held_by_default_where_every_summed_value_is_a_1_bit_value(bits, workers, requantize_sum,
                                                                                    held):
    from types import SimpleNamespace

    from dtrain.exchange import Quantized

    strategy = Quantized(bits, requantize_sum=requantize_sum)
    strategy.comm = SimpleNamespace(size=workers)
    assert strategy.holds_adam_variance is held


def test_freeze_variance_that_is_not_a_switch_is_refused_in_one_line():
    from dtrain.learners import data_parallel_distributed_learner

    model = make_model(0)
    with pytest.raises(ValueError, match="freeze_variance='yes': expected true, false or auto"):
        data_parallel_distributed_learner(torch.optim.AdamW(model.parameters()), num_quantization_bits=1,
                                          freeze_variance="yes")


# -- whether the owner re-quantizes the sum -------------------------------------------------------------


@pytest.mark.parametrize("bits, workers, requantized, owner_bits", [
    (1, 2, False, 1), (1, 4, False, 1), (1, 8, False, 1),  # 1 bit: gathered up to 8 workers,
    (1, 9, True, 2), (1, 16, True, 2),                      # beyond, the owner's sum at 2 bits
    (2, 2, False, 2), (2, 3, True, 2), (2, 4, True, 2), (8, 4, True, 8), (32, 2, False, 32), (32, 8, True, 32),
])
def test_auto_forms_the_sum_by_the_number_of_workers_and_bits(bits, workers, requantized, owner_bits):
    from dtrain.exchange.quantized import SumForm, requantizes_sum, sum_form

    assert sum_form("auto", workers, bits) == SumForm(requantized, owner_bits)
    assert requantizes_sum("auto", workers, bits) is requantized
    assert sum_form(True, 16, 1) == SumForm(True, 1)  # true is CNTK's exchange: the owner at the workers' bits
    assert sum_form(False, 16, 4) == SumForm(False, 4)


def test_a_restored_run_under_auto_keeps_its_saved_form_only_at_the_same_world_size_and_bits():
    from dtrain.exchange.quantized import SumForm, restored_sum_form

    old = {"world_size": 16, "num_bits": 1}  # from before either setting: CNTK's two phases at its own bits
    assert restored_sum_form("auto", old, 16, 1) == SumForm(True, 1)
    assert restored_sum_form("auto", {**old, "world_size": 4}, 4, 1) == SumForm(True, 1)
    assert restored_sum_form("auto", old, 8, 1) is None  # another world size: the rule decides
    assert restored_sum_form("auto", old, 16, 2) is None  # other bits: the rule decides
    assert restored_sum_form(False, old, 16, 1) is None  # an explicit setting wins
    today = {"world_size": 16, "num_bits": 1, "requantize_sum": True, "owner_bits": 2}
    assert restored_sum_form("auto", today, 16, 1) is None  # what the rule gives anyway: nothing to restore


def test_beyond_eight_workers_auto_one_bit_sums_are_re_quantized_at_two_bits_and_resume_bit_for_bit():
    """The strategy at 9 workers under ``auto``: the two phases with the owner's sum at 2 bits, equal to the
    reference; its state records the form, and a resume continues the uninterrupted run bit for bit."""
    from dtrain.exchange import Quantized

    workers = 9
    layout, stripe_major, _, _ = reference_exchange(workers, 1, 4, requantize_sum=True, owner_bits=2)
    expected = []  # in tensor order, as the strategy's flat bucket holds them
    for result in stripe_major:
        tensors = [torch.empty(shape) for shape in SHAPES]
        layout.unflatten_(result, tensors)
        expected.append(torch.cat([tensor.reshape(-1) for tensor in tensors]))

    def run(states=None, first_step=0, steps=4):
        def work(comm):
            strategy = Quantized(1)
            strategy.bind(comm)
            if states is not None:
                strategy.load_state_dict(copy.deepcopy(states[comm.rank]))
            outputs = []
            for step in range(first_step, first_step + steps):
                flat = torch.cat([g.reshape(-1) for g in make_gradients(step, comm.rank)])
                strategy.begin_step()
                strategy.allreduce_("bucket", flat, [torch.Size(shape) for shape in SHAPES])
                strategy.drain()
                outputs.append(flat.clone())
            return strategy.state_dict(), outputs
        return FakeWorld(workers).run(work)

    uninterrupted = run()
    assert all(torch.equal(output, reference) for output, reference in zip(uninterrupted[0][1], expected))
    assert uninterrupted[0][0]["per_key"]["bucket"]["owner_bits"] == 2
    saved = [state for state, _ in run(steps=2)]
    resumed = run(saved, first_step=2, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(resumed[3][1], uninterrupted[3][1][2:]))


def test_the_start_up_line_says_how_the_sum_is_formed():
    from dtrain.exchange import Quantized

    def describe(comm, requantize_sum="auto", bits=1):
        strategy = Quantized(bits, requantize_sum=requantize_sum)
        strategy.bind(comm)
        return strategy.describe_plan()

    assert FakeWorld(2).run(describe)[0] == "1-bit (every worker sums every worker's codes, auto)"
    assert FakeWorld(2).run(lambda comm: describe(comm, True))[0] == \
        "1-bit (two phases: each stripe's owner re-quantizes the sum)"
    assert FakeWorld(9).run(describe)[0] == \
        "1-bit (two phases: each stripe's owner re-quantizes the sum at 2 bits, auto)"
    assert FakeWorld(9).run(lambda comm: describe(comm, True))[0] == \
        "1-bit (two phases: each stripe's owner re-quantizes the sum)"
    assert FakeWorld(4).run(lambda comm: describe(comm, bits=4))[0] == \
        "4-bit (two phases: each stripe's owner re-quantizes the sum, auto)"
    assert describe(LocalCommunicator()) == "1-bit"


def test_a_requantizing_runs_residuals_resume_into_a_gathered_sum_without_losing_any_error():
    """The owner residual a re-quantizing run saved goes into the worker residual of a run that gathers, so the
    error still to be sent (summed over ranks) is the same, and every rank then decodes the same bits."""
    num_workers = 3

    def run(requantize_sum, states=None, steps=2):
        def work(comm):
            exchange = QuantizedExchange(comm, 1, requantize_sum=requantize_sum)
            if states is not None:
                exchange.load_state_dict(states[comm.rank])
            outputs = []
            for step in range(steps):
                gradients = make_gradients(10 + step, comm.rank)
                exchange.allreduce_(gradients)
                outputs.append(torch.cat([g.reshape(-1) for g in gradients]))
            return exchange.state_dict(), outputs
        return FakeWorld(num_workers).run(work)

    saved = [state for state, _ in run(True)]
    assert any(bool(state["owner_residual"].abs().sum()) for state in saved)
    loaded = [state for state, _ in run(False, saved, steps=0)]
    assert all(not state["owner_residual"].abs().sum() for state in loaded)
    torch.testing.assert_close(sum(state["worker_residual"] for state in loaded),
                               sum(state["worker_residual"] + state["owner_residual"] for state in saved))
    continued = run(False, saved)
    assert all(torch.equal(outputs[-1], continued[0][1][-1]) for _, outputs in continued)


def test_requantize_sum_is_the_exchanges_and_a_switch():
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="requantize_sum='maybe': expected true, false or auto"):
        Quantized(1, requantize_sum="maybe")
    with pytest.raises(TypeError, match=r"^requantize_sum=True: no longer a learner keyword; pass "
                                        r"exchange=Quantized\(num_bits, requantize_sum=True\)$"):
        data_parallel_distributed_learner(optimizer, exchange=Quantized(2), requantize_sum=True)
    with pytest.raises(ValueError, match="requantize_sum=1: expected true, false or auto"):
        Quantized(1, requantize_sum=1)


def test_a_resumed_run_forms_its_sums_as_it_began_under_auto():
    """A run that re-quantized its sums (the default before, or ``requantize_sum=true``) and is resumed with
    ``"auto"`` at the same world size goes on re-quantizing, bit for bit with the uninterrupted run; a
    checkpoint from before the setting existed (no ``requantize_sum`` in it) did re-quantize."""
    from dtrain.exchange import Quantized

    def run(setting, states=None, steps=2, first_step=0, drop_key=False):
        def work(comm):
            strategy = Quantized(1, requantize_sum=setting)
            strategy.bind(comm)
            if states is not None:
                state = copy.deepcopy(states[comm.rank])
                if drop_key:
                    for saved in state["per_key"].values():
                        del saved["requantize_sum"], saved["owner_bits"]
                strategy.load_state_dict(state)
            outputs = []
            for step in range(first_step, first_step + steps):
                flat = torch.cat([g.reshape(-1) for g in make_gradients(step, comm.rank)])
                strategy.begin_step()
                strategy.allreduce_("bucket", flat, [torch.Size(shape) for shape in SHAPES])
                outputs.append(flat.clone())
            return strategy.state_dict(), outputs, strategy.describe_plan()
        return FakeWorld(2).run(work)

    uninterrupted = run(True, steps=4)[0][1]
    saved = [state for state, _, _ in run(True, steps=2)]
    for drop_key in (False, True):
        resumed = run("auto", saved, first_step=2, drop_key=drop_key)
        assert all(torch.equal(a, b) for a, b in zip(resumed[0][1], uninterrupted[2:])), drop_key
        assert resumed[0][2] == "1-bit (two phases: each stripe's owner re-quantizes the sum, auto, as the checkpoint's run began)"
    # the user's explicit choice wins over the checkpoint's
    assert not torch.equal(run(False, saved, first_step=2)[0][1][0], uninterrupted[2])

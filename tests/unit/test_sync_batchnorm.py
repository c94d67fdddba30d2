"""Synchronized BatchNorm: N ranks (threads) with uneven shares give one BatchNorm's outputs, gradients and
running statistics over the whole minibatch; one process issues no collective; state_dict keys unchanged."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dtrain.comm.local import LocalCommunicator
from dtrain.nn import BatchNormSync, SyncBatchNorm, convert_sync_batchnorm

from tests.helpers.thread_world import FakeWorld


def _model(momentum=0.1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(),
                          nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.BatchNorm1d(6, momentum=momentum), nn.Linear(6, 3))
    with torch.no_grad():  # affine parameters away from their 1/0 start, so their gradients are exercised
        for layer in (model[1], model[5]):
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-0.5, 0.5)
    return model


def _reference(model, inputs, targets, steps):
    """One process, plain BatchNorm, the whole minibatch: outputs' loss gradients and buffers after ``steps``."""
    model = copy.deepcopy(model)
    grads = []
    for _ in range(steps):
        model.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads, {k: v.clone() for k, v in model.state_dict().items()}


#: (gradients, state) tolerances (rtol, atol) per dtype: a float64 model is normalised and differentiated in float64,
#: far below float32's 1e-7
TOLERANCES = {torch.float32: ((1e-4, 1e-6), (1e-5, 1e-6)), torch.float64: ((1e-12, 1e-12), (1e-12, 1e-12))}


@pytest.mark.parametrize("shares, momentum, dtype", [((5, 2, 0, 4), 0.1, torch.float32), ((6, 5), None, torch.float32),
                                                     ((4, 5), 0.1, torch.float64)])
def test_ranks_with_uneven_shares_equal_one_process(shares, momentum, dtype):
    model = _model(momentum).to(dtype)
    total = sum(shares)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(total, 2, 5, 5, generator=generator).to(dtype)
    targets = torch.randint(0, 3, (total,), generator=generator)
    (grad_rtol, grad_atol), (state_rtol, state_atol) = TOLERANCES[dtype]
    expected_grads, expected_state = _reference(model, inputs, targets, steps=2)
    starts = [sum(shares[:r]) for r in range(len(shares))]

    def work(comm):
        local = convert_sync_batchnorm(copy.deepcopy(model), BatchNormSync(comm))
        share = slice(starts[comm.rank], starts[comm.rank] + shares[comm.rank])
        grads = []
        for _ in range(2):
            local.zero_grad()
            output = local(inputs[share])
            # the data-parallel learner's weighting: each rank's mean loss times its share of the minibatch
            loss = nn.functional.cross_entropy(output, targets[share]) * (shares[comm.rank] / total) \
                if shares[comm.rank] else output.sum() * 0.0
            loss.backward()
            summed = [comm.allreduce(p.grad.clone()) for p in local.parameters()]
            grads.append(summed)
        return grads, local.state_dict()

    for grads, state in FakeWorld(len(shares)).run(work):
        for step_grads, step_expected in zip(grads, expected_grads):
            for got, want in zip(step_grads, step_expected):  # dtypes compared too
                torch.testing.assert_close(got, want, rtol=grad_rtol, atol=grad_atol)
        assert state.keys() == expected_state.keys()
        for key, want in expected_state.items():
            torch.testing.assert_close(state[key], want, rtol=state_rtol, atol=state_atol, msg=key)


def test_unscaled_rank_losses_give_the_same_gradients():
    """A learner that does not fold its weighting: each rank back-propagates its own mean loss and says so
    through ``gradient_factor``; the input gradients still match one process's (up to that factor)."""
    model, shares = _model(), (6, 2)
    total = sum(shares)
    inputs, targets = torch.randn(total, 2, 5, 5), torch.randint(0, 3, (total,))
    expected_grads, _ = _reference(model, inputs, targets, steps=1)

    def work(comm):
        local = convert_sync_batchnorm(copy.deepcopy(model), BatchNormSync(comm))
        local[1].sync.gradient_factor = total / shares[comm.rank]
        share = slice(0, 6) if comm.rank == 0 else slice(6, 8)
        nn.functional.cross_entropy(local(inputs[share]), targets[share]).backward()
        return [comm.allreduce(p.grad * (shares[comm.rank] / total)) for p in local.parameters()]

    for grads in FakeWorld(2).run(work):
        for got, want in zip(grads, expected_grads[0]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_without_synchronization_the_ranks_differ():
    """The comparison above can fail: plain per-rank BatchNorm gives other running statistics."""
    model, first_share = _model(), 5  # rank 0's 5 of the 8 samples
    inputs = torch.randn(8, 2, 5, 5)
    _, expected = _reference(model, inputs, torch.zeros(8, dtype=torch.long), steps=1)
    local = copy.deepcopy(model)
    local(inputs[:first_share])
    assert not torch.allclose(local.state_dict()["1.running_mean"], expected["1.running_mean"], atol=1e-4)


def test_one_process_is_plain_batchnorm_without_collectives():
    model = _model()
    sync = BatchNormSync(LocalCommunicator())
    converted = convert_sync_batchnorm(copy.deepcopy(model), sync)
    inputs = torch.randn(7, 2, 5, 5)
    torch.testing.assert_close(converted(inputs), model(inputs), rtol=0, atol=0)
    assert sync.collectives == 0
    assert isinstance(converted[1], SyncBatchNorm) and isinstance(converted[5], SyncBatchNorm)
    assert converted.state_dict().keys() == model.state_dict().keys()
    converted.load_state_dict(model.state_dict())  # old checkpoints and model.safetensors load unchanged


def test_conversion_keeps_the_parameter_objects():
    model = _model()
    weight = model[1].weight
    converted = convert_sync_batchnorm(model, BatchNormSync(LocalCommunicator()))
    assert converted[1].weight is weight and converted[1].running_mean is model[1].running_mean


def test_eval_mode_uses_running_statistics_and_no_collective():
    model = _model()
    model.eval()

    def work(comm):
        sync = BatchNormSync(comm)
        local = convert_sync_batchnorm(copy.deepcopy(model), sync)
        local(torch.randn(3 + comm.rank, 2, 5, 5))  # different batch counts: no collective may be issued
        return sync.collectives

    assert FakeWorld(2).run(work) == [0, 0]


def test_bf16_autocast_keeps_float32_statistics():
    model = _model()
    inputs = torch.randn(8, 2, 5, 5)
    expected = copy.deepcopy(model)
    expected(inputs)

    def work(comm):
        local = convert_sync_batchnorm(copy.deepcopy(model), BatchNormSync(comm))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = local(inputs[:5] if comm.rank == 0 else inputs[5:])
        return output.dtype, local[1].running_mean.dtype, local[1].running_mean

    for output_dtype, buffer_dtype, running_mean in FakeWorld(2).run(work):
        assert output_dtype == torch.bfloat16 and buffer_dtype == torch.float32
        torch.testing.assert_close(running_mean, expected[1].running_mean, rtol=2e-2, atol=2e-3)  # bf16 convolution


# -- the session's settings -------------------------------------------------------------------------------

class _TwoRankLearner:
    """A learner that is not replicated (as block momentum and DiLoCo), on a communicator of two ranks."""

    kind = "block_momentum"

    class comm:  # noqa: N801 - a stand-in object
        size = 2


def test_sync_batchnorm_is_refused_with_a_learner_whose_ranks_hold_different_models():
    from dtrain.session.batchnorm import prepare_batchnorm

    with pytest.raises(ValueError, match="sync_batchnorm=true with the block_momentum learner"):
        prepare_batchnorm(_model(), _TwoRankLearner(), True, "running", 4096)


@pytest.mark.parametrize("sync, statistics, setting", [(True, "running", "sync_batchnorm=true"),
                                                       (False, "recomputed", "batchnorm_statistics=recomputed")])
def test_a_model_without_batchnorm_is_refused(sync, statistics, setting):
    from dtrain.learners import LocalLearner
    from dtrain.session.batchnorm import prepare_batchnorm

    model = nn.Linear(3, 2)
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1), LocalCommunicator())
    with pytest.raises(ValueError, match=f"{setting}: Linear has no BatchNorm layer"):
        prepare_batchnorm(model, learner, sync, statistics, 4096)


def test_the_config_refuses_bad_batchnorm_settings():
    from dtrain.config import validate
    from tests.helpers.config import compose_config

    problems = validate(compose_config("+recipe=digits", "model.batch_norm=true", "session.batchnorm_recompute_samples=0",
                                       "session.batchnorm_statistics=exact"), check_run_dir=False)
    assert any(p.startswith("session.batchnorm_recompute_samples=0: expected") for p in problems), problems
    assert any(p.startswith("session.batchnorm_statistics='exact': expected one of running, recomputed")
               for p in problems), problems
    assert validate(compose_config("+recipe=digits", "model.batch_norm=true", "session.sync_batchnorm=true",
                                   "session.batchnorm_statistics=recomputed"), check_run_dir=False) == []


def test_digits_cnn_batch_norm_variant_and_unchanged_default():
    from dtrain.models import DigitsCNN

    plain, normed = DigitsCNN(), DigitsCNN(batch_norm=True)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in plain.modules())
    assert sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in normed.modules()) == 3
    assert list(plain.state_dict()) == ["features.0.weight", "features.0.bias", "features.2.weight", "features.2.bias",
                                        "classifier.1.weight", "classifier.1.bias", "classifier.4.weight",
                                        "classifier.4.bias"]
    assert normed(torch.randn(4, 1, 8, 8)).shape == (4, 10)

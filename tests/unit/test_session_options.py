"""Session settings of issue 12: micro-batches, gradient clipping, bf16 precision (one process, CPU)."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from dtrain import LocalLearner, MinibatchSource, training_session
from dtrain.data import ArrayDeserializer


def make_data(num_samples: int = 120) -> ArrayDeserializer:
    generator = np.random.default_rng(0)
    features = generator.normal(size=(num_samples, 6)).astype(np.float32)
    labels = (features[:, 0] + features[:, 1] > 0).astype(np.int64) + 2 * (features[:, 2] > 0.5)
    return ArrayDeserializer(features, labels, num_classes=4)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))


def train(run_dir: Path, model: nn.Module, *, lr: float = 0.1, momentum: float = 0.9, minibatch_size: int = 20,
          max_samples: int = 200, **options):
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum))
    session = training_session(model, nn.functional.cross_entropy, learner,
                               MinibatchSource(make_data(), randomize=True, randomization_seed=5),
                               minibatch_size=minibatch_size, max_samples=max_samples, run_dir=run_dir,
                               tensorboard=False, stream=io.StringIO(), **options)
    return session.train(), learner


def test_micro_batches_give_the_update_of_the_whole_minibatch(tmp_path):
    """Shares of 20 computed in passes of 3 (6 of 3 and one of 2): the same parameters as one pass."""
    whole, capped = make_model(), make_model()
    train(tmp_path / "whole", whole)
    passes = []
    capped.register_forward_hook(lambda module, inputs, output: passes.append(inputs[0].shape[0]))
    result, _ = train(tmp_path / "capped", capped, micro_batch_size=3)
    assert result.minibatches == 10
    assert passes[:7] == [3, 3, 3, 3, 3, 3, 2] and len(passes) == 70
    for name, parameter in whole.named_parameters():
        torch.testing.assert_close(dict(capped.named_parameters())[name], parameter, rtol=1e-5, atol=1e-6)
    assert not torch.equal(whole[0].weight, make_model()[0].weight)  # training did something


def test_clipping_matches_clip_grad_norm_on_the_minibatch_gradient(tmp_path):
    """One minibatch of 20 with clip_grad_norm=0.05: p - lr * clip(grad of the mean loss), by hand."""
    model, reference = make_model(), make_model()
    order = MinibatchSource(make_data(), randomize=True, randomization_seed=5).next_minibatch(20, 1, 0)
    loss = nn.functional.cross_entropy(reference(order.features), order.labels)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.05)
    assert norm > 0.05  # the clip is active
    expected = [parameter - 0.1 * parameter.grad for parameter in reference.parameters()]
    train(tmp_path / "run", model, momentum=0.0, max_samples=20, clip_grad_norm=0.05)
    for parameter, wanted in zip(model.parameters(), expected):
        torch.testing.assert_close(parameter, wanted, rtol=1e-6, atol=1e-7)
    unclipped = make_model()
    train(tmp_path / "off", unclipped, momentum=0.0, max_samples=20)
    assert not torch.allclose(unclipped[0].weight, model[0].weight)


def test_bf16_autocasts_the_forward_on_the_cpu_and_trains(tmp_path):
    seen = []
    model = make_model()
    model.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    result, _ = train(tmp_path / "bf16", model, precision="bf16", max_samples=400)
    assert set(seen) == {torch.bfloat16}
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())
    assert result.last_training_error is not None and result.last_training_error < 0.5  # 4 classes: chance 0.75
    plain = []
    model = make_model()
    model.register_forward_hook(lambda module, inputs, output: plain.append(output.dtype))
    train(tmp_path / "fp32", model, max_samples=20)
    assert set(plain) == {torch.float32}


@pytest.mark.parametrize("options, message", [
    ({"micro_batch_size": 0}, "micro_batch_size=0: expected a positive whole number of samples"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm=-1.0: expected"),
    ({"precision": "16"}, "precision='16': expected one of 32, bf16"),
    ({"precision": "fp16"}, "precision='fp16': fp16 (float16 with a loss scaler) is not available yet"),
])
def test_bad_session_settings_are_refused_naming_them(tmp_path, options, message):
    with pytest.raises(ValueError) as error:
        train(tmp_path, make_model(), **options)
    assert str(error.value).startswith(message)


def test_config_checks_the_new_session_settings():
    from test_config import compose_config

    from dtrain.config import validate

    problems = validate(compose_config("+recipe=digits", "session.micro_batch_size=0", "session.clip_grad_norm=-2",
                                       "session.precision=fp32", "session.tensorboard=null"), check_run_dir=False)
    assert any(p.startswith("session.micro_batch_size=0") for p in problems), problems
    assert any(p.startswith("session.clip_grad_norm=-2") for p in problems), problems
    assert any(p.startswith("session.precision='fp32'") for p in problems), problems
    assert not any("tensorboard" in p for p in problems), problems  # null: "when installed" is a valid choice
    good = validate(compose_config("+recipe=digits", "session.micro_batch_size=8", "session.clip_grad_norm=1.0",
                                   "session.precision=bf16"), check_run_dir=False)
    assert good == [], good

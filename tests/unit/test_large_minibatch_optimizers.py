"""LARS, LAMB and RMSprop warm-up then SGD against references written from the papers' equations."""
from __future__ import annotations

import math

import pytest
import torch

from dtrain.optim import LAMB, LARS, RMSpropWarmupSGD, norm_and_bias_groups, optimizer_parameters


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(12, 4), torch.nn.LayerNorm(4),
                               torch.nn.Linear(4, 2, bias=False))


def _gradients(steps: int, shapes: list[torch.Size], seed: int = 1) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes] for _ in range(steps)]


def _run(optimizer_class, model, gradients, **settings) -> list[torch.Tensor]:
    model = model.double()
    optimizer = optimizer_class(norm_and_bias_groups(model), **settings)
    for step_gradients in gradients:
        for parameter, gradient in zip(model.parameters(), step_gradients):
            parameter.grad = gradient.clone()
        optimizer.step()
    return [parameter.detach().clone() for parameter in model.parameters()]


def _excluded_flags(model) -> list[bool]:
    excluded = {id(p) for group in norm_and_bias_groups(model) if group["excluded"] for p in group["params"]}
    return [id(p) in excluded for p in model.parameters()]


def test_groups_exclude_normalization_parameters_and_biases_by_module_and_name():
    model = _model()
    names = [name for name, _ in model.named_parameters()]
    flags = _excluded_flags(model)
    assert dict(zip(names, flags)) == {"0.weight": False, "0.bias": True, "1.weight": True, "1.bias": True,
                                       "4.weight": False, "4.bias": True, "5.weight": True, "5.bias": True,
                                       "6.weight": False}
    assert isinstance(optimizer_parameters(torch.optim.SGD, model), type(model.parameters()))  # others: unchanged


def _lars_reference(weights, gradients, excluded, lr, momentum, eta, weight_decay, eps):
    """You, Gitman, Ginsburg 2017, Algorithm 1, per tensor; excluded tensors: v = m v + lr g."""
    weights = [w.clone() for w in weights]
    velocities = [torch.zeros_like(w) for w in weights]
    for step_gradients in gradients:
        for index, (w, g) in enumerate(zip(weights, step_gradients)):
            if excluded[index]:
                local, decay = 1.0, 0.0
            else:
                w_norm, g_norm = w.norm().item(), g.norm().item()
                local = eta * w_norm / (g_norm + weight_decay * w_norm + eps) if w_norm > 0 and g_norm > 0 else 1.0
                decay = weight_decay
            velocities[index] = momentum * velocities[index] + lr * local * (g + decay * w)
            weights[index] = w - velocities[index]
    return weights


def _lamb_reference(weights, gradients, excluded, lr, beta1, beta2, eps, weight_decay, bias_correction=True):
    """You et al. 2019, Algorithm 2, per tensor, phi = identity; excluded tensors: Adam."""
    weights = [w.clone() for w in weights]
    first = [torch.zeros_like(w) for w in weights]
    second = [torch.zeros_like(w) for w in weights]
    for t, step_gradients in enumerate(gradients, start=1):
        for index, (x, g) in enumerate(zip(weights, step_gradients)):
            first[index] = beta1 * first[index] + (1 - beta1) * g
            second[index] = beta2 * second[index] + (1 - beta2) * g * g
            m, v = first[index], second[index]
            if bias_correction:
                m, v = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
            r = m / (v.sqrt() + eps)
            decay = 0.0 if excluded[index] else weight_decay
            u = r + decay * x
            ratio = 1.0
            if not excluded[index] and x.norm() > 0 and u.norm() > 0:
                ratio = (x.norm() / u.norm()).item()
            weights[index] = x - lr * ratio * u
    return weights


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_lars_matches_the_paper(weight_decay):
    model = _model().double()
    start = [p.detach().clone() for p in model.parameters()]
    gradients = _gradients(5, [p.shape for p in start])
    settings = dict(lr=0.5, momentum=0.9, eta=0.02, weight_decay=weight_decay, eps=1e-9)
    got = _run(LARS, model, gradients, **settings)
    want = _lars_reference(start, gradients, _excluded_flags(model), **settings)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("weight_decay,bias_correction", [(0.0, True), (0.05, True), (0.05, False)])
def test_lamb_matches_the_paper(weight_decay, bias_correction):
    model = _model().double()
    start = [p.detach().clone() for p in model.parameters()]
    gradients = _gradients(5, [p.shape for p in start])
    got = _run(LAMB, model, gradients, lr=0.01, momentum=0.9, variance_momentum=0.99, eps=1e-6,
               weight_decay=weight_decay, bias_correction=bias_correction)
    want = _lamb_reference(start, gradients, _excluded_flags(model), 0.01, 0.9, 0.99, 1e-6, weight_decay,
                           bias_correction)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_excluded_parameters_follow_torch_sgd_and_adam():
    model = _model().double()
    gradients = _gradients(4, [p.shape for p in model.parameters()])
    flags = _excluded_flags(model)
    lars = _run(LARS, _model(), gradients, lr=0.1, momentum=0.9, eta=0.01, weight_decay=0.01)
    lamb = _run(LAMB, _model(), gradients, lr=0.01, momentum=0.9, variance_momentum=0.999, eps=1e-6, weight_decay=0.1)
    for reference_class, settings, got in ((torch.optim.SGD, dict(lr=0.1, momentum=0.9), lars),
                                           (torch.optim.Adam, dict(lr=0.01, eps=1e-6), lamb)):
        plain = _model().double()
        optimizer = reference_class(plain.parameters(), **settings)
        for step_gradients in gradients:
            for parameter, gradient in zip(plain.parameters(), step_gradients):
                parameter.grad = gradient.clone()
            optimizer.step()
        for flag, a, b in zip(flags, got, plain.parameters()):
            if flag:
                torch.testing.assert_close(a, b.detach(), rtol=1e-10, atol=1e-12)
            else:
                assert not torch.allclose(a, b.detach())  # adapted tensors do differ from plain SGD/Adam


def test_including_norm_and_bias_adapts_and_decays_every_tensor():
    model = _model().double()
    start = [p.detach().clone() for p in model.parameters()]
    gradients = _gradients(3, [p.shape for p in start])
    got = _run(LARS, model, gradients, lr=0.5, momentum=0.9, eta=0.02, weight_decay=0.01, exclude_norm_and_bias=False)
    want = _lars_reference(start, gradients, [False] * len(start), 0.5, 0.9, 0.02, 0.01, 1e-9)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_trust_ratio_is_one_for_a_zero_tensor():
    weight = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    weight.grad = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    LAMB([weight], lr=0.1, weight_decay=0.1).step()  # ||x|| = 0: ratio 1, the Adam step of size lr
    torch.testing.assert_close(weight.detach(), -0.1 * torch.sign(weight.grad) / (1 + 1e-6), rtol=1e-5, atol=0)


def _paper_alpha_sgd(epoch, center, period):
    """Akiba et al. 2017, section 3.1: an ELU-shaped rise of the SGD share, 1/2 at the center."""
    if epoch < center:
        return 0.5 * math.exp(2 * (epoch - center) / period)
    if epoch < center + period / 2:
        return 0.5 + (epoch - center) / period
    return 1.0


def _rmsprop_warmup_reference(weights, gradients, samples, lr, mu1, mu2, eps, center, period, scale):
    """m = mu2 m + (1-mu2) g^2; delta = mu1 delta - (a_sgd + a_rmsprop / (sqrt(m)+eps)) g; theta += lr delta."""
    weights = [w.clone() for w in weights]
    m = [torch.zeros_like(w) for w in weights]
    delta = [torch.zeros_like(w) for w in weights]
    for seen, step_gradients in zip(samples, gradients):
        a_sgd = _paper_alpha_sgd(seen, center, period)
        a_rmsprop = scale * (1 - a_sgd)
        for index, g in enumerate(step_gradients):
            m[index] = mu2 * m[index] + (1 - mu2) * g * g
            delta[index] = mu1 * delta[index] - (a_sgd + a_rmsprop / (m[index].sqrt() + eps)) * g
            weights[index] = weights[index] + lr * delta[index]
    return weights


def test_rmsprop_warmup_sgd_matches_the_formula_through_the_transition():
    model = _model().double()
    start = [p.detach().clone() for p in model.parameters()]
    gradients = _gradients(10, [p.shape for p in start])
    samples = [64 * step for step in range(10)]  # center 256, period 256: all SGD from 384 (the 7th step) on
    optimizer = RMSpropWarmupSGD(model.parameters(), lr=0.05, momentum=0.9, variance_momentum=0.99, eps=1e-8,
                                 center_samples=256, period_samples=256, rmsprop_scale=0.3)
    alphas = []
    for seen, step_gradients in zip(samples, gradients):
        optimizer.set_samples_seen(seen)
        alphas.append(optimizer.param_groups[0]["alpha_sgd"])
        for parameter, gradient in zip(model.parameters(), step_gradients):
            parameter.grad = gradient.clone()
        optimizer.step()
    want = _rmsprop_warmup_reference(start, gradients, samples, 0.05, 0.9, 0.99, 1e-8, 256, 256, 0.3)
    for a, b in zip(model.parameters(), want):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)
    assert alphas[:7] == pytest.approx([0.5 * math.exp(-2), 0.5 * math.exp(-1.5), 0.5 * math.exp(-1),
                                        0.5 * math.exp(-0.5), 0.5, 0.75, 1.0])


def test_rmsprop_warmup_sgd_is_torch_momentum_sgd_once_the_transition_is_over():
    model, twin = _model().double(), _model().double()
    twin.load_state_dict(model.state_dict())
    ours = RMSpropWarmupSGD(model.parameters(), lr=0.05, momentum=0.9, center_samples=0, period_samples=2)
    torch_sgd = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    for step_gradients in _gradients(5, [p.shape for p in model.parameters()]):
        ours.set_samples_seen(100)
        for a, b, gradient in zip(model.parameters(), twin.parameters(), step_gradients):
            a.grad, b.grad = gradient.clone(), gradient.clone()
        ours.step()
        torch_sgd.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("factory,settings,message", [
    (LARS, {"lr": -0.1}, "lr=-0.1"), (LARS, {"eta": -1.0}, "eta=-1.0"), (LARS, {"weight_decay": -1e-4}, "weight_decay"),
    (LARS, {"eps": 0.0}, "eps=0.0"), (LAMB, {"momentum": 1.0}, "momentum=1.0"),
    (LAMB, {"variance_momentum": -0.1}, "variance_momentum"), (LAMB, {"eps": 0.0}, "eps=0.0"),
    (RMSpropWarmupSGD, {"period_samples": 0}, "period_samples=0"),
    (RMSpropWarmupSGD, {"center_samples": -1}, "center_samples=-1"),
    (RMSpropWarmupSGD, {"rmsprop_scale": 0.0}, "rmsprop_scale=0.0"),
])
def test_out_of_range_hyperparameters_are_refused(factory, settings, message):
    with pytest.raises(ValueError, match=message):
        factory([torch.nn.Parameter(torch.ones(2))], **settings)


def test_state_dict_round_trip_continues_bit_identically():
    gradients = _gradients(6, [p.shape for p in _model().parameters()])
    for optimizer_class in (LARS, LAMB):
        straight = _run(optimizer_class, _model(), gradients)
        model = _model().double()
        first = optimizer_class(norm_and_bias_groups(model))
        for step_gradients in gradients[:3]:
            for parameter, gradient in zip(model.parameters(), step_gradients):
                parameter.grad = gradient.clone()
            first.step()
        saved_model, saved_state = model.state_dict(), first.state_dict()
        resumed_model = _model().double()
        resumed_model.load_state_dict(saved_model)
        second = optimizer_class(norm_and_bias_groups(resumed_model))
        second.load_state_dict(saved_state)
        for step_gradients in gradients[3:]:
            for parameter, gradient in zip(resumed_model.parameters(), step_gradients):
                parameter.grad = gradient.clone()
            second.step()
        for a, b in zip(straight, resumed_model.parameters()):
            assert torch.equal(a, b.detach())

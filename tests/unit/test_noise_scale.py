"""``python -m dtrain.noise_scale``: the simple noise scale of McCandlish et al. 2018 from a run's checkpoints.

The estimator recovers a known ``tr(Sigma) / |G|^2`` from gradients with Gaussian noise of known variance
(even and uneven minibatch sizes); ``measure`` feeds it the gradients of the minibatches the source
serves; the command reads a real run's checkpoints, and its bad inputs give one line and exit 2.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dtrain.data import ArrayDeserializer, MinibatchSource
from dtrain.noise_scale import main, measure, samples_ratio, simple_noise_scale
from dtrain.session.binding import StreamBinding


def noisy_gradients(true_gradient: torch.Tensor, sigma: float, samples: torch.Tensor, seed: int) -> torch.Tensor:
    """One gradient per minibatch: the true one plus the mean of ``samples[i]`` per-sample noises of
    variance ``sigma^2`` in every coordinate (so ``tr Sigma = P sigma^2``)."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(samples), true_gradient.numel(), generator=generator, dtype=torch.float64)
    return true_gradient + sigma * noise / samples.double().sqrt()[:, None]


@pytest.mark.parametrize("uneven", [False, True])
def test_the_estimate_recovers_a_known_noise_scale(uneven: bool) -> None:
    parameters, sigma = 20_000, 0.5
    true_gradient = torch.full((parameters,), 0.02, dtype=torch.float64)  # |G|^2 = 8
    samples = torch.randint(16, 48, (64,), generator=torch.Generator().manual_seed(1)) if uneven \
        else torch.full((64,), 32)
    estimate = simple_noise_scale(noisy_gradients(true_gradient, sigma, samples, seed=0), samples)
    expected = parameters * sigma ** 2 / 8.0  # 625 samples
    assert estimate.gradient_norm_sq == pytest.approx(8.0, rel=0.03)
    assert estimate.trace_sigma == pytest.approx(parameters * sigma ** 2, rel=0.03)
    assert estimate.b_simple == pytest.approx(expected, rel=0.05)
    assert 0 < estimate.b_simple_se < 0.05 * expected


def test_a_noisier_gradient_has_a_larger_noise_scale_in_proportion() -> None:
    samples = torch.full((32,), 64)
    true_gradient = torch.full((10_000,), 0.05, dtype=torch.float64)
    quiet = simple_noise_scale(noisy_gradients(true_gradient, 0.2, samples, seed=0), samples)
    noisy = simple_noise_scale(noisy_gradients(true_gradient, 0.4, samples, seed=0), samples)
    assert noisy.b_simple / quiet.b_simple == pytest.approx(4.0, rel=0.05)


def test_samples_ratio_follows_the_empirical_model() -> None:
    # E = E_min (1 + B / B_noise): at B_noise = b, b needs 2 E_min and 16 b needs 17 E_min
    assert samples_ratio(b_noise=100.0, minibatch=100.0, scale=16) == pytest.approx(17 / 2)
    # far below the noise scale a larger minibatch costs (almost) no extra samples
    assert samples_ratio(b_noise=1e9, minibatch=100.0, scale=16) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("gradients, samples, message", [
    (torch.zeros(1, 5), torch.tensor([4]), "expected [minibatches >= 2, parameters]"),
    (torch.zeros(3, 5), torch.tensor([4, 4]), "expected one positive count per gradient (3)"),
    (torch.zeros(2, 5), torch.tensor([4, 0]), "expected one positive count per gradient (2)"),
])
def test_bad_gradients_are_refused(gradients, samples, message) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        simple_noise_scale(gradients, samples)


def test_measure_uses_the_gradients_of_the_minibatches_the_source_serves() -> None:
    torch.manual_seed(0)
    features, labels = torch.randn(512, 6), torch.randn(512, 1)
    source = MinibatchSource(ArrayDeserializer(features, labels, num_classes=None), randomize=True,
                             randomization_seed=3)
    model = torch.nn.Linear(6, 1)
    start = source.get_checkpoint_state()
    estimate, mean_loss, mean_samples = measure(model, torch.nn.functional.mse_loss, source, StreamBinding(), 16, 12)

    source.restore_from_checkpoint(start)
    gradients, losses = [], []
    for _ in range(12):
        batch = source.next_minibatch(16, 1, 0)
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(batch.streams["features"]), batch.streams["labels"])
        loss.backward()
        gradients.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        losses.append(float(loss.detach()))
    by_hand = simple_noise_scale(torch.stack(gradients), torch.full((12,), 16))
    assert mean_samples == 16 and mean_loss == pytest.approx(sum(losses) / 12, rel=1e-6)
    assert estimate.b_simple == pytest.approx(by_hand.b_simple, rel=1e-5)
    assert estimate.trace_sigma == pytest.approx(by_hand.trace_sigma, rel=1e-5)


def test_bad_input_gives_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.yaml does not exist" in err, err

    assert main([str(tmp_path), "--minibatches", "2"]) == 2
    assert capsys.readouterr().err.strip() == "python -m dtrain.noise_scale: error: --minibatches 2: expected at least 4"

    assert main([str(tmp_path), "--scale", "1"]) == 2
    assert "--scale 1.0: expected a multiple above 1" in capsys.readouterr().err


def test_a_row_near_a_minimum_says_the_noise_scale_is_not_measurable() -> None:
    from dtrain.noise_scale import NoiseScale, _row

    # |G|^2 estimated below zero: the gradients are all noise, no noise scale to report
    row = _row(9000, 0.0002, NoiseScale(-1e-6, 0.5, -5e5, math.nan), 32.0, 16.0)
    assert "not measurable (|G|^2 estimated at -1e-06)" in row
    measured = _row(9000, 0.0002, NoiseScale(1e-3, 0.5, 500.0, math.inf), 32.0, 16.0)
    assert "| 500 +- n/a | 15.62 |" in measured and f"{samples_ratio(500.0, 32.0, 16.0):.2f}" in measured


def test_the_streaming_sums_give_the_estimate_of_the_whole_matrix() -> None:
    from dtrain.noise_scale import GradientSums

    samples = torch.randint(8, 40, (24,), generator=torch.Generator().manual_seed(2))
    gradients = noisy_gradients(torch.full((300,), 0.1, dtype=torch.float64), 0.3, samples, seed=4)
    sums = GradientSums(groups=6)
    for gradient, count in zip(gradients.float(), samples.tolist()):
        sums.add(gradient.reshape(10, 30), count)  # any shape: flattened
    streamed, whole = sums.estimate(), simple_noise_scale(gradients, samples, groups=6)
    assert streamed.b_simple == pytest.approx(whole.b_simple, rel=1e-5)
    assert streamed.b_simple_se == pytest.approx(whole.b_simple_se, rel=1e-4)
    assert sums.group_sums.shape == (6, 300)  # memory: one sum per group, not one row per minibatch
    with pytest.raises(ValueError, match="a gradient of 7 values after ones of 300"):
        sums.add(torch.zeros(7), 4)


def test_a_device_that_is_not_there_is_refused(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path), "--device", "tpu"]) == 2
    assert "--device 'tpu': expected cpu or cuda[:N]" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([str(tmp_path), "--device", "cuda"]) == 2
        assert capsys.readouterr().err.strip() == ("python -m dtrain.noise_scale: error: --device cuda: this machine "
                                                   "has no CUDA device; expected cpu")

"""How large a minibatch a model can use: the gradient noise scale at a run's checkpoints.

    python -m dtrain.noise_scale outputs/shakespeare_char/2026-11-25_12-00-00
    python -m dtrain.noise_scale RUN_DIR --minibatches 64 --scale 16

The simple noise scale ``B_simple = tr(Sigma) / |G|^2`` of McCandlish et al. 2018 ("An Empirical Model
of Large-Batch Training", appendix A) compares the variance of one sample's gradient (``tr Sigma``) with
the squared norm of the true gradient (``|G|^2``). Below about ``B_simple`` samples a larger minibatch
buys nearly proportionally fewer steps; well above it, more samples per step buy almost nothing, so a
run with the same number of samples ends worse. Both quantities are estimated without bias from
``--minibatches`` gradients of the run's own minibatch size ``b`` at the same weights: the mean
squared norm of one minibatch's gradient is ``|G|^2 + tr(Sigma) / b``, and that of their average
(``B = M b`` samples) ``|G|^2 + tr(Sigma) / B``.

Every checkpoint the run kept is measured (``session.checkpoint.preserve_all=true`` keeps them all),
with the model in training mode (dropout as in training) on the run's training data, read from its
start with the run's seed, so every checkpoint sees the same minibatches; ``--device cuda`` computes
the gradients on a GPU. Memory beyond the model's: 8 sums of its gradient in float64. The model, loss,
data and stream binding come from the run directory's latest config, as ``python -m dtrain.generate``
reads them.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["GradientSums", "NoiseScale", "load_run_setup", "main", "measure", "run_checkpoints", "samples_ratio",
           "simple_noise_scale"]


@dataclass(frozen=True)
class NoiseScale:
    """Estimates at one set of weights: ``|G|^2``, ``tr(Sigma)`` (per sample) and their ratio ``B_simple``
    (in samples), with the ratio's jackknife standard error over groups of minibatches (``nan`` with
    fewer than two groups)."""

    gradient_norm_sq: float
    trace_sigma: float
    b_simple: float
    b_simple_se: float


def _estimates(small_norm_sq_mean: float, big_norm_sq: float, b: float, big: float) -> tuple[float, float]:
    """``(|G|^2, tr Sigma)`` from the mean squared norm of ``b``-sample gradients and the squared norm of
    their ``big``-sample average (McCandlish et al., appendix A.1)."""
    gradient_norm_sq = (big * big_norm_sq - b * small_norm_sq_mean) / (big - b)
    trace_sigma = (small_norm_sq_mean - big_norm_sq) / (1.0 / b - 1.0 / big)
    return gradient_norm_sq, trace_sigma


class GradientSums:
    """What the estimate needs from a stream of minibatch gradients, in ``groups x P`` memory: each group's
    sample-weighted gradient sum, and every gradient's squared norm and sample count. Gradient ``i``
    goes to group ``i mod groups``; the groups make the jackknife's standard error."""

    def __init__(self, groups: int = 8) -> None:
        if groups < 1:
            raise ValueError(f"groups {groups}: expected at least 1")
        self.groups = groups
        self.group_sums: torch.Tensor | None = None  # [groups, P], float64
        self.norms_sq: list[float] = []
        self.samples: list[float] = []

    def add(self, gradient: torch.Tensor, samples: float) -> None:
        """One minibatch's mean-loss gradient (any shape; flattened) over ``samples`` samples."""
        if not samples > 0:
            raise ValueError(f"samples {samples}: expected a positive count for each gradient")
        flat = gradient.detach().reshape(-1).double()
        if self.group_sums is None:
            self.group_sums = torch.zeros(self.groups, flat.numel(), dtype=torch.float64, device=flat.device)
        elif flat.numel() != self.group_sums.shape[1]:
            raise ValueError(f"a gradient of {flat.numel()} values after ones of {self.group_sums.shape[1]}")
        self.group_sums[len(self.norms_sq) % self.groups].add_(flat, alpha=float(samples))
        self.norms_sq.append(float(flat.square().sum()))
        self.samples.append(float(samples))

    def _estimate(self, total: torch.Tensor, left_out: int | None) -> tuple[float, float]:
        """The estimate from every gradient (``total``: the sum of all groups), or without group ``left_out``."""
        keep = [i for i in range(len(self.norms_sq)) if left_out is None or i % self.groups != left_out]
        n = torch.tensor([self.samples[i] for i in keep], dtype=torch.float64)
        big = float(n.sum())
        if left_out is not None:
            total = total - self.group_sums[left_out]
        big_norm_sq = float((total / big).square().sum())
        small_norm_sq = sum(self.norms_sq[i] for i in keep) / len(keep)
        harmonic = float(len(keep) / (1.0 / n).sum())  # E|g_i|^2 = |G|^2 + tr(Sigma) / n_i, averaged over i
        return _estimates(small_norm_sq, big_norm_sq, harmonic, big)

    def estimate(self) -> NoiseScale:
        """The noise scale from every gradient added; the standard error from leaving out one group at a time
        (delete-a-group jackknife; ``nan`` with fewer than two groups holding two gradients each).

        Raises:
            ValueError: fewer than two gradients.
        """
        if len(self.norms_sq) < 2:
            raise ValueError(f"{len(self.norms_sq)} gradient(s): expected at least 2 minibatches at the same weights")
        total = self.group_sums.sum(0)
        norm_sq, trace = self._estimate(total, None)
        se = math.nan
        groups = min(self.groups, len(self.norms_sq))
        if groups >= 2 and len(self.norms_sq) >= 2 * groups:
            ratios = []
            for left_out in range(groups):
                g_sq, tr = self._estimate(total, left_out)
                ratios.append(tr / g_sq if g_sq > 0 else math.inf)
            ratios_t = torch.tensor(ratios, dtype=torch.float64)
            se = math.sqrt((groups - 1) / groups * float((ratios_t - ratios_t.mean()).square().sum()))
        return NoiseScale(norm_sq, trace, trace / norm_sq if norm_sq > 0 else math.inf, se)


def simple_noise_scale(gradients: torch.Tensor, samples: torch.Tensor, groups: int = 8) -> NoiseScale:
    """``B_simple`` from ``gradients`` ``[M, P]``, each the mean-loss gradient of one minibatch of
    ``samples[i]`` samples drawn independently at the same weights (:class:`GradientSums` one by one).

    The large gradient is the sample-weighted average of all ``M`` (as a data-parallel step weights its
    shares), and the small minibatch size the harmonic mean of ``samples`` (what makes the mean squared
    norm of uneven minibatches' gradients an unbiased estimate). The standard error comes from
    leaving out one of ``groups`` groups of minibatches at a time (delete-a-group jackknife).

    Raises:
        ValueError: fewer than two minibatches, or shapes that do not fit.
    """
    if gradients.dim() != 2 or gradients.shape[0] < 2:
        raise ValueError(f"gradients of shape {tuple(gradients.shape)}: expected [minibatches >= 2, parameters]")
    samples = torch.as_tensor(samples, dtype=torch.float64).flatten()
    if samples.numel() != gradients.shape[0] or bool((samples <= 0).any()):
        raise ValueError(f"samples {samples.tolist()}: expected one positive count per gradient ({gradients.shape[0]})")
    sums = GradientSums(min(groups, gradients.shape[0] // 2) or 1)
    for gradient, count in zip(gradients, samples.tolist()):
        sums.add(gradient, count)
    return sums.estimate()


def samples_ratio(b_noise: float, minibatch: float, scale: float) -> float:
    """Samples a ``scale`` times larger minibatch needs to reach the same loss, as a multiple of what
    ``minibatch`` needs, from McCandlish et al.'s ``E = E_min (1 + B / B_noise)``."""
    return (1.0 + scale * minibatch / b_noise) / (1.0 + minibatch / b_noise)


def _flat_gradient(parameters: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
    grads = torch.autograd.grad(loss, parameters, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                      for g, p in zip(grads, parameters)])


def measure(model: torch.nn.Module, loss_fn, source, binding, minibatch_size: int, minibatches: int,
            groups: int = 8, device: torch.device | str = "cpu") -> tuple[NoiseScale, float, float]:
    """``(noise scale, mean training loss, mean samples per minibatch)`` of ``model`` (on ``device``) at its
    weights over the next ``minibatches`` minibatches of ``minibatch_size`` samples of ``source`` (one
    partition)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    sums, losses = GradientSums(min(groups, minibatches // 2) or 1), []
    model.train()
    for _ in range(minibatches):
        batch = source.next_minibatch(minibatch_size, 1, 0)
        if batch is None:
            raise ValueError(f"the training data ended after {len(losses)} minibatches; expected {minibatches} "
                             f"(ask for fewer with --minibatches)")
        batch = batch.to(torch.device(device))
        target, count, _ = binding.target_and_counts(batch)
        loss = loss_fn(binding.forward(model, batch), target)
        sums.add(_flat_gradient(parameters, loss), count)
        losses.append(float(loss.detach()))
    return sums.estimate(), sum(losses) / len(losses), sum(sums.samples) / len(sums.samples)


def _row(samples_seen: int, mean_loss: float, estimate: NoiseScale, minibatch: float, scale: float) -> str:
    """One table row. Near a minimum ``|G|^2`` is small and its estimate noisy, even negative: the noise
    scale is then printed as unmeasurable, and a standard error that some group's estimate made
    infinite as ``n/a``."""
    if not (estimate.gradient_norm_sq > 0 and estimate.trace_sigma > 0):
        return f"| {samples_seen:,} | {mean_loss:.4f} | not measurable (|G|^2 estimated at {estimate.gradient_norm_sq:.3g}) | | |"
    se = f"{estimate.b_simple_se:,.0f}" if math.isfinite(estimate.b_simple_se) else "n/a"
    return (f"| {samples_seen:,} | {mean_loss:.4f} | {estimate.b_simple:,.0f} +- {se} | {estimate.b_simple / minibatch:.2f} | "
            f"{samples_ratio(estimate.b_simple, minibatch, scale):.2f} |")


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: expected cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this machine has no CUDA device; expected cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: expected cpu or cuda[:N]")
    return device


def run_checkpoints(run_dir: Path, filename: str) -> list[tuple[int, Path]]:
    """``(samples, path)`` of every checkpoint in ``run_dir`` named after ``filename``, oldest first.

    Raises:
        FileNotFoundError: there is none (a message that says how to keep them)."""
    from dtrain.session.checkpoint import CheckpointFiles

    checkpoints = CheckpointFiles(run_dir / filename).by_content()
    if not checkpoints:
        raise FileNotFoundError(f"{run_dir} has no checkpoint-<samples>.pt; expected a run's checkpoints "
                                f"(session.checkpoint.preserve_all=true keeps every one)")
    return checkpoints


def load_run_setup(run_dir: Path, length_bucketing: int = 0):
    """``(config, model, loss, training source, binding, note)`` from the run directory's latest config.

    The training source reads with ``length_bucketing`` (default 0, off: a bucket's minibatches hold
    sequences of one length range, so a few dozen of them would measure the gradient of that range,
    not of the data; the noise scale's definition assumes minibatches drawn at random); ``note`` says
    so when the run used another setting."""
    from dtrain.build import _instantiate as instantiate  # a component's own error as one line naming it
    from dtrain.build import load_run_config
    from dtrain.session.from_settings import session_inputs
    from dtrain.session.binding import StreamBinding
    from dtrain.data.user_source import as_source
    from dtrain.session.stream_checks import bind_sources
    from omegaconf import OmegaConf

    config_path, config = load_run_config(run_dir)
    if config.get("objective") is not None:  # its loss is no loss(output, target) to take per-sample gradients of
        raise ValueError(f"{config_path}: the run trained with objective {config.objective.get('_target_')}; the "
                         f"gradient noise scale is measured on a run trained with a loss (loss(output, target))")
    torch.manual_seed(int(config.get("seed", 0)))
    model = instantiate(config.model, "model")
    loss_fn = instantiate(config.loss, "loss")
    train, note = config.source.train, ""
    if int(train.get("length_bucketing") or 0) != length_bucketing:
        reading = (f"buckets of {length_bucketing} sequences" if length_bucketing else
                   "minibatches of sequences drawn at random, as the definition assumes")
        note = (f"length bucketing {length_bucketing or 'off'} for the measurement (the run used "
                f"source.train.length_bucketing={train.get('length_bucketing') or 0}): {reading}")
        train = OmegaConf.merge(train, {"length_bucketing": length_bucketing})
    source = as_source(instantiate(train, f"source.train of {config_path}"))  # read as the session reads it
    binding = StreamBinding(session_inputs(config.session), config.session.target)
    bind_sources(binding, {f"source.train of {config_path}": source})  # samples counted as the run counted them
    return config, model, loss_fn, source, binding, note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.noise_scale", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory (config.yaml and checkpoint-<samples>.pt files)")
    parser.add_argument("--minibatches", type=int, default=64,
                        help="gradients measured at each checkpoint (default 64); the large batch is all of them")
    parser.add_argument("--minibatch-size", type=int, default=None,
                        help="samples per measured gradient (default: the run's session.minibatch_size)")
    parser.add_argument("--scale", type=float, default=16.0,
                        help="the larger minibatch to predict for, as a multiple of the minibatch size (default 16)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="where the gradients are computed: cpu (default), cuda, cuda:1, ...")
    args = parser.parse_args(argv)
    from dtrain.failures import UserError

    try:
        if args.minibatches < 4:
            raise ValueError(f"--minibatches {args.minibatches}: expected at least 4")
        if args.minibatch_size is not None and args.minibatch_size < 1:
            raise ValueError(f"--minibatch-size {args.minibatch_size}: expected a positive number of samples")
        if not args.scale > 1:
            raise ValueError(f"--scale {args.scale}: expected a multiple above 1")
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        device = _device(args.device)
        run_dir = Path(args.run_dir)
        config, model, loss_fn, source, binding, note = load_run_setup(run_dir)
        model.to(device)
        minibatch_size = args.minibatch_size or int(config.session.minibatch_size)
        checkpoints = run_checkpoints(run_dir, str(config.session.checkpoint.filename))
    except (OSError, ValueError, UserError) as error:
        print(f"python -m dtrain.noise_scale: error: {error}", file=sys.stderr)
        return 2
    from dtrain.session.checkpoint import load

    start = source.get_checkpoint_state()
    print(f"gradient noise scale of {run_dir}: {args.minibatches} gradients of {minibatch_size} samples per checkpoint")
    if note:
        print(note)
    print(f"| samples trained | training loss | B_simple (samples) | B_simple / minibatch | samples a {args.scale:g}x "
          f"minibatch needs, x |")
    print("|---:|---:|---:|---:|---:|")
    for samples_seen, path in checkpoints:
        try:
            model.load_state_dict(load(path)["model"])  # copied onto the model's device
        except Exception as error:  # noqa: BLE001 - one line naming the file, whatever went wrong
            print(f"python -m dtrain.noise_scale: error: {path}: {str(error).splitlines()[0]}", file=sys.stderr)
            return 2
        source.restore_from_checkpoint(start)
        estimate, mean_loss, mean_samples = measure(model, loss_fn, source, binding, minibatch_size, args.minibatches,
                                                    device=device)
        print(_row(samples_seen, mean_loss, estimate, mean_samples, args.scale), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

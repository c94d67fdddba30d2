"""Before training through ``torch.compile``, one minibatch's loss and gradients compared with eager
PyTorch's on the same weights, so that a compiler that computes wrong gradients is refused instead of
training a worse model without a word (``session.compile``, ``docs/semantics.md#compiled-training``).

The check runs once, on the first minibatch, and costs one eager and one compiled forward and
backward (the compiled one compiles the graph training then uses; no second compilation). It
computes gradients with ``torch.autograd.grad``, so no ``.grad``, learner hook, parameter, buffer
(BatchNorm statistics are put back), optimizer state or random stream is changed. Dropout draws the
same numbers in both: the compiled graph is built with inductor's ``fallback_random`` (eager's
random operators), and training keeps that graph. The per-parameter differences are all-reduced
(max), so every rank reaches the same verdict.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

#: largest relative difference accepted, per precision: float32 rounding in another order stays far
#: below 1e-2 (about 1e-7 on dtrain's models); bf16 autocast differs by up to about 1e-2
TOLERANCES = {"32": 1e-2, "bf16": 5e-2, "fp16": 5e-2}

#: a parameter's gradient is judged against at least this fraction of the whole gradient's norm: a
#: gradient that is only rounding noise (a bias before BatchNorm: about 2e-8 of the whole in float32,
#: 2e-4 in bf16) is not judged on its own scale
NOISE_FLOORS = {"32": 1e-4, "bf16": 3e-2, "fp16": 3e-2}

_PRECISION_WORDS = {"32": "float32", "bf16": "bf16", "fp16": "fp16"}


def relative_differences(model: torch.nn.Module, compiled_forward: Callable,
                         compute_loss: Callable[[Callable], torch.Tensor], device: torch.device,
                         precision: str = "32") -> tuple[list[str], torch.Tensor]:
    """``(names, differences)``: ``"loss"`` and every trainable parameter's name, with the relative
    difference between ``compute_loss(compiled_forward)`` and ``compute_loss(model)`` (the loss) and
    between their gradients (per parameter ``||compiled - eager||`` over the largest of ``||compiled||``,
    ``||eager||`` and ``NOISE_FLOORS[precision]`` times the whole eager gradient's norm), as a float64
    tensor on ``device``.

    ``compute_loss(forward)`` runs the forward (under the run's autocast) and returns the mean loss;
    both calls see the same parameters, buffers and random numbers.
    """
    named = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    parameters = [parameter for _, parameter in named]
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    random_state = _random_state(device)

    def loss_and_gradients(forward: Callable) -> tuple[torch.Tensor, list[torch.Tensor]]:
        _set_random_state(device, random_state)
        loss = compute_loss(forward)
        gradients = torch.autograd.grad(loss, parameters, allow_unused=True)
        with torch.no_grad():
            for buffer, saved in buffers:  # a training forward updates BatchNorm statistics
                buffer.copy_(saved)
        gradients = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(parameters, gradients)]
        return loss.detach().double(), gradients

    eager_loss, eager = loss_and_gradients(model)
    import torch._inductor.config as inductor_config  # noqa: PLC0415 - only where compile is on

    with inductor_config.patch(fallback_random=True):  # dropout draws eager's numbers in the compiled graph
        compiled_loss, compiled = loss_and_gradients(compiled_forward)
    _set_random_state(device, random_state)  # training's first minibatch draws what it would have without the check
    differences = [_relative(compiled_loss, eager_loss)]
    eager_norms = [e.double().norm() for e in eager]
    floor = NOISE_FLOORS[precision] * torch.stack(eager_norms).norm() if eager_norms else 0.0
    differences += [_relative(c.double().norm(), e_norm, (c.double() - e.double()).norm(), floor)
                    for c, e, e_norm in zip(compiled, eager, eager_norms)]
    return ["loss", *(name for name, _ in named)], torch.stack(differences).to(device)


def no_differences(model: torch.nn.Module, device: torch.device) -> tuple[list[str], torch.Tensor]:
    """What a rank without samples in the first minibatch contributes: zeros, named as above."""
    names = ["loss", *(name for name, parameter in model.named_parameters() if parameter.requires_grad)]
    return names, torch.zeros(len(names), dtype=torch.float64, device=device)


def verdict(names: list[str], differences: torch.Tensor, precision: str, comm) -> str | None:
    """The one-line refusal when the largest difference over all ranks exceeds ``TOLERANCES[precision]``,
    else ``None``; the same on every rank (a collective when several run)."""
    if comm.size > 1:
        differences = comm.allreduce(differences.to(comm.device), op="max")
    differences = differences.cpu()
    worst = int(torch.argmax(differences))
    largest, tolerance = float(differences[worst]), TOLERANCES[precision]
    if largest <= tolerance:
        return None
    what = "the loss" if worst == 0 else f"the gradient of {names[worst]}"
    return (f"session.compile=true: torch.compile computes {what} {100 * largest:.3g}% away from eager PyTorch on "
            f"the first minibatch (relative difference {largest:.3g}, tolerance {tolerance:g} in "
            f"{_PRECISION_WORDS[precision]}), so the compiled model would train differently; train without it "
            f"(session.compile=false)")


def _relative(compiled: torch.Tensor, eager: torch.Tensor, difference: torch.Tensor | None = None,
              floor: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``|difference| / max(|compiled|, |eager|, floor)``, 0 when that is 0 (norms, or the losses themselves).

    A non-finite eager value cannot be judged (0: the divergence checks report it); a non-finite
    compiled value where eager is finite is infinitely far.
    """
    difference = (compiled - eager).abs() if difference is None else difference
    scale = torch.maximum(torch.maximum(compiled.abs(), eager.abs()), torch.as_tensor(floor, dtype=eager.dtype))
    relative = torch.where(scale > 0, difference / scale.clamp(min=torch.finfo(torch.float64).tiny),
                           torch.zeros_like(scale))
    relative = torch.where(torch.isfinite(compiled), relative, torch.full_like(relative, float("inf")))
    return torch.where(torch.isfinite(eager), relative, torch.zeros_like(relative))


def _random_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_random_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


__all__ = ["NOISE_FLOORS", "TOLERANCES", "no_differences", "relative_differences", "verdict"]

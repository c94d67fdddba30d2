"""Training precision: autocast for bf16/fp16 and the dynamic loss scale of fp16.

``precision=fp16`` multiplies the loss by a scale before backward so small float16 gradients do
not flush to zero; the learner divides the gradients by it before any exchange (see
``Learner.loss_scale``) and skips the optimizer step on every rank when they overflowed. The
scale follows ``torch.amp.GradScaler``'s rule (halve on an overflow, double after
``growth_interval`` clean steps) and its state is a ``GradScaler`` state dict, stored in checkpoints.
"""
from __future__ import annotations

import contextlib
import platform
from pathlib import Path
from typing import Any

import torch

#: autocast dtypes of the reduced precisions (float32 runs without autocast)
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    """``torch.autocast`` for ``bf16``/``fp16`` on ``device``'s type; a no-op context for ``32``."""
    if precision in AUTOCAST_DTYPES:
        return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU multiplies bfloat16 matrices in hardware: AMX tiles on x86 (torch's own check;
    AVX512-BF16 alone is not enough to beat float32), the BF16 extension on ARM; ``None`` when unknown."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
        return bool(amx()) if amx is not None else None
    if machine in ("aarch64", "arm64"):
        try:
            features = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
        return any(line.startswith("Features") and "bf16" in line.split() for line in features.splitlines())
    return None


def bf16_cpu_note(precision: str, device: torch.device) -> str | None:
    """The start-up line for ``precision=bf16`` on a CPU without native bfloat16 matrix units (``None``
    otherwise): autocast there adds casts without faster products, so float32 is usually faster."""
    if precision != "bf16" or device.type != "cpu" or cpu_has_native_bf16() is not False:
        return None
    return ("dtrain: note: precision bf16 on a CPU without native bfloat16 matrix units (AMX on x86, BF16 on ARM) "
            "is usually slower than float32; session.precision=32 trains faster here")


class LossScaler:
    """fp16's dynamic loss scale, kept in a ``torch.amp.GradScaler`` (its state dict is the checkpoint entry).

    The learner unscales and checks the gradients itself (before the exchange, which a
    ``GradScaler.unscale_`` after the exchange could not do), so only the scale's bookkeeping is
    used here: :attr:`scale` before backward, :meth:`update` with the overflow verdict every
    rank agreed on after the step.

    Args:
        device: where training runs (``GradScaler`` is made for its device type).
    """

    def __init__(self, device: torch.device):
        self.grad_scaler = torch.amp.GradScaler(device.type)

    @property
    def scale(self) -> float:
        """The factor the next minibatch's loss is multiplied by."""
        return float(self.grad_scaler.get_scale())

    def update(self, found_inf: bool) -> None:
        """``GradScaler.update``'s rule: on an overflow multiply the scale by ``backoff_factor`` (0.5);
        after ``growth_interval`` steps without one, by ``growth_factor`` (2)."""
        state = self.grad_scaler.state_dict()
        if found_inf:
            state["scale"] *= state["backoff_factor"]
            state["_growth_tracker"] = 0
        else:
            state["_growth_tracker"] += 1
            if state["_growth_tracker"] == state["growth_interval"]:
                state["scale"] *= state["growth_factor"]
                state["_growth_tracker"] = 0
        self.grad_scaler.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """The ``GradScaler`` state dict (scale, growth tracker, factors, interval)."""
        return self.grad_scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output."""
        self.grad_scaler.load_state_dict(state)


__all__ = ["AUTOCAST_DTYPES", "LossScaler", "autocast", "bf16_cpu_note", "cpu_has_native_bf16"]

"""What decides float32 rounding on a CPU, so a fixture of trained weights can say where it was written.

The same code and seed give bit-identical weights only on a machine with the same torch build and
vector instructions (torch's kernels sum in another order with AVX-512 than with AVX2, and a CPU
vendor's BLAS may pick other blockings); elsewhere they agree to rounding, grown over the steps.
"""
from __future__ import annotations

import platform
import re
from pathlib import Path

import torch


def cpu_model_name() -> str:
    """The first ``model name`` of /proc/cpuinfo (Linux), else the platform's processor string."""
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        found = None
    return found[1].strip() if found else platform.processor()


def float_machine() -> dict[str, str]:
    """The torch build, its CPU vector capability and the CPU model: equal dicts, bit-identical float32 runs."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": cpu_model_name(), "machine": platform.machine()}


__all__ = ["cpu_model_name", "float_machine"]

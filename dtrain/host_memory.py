"""Whether freed host memory stays in the process for the next step, and why: one line for the start-up summary.

A training step allocates and frees the same large CPU tensors every time (activations, their
gradients). glibc's malloc serves a block above its *mmap threshold* with fresh pages from the
kernel and hands the top of its heap back when more than the *trim threshold* is free; its
thresholds adapt to what it sees, but not to a training loop. Every step then faults its memory in
again, page by page: the CIFAR-10 ConvNet on the CPU took 20,000 to 35,000 page faults per step and
trained about a quarter slower than with fixed thresholds (``benchmarks/host_memory.py``).

So a training process fixes both thresholds (``mallopt``): blocks up to 32 MiB (glibc's highest
mmap threshold) come from the heap, and up to 1 GiB of free heap is kept for the next step. The
process then holds its peak memory between steps, as torch's CUDA caching allocator does on a GPU.
Nothing is changed where the user already chose: ``session.keep_host_memory=false``, glibc's
``MALLOC_*_`` variables or ``GLIBC_TUNABLES``, another allocator in ``LD_PRELOAD`` (jemalloc,
tcmalloc, mimalloc), or a C library that is not glibc.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: blocks up to this size come from the heap (glibc refuses a higher mmap threshold on 64-bit systems)
MMAP_THRESHOLD_BYTES = 32 << 20
#: free heap kept for the next step before any is returned to the kernel
TRIM_THRESHOLD_BYTES = 1 << 30

_GLIBC_MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


@dataclass(frozen=True)
class HostMemoryChoice:
    """Whether freed host memory is kept for reuse, and the reason in words (for the start-up line)."""

    kept: bool
    reason: str

    def describe(self) -> str:
        """``host memory: ...``: the start-up line's text."""
        return f"host memory: {'freed blocks kept for the next step' if self.kept else 'allocator left as it is'} " \
               f"({self.reason})"


def keep_freed_host_memory(enabled: bool = True, environment: Mapping[str, str] | None = None,
                           libc_version: str | None = None) -> HostMemoryChoice:
    """Fixes glibc malloc's thresholds for this process so a step's freed memory serves the next one,
    unless :func:`reason_to_leave_allocator` gives a reason not to (the arguments are its own)."""
    reason = reason_to_leave_allocator(enabled, environment, libc_version)
    if reason is not None:
        return HostMemoryChoice(False, reason)
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting either one stops glibc adapting both
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        return HostMemoryChoice(False, "glibc refused the thresholds")
    return HostMemoryChoice(True, f"glibc malloc: blocks up to {MMAP_THRESHOLD_BYTES >> 20} MiB from the heap, "
                                  f"up to {TRIM_THRESHOLD_BYTES >> 30} GiB of it kept free")


def reason_to_leave_allocator(enabled: bool = True, environment: Mapping[str, str] | None = None,
                              libc_version: str | None = None) -> str | None:
    """Why the allocator is left as it is, in words, or ``None`` when its thresholds are to be fixed.

    Args:
        enabled: ``session.keep_host_memory``; ``False`` leaves the allocator as it is.
        environment: where to look for the user's own allocator settings (default: ``os.environ``).
        libc_version: the C library (default: this process's, ``os.confstr("CS_GNU_LIBC_VERSION")``).
    """
    environment = os.environ if environment is None else environment
    if not enabled:
        return "session.keep_host_memory=false"
    libc_version = _libc_version() if libc_version is None else libc_version
    if not libc_version.startswith("glibc"):
        return f"C library {libc_version or 'unknown'}, not glibc"
    preloaded = environment.get("LD_PRELOAD", "")
    for allocator in _OTHER_ALLOCATORS:
        if allocator in preloaded:
            return f"{allocator} in LD_PRELOAD"
    chosen = [name for name in _GLIBC_MALLOC_VARIABLES if name in environment]
    if "glibc.malloc." in environment.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    return f"{', '.join(chosen)} set in the environment" if chosen else None


def _libc_version() -> str:
    """``glibc 2.36``, or ``""`` where the C library does not say (musl, macOS)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        return ""


__all__ = ["HostMemoryChoice", "keep_freed_host_memory", "reason_to_leave_allocator"]

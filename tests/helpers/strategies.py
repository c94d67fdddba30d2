"""The exchange strategies the generic tests run over, by test name: one registry for the pytest
side (``tests/dist/test_exchange_strategies.py``) and the worker it launches under mpiexec."""
from __future__ import annotations

from collections.abc import Callable

from dtrain.exchange import AllReduce, CompressedAllReduce, Exchange, PowerSGD, Quantized, Sparse

STRATEGIES: dict[str, Callable[[], Exchange]] = {
    "allreduce": lambda: AllReduce(),
    "bf16": lambda: CompressedAllReduce("bf16"),
    "fp16": lambda: CompressedAllReduce("fp16"),
    "quantized1": lambda: Quantized(1),
    "quantized4": lambda: Quantized(4),
    "powersgd1": lambda: PowerSGD(matrix_approximation_rank=1, start_powersgd_iter=1),
    "powersgd2": lambda: PowerSGD(matrix_approximation_rank=2, start_powersgd_iter=0),
    "sparse": lambda: Sparse(chunk_size=64, top_k=8, num_bits=2),
}
"""A fresh strategy of each kind; a new shipped strategy gets a line here and is tested with the rest."""

__all__ = ["STRATEGIES"]

"""The quantized data-parallel learner: 1-bit SGD (and k-bit) with error feedback, CNTK-style.

One thing, three names: the config option ``learner=quantized`` (``learner.num_quantization_bits``,
1 by default) and the API call ``data_parallel_distributed_learner(num_quantization_bits=k)``
with k < 32 (CNTK's factory) both build a :class:`QuantizedDataParallelLearner` (CNTK's
``QuantizedDataParallelDistributedLearner``): the data-parallel learner with the
:class:`dtrain.exchange.Quantized` strategy (k-bit packed on the wire, two error-feedback
buffers, bucket by bucket overlapped with backward), and every worker applies the same decoded
sum with its local optimizer; see ``docs/semantics.md#quantized-gradients``. The class lives in
:mod:`dtrain.learners.data_parallel` (it is that learner with one more strategy); this module names it.
"""
from __future__ import annotations

from dtrain.learners.data_parallel import QuantizedDataParallelLearner

__all__ = ["QuantizedDataParallelLearner"]

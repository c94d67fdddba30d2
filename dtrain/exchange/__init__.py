"""Exchange strategies: how learners sum gradients or model deltas over ranks (see :mod:`dtrain.exchange.base`)."""
from dtrain.exchange.allreduce import AllReduce
from dtrain.exchange.base import Exchange, full_precision_allreduce_bytes
from dtrain.exchange.quantized import Quantized

__all__ = ["AllReduce", "Exchange", "Quantized", "full_precision_allreduce_bytes"]

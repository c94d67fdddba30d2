"""Exchange strategies: how learners sum gradients or model deltas over ranks (see :mod:`dtrain.exchange.base`)."""
from dtrain.exchange.allreduce import AllReduce
from dtrain.exchange.base import Exchange, ThreadedExchange, full_precision_allreduce_bytes
from dtrain.exchange.between_hosts import BetweenHosts
from dtrain.exchange.compressed import CompressedAllReduce
from dtrain.exchange.powersgd import PowerSGD
from dtrain.exchange.quantized import Quantized
from dtrain.exchange.sparse import Sparse

__all__ = ["AllReduce", "BetweenHosts", "CompressedAllReduce", "Exchange", "PowerSGD", "Quantized", "Sparse",
           "ThreadedExchange", "full_precision_allreduce_bytes"]

"""Exchange strategies: how learners sum gradients or model deltas over ranks (see :mod:`dtrain.exchange.base`)."""
from dtrain.exchange.base import Exchange, full_precision_allreduce_bytes

__all__ = ["Exchange", "full_precision_allreduce_bytes"]

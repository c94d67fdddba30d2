"""Loggers: the run's records, config and outputs in an experiment tracker (``logger=[wandb,mlflow]``;
``docs/callbacks-and-loggers.md#loggers``). Each is a :class:`dtrain.Callback` on rank 0; its client library is an optional extra,
imported only when a run starts."""
from dtrain.loggers.mlflow_logger import MLflowLogger
from dtrain.loggers.tracking import TrackingLogger
from dtrain.loggers.wandb_logger import WandbLogger

__all__ = ["MLflowLogger", "TrackingLogger", "WandbLogger"]

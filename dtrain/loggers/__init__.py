"""Loggers: the run's records in files and experiment trackers (``logger=[tensorboard,csv,wandb,mlflow]``;
``docs/callbacks-and-loggers.md#loggers``). Each is a :class:`dtrain.Callback` on rank 0; a client library is an
optional extra, imported only when a run starts."""
from dtrain.loggers.csv_logger import CsvLogger
from dtrain.loggers.mlflow_logger import MLflowLogger
from dtrain.loggers.tensorboard_logger import TensorBoardLogger
from dtrain.loggers.tracking import TrackingLogger
from dtrain.loggers.wandb_logger import WandbLogger

__all__ = ["CsvLogger", "MLflowLogger", "TensorBoardLogger", "TrackingLogger", "WandbLogger"]

"""Loggers: the run's records in files and experiment trackers (``logger=[tensorboard,csv,wandb,mlflow]``;
``docs/callbacks-and-loggers.md#loggers``). Each is a :class:`dtrain.Callback` on rank 0; a client library is an
optional extra, imported only when a run starts. The CSV and TensorBoard loggers are the run's own record files,
which the session writes without any logger, so they live in ``dtrain.session`` and are named here too; the
trackers sit above the session and go through its callback interface only."""
from dtrain.loggers.mlflow_logger import MLflowLogger
from dtrain.loggers.tracking import TrackingLogger
from dtrain.loggers.wandb_logger import WandbLogger
from dtrain.session.csv_logger import CsvLogger
from dtrain.session.tensorboard_logger import TensorBoardLogger

__all__ = ["CsvLogger", "MLflowLogger", "TensorBoardLogger", "TrackingLogger", "WandbLogger"]

"""Callbacks shipped with dtrain (``docs/callbacks-and-loggers.md``): give them to ``training_session(callbacks=[...])``
or choose them on the command line, ``callbacks=[early_stopping,best_checkpoint]``."""
from dtrain.callbacks.best_checkpoint import BestCheckpoint
from dtrain.callbacks.early_stopping import EarlyStopping
from dtrain.callbacks.time_limit import TimeLimit
from dtrain.session.callbacks import Callback, RunView, StepEnd

__all__ = ["BestCheckpoint", "Callback", "EarlyStopping", "RunView", "StepEnd", "TimeLimit"]

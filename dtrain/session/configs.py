"""CNTK's training_session configuration objects: checkpoints, cross-validation, test."""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dtrain import checks


def action_frequency(name: str, frequency: int | None) -> int:
    """CNTK's rule for how often an action fires, in samples: ``None`` means once, at the end
    (returned as ``sys.maxsize``); 0 disables the action.

    Raises:
        ValueError: not a non-negative whole number of samples or None (naming ``name``).
    """
    checks.sample_count(name, frequency, allow_zero=True, allow_none=True)
    return sys.maxsize if frequency is None else frequency


def signal_from_name(name: str) -> signal.Signals:
    """The signal called ``name`` (e.g. ``'SIGTERM'``); ValueError naming the value for anything else."""
    found = getattr(signal, str(name), None)
    if not isinstance(found, signal.Signals):  # SIG_IGN and SIG_BLOCK are constants, not signals
        raise ValueError(f"preemption_signal={name!r}: expected a signal name such as 'SIGTERM' or 'SIGUSR1', or None")
    return found


def device_and_profile_options(session) -> dict:
    """``training_session``'s ``device`` and ``profile`` arguments from the command line's ``session``
    config section (``session.device``; ``session.profile``, a ``ProfileConfig`` when ``enabled``)."""
    from dtrain.session.profiling import ProfileConfig

    profile = session.profile
    return {"device": session.device,
            "profile": ProfileConfig(profile.wait, profile.warmup, profile.active, profile.ranks)
            if profile.enabled else None}


@dataclass
class CheckpointConfig:
    """Where and how often to save checkpoints.

    Args:
        filename: checkpoint file name; a relative name is placed in the session's run directory.
        frequency: samples between checkpoints (``None``: only at the end; 0: never).
        restore: continue from the latest checkpoint at ``filename`` if there is one.
        preserve_all: keep every checkpoint instead of the newest ``keep_last``.
        keep_last: checkpoints kept (files ``<stem>-<samples><suffix>``, the newest by the samples
            recorded inside them); at least 2, so a damaged newest file can fall back to the one before.
        preemption_signal: the signal (name, e.g. ``"SIGTERM"``) that makes every rank save a
            checkpoint where the ranks next meet (the next minibatch; block momentum: within one block)
            and stop with exit code 75; ``None`` disables.
        restore_from: a checkpoint file (any name, any run) to start from when the run directory has
            no checkpoint of its own yet; once it has, its newest continues the run, so the same
            command resumes after a preemption. Verified as any restore (model, learner, data).
    """

    filename: str | Path = "checkpoint.pt"
    frequency: int | None = None
    restore: bool = True
    preserve_all: bool = False
    keep_last: int = 2
    preemption_signal: str | None = "SIGTERM"
    restore_from: str | Path | None = None

    def __post_init__(self):
        self.frequency = action_frequency("CheckpointConfig.frequency", self.frequency)
        if not str(self.filename) or str(self.filename).endswith(("/", os.sep)):
            raise ValueError(f"checkpoint filename {str(self.filename)!r} must name a file")
        checks.whole_number("CheckpointConfig.keep_last", self.keep_last, 2, unit="checkpoints")  # the newest and a fallback
        if self.preemption_signal is not None:
            signal_from_name(self.preemption_signal)
        if self.restore_from is not None and (not str(self.restore_from) or not self.restore):
            raise ValueError(f"CheckpointConfig.restore_from={str(self.restore_from)!r}: expected the path of a "
                             f"checkpoint file, with restore=True")


@dataclass
class CrossValidationConfig:
    """Periodic evaluation on a held-out source; ``callback`` may stop training.

    Args:
        minibatch_source: the cross-validation source (read in full each time, position restored).
        frequency: samples between evaluations (``None``: only at the end; 0: never).
        minibatch_size: samples per evaluation minibatch (global).
        callback: ``callback(index, average_error, num_samples, num_minibatches) -> bool``;
            returning ``False`` stops training. Fires on schedule even without a source (then with
            ``average_error``, ``num_samples`` and ``num_minibatches`` 0, as CNTK's).
        max_samples: read at most this many samples per evaluation (``None``: the whole source).
    """

    minibatch_source: object | None = None
    frequency: int | None = None
    minibatch_size: int = 256
    callback: Callable[[int, float, int, int], bool | None] | None = None
    max_samples: int | None = None

    def __post_init__(self):
        self.frequency = action_frequency("CrossValidationConfig.frequency", self.frequency)
        checks.sample_count("CrossValidationConfig.minibatch_size", self.minibatch_size)
        checks.sample_count("CrossValidationConfig.max_samples", self.max_samples, allow_none=True)
        if self.minibatch_source is None and self.callback is None:
            raise ValueError("CrossValidationConfig needs a minibatch_source, a callback, or both")


@dataclass
class TestConfig:
    """Evaluation on a test source once, after training.

    Args:
        minibatch_source: the test source (read in full once).
        minibatch_size: samples per evaluation minibatch (global).
    """

    __test__ = False  # not a pytest test class

    minibatch_source: object
    minibatch_size: int = 256

    def __post_init__(self):
        checks.sample_count("TestConfig.minibatch_size", self.minibatch_size)

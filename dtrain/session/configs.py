"""CNTK's training_session configuration objects: checkpoints, cross-validation, test."""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

from dtrain import checks
from dtrain.rules import KeyChecks, StrictBool, check_fields


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
    """Where and how often to save checkpoints: the Python API's class and the ``session.checkpoint``
    config section's schema (one definition, one set of rules: :func:`checkpoint_problems`).

    Args:
        filename: checkpoint file name (a str or a Path); a relative name is placed in the session's run directory.
        frequency: samples between checkpoints (``None``: only at the end; 0: never).
        restore: continue from the latest checkpoint at ``filename`` if there is one.
        preserve_all: keep every checkpoint instead of the newest ``keep_last``.
        keep_last: checkpoints kept (files ``<stem>-<samples><suffix>``, the newest by the samples
            recorded inside them); at least 2, so a damaged newest file can fall back to the one before.
        preemption_signal: the signal (name, e.g. ``"SIGTERM"``) that makes every rank save a
            checkpoint where the ranks next meet (the next minibatch; block momentum: within one block)
            and stop with exit code 75; ``None`` disables.
        restore_from: a checkpoint file (any name, any run; a str or a Path) to start from when the run
            directory has no checkpoint of its own yet; once it has, its newest continues the run, so the
            same command resumes after a preemption. Verified as any restore (model, learner, data).

    Raises:
        ValueError: the first of :func:`checkpoint_problems`, naming ``CheckpointConfig.<field>``.
    """

    filename: str = "checkpoint.pt"     # relative to the run directory
    frequency: Optional[int] = None     # samples; null = at the end only; 0 = never
    restore: StrictBool = True
    preserve_all: StrictBool = False    # keep every checkpoint, not only the newest keep_last
    keep_last: int = 2                  # >= 2: the newest and a fallback if it is damaged
    preemption_signal: Optional[str] = "SIGTERM"  # save at the next step and exit 75; null disables
    restore_from: Optional[str] = None  # a checkpoint file to start from while run_dir has none of its own

    def __post_init__(self):
        problems = checkpoint_problems(self, "CheckpointConfig") + restore_from_problems(self, "CheckpointConfig",
                                                                                        look=False)
        if problems:
            raise ValueError(problems[0])


def checkpoint_problems(checkpoint: Any, name: str) -> list[str]:
    """One line per setting of ``checkpoint`` (a :class:`CheckpointConfig` or its config node, called ``name``)
    out of range; ``restore_from`` is :func:`restore_from_problems`'s."""
    problems = checks.collect([
        lambda: checks.sample_count(f"{name}.frequency", checkpoint.frequency, allow_none=True, allow_zero=True),
        lambda: checks.whole_number(f"{name}.keep_last", checkpoint.keep_last, low=2,
                                    unit="checkpoints (the newest and a fallback)"),
        lambda: checks.boolean(f"{name}.restore", checkpoint.restore),
        lambda: checks.boolean(f"{name}.preserve_all", checkpoint.preserve_all),
    ])
    filename = checkpoint.filename
    if not filename or str(filename).endswith(("/", os.sep)):
        problems.append(f"{name}.filename={str(filename)!r}: expected a file name (e.g. checkpoint.pt)")
    signal_name = checkpoint.preemption_signal
    if signal_name is not None and not _names_a_signal(signal_name):
        problems.append(f"{name}.preemption_signal={signal_name!r}: expected a signal name such as "
                        f"SIGTERM or SIGUSR1, or null")
    return problems


def restore_from_problems(checkpoint: Any, name: str = "session.checkpoint", *, look: bool = True) -> list[str]:
    """``restore_from``: null, or (with restore on) a file that exists when ``look``.

    Reads the file system only; whether the file is a checkpoint of this run is checked when it is restored.
    """
    value = checkpoint.restore_from
    if value is None:
        return []
    value = os.fspath(value) if isinstance(value, os.PathLike) else value
    key = f"{name}.restore_from={value!r}"
    if not isinstance(value, str) or not value.strip():
        return [f"{key}: expected the path of a dtrain checkpoint file, or null"]
    if checkpoint.restore is False:
        return [f"{key}: expected {name}.restore=true (restore_from names the checkpoint to restore)"]
    if look and not os.path.isfile(value):
        where = "is a directory" if os.path.isdir(value) else "no such file"
        return [f"{key}: {where}; expected a dtrain checkpoint file (a relative path is from the working "
                f"directory, {os.getcwd()})"]
    return []


def _names_a_signal(name: str) -> bool:
    try:
        signal_from_name(name)
    except ValueError:
        return False
    return True


#: the value rules of cross-validation and test (``session.cv``, ``session.test``), used by the classes below
#: and by ``validate``
CROSS_VALIDATION: KeyChecks = {
    "frequency": partial(checks.sample_count, allow_none=True, allow_zero=True),
    "minibatch_size": checks.sample_count,
    "max_samples": partial(checks.sample_count, allow_none=True),
}
TEST: KeyChecks = {"minibatch_size": checks.sample_count, "max_samples": partial(checks.sample_count, allow_none=True)}


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
        check_fields(CROSS_VALIDATION, vars(self), "CrossValidationConfig")
        self.frequency = action_frequency("CrossValidationConfig.frequency", self.frequency)
        if self.minibatch_source is None and self.callback is None:
            raise ValueError("CrossValidationConfig needs a minibatch_source, a callback, or both")


@dataclass
class TestConfig:
    """Evaluation on a test source once, after training.

    Args:
        minibatch_source: the test source (read in full once, or up to ``max_samples``).
        minibatch_size: samples per evaluation minibatch (global).
        max_samples: read at most this many samples (``None``: the whole source), as cross-validation's:
            a shortened run's quicker test, on the source's first samples.
    """

    __test__ = False  # not a pytest test class

    minibatch_source: object
    minibatch_size: int = 256
    max_samples: int | None = None

    def __post_init__(self):
        check_fields(TEST, vars(self), "TestConfig")

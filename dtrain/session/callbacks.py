"""Callbacks: your code at the training loop's events (``docs/callbacks-and-loggers.md``).

A callback is an object with any of :class:`Callback`'s ``on_*`` methods; the session calls each at its event,
in the order the callbacks were given, on rank 0 only unless the callback sets ``all_ranks = True``. A callback
reads the run through :class:`RunView` (samples seen, model, optimizer, run directory, the records of
``metrics.jsonl``) and may end it with ``run.stop(reason)``: the ranks agree on it at the next progress,
cross-validation or checkpoint point (a single process: after the step), and training then ends as at
``max_samples``: the last checkpoint, the test, exit 0, with a line saying why.

The order of events in one run::

    on_run_start                  once this run's checks have passed (its first minibatch trained), before its
                                  first write (``run.start_samples``: where the run started)
    on_checkpoint_restore         a resumed run: the checkpoint it continues from
    on_step_end                   after every minibatch (its figures: StepEnd)
    on_progress                   after each progress period (the ``train`` record of metrics.jsonl)
    on_cross_validation           after each cross-validation pass (the ``cv`` record)
    on_checkpoint_save            after a checkpoint is written
    on_preemption                 the preemption signal was agreed on: the checkpoint is saved, the run ends
    on_test                       after the test pass (the ``test`` record; ``test_ema`` too with ema_decay)
    on_run_end                    the run's TrainingResult (also after a preemption)
    on_exception                  training failed with this exception (then it is raised)

A callback's ``state_dict()`` is kept in every checkpoint and given back to ``load_state_dict()`` on resume
(before ``on_run_start``), so early stopping's patience and the best value so far survive a restart.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtrain.session.results import TrainingResult

#: the events, in the order they can happen in a run (Callback's methods of these names)
EVENTS = ("on_run_start", "on_checkpoint_restore", "on_step_end", "on_progress", "on_cross_validation",
          "on_checkpoint_save", "on_preemption", "on_test", "on_run_end", "on_exception")


@dataclasses.dataclass
class StepEnd:
    """One trained minibatch, as ``on_step_end`` gets it.

    ``loss`` is this rank's mean loss of the minibatch's last pass as a detached tensor on the training device:
    reading it (``float(step.loss)``) waits for the device, so a callback that needs it every step costs a
    synchronisation per step; the period averages arrive with ``on_progress`` for free.
    """

    samples_seen: int       # global samples trained so far, this minibatch included
    minibatches: int        # minibatches trained so far (over all runs of this run directory)
    num_samples: int        # this minibatch's global samples
    learning_rate: float    # the first parameter group's learning rate this step used
    loss: Any               # see the class docstring (None: this rank had no samples)


class Callback:
    """Base class of a callback: override the events you need (each default does nothing).

    ``all_ranks = True`` runs the callback on every rank instead of rank 0 only (metrics records and the
    result are then given to every rank too). ``check(run)`` is called when the session is built: raise a
    ValueError naming the setting there (a metric the run does not produce, say) and nothing is written.
    """

    all_ranks: bool = False

    def check(self, run: RunView) -> None:
        """Refuses settings this run cannot honour (ValueError naming the value and what was expected)."""

    def on_run_start(self, run: RunView) -> None:
        """The run's checks have passed; nothing of it is written yet."""

    def on_checkpoint_restore(self, run: RunView, path: Path) -> None:
        """The run continues from the checkpoint at ``path``."""

    def on_step_end(self, run: RunView, step: StepEnd) -> None:
        """After every minibatch; keep it cheap, it is on the hot path."""

    def on_progress(self, run: RunView, record: dict) -> None:
        """After each progress period: its ``train`` record, as written to ``metrics.jsonl``."""

    def on_cross_validation(self, run: RunView, record: dict) -> None:
        """After each cross-validation pass: its ``cv`` record."""

    def on_test(self, run: RunView, record: dict) -> None:
        """After a test pass: its ``test`` (or ``test_ema``) record."""

    def on_checkpoint_save(self, run: RunView, path: Path) -> None:
        """A checkpoint was written at ``path`` (every rank holds the model it saved)."""

    def on_preemption(self, run: RunView, path: Path | None) -> None:
        """The preemption signal ended training; ``path`` is the checkpoint saved for the restart."""

    def on_run_end(self, run: RunView, result: TrainingResult) -> None:
        """Training, the test and the run's outputs are done (also after a preemption: ``result.preempted``)."""

    def on_exception(self, run: RunView, error: BaseException) -> None:
        """Training failed with ``error``; it is raised once every callback has seen it."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this callback (plain values and tensors)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Takes back what :meth:`state_dict` returned, when a run resumes."""


class RunView:
    """What a callback sees of the run and may do to it: read-only facts and ``stop()``.

    Args:
        session: the :class:`~dtrain.session.TrainingSession` (its model, learner, run directory and metrics).
    """

    def __init__(self, session):
        self._session = session
        self.stop_reason: str | None = None  # set by stop(); agreed on by the ranks at the next meeting point

    @property
    def samples_seen(self) -> int:
        """Global samples trained so far."""
        return self._session.learner.samples_seen

    @property
    def start_samples(self) -> int:
        """Global samples trained when this run started (a resumed run: its checkpoint's)."""
        return self._session.start_samples

    @property
    def max_samples(self) -> int | None:
        return self._session.max_samples

    @property
    def model(self):
        """The model being trained (the plain module, not a compiled wrapper)."""
        return self._session.model

    @property
    def optimizer(self):
        return self._session.learner.optimizer

    @property
    def learner(self):
        return self._session.learner

    @property
    def rank(self) -> int:
        return self._session.comm.rank

    @property
    def world_size(self) -> int:
        return self._session.comm.size

    @property
    def run_dir(self) -> Path:
        return self._session.run_dir

    @property
    def config(self) -> dict | None:
        """The run's whole resolved config as plain containers (``None``: a Python API run without one)."""
        return self._session.settings.get("config")

    @property
    def restored_from(self) -> Path | None:
        """The checkpoint this run continues (``None``: a fresh start)."""
        return self._session.restore()

    @property
    def records(self) -> list[dict]:
        """Every record of ``metrics.jsonl`` so far, earlier runs of this run directory included (rank 0)."""
        metrics = self._session.metrics_writer
        return metrics.records if metrics is not None else []

    @property
    def figures_named_later(self) -> bool:
        """Whether the records also hold figures named only when training starts (an objective's own), beside
        :meth:`produced_metrics`' keys."""
        return self._session.objective is not None

    def produced_metrics(self) -> dict[str, list[str]]:
        """The keys this run writes to ``metrics.jsonl`` by record kind (``train``, ``cv``, ``test``), for ``check``."""
        return self._session.produced_metrics()

    def evaluation_period(self, kind: str) -> int:
        """Global samples between this run's records of ``kind`` (``train``: progress reports, ``cv``:
        cross-validations); ``sys.maxsize``: only at the end of training, 0: none."""
        session = self._session
        periods = {"train": session.progress_period, "cv": session.cv_period}
        return periods[kind].frequency if kind in periods else 0

    @property
    def checkpoint_period(self) -> int:
        """Global samples between this run's checkpoints; ``sys.maxsize``: only at the end, 0: none."""
        session = self._session
        return session.checkpoint_period.frequency if session.checkpointing.files is not None else 0

    @property
    def metric_in_percent(self) -> bool:
        """Whether the run shows its metric as a rate in percent (``error 3.12%``) rather than a value."""
        return self._session.metric_percent

    def save_weights(self, path: Path, metadata: dict[str, str] | None = None) -> Path:
        """Writes the model's weights to ``path`` (safetensors, atomically) as ``model.safetensors`` is written, with
        ``samples_seen`` and ``metadata`` (string pairs) in the file's header."""
        return self._session.save_weights(Path(path), metadata)

    def line(self, text: str) -> None:
        """Prints one line where the run's progress goes (``training_session``'s ``stream``, standard output by
        default), so a callback's words land beside the run's own."""
        print(text, file=self._session.stream or sys.stdout, flush=True)

    def stop(self, reason: str) -> None:
        """Ends training at the next point where the ranks meet (see the module docstring); the first reason wins."""
        if self.stop_reason is None:
            self.stop_reason = str(reason)


class CallbackList:
    """The session's callbacks: the ones this rank runs, called by event in the order given.

    Only the callbacks defining an event are called for it, so an event no callback wants costs one
    empty loop; ``wants(event)`` lets the loop skip building its arguments at all.
    """

    def __init__(self, callbacks: Iterable[Any], is_main: bool):
        self.all = list(callbacks or ())
        for callback in self.all:
            problem = not_a_callback(callback)
            if problem is not None:
                raise TypeError(problem)
        self.here = [callback for callback in self.all if is_main or getattr(callback, "all_ranks", False)]
        self._handlers = {event: [getattr(callback, event) for callback in self.here
                                  if _overrides(callback, event)] for event in EVENTS}

    def __bool__(self) -> bool:
        return bool(self.all)

    def wants(self, event: str) -> bool:
        """Whether any callback on this rank handles ``event``."""
        return bool(self._handlers[event])

    def handlers(self, event: str) -> list:
        """The bound methods handling ``event`` on this rank, in order."""
        return self._handlers[event]

    def fire(self, event: str, *args) -> None:
        """Calls every handler of ``event`` with ``args``."""
        for handler in self._handlers[event]:
            handler(*args)

    def check(self, run: RunView) -> None:
        """Each callback's ``check`` (every rank runs them, so every rank refuses alike)."""
        for callback in self.all:
            check = getattr(callback, "check", None)
            if callable(check):
                check(run)

    def state_dict(self) -> dict[str, dict]:
        """Every callback's state, by its place and class name (rank 0's, the one that saves)."""
        return {_key(index, callback): callback.state_dict() for index, callback in enumerate(self.all)
                if callable(getattr(callback, "state_dict", None))}

    def load_state_dict(self, states: dict[str, dict] | None) -> None:
        """Gives each callback its saved state, matched by place and class name (a callback added since starts
        fresh; one removed since is dropped)."""
        for index, callback in enumerate(self.all):
            state = (states or {}).get(_key(index, callback))
            if state is not None and callable(getattr(callback, "load_state_dict", None)):
                callback.load_state_dict(state)


#: the arguments each method of a callback is called with (after ``self``)
ARGUMENTS = {"on_run_start": ("run",), "on_checkpoint_restore": ("run", "path"), "on_step_end": ("run", "step"),
             "on_progress": ("run", "record"), "on_cross_validation": ("run", "record"),
             "on_checkpoint_save": ("run", "path"), "on_preemption": ("run", "path"), "on_test": ("run", "record"),
             "on_run_end": ("run", "result"), "on_exception": ("run", "error"), "check": ("run",),
             "state_dict": (), "load_state_dict": ("state",)}


def not_a_callback(candidate: Any) -> str | None:
    """Why ``candidate`` is no callback (it has none of the events, or a method that cannot take the arguments
    the session calls it with), or ``None``: it is one. Checked when the session is built, so a wrong signature
    is refused before anything is written rather than failing the run at its first event."""
    if not any(callable(getattr(candidate, event, None)) for event in EVENTS):
        return (f"callback {_name(candidate)} has none of the events {', '.join(EVENTS)}; expected a dtrain.Callback "
                f"(see docs/callbacks-and-loggers.md)")
    for name, arguments in ARGUMENTS.items():
        method = getattr(candidate, name, None)
        if not callable(method):
            continue
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):  # a builtin without a signature: taken as it is
            continue
        try:
            signature.bind(*arguments)
        except TypeError:
            called = f"{name}({', '.join(arguments)})"
            return (f"callback {_name(candidate)}.{name}{signature} cannot be called as {called}; expected a method "
                    f"taking {', '.join(arguments) or 'no arguments'} (see docs/callbacks-and-loggers.md)")
    return None


def _overrides(callback: Any, event: str) -> bool:
    """Whether ``callback`` does something at ``event`` (a Callback subclass's inherited no-op does not)."""
    method = getattr(type(callback), event, None)
    if method is None:
        return callable(getattr(callback, event, None))
    return method is not getattr(Callback, event, None)


def _key(index: int, callback: Any) -> str:
    return f"{index}:{type(callback).__qualname__}"


def _name(callback: Any) -> str:
    kind = type(callback)
    return f"{kind.__module__}.{kind.__qualname__}"


__all__ = ["EVENTS", "Callback", "CallbackList", "RunView", "StepEnd", "not_a_callback"]

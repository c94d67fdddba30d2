"""``training_session``'s arguments from the session settings the command line composes (``SessionConfig``).

One translation for both doors: ``python -m dtrain`` builds its session from ``cfg.session`` through
:func:`session_arguments`, and a Python user hands the same typed settings to
``TrainingSession.from_settings(model, loss, learner, source, SessionConfig(...))``, so a setting means the
same thing, with the same defaults and the same rules, whichever way a run is started.
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from dtrain.schedules import Schedule, schedule_values
from dtrain.session.configs import CheckpointConfig, CrossValidationConfig, TestConfig, device_and_profile_options
from dtrain.session.lr_scaling import LearningRateScaling

#: the ``session`` settings that are the process's, not the training loop's (the command line applies them)
PROCESS_SETTINGS = ("num_threads", "keep_host_memory", "epoch_size")


def session_node(settings: Any) -> DictConfig:
    """``settings`` as a typed config node: a ``SessionConfig`` (or a DictConfig of one, as the command line has it).

    Raises:
        TypeError: anything else.
        ValueError: settings that break the ``session`` section's rules (every problem, one per line).
    """
    from dtrain.session.settings import SessionConfig, session_problems

    if isinstance(settings, SessionConfig):
        node = OmegaConf.structured(settings)
    elif isinstance(settings, DictConfig):
        node = settings
    else:
        raise TypeError(f"settings must be a dtrain SessionConfig (dtrain.session.settings), got "
                        f"{type(settings).__name__}")
    problems = session_problems(node)
    if problems:
        raise ValueError("; ".join(problems))
    return node


def schedule(node, warmup: bool = True) -> Schedule | None:
    """The schedule a ``ScheduleConfig`` node describes (None when off); ``warmup=False``: without its
    warm-up (``lr_scaling``'s). An lr warm-up without values ramps the constant lr (values ``[1.0]``)."""
    values = schedule_values(node)
    warmup_samples = node.warmup_samples if node is not None and warmup else 0
    if values is None:
        return Schedule(1.0, None, warmup_samples) if warmup_samples else None
    return Schedule(OmegaConf.to_container(values, resolve=True), node.epoch_size, warmup_samples)


def lr_scaling(session: DictConfig) -> LearningRateScaling | None:
    """``session.lr_scaling``: warmed up over ``session.lr_schedule.warmup_samples`` from the unscaled lr."""
    if session.lr_scaling == "none":
        return None
    warmup = session.lr_schedule.warmup_samples if session.lr_schedule is not None else 0  # with or without values
    return LearningRateScaling(session.lr_scaling, session.minibatch_size, session.lr_reference_minibatch_size, warmup)


def session_inputs(session: DictConfig):
    """``session.inputs`` as :class:`StreamBinding` takes it: a plain list or mapping, or the string it is."""
    inputs = session.inputs
    return OmegaConf.to_container(inputs, resolve=True) if isinstance(inputs, (DictConfig, ListConfig)) else inputs


def session_arguments(settings: Any, cv_source=None, test_source=None) -> dict[str, Any]:
    """``training_session``'s keyword arguments that the ``session`` settings hold (all but the model, loss,
    metric, learner, sources and run directory), with the cross-validation and test sources they apply to
    (``None``: no cross-validation, no test).

    Raises:
        TypeError, ValueError: see :func:`session_node`.
    """
    session = session_node(settings)
    minibatch_sizes = schedule(session.minibatch_size_schedule)
    return {
        "minibatch_size": minibatch_sizes or session.minibatch_size,
        "max_samples": session.max_samples,
        "progress_frequency": session.progress_frequency,
        "checkpoint_config": CheckpointConfig(**OmegaConf.to_container(session.checkpoint, resolve=True)),
        "cv_config": CrossValidationConfig(cv_source, session.cv.frequency, session.cv.minibatch_size,
                                           max_samples=session.cv.max_samples) if cv_source is not None else None,
        "test_config": TestConfig(test_source, session.test.minibatch_size, max_samples=session.test.max_samples)
        if test_source is not None else None,
        "lr_schedule": schedule(session.lr_schedule, warmup=session.lr_scaling == "none"),
        "lr_scaling": lr_scaling(session),
        "ema_decay": session.ema_decay,
        "momentum_time_constant_schedule": schedule(session.momentum_time_constant_schedule),
        "unit_gain_momentum": session.unit_gain_momentum,
        "tensorboard": session.tensorboard,
        "progress_bar": session.progress_bar,
        "micro_batch_size": session.micro_batch_size,
        "clip_grad_norm": session.clip_grad_norm,
        "precision": session.precision,
        "compile": session.compile,
        "sync_batchnorm": session.sync_batchnorm,
        "batchnorm_statistics": session.batchnorm_statistics,
        "batchnorm_recompute_samples": session.batchnorm_recompute_samples,
        **device_and_profile_options(session),
        "inputs": session_inputs(session),
        "target": session.target,
    }


__all__ = ["PROCESS_SETTINGS", "lr_scaling", "schedule", "session_arguments", "session_inputs", "session_node"]

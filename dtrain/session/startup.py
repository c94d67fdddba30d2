"""The start-up lines of a training session: what trains where, on how many workers, with which learner,
precision and options, and which checkpoint it starts from."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dtrain.learners.replicated import ReplicatedLearner
from dtrain.session.batchnorm import describe as describe_batchnorm
from dtrain.session.lr_scaling import LearningRateScaling, lr_warmup_samples
from dtrain.session.objective_call import ObjectiveCall
from dtrain.session.precision import bf16_cpu_note
from dtrain.session.profiling import StepProfiler
from dtrain.session.short_run import short_run_note


@dataclass(frozen=True)
class StartupSettings:
    """The session's settings that the start-up lines name (the session's arguments of the same names, checked)."""

    max_samples: int | None = None
    precision: str = "32"
    compile: bool = False
    micro_batch_size: int | None = None
    clip_grad_norm: float | None = None
    sync_batchnorm: bool = False
    batchnorm_statistics: str = "running"
    batchnorm_recompute_samples: int = 0
    lr_schedule: object = None
    lr_scaling: LearningRateScaling | None = None
    defining_stream_note: str = ""  # which stream counts the samples, when the source names one


class StartupLines:
    """The start-up lines of a training session: what trains where, on how many workers, with which learner,
    precision and options, and which checkpoint it starts from.

    Args:
        settings: the settings named.
        model, learner, source, device, minibatch_size: what trains, where and in which minibatches.
        binding: how the model takes the streams; ``objective``: the run's own objective (``None``: a loss).
        ema: the weight EMA (``None``: none); ``base_learning_rates``: the configured rates, before any scaling.
        checkpointing: which checkpoint the run starts from, and the settings changed since.
    """

    def __init__(self, settings: StartupSettings, *, model: torch.nn.Module, learner, source, device: torch.device,
                 minibatch_size, binding, objective: ObjectiveCall | None, ema, base_learning_rates: list[float],
                 checkpointing):
        self.settings = settings
        self.model, self.learner, self.comm, self.source = model, learner, learner.comm, source
        self.device, self.minibatch_size, self.binding, self.objective = device, minibatch_size, binding, objective
        self.ema, self.base_learning_rates, self.checkpointing = ema, base_learning_rates, checkpointing

    def print_lines(self, printer, restored_from: Path | None, profiler: StepProfiler | None) -> None:
        """The start-up lines, rank 0's printer printing them (``profiler``: the run's, ``None`` without one)."""
        settings, stream_note = self.settings, self.settings.defining_stream_note
        size = self.comm.size
        mb = int(self.minibatch_size(self.learner.samples_seen))
        parts = [f"training {sum(p.numel() for p in self.model.parameters()):,} parameters on {_device_name(self.device)}",
                 f"{size} worker{'s' if size > 1 else ''}" + (f" ({self.comm.backend})" if size > 1 else ""),
                 f"global minibatch {mb} ({mb // size}-{-(-mb // size)} per worker)"]
        sweep = self.source.samples_per_sweep
        if settings.max_samples is not None:  # in sweeps where the source says how long one is
            parts.append(f"{settings.max_samples:,} samples" + (f" ({settings.max_samples / sweep:.3g} sweeps of "
                                                                 f"{sweep:,})" if sweep else ""))
        printer.line("dtrain: " + ", ".join(parts))
        window_note = _randomization_window_note(self.source)
        if window_note:
            printer.line(f"dtrain: {window_note}")
        if self.objective is not None:
            counted = self.binding.target.text if self.binding.target is not None else "the minibatch"
            printer.line(f"dtrain: objective {self.objective.name}(model, minibatch), samples counted in {counted}"
                         + (f"; {stream_note}" if stream_note else ""))
        elif self.source.has_sequences or not self.binding.is_default:
            printer.line(f"dtrain: {self.binding.describe()}" + (f"; {stream_note}" if stream_note else ""))
        printer.line("dtrain: " + self.learner.describe() + _one_process_note(self.learner, size))
        options = [f"precision {settings.precision}" if settings.precision != "32" else "",
                   "torch.compile (inductor backend)" if settings.compile else "",
                   f"passes of at most {settings.micro_batch_size} samples per worker (one exchange per minibatch)"
                   if settings.micro_batch_size else "",
                   f"gradient clipped to global L2 norm {settings.clip_grad_norm:g}" if settings.clip_grad_norm else "",
                   profiler.describe() if profiler is not None else "",
                   describe_batchnorm(settings.sync_batchnorm, settings.batchnorm_statistics,
                                      settings.batchnorm_recompute_samples, self.comm.size),
                   settings.lr_scaling.describe(self.base_learning_rates[0]) if settings.lr_scaling is not None else "",
                   self.ema.describe() if self.ema is not None else ""]
        if any(options):
            printer.line("dtrain: " + ", ".join(option for option in options if option))
        for note in (bf16_cpu_note(settings.precision, self.device), self.unreached_lr_change_note(),
                     self.short_run_note()):
            if note:
                printer.line(note)
        if restored_from is None:
            printer.line(f"dtrain: {self.checkpointing.note}")
        else:
            printer.line(f"restored {restored_from} at {self.learner.samples_seen} samples"
                         + (f" ({self.checkpointing.note})" if self.checkpointing.note else ""))
            if self.checkpointing.changed_settings:
                printer.line(f"dtrain: settings changed since the checkpoint, now in effect: "
                             f"{'; '.join(self.checkpointing.changed_settings)}")

    def short_run_note(self) -> str:
        """A note when the run is too short for the learner's automatic settings (``dtrain.session.short_run``)."""
        settings = self.settings
        change = _first_lr_change(settings.lr_schedule)
        return short_run_note(self.learner.label(), self.learner.automatic_settings(), settings.max_samples,
                              lr_warmup_samples(settings.lr_schedule, settings.lr_scaling),
                              change[0] if change is not None else None)

    def unreached_lr_change_note(self) -> str:
        """A note when ``session.max_samples`` ends the run inside the learning-rate warm-up (the rate rises all
        run) or before ``session.lr_schedule``'s first change: a recipe shortened on the command line keeps its
        schedule's lengths (they are not scaled), so its rate may never reach its peak, or never drop."""
        settings = self.settings
        if settings.max_samples is None:
            return ""
        end = settings.max_samples
        change = _first_lr_change(settings.lr_schedule)
        unreached = change is not None and change[0] >= end
        warmup, share = 0, 1.0  # the longest warm-up (the schedule's, or lr_scaling's), the peak's share at the end
        for part in (settings.lr_schedule, settings.lr_scaling):
            if getattr(part, "warmup_samples", 0) and hasattr(part, "warmup_multiplier"):
                warmup = max(warmup, part.warmup_samples)
                share *= part.warmup_multiplier(end - 1)
        said = f"dtrain: note: the run ends at {end:,} samples"
        drop = (f"session.lr_schedule's first change (x{change[1]:g} to x{change[2]:g} at {change[0]:,})"
                if unreached else "")
        if share < 1.0:
            return (f"{said}, inside the learning-rate warm-up of {warmup:,} samples: the learning rate rises all run, "
                    f"to x{share:.2g} of its peak at the end" + (f", and {drop} is not reached" if drop else "")
                    + "; shorten session.lr_schedule.warmup_samples with session.max_samples if it should")
        if not unreached:
            return ""
        if warmup:
            return (f"{said}, before {drop}: the learning rate rises over the warm-up's first {warmup:,} samples, "
                    f"then stays at its peak to the end; shorten session.lr_schedule.values with session.max_samples "
                    f"if it should")
        return (f"{said}, before {drop}: the learning rate does not change in this run; shorten "
                f"session.lr_schedule.values with session.max_samples if it should")


def _first_lr_change(lr_schedule) -> tuple[int, float, float] | None:
    """``lr_schedule``'s first change (samples, multiplier before, after); ``None``: none, or a plain callable."""
    first_change = getattr(lr_schedule, "first_change", None)  # a Schedule; a plain callable says nothing
    return first_change() if first_change is not None else None


def _device_name(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3)`` or ``the CPU``: where the model trains, for the start-up line."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return "the CPU" if device.type == "cpu" else str(device)


def _one_process_note(learner, size: int) -> str:
    """For a replicated learner (``data_parallel``, ``quantized``, ``powersgd``, your own) in one process: that it
    makes plain local optimizer steps, so that ``learner data_parallel`` with 1 worker is not read as distributed."""
    if size == 1 and isinstance(learner, ReplicatedLearner):
        return " (one process: plain local optimizer steps, nothing is exchanged)"
    return ""



def _randomization_window_note(source) -> str:
    """How chunked training data (shards) is shuffled, where the source says (``MinibatchSource``)."""
    describe = getattr(source, "describe_randomization_window", None)
    return describe() if callable(describe) else ""

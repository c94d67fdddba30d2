"""Progress on the console: a rich progress bar on a terminal, plain lines otherwise.

``rich`` is imported only when a live bar is shown: plain lines (a file, a pipe, every rank but 0)
need nothing from it, and its import is a noticeable part of start-up (``benchmarks/startup_time.py``).
"""
from __future__ import annotations

import sys
import time
from datetime import timedelta


def _is_terminal(stream) -> bool:
    """Whether ``stream`` is an interactive terminal (a closed or odd stream is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def format_duration(seconds: float) -> str:
    """``h:mm:ss`` for a number of seconds; ``?`` when unknown."""
    if seconds != seconds or seconds == float("inf"):
        return "?"
    return str(timedelta(seconds=int(round(seconds))))


class ProgressPrinter:
    """Reports training progress on rank 0; silent elsewhere.

    On a terminal it shows a live bar (samples done, rate, ETA) with progress lines above it;
    when output goes to a file or pipe it prints one plain line per progress period.

    Args:
        total_samples: samples the run will train on (``None`` when it ends with the data).
        enabled: whether this process prints at all (rank 0 only).
        stream: where to print (standard output by default).
        live_bar: show the live bar (``None``: when ``stream`` is a terminal).
    """

    def __init__(self, total_samples: int | None, enabled: bool = True, stream=None, live_bar: bool | None = None):
        self.total_samples = total_samples
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.interactive = enabled and (_is_terminal(self.stream) if live_bar is None else bool(live_bar))
        self._bar = None  # a rich.progress.Progress while the live bar shows
        self._task = None

    def __enter__(self) -> ProgressPrinter:
        if self.interactive:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            console = Console(file=self.stream, highlight=False, soft_wrap=True)
            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("samples"),
                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=console, transient=True,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total_samples, rate="")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None

    def advance(self, samples_seen: int, throughput: Throughput) -> None:
        """Moves the live bar to ``samples_seen`` at ``throughput``'s rate (cheap; the bar redraws at most
        a few times a second); without a bar, nothing, not even the rate."""
        if self._bar is not None:
            self._bar.update(self._task, completed=samples_seen, rate=f"{throughput.rate():,.0f}/s")

    def line(self, text: str) -> None:
        """Prints one line (above the live bar on a terminal)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False)
        else:
            print(text, file=self.stream, flush=True)

    def progress(self, samples_seen: int, loss: float, error: float, samples_per_second: float,
                 learning_rate: float, elapsed: float, note: str = "", metric_name: str = "error",
                 percent: bool = True, time_split: dict[str, float] | None = None,
                 figures: dict[str, float] | None = None) -> None:
        """One progress line: samples, loss, the metric (``error``: its average, named ``metric_name``,
        in percent when ``percent``; ``metric_name`` None: no metric), an objective's ``figures`` (up to
        :data:`FIGURES_SHOWN` of them; all are in the metrics files), throughput with the period's time split
        (``PhaseTimer.take``'s dict, when given), learning rate and ETA."""
        if self.total_samples:
            remaining = (self.total_samples - samples_seen) / samples_per_second if samples_per_second > 0 else float("inf")
            where = f"{samples_seen:>{len(str(self.total_samples))}}/{self.total_samples} ({100 * samples_seen / self.total_samples:5.1f}%)"
            eta = f" | ETA {format_duration(remaining)}"
        else:
            where, eta = f"{samples_seen}", ""
        shown = [] if metric_name is None else \
            [f"{metric_name} {100 * error:6.2f}%" if percent else f"{metric_name} {error:.4g}"]
        if figures and len(figures) <= FIGURES_SHOWN:
            shown.append(figures_line(figures, figures.values()))
        self.line(
            f"samples {where} | loss {loss:.4f} | " + "".join(f"{part} | " for part in shown)
            + f"{samples_per_second:,.0f} samples/s"
            f"{format_time_split(time_split)}"
            f" | lr {learning_rate:.4g} | {format_duration(elapsed)}{eta}" + (f" | {note}" if note else "")
        )


def figures_line(names, values) -> str:
    """``main_loss 0.4321, aux 0.0123``: an objective's figures as progress lines and messages show them."""
    return ", ".join(f"{name} {value:.4g}" for name, value in zip(names, values))


#: an objective's figures are shown in progress lines when it returns at most this many (else only logged)
FIGURES_SHOWN = 3

#: seconds between the progress lines of a long evaluation pass
EVALUATION_PROGRESS_SECONDS = 30.0


class EvaluationProgress:
    """Progress lines during an evaluation pass that takes long (a decoding metric over a large split):
    one every ``interval`` seconds of the pass, none for a pass that ends sooner; silent where the printer
    is (every rank but 0). Called by :func:`dtrain.session.evaluate.evaluate` after each minibatch.

    Args:
        printer: the session's :class:`ProgressPrinter`.
        what: the pass, as the lines name it (``cross-validation 2``, ``test``, ``test of the weight EMA``).
        limit: the samples the pass reads at most (its ``max_samples``), shown when set.
        interval: seconds between lines (default :data:`EVALUATION_PROGRESS_SECONDS`).
    """

    def __init__(self, printer: ProgressPrinter, what: str, limit: int | None = None, interval: float | None = None,
                 clock=time.perf_counter) -> None:
        self.printer, self.what, self.limit, self.clock = printer, what, limit, clock
        self.interval = EVALUATION_PROGRESS_SECONDS if interval is None else interval
        self.start = clock()
        self.next_line = self.start + self.interval

    def __call__(self, samples_read: int) -> None:
        now = self.clock()
        if now < self.next_line:
            return
        self.next_line = now + self.interval
        elapsed = now - self.start
        of = f" of at most {self.limit:,}" if self.limit is not None else ""
        self.printer.line(f"{self.what}: {samples_read:,}{of} samples evaluated in {format_duration(elapsed)} "
                          f"({samples_read / elapsed:,.0f} samples/s)")


#: the phases a progress line shows, in the order the loop runs them
_SHOWN_PHASES = ("data", "compute", "exchange", "optimizer")


def format_time_split(split: dict[str, float] | None) -> str:
    """`` (data 2%, compute 81%, exchange 6%, optimizer 9%)``: each phase's share of the period; ``""``
    without a split (or a period of no length)."""
    period = (split or {}).get("period_s") or 0.0
    if period <= 0:
        return ""
    shares = ", ".join(f"{phase} {100 * split.get(f'{phase}_s', 0.0) / period:.0f}%" for phase in _SHOWN_PHASES)
    return f" ({shares})"


class Throughput:
    """Samples per second over the current progress period (wall clock)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.period_start = self.start
        self.period_samples = 0

    def add(self, samples: int) -> None:
        self.period_samples += samples

    def rate(self) -> float:
        elapsed = time.perf_counter() - self.period_start
        return self.period_samples / elapsed if elapsed > 0 else 0.0

    def new_period(self) -> None:
        self.period_start = time.perf_counter()
        self.period_samples = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def period_elapsed(self) -> float:
        """Seconds since the current progress period began."""
        return time.perf_counter() - self.period_start

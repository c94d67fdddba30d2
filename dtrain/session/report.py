"""``report.png``: one page of plots of a run's metric records, for people to look at.

Drawn with matplotlib's object API (``matplotlib.figure.Figure`` and its Agg canvas), so it works
without a display and leaves ``pyplot``'s global state alone.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from dtrain.safe_files import write_through_temporary

_KIND_STYLE = {"train": dict(color="tab:blue", marker="o", label="train"),
               "cv": dict(color="tab:orange", marker="s", label="cross-validation"),
               "test": dict(color="tab:red", marker="*", markersize=12, linestyle="none", label="test")}
_PHASE_COLORS = {"data_s": ("waiting for data", "tab:gray"), "compute_s": ("compute (forward, backward)", "tab:green"),
                 "exchange_s": ("exchange (gradient communication)", "tab:red"),
                 "optimizer_s": ("optimizer (rest of the update)", "tab:purple"),
                 "other_s": ("other (progress, evaluation, checkpoints)", "tab:olive")}


def write_report(records: list[dict], path: str | Path, metric_name: str | None = "error", title: str = "",
                 percent: bool | None = None, more_metrics: tuple[str, ...] = ()) -> Path:
    """Draws ``records`` (``metrics.jsonl``'s objects) into a PNG at ``path`` (atomically, never through a
    link planted there) and returns it.

    Panels: loss and the metric against samples and against wall time (train, cross-validation,
    test; an elastic run's membership changes marked on the loss, :func:`membership_changes`), then each of ``more_metrics`` (a metric's further figures, e.g. ``per`` beside ``wer``, shown
    in the same unit) the same way, training throughput, the split of each progress period between waiting for data,
    computing, the gradient exchange, the optimizer and the rest, and, when the learner reports it, bytes sent per
    step.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: there are no training records to draw.
    """
    from matplotlib.figure import Figure  # imported here: only rank 0 draws, once, at the end

    # records of another program or a damaged line carry no position: they cannot be placed
    records = [r for r in records if _number(r.get("samples")) is not None and _number(r.get("time")) is not None]
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise ValueError("no training records to draw (progress_frequency=0?)")
    start = _start_time(train)
    time_unit, time_scale = _time_unit(max(float(r.get("time", start)) for r in records) - start)
    has_bytes = any(_number(r.get("bytes_sent_per_step")) for r in train)
    shown = [("loss", "loss")]  # (key, axis label) per row of the two-column part
    if percent is None:
        percent = "error" in (metric_name or "")  # error rates read best in percent
    metrics = (metric_name,) if metric_name is not None else ()  # None: an objective's run, its figures alone
    for name in (*metrics, *(m for m in more_metrics if m != metric_name)):
        shown.append((name, f"{name} (%)" if percent else name))
    first_free = len(shown)  # the row of the throughput and time-split panels
    rows = first_free + (2 if has_bytes else 1)
    height = 3.6 * rows
    figure = Figure(figsize=(13, height), dpi=100)
    # fixed margins in inches: a layout engine would draw the whole page twice (once to measure), which
    # doubles the cost of the end of every run
    figure.subplots_adjust(left=0.8 / 13, right=1 - 0.3 / 13, bottom=0.7 / height, top=1 - 0.8 / height,
                           wspace=0.22, hspace=0.42)
    axes = figure.subplots(rows, 2)
    changes = membership_changes(records)  # an elastic run's joins, losses and discarded blocks, on the loss panels

    for column, (x_key, x_label) in enumerate((("samples", "samples (global)"), ("time", f"wall time ({time_unit})"))):
        for row, (key, label) in enumerate(shown):
            axis = axes[row][column]
            for kind, style in _KIND_STYLE.items():
                points = [(r["samples"] if x_key == "samples" else (float(r["time"]) - start) / time_scale, r[key]) for r in records
                          if r.get("kind") == kind and _number(r.get(key)) is not None and _number(r.get("time")) is not None]
                if points:
                    xs, ys = zip(*points)
                    ys = [100 * y for y in ys] if percent and row > 0 else ys
                    axis.plot(xs, ys, **style)
            axis.set_xlabel(x_label)
            axis.set_ylabel(label)
            axis.set_title(f"{label} against {x_label.split(' (')[0]}")
            losses = [_number(r.get("loss")) for r in records if r.get("kind") in _KIND_STYLE]
            losses = [value for value in losses if value is not None]
            if key == "loss" and losses and min(losses) > 0 and max(losses) / min(losses) > 30:
                axis.set_yscale("log")  # a loss falling over decades
            if row == 0:
                labelled = set()  # one legend entry per kind of mark
                for change in changes:
                    x = change.samples if x_key == "samples" else (change.time - start) / time_scale
                    axis.axvline(x, color=change.color, linestyle=change.style, linewidth=1.2, alpha=0.8,
                                 label="_nolegend_" if change.text in labelled else change.text)
                    labelled.add(change.text)
            axis.grid(True, alpha=0.3)
            axis.legend(fontsize="small")

    samples = [r["samples"] for r in train]
    axis = axes[first_free][0]
    rates = [r.get("samples_per_second", math.nan) for r in train]
    axis.plot(samples, rates, color="tab:blue", marker="o")
    axis.set_title("training throughput (per progress period)")
    axis.set_xlabel("samples (global)")
    axis.set_ylabel("samples / s")
    finite = [rate for rate in rates if _number(rate) is not None]
    axis.set_ylim(0, 1.15 * max(finite) if finite and max(finite) > 0 else 1)
    axis.grid(True, alpha=0.3)

    axis = axes[first_free][1]
    timed = [r for r in train if _number(r.get("period_s"))]
    if timed:
        positions = list(range(len(timed)))
        bottom = [0.0] * len(timed)
        for key, (label, color) in _PHASE_COLORS.items():
            shares = [100 * (_phase_seconds(r, key) or 0.0) / r["period_s"] for r in timed]
            axis.bar(positions, shares, bottom=bottom, color=color, label=label, width=0.8)
            bottom = [b + s for b, s in zip(bottom, shares)]
        axis.set_xticks(positions, [_short(r["samples"]) for r in timed], rotation=45 if len(timed) > 8 else 0,
                        fontsize="small")
        axis.set_ylim(0, 140)  # the legend (three rows) sits above the bars
        axis.set_yticks(range(0, 101, 20))
        axis.legend(fontsize="small", loc="upper center", ncol=2, framealpha=0.9)
    else:
        axis.text(0.5, 0.5, "no time split recorded", ha="center", va="center", transform=axis.transAxes)
    axis.set_title("where each progress period's time went (rank 0)")
    axis.set_xlabel("progress period ending at samples")
    axis.set_ylabel("% of the period")

    if has_bytes:
        axis = axes[first_free + 1][0]
        points = [(r["samples"], r["bytes_sent_per_step"]) for r in train if _number(r.get("bytes_sent_per_step"))]
        xs, ys = zip(*points)
        axis.plot(xs, [y / 1024 for y in ys], color="tab:brown", marker="o")
        axis.set_title("bytes sent per step by this rank (compressed learner)")
        axis.set_xlabel("samples (global)")
        axis.set_ylabel("KiB per step")
        axis.set_ylim(0, 1.15 * max(ys) / 1024)
        axis.grid(True, alpha=0.3)
        _summary(axes[first_free + 1][1], records, metric_name or "loss", percent)
    figure.suptitle(title or "dtrain run", fontsize="x-large", y=1 - 0.15 / height, verticalalignment="top")

    return write_through_temporary(Path(path), lambda name: figure.savefig(name, format="png"))


class MembershipChange(NamedTuple):
    """Where an elastic run's replica groups changed, as the loss panels mark it."""

    samples: float
    time: float
    text: str
    color: str
    style: str


def membership_changes(records: list[dict]) -> list[MembershipChange]:
    """The ``elastic`` records (``docs/fault-tolerance.md``) worth a mark: a commit by another number of groups than
    the one before (``groups: 3 -> 2``, red when fewer, green when more), a discarded block (grey, dashed) and a
    heal from a live peer (green, dotted). Commits by the same groups are the run going on: no mark."""
    changes, groups = [], None
    for record in records:
        if record.get("kind") != "elastic":
            continue
        samples, time, event = _number(record.get("samples")), _number(record.get("time")), record.get("event")
        if samples is None or time is None:
            continue
        if event == "commit" and _number(record.get("groups")) is not None:
            now = int(record["groups"])
            if groups is not None and now != groups:
                changes.append(MembershipChange(samples, time, f"groups: {groups} -> {now}",
                                                "tab:red" if now < groups else "tab:green", "-"))
            groups = now
        elif event == "discard":
            changes.append(MembershipChange(samples, time, "block discarded", "tab:gray", "--"))
        elif event == "heal":
            changes.append(MembershipChange(samples, time, "healed from a peer", "tab:green", ":"))
    return changes


def _phase_seconds(record: dict, key: str) -> float | None:
    """One phase's seconds in a training record; records written before the update was split into
    exchange and optimizer count their whole ``update_s`` as optimizer."""
    if key == "optimizer_s" and "optimizer_s" not in record:
        return _number(record.get("update_s"))
    return _number(record.get(key))


def _summary(axis, records: list[dict], metric_name: str, percent: bool) -> None:
    """The last value of each kind as text, in the panel left over beside the bytes plot."""
    axis.axis("off")
    lines = []
    for kind in ("train", "cv", "test"):
        last = [r for r in records if r.get("kind") == kind and _number(r.get(metric_name)) is not None]
        if last:
            value = last[-1][metric_name]
            shown = f"{100 * value:.2f}%" if percent else f"{value:.4g}"
            lines.append(f"{kind}: {metric_name} {shown}, loss {last[-1].get('loss', math.nan):.4f} "
                         f"at {last[-1]['samples']:,} samples")
    axis.text(0.02, 0.9, "\n".join(lines), va="top", fontsize="medium", family="monospace", transform=axis.transAxes)


def _start_time(train: list[dict]) -> float:
    """Wall-clock start of the run: the first progress period's end minus its length."""
    first = train[0]
    return float(first.get("time", 0.0)) - float(first.get("period_s") or 0.0)


def _time_unit(seconds: float) -> tuple[str, float]:
    """A readable unit for a run of ``seconds``: its name and its length in seconds."""
    if seconds < 120:
        return "seconds", 1.0
    if seconds < 2 * 3600:
        return "minutes", 60.0
    return "hours", 3600.0


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _short(samples: int) -> str:
    for divisor, suffix in ((1_000_000, "M"), (1_000, "k")):
        if samples >= divisor:
            return f"{samples / divisor:.3g}{suffix}"
    return str(samples)

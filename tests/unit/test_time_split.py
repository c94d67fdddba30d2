"""The time split of each progress period: the learner's update is split into the gradient exchange it
reports (``exchange_seconds_last_step``) and the optimizer, in metrics.jsonl/csv, progress lines and
report.png."""
from __future__ import annotations

import csv
import io
import json
import re
import time

import numpy as np
import pytest
import torch
from torch import nn

from dtrain import LocalLearner, MinibatchSource, training_session
from dtrain.data import ArrayDeserializer
from dtrain.session.metrics import PhaseTimer

EXCHANGE_S = 0.004  # what the fake learner reports per step
OPTIMIZER_S = 0.002  # the rest of its step


class ExchangingLearner(LocalLearner):
    """A one-process learner whose step spends known times "exchanging" and stepping, and says so."""

    def apply_update(self) -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < EXCHANGE_S:  # the "exchange"
            pass
        super().apply_update()
        start = time.perf_counter()
        while time.perf_counter() - start < OPTIMIZER_S:
            pass
        self.exchange_seconds_last_step = EXCHANGE_S


def train(tmp_path, learner_class, max_samples=320, progress_frequency=80):
    generator = np.random.default_rng(0)
    features = generator.normal(size=(200, 6)).astype(np.float32)
    labels = (features[:, 0] > 0).astype(np.int64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    learner = learner_class(torch.optim.SGD(model.parameters(), lr=0.1))
    out = io.StringIO()
    session = training_session(model, nn.functional.cross_entropy, learner,
                               MinibatchSource(ArrayDeserializer(features, labels, num_classes=2), randomize=True),
                               16, max_samples=max_samples, progress_frequency=progress_frequency, run_dir=tmp_path,
                               tensorboard=False, stream=out)
    session.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"], out.getvalue()


def test_a_learner_reporting_exchange_time_shows_it_and_the_split_adds_up(tmp_path):
    records, printed = train(tmp_path, ExchangingLearner)
    assert len(records) == 4
    steps = 80 // 16
    for record in records:
        assert record["exchange_s"] == pytest.approx(steps * EXCHANGE_S, rel=1e-6, abs=2e-6), record
        assert record["optimizer_s"] >= steps * OPTIMIZER_S, record
        assert record["update_s"] == pytest.approx(record["exchange_s"] + record["optimizer_s"], abs=2e-6)
        parts = [record[key] for key in ("data_s", "compute_s", "exchange_s", "optimizer_s", "other_s")]
        assert all(part >= 0 for part in parts), record
        assert sum(parts) == pytest.approx(record["period_s"], abs=1e-4), record
    lines = [line for line in printed.splitlines() if line.startswith("samples ")]
    assert len(lines) == 4
    for line, record in zip(lines, records):
        shares = dict(re.findall(r"(data|compute|exchange|optimizer) (\d+)%", line))
        assert set(shares) == {"data", "compute", "exchange", "optimizer"}, line
        assert int(shares["exchange"]) == round(100 * record["exchange_s"] / record["period_s"]), (line, record)
        assert int(shares["exchange"]) > 0
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["kind"] == "train"]
    assert [float(row["exchange_s"]) for row in rows] == [r["exchange_s"] for r in records]
    assert [float(row["optimizer_s"]) for row in rows] == [r["optimizer_s"] for r in records]


def test_a_learner_that_reports_nothing_has_no_exchange_time_and_its_whole_step_is_optimizer(tmp_path):
    records, _ = train(tmp_path, LocalLearner)
    for record in records:
        assert record["exchange_s"] == 0.0
        assert record["optimizer_s"] == record["update_s"] > 0


def test_phase_timer_never_counts_more_exchange_than_the_step_took_nor_a_nonsense_value():
    timer = PhaseTimer()
    timer.mark()
    time.sleep(0.002)
    timer.lap_update(10.0)  # exchange overlapping backward reported as longer than the step itself
    first = timer.seconds["exchange"]
    assert first > 0 and timer.seconds["optimizer"] == 0.0
    for bad in (float("nan"), -1.0, None, "1"):
        timer.lap_update(bad)
    assert timer.seconds["exchange"] == first
    split = timer.take(1.0)
    assert split["update_s"] == pytest.approx(split["exchange_s"] + split["optimizer_s"], abs=2e-6)
    assert split["other_s"] == pytest.approx(1.0 - split["update_s"], abs=2e-6)


def test_report_draws_exchange_and_optimizer_and_reads_records_of_older_runs(tmp_path):
    from dtrain.session import report

    new = {"kind": "train", "samples": 100, "time": 1001.0, "loss": 1.0, "error": 0.5, "period_s": 1.0,
           "data_s": 0.1, "compute_s": 0.5, "update_s": 0.3, "exchange_s": 0.2, "optimizer_s": 0.1, "other_s": 0.1}
    old = {key: value for key, value in new.items() if key not in ("exchange_s", "optimizer_s")}
    assert report._phase_seconds(new, "exchange_s") == 0.2 and report._phase_seconds(new, "optimizer_s") == 0.1
    assert report._phase_seconds(old, "exchange_s") is None and report._phase_seconds(old, "optimizer_s") == 0.3
    assert set(report._PHASE_COLORS) == {"data_s", "compute_s", "exchange_s", "optimizer_s", "other_s"}
    path = report.write_report([old, {**new, "samples": 200, "time": 1002.0}], tmp_path / "report.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_training_clock_stops_before_the_weights_and_the_report_are_written(tmp_path, monkeypatch):
    from dtrain.session import summary as summary_module

    drawn = []

    def slow_report(*args, **kwargs):  # drawing report.png is a one-off output, not training
        time.sleep(1.0)
        drawn.append(True)
        return tmp_path / "report.png"

    monkeypatch.setattr(summary_module, "write_report", slow_report)
    generator = np.random.default_rng(0)
    features = generator.normal(size=(64, 6)).astype(np.float32)
    labels = (features[:, 0] > 0).astype(np.int64)
    model = nn.Linear(6, 2)
    session = training_session(model, nn.functional.cross_entropy, LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                               MinibatchSource(ArrayDeserializer(features, labels, num_classes=2)), 16, max_samples=64,
                               progress_frequency=32, run_dir=tmp_path, tensorboard=False, stream=io.StringIO())
    start = time.perf_counter()
    result = session.train()
    whole = time.perf_counter() - start
    assert drawn and whole >= 1.0
    assert result.seconds < whole - 0.9


def test_an_elastic_runs_joins_losses_and_discards_are_marked_on_the_loss_panels(tmp_path):
    """``report.png`` marks where the replica groups changed (docs/fault-tolerance.md): commits by the same groups are
    the run going on, a commit by fewer or more groups is a loss or a join, a discarded block and a heal are marked
    as such."""
    from matplotlib.figure import Figure

    from dtrain.session import report

    def elastic(samples, event, groups):
        return {"kind": "elastic", "samples": samples, "time": 1000.0 + samples / 100, "event": event,
                "groups": groups, "members": groups, "block_samples": 32, "seconds": 0.1}

    train = [{"kind": "train", "samples": s, "time": 1000.0 + s / 100, "loss": 2.0 - s / 1000, "error": 0.5,
              "samples_per_second": 100.0} for s in (128, 256, 384, 512)]
    records = [train[0], elastic(96, "commit", 3), elastic(128, "commit", 3), elastic(160, "discard", 2),
               train[1], elastic(192, "commit", 2), elastic(224, "commit", 2), elastic(240, "heal", 3),
               train[2], elastic(256, "commit", 3), train[3]]
    changes = report.membership_changes(records)
    assert [(c.samples, c.text, c.color) for c in changes] == [
        (160, "block discarded", "tab:gray"), (192, "groups: 3 -> 2", "tab:red"),
        (240, "healed from a peer", "tab:green"), (256, "groups: 2 -> 3", "tab:green")]
    assert report.membership_changes(train) == []  # a run that is not elastic: nothing marked
    drawn = []
    original = Figure.savefig

    def keep_axes(figure, *args, **kwargs):
        drawn.append(figure)
        return original(figure, *args, **kwargs)

    Figure.savefig = keep_axes
    try:
        path = report.write_report(records, tmp_path / "report.png")
    finally:
        Figure.savefig = original
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loss_by_samples, loss_by_time = drawn[0].axes[0], drawn[0].axes[1]
    for axis in (loss_by_samples, loss_by_time):
        assert len(axis.lines) == 1 + len(changes)  # the training loss and one line per mark
        labels = axis.get_legend_handles_labels()[1]
        assert {"block discarded", "groups: 3 -> 2", "groups: 2 -> 3", "healed from a peer"} <= set(labels)
    assert [line.get_xdata()[0] for line in loss_by_samples.lines[1:]] == [160, 192, 240, 256]

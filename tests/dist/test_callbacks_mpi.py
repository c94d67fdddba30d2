"""Callbacks under a real ``mpiexec -n 2`` of the command line: each event once, in order, on rank 0 only (every
rank for ``all_ranks``), across a resume too; early stopping ends every rank with exit 0 and its line, and the
best checkpoint is written once, by rank 0."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers.callbacks import logged_events
from tests.helpers.cli_runs import launch_cli_runs
from tests.helpers.mpi import run_mpi

pytestmark = [pytest.mark.timeout(300)]

# the digits recipe on 2 ranks (global minibatch 32), with cross-validation on the test digits; every 320 samples
# a progress report, a cross-validation and a checkpoint
SHORT = ["+recipe=digits", "source.cv=${source.test}", "session.cv.frequency=320",
         "session.progress_frequency=320", "session.checkpoint.frequency=320", "session.tensorboard=false"]


def events_option(directory: Path) -> list[str]:
    return ["+callbacks.events._target_=tests.helpers.callbacks.EventLog", f"+callbacks.events.directory={directory}"]


def expected_events(run_dir: Path, start: int, end: int, restored: bool) -> list[tuple[str, int]]:
    """The events a run from ``start`` to ``end`` samples fires, from the records of its metrics.jsonl: a step
    every 32 samples, then at each 320 its progress report, cross-validation and checkpoint; the test at the end."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [("run_start", start + 32)] + ([("checkpoint_restore", start + 32)] if restored else [])
    for seen in range(start + 32, end + 1, 32):
        events.append(("step_end", seen))
        for kind, event in (("train", "progress"), ("cv", "cross_validation")):
            events += [(event, seen) for record in records if record["kind"] == kind and record["samples"] == seen]
        if seen % 320 == 0:
            events.append(("checkpoint_save", seen))
    return events + [("test", end), ("run_end", end)]


def test_each_event_fires_once_in_order_on_rank_0_only_and_across_a_resume(tmp_path):
    """A run to 640 samples, then the same command to 960 (restored from its run directory): one launch of both
    command lines (``tests.helpers.cli_runs``)."""
    run_dir = tmp_path / "run"
    runs = launch_cli_runs(2, {"events": [
        ("first", [*SHORT, f"run_dir={run_dir}", "session.max_samples=640", *events_option(tmp_path / "first")]),
        ("resumed", [*SHORT, f"run_dir={run_dir}", "session.max_samples=960", *events_option(tmp_path / "resumed")]),
    ]}, tmp_path / "launch", timeout=240)
    first, resumed = runs.run_ended("events", "first"), runs.run_ended("events", "resumed")
    assert "restored" in resumed.stdout and "at 640 samples" in resumed.stdout, resumed.report()
    # metrics.jsonl holds both runs' records by now: each run's expected events are read from its own range
    assert logged_events(tmp_path / "first" / "events.0.txt") == expected_events(run_dir, 0, 640, restored=False), \
        first.report()
    assert (tmp_path / "first" / "events.1.txt").read_text() == ""  # built on rank 1, never called there
    events = logged_events(tmp_path / "resumed" / "events.0.txt")
    assert events == expected_events(run_dir, 640, 960, restored=True)
    assert (tmp_path / "resumed" / "events.1.txt").read_text() == ""


@pytest.mark.slow  # a launch of its own (the event order at 2 ranks stays in the default suite)
def test_an_early_stop_at_2_ranks_ends_every_rank_with_exit_0_and_its_line(tmp_path):
    run_dir = tmp_path / "run"
    # nothing beats the first cross-validation by a whole 100%: the second stops the run (patience 1)
    result = run_mpi(2, ["-m", "dtrain", *SHORT, f"run_dir={run_dir}", "session.max_samples=3200",
                         "callbacks=[early_stopping,best_checkpoint]", "callbacks.early_stopping.patience=1",
                         "callbacks.early_stopping.min_delta=1.0", *events_option(tmp_path / "events"),
                         "+callbacks.events.all_ranks=true"], timeout=240)
    assert result.returncode == 0, result.report()
    line = re.search(r"^stopped early at 640 samples: early stopping: cv.error has not improved on [\d.]+% \(at 320 "
                     r"samples\) for 1 cross-validation \(patience 1\)$", result.stdout, re.MULTILINE)
    assert line, result.report()
    cv = [record for record in map(json.loads, (run_dir / "metrics.jsonl").open()) if record["kind"] == "cv"]
    best = min(cv, key=lambda record: record["error"])
    assert result.stdout.count("best: ") == 1, result.report()  # rank 0 alone
    assert f"best: cv.error {100 * best['error']:.2f}% at {best['samples']} samples: {run_dir / 'best.safetensors'}" \
        in result.stdout, result.report()
    assert load_file(run_dir / "best.safetensors").keys() == load_file(run_dir / "model.safetensors").keys()
    # all_ranks: rank 1 saw every event rank 0 saw, records included
    rank0, rank1 = (logged_events(tmp_path / "events" / f"events.{rank}.txt") for rank in (0, 1))
    assert rank0 == rank1 and rank0[-1] == ("run_end", 640) and ("cross_validation", 640) in rank0

"""Callbacks: each event once, in order, with the records metrics.jsonl holds; state across a resume; stop."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dtrain.session.callbacks import Callback, StepEnd

from tests.helpers.callbacks import toy_session


class Recorder(Callback):
    """Every event it sees, with the samples seen then; its state counts the events, to test the resume."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []
        self.restored_count: int | None = None

    def _note(self, name, run):
        self.events.append((name, run.samples_seen))

    def on_run_start(self, run):
        self.started_at = run.start_samples
        self._note("run_start", run)

    def on_checkpoint_restore(self, run, path):
        self._note("checkpoint_restore", run)

    def on_step_end(self, run, step):
        assert isinstance(step, StepEnd) and step.samples_seen == run.samples_seen and step.loss.dim() == 0
        self._note("step_end", run)

    def on_progress(self, run, record):
        assert record["kind"] == "train" and record["samples"] == run.samples_seen
        self._note("progress", run)

    def on_cross_validation(self, run, record):
        assert record["kind"] == "cv"
        self._note("cross_validation", run)

    def on_test(self, run, record):
        assert record["kind"] == "test"
        self._note("test", run)

    def on_checkpoint_save(self, run, path):
        assert Path(path).is_file()
        self._note("checkpoint_save", run)

    def on_run_end(self, run, result):
        assert result.samples_seen == run.samples_seen
        self._note("run_end", run)

    def state_dict(self):
        return {"count": len(self.events)}

    def load_state_dict(self, state):
        self.restored_count = state["count"]


def test_each_event_fires_once_in_order_with_the_records_of_metrics_jsonl(tmp_path):
    recorder = Recorder()
    toy_session(tmp_path, 128, [recorder]).train()
    names = [name for name, _ in recorder.events]
    assert names[0] == "run_start" and names[-2:] == ["test", "run_end"]
    assert names.count("step_end") == 8 and "checkpoint_restore" not in names
    # at 64 samples: the step, its progress record, cross-validation, then the checkpoint
    at_64 = [name for name, seen in recorder.events if seen == 64]
    assert at_64 == ["step_end", "progress", "cross_validation", "checkpoint_save"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records if r["kind"] == "train"] == \
        [seen for name, seen in recorder.events if name == "progress"]


def test_a_resumed_run_gets_its_callbacks_state_and_a_restore_event(tmp_path):
    first = Recorder()
    toy_session(tmp_path, 64, [first]).train()
    second = Recorder()
    result = toy_session(tmp_path, 128, [second]).train()
    assert result.restored_from is not None
    # the state the checkpoint at 64 samples kept: the events up to its save
    assert second.restored_count == [name for name, _ in first.events].index("checkpoint_save")
    assert [name for name, _ in second.events][:2] == ["run_start", "checkpoint_restore"]
    assert second.started_at == 64  # the run starts where the checkpoint left it


class StopAt(Callback):
    def __init__(self, samples):
        self.samples = samples

    def on_step_end(self, run, step):
        if step.samples_seen >= self.samples:
            run.stop(f"reached {self.samples}")


def test_a_callback_stops_the_run_which_ends_normally_with_the_reason(tmp_path, capsys):
    result = toy_session(tmp_path, 192, [StopAt(48)]).train()
    assert result.stopped_early and result.samples_seen == 48 and result.stop_reason == "reached 48"
    assert result.test is not None  # the test still runs
    assert "stopped early at 48 samples: reached 48" in capsys.readouterr().out


def test_an_object_without_events_is_refused():
    with pytest.raises(TypeError, match="has none of the events"):
        toy_session(Path("/nonexistent"), 64, [object()])


class OnProgressWithoutRun(Callback):
    def on_progress(self, record):  # the run is missing
        pass


class StateWithArgument:
    def on_run_end(self, run, result):
        pass

    def state_dict(self, destination):
        return {}


@pytest.mark.parametrize("callback, fragment", [
    (OnProgressWithoutRun(), "OnProgressWithoutRun.on_progress(record) cannot be called as on_progress(run, record)"),
    (StateWithArgument(), "StateWithArgument.state_dict(destination) cannot be called as state_dict(); expected a "
                          "method taking no arguments"),
])
def test_a_method_with_the_wrong_signature_is_refused_before_anything_is_written(tmp_path, callback, fragment):
    with pytest.raises(TypeError, match=re.escape(fragment)):
        toy_session(tmp_path / "run", 64, [callback])
    assert not (tmp_path / "run").exists()

"""The shipped callbacks: early stopping stops at the right evaluation and keeps its count across a resume; the
best checkpoint holds the weights of the best cross-validation point, never replaced by a worse one; monitors a
run does not write are refused before anything is written."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dtrain import CrossValidationConfig, LocalLearner, MinibatchSource
from dtrain.callbacks import BestCheckpoint, Callback, EarlyStopping

from tests.helpers.callbacks import toy_session
from tests.helpers.toy_data import four_class_data


class ScriptedRun:
    """What a callback sees of a run (``RunView``'s part the monitors use), with the stop it asks for."""

    def __init__(self, produced=None, world_size=1, learner=None):
        self.stop_reason = None
        self.metric_in_percent = True
        self.world_size = world_size
        self.learner = learner
        self._produced = produced or {"train": ["loss", "error", "samples_per_second", "lr"], "cv": ["loss", "error"]}

    max_samples = None

    def produced_metrics(self):
        return self._produced

    def evaluation_period(self, kind):
        return 1024

    def stop(self, reason):
        if self.stop_reason is None:
            self.stop_reason = reason


def feed(callback, values, kind="cv", key="error", run=None):
    """Gives ``values`` to ``callback`` as records 1,024 samples apart; the index of the record it stopped at."""
    run = run or ScriptedRun()
    for index, value in enumerate(values):
        record = {"kind": kind, "samples": 1024 * (index + 1), key: value}
        (callback.on_cross_validation if kind == "cv" else callback.on_progress)(run, record)
        if run.stop_reason is not None:
            return index, run.stop_reason
    return None, None


def test_early_stopping_stops_after_patience_evaluations_without_improvement():
    # best 0.40 at the 2nd; 0.45 and 0.41 do not improve on it: the 4th stops (patience 2)
    index, reason = feed(EarlyStopping(patience=2), [0.50, 0.40, 0.45, 0.41, 0.39])
    assert index == 3
    assert reason == ("early stopping: cv.error has not improved on 40.00% (at 2,048 samples) for 2 "
                      "cross-validations (patience 2)")


def test_an_improvement_restarts_the_count_and_min_delta_decides_what_one_is():
    assert feed(EarlyStopping(patience=2), [0.5, 0.6, 0.4, 0.45, 0.41])[0] == 4  # 0.4 restarted it
    # 0.395 is not better than 0.40 by more than 0.01
    assert feed(EarlyStopping(patience=2, min_delta=0.01), [0.5, 0.40, 0.395, 0.3951])[0] == 3
    assert feed(EarlyStopping(patience=2, min_delta=0.01), [0.5, 0.40, 0.385, 0.39, 0.386])[0] == 4


def test_the_mode_comes_from_the_key_and_a_train_monitor_counts_progress_reports():
    index, reason = feed(EarlyStopping(monitor="cv.accuracy", patience=1), [0.5, 0.6, 0.55], key="accuracy",
                         run=ScriptedRun({"cv": ["accuracy"]}))
    assert index == 2 and "on 60.00%" in reason  # higher is better for an accuracy
    index, reason = feed(EarlyStopping(monitor="train.loss", patience=1), [2.0, 1.5, 1.7], kind="train", key="loss")
    assert index == 2 and reason.endswith("has not improved on 1.5 (at 2,048 samples) for 1 progress report "
                                          "(patience 1)")


def test_monitors_and_settings_the_run_cannot_honour_are_refused_naming_what_it_writes():
    no_cv = ScriptedRun({"train": ["loss", "error"]})
    with pytest.raises(ValueError, match=r"monitor='cv.error': this run writes no cv records .* expected one of the "
                                         r"values it writes: train.loss, train.error$"):
        EarlyStopping().check(no_cv)
    with pytest.raises(ValueError, match=r"'cv.top5_error': cv records have no top5_error; .*cv.loss, cv.error"):
        BestCheckpoint(monitor="cv.top5_error").check(ScriptedRun())
    with pytest.raises(ValueError, match=r"cannot tell whether a lower or a higher auc is better; expected mode=min"):
        EarlyStopping(monitor="cv.auc").check(ScriptedRun({"cv": ["auc"]}))
    EarlyStopping(monitor="cv.auc", mode="max").check(ScriptedRun({"cv": ["auc"]}))
    for bad, match in [({"monitor": "error"}, "expected KIND.KEY"),
                       ({"monitor": "test.error"}, "KIND one of cv, train"),
                       ({"mode": "up"}, "mode='up': expected one of min, max"),
                       ({"patience": 0}, "patience=0: expected a whole number"),
                       ({"min_delta": -0.1}, "min_delta=-0.1: expected a non-negative")]:
        with pytest.raises(ValueError, match=match):
            EarlyStopping(**bad)
    for filename, match in [("model.safetensors", "the run writes its own model.safetensors there at its end"),
                            ("sub/", "expected a file name such as best.safetensors"), ("", "expected a file name")]:
        with pytest.raises(ValueError, match=match):
            BestCheckpoint(filename=filename)
    # the ranks of a local (or block) learner hold different models at a progress report: no best to keep there
    local = LocalLearner(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    with pytest.raises(ValueError, match="hold different models between their synchronisations"):
        BestCheckpoint(monitor="train.loss").check(ScriptedRun(world_size=2, learner=local))
    BestCheckpoint(monitor="train.loss").check(ScriptedRun(world_size=1, learner=local))


def test_a_monitor_the_run_does_not_write_refuses_the_session_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="this run writes no cv records"):
        toy_session(tmp_path / "run", 128, [EarlyStopping()], cv_config=None)
    assert not (tmp_path / "run").exists()


def cv_records(run_dir: Path) -> list[dict]:
    return [record for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if (record := json.loads(line))["kind"] == "cv"]


def test_early_stopping_ends_a_session_normally_at_the_evaluation_it_names(tmp_path, capsys):
    # nothing beats the first cross-validation by 10: the third (192 samples) is the second without improvement
    result = toy_session(tmp_path, 640, [EarlyStopping(monitor="cv.loss", patience=2, min_delta=10.0)]).train()
    assert result.stopped_early and result.samples_seen == 192 and result.test is not None
    first = cv_records(tmp_path)[0]
    assert result.stop_reason == (f"early stopping: cv.loss has not improved on {first['loss']:.4g} (at 64 samples) "
                                  f"for 2 cross-validations (patience 2)")
    assert f"stopped early at 192 samples: {result.stop_reason}" in capsys.readouterr().out


def test_early_stopping_continues_its_count_across_a_resume(tmp_path):
    def stopping():
        return EarlyStopping(monitor="cv.loss", patience=3, min_delta=10.0)

    whole = toy_session(tmp_path / "whole", 640, [stopping()]).train()
    toy_session(tmp_path / "cut", 128, [stopping()]).train()  # one cross-validation without improvement so far
    resumed = toy_session(tmp_path / "cut", 640, [stopping()]).train()
    assert resumed.restored_from is not None
    assert whole.samples_seen == resumed.samples_seen == 256 and resumed.stop_reason == whole.stop_reason
    # run again after the stop: it ends at once (its first step), not at max_samples
    again = toy_session(tmp_path / "cut", 640, [stopping()]).train()
    assert again.stopped_early and again.samples_seen == 256 + 16 and again.stop_reason == whole.stop_reason


class Snapshots(Callback):
    """The model's weights at each cross-validation (placed before BestCheckpoint, it sees the same model)."""

    def __init__(self):
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_cross_validation(self, run, record):
        self.weights[record["samples"]] = {name: t.detach().clone() for name, t in run.model.state_dict().items()}


def assert_same_weights(path: Path, expected: dict[str, torch.Tensor]) -> None:
    saved = load_file(path)
    assert saved.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(saved[name], tensor), name


def best_point(run_dir: Path, key: str, mode: str) -> tuple[int, float]:
    records = cv_records(run_dir)
    best = (min if mode == "min" else max)(records, key=lambda record: record[key])  # the first of equals
    return best["samples"], best[key]


@pytest.mark.parametrize("mode", ["min", "max"])
def test_the_best_checkpoint_holds_the_weights_of_the_best_cross_validation(tmp_path, mode, capsys):
    snapshots, stream = Snapshots(), io.StringIO()
    toy_session(tmp_path, 384, [snapshots, BestCheckpoint(monitor="cv.loss", mode=mode)], stream=stream).train()
    samples, value = best_point(tmp_path, "loss", mode)
    assert_same_weights(tmp_path / "best.safetensors", snapshots.weights[samples])
    if mode == "max":  # the loss falls: the first point is the best by max, and no worse later one replaced it
        assert samples == 64
    with safe_open(str(tmp_path / "best.safetensors"), "pt") as written:
        metadata = written.metadata()
    assert metadata["monitor"] == "cv.loss" and float(metadata["value"]) == value
    assert int(metadata["samples_seen"]) == samples
    # its line goes where the run's progress goes, as the run's own lines do
    assert f"best: cv.loss {value:.4g} at {samples:,} samples: {tmp_path / 'best.safetensors'}" in stream.getvalue()
    assert "best:" not in capsys.readouterr().out


def test_a_resumed_run_does_not_replace_a_better_best_checkpoint(tmp_path):
    snapshots = Snapshots()
    toy_session(tmp_path, 128, [snapshots, BestCheckpoint(monitor="cv.loss", mode="max")]).train()
    written = (tmp_path / "best.safetensors").read_bytes()
    resumed = toy_session(tmp_path, 384, [BestCheckpoint(monitor="cv.loss", mode="max")]).train()
    assert resumed.restored_from is not None
    assert best_point(tmp_path, "loss", "max")[0] == 64  # every later point is worse
    assert (tmp_path / "best.safetensors").read_bytes() == written


def test_a_best_file_written_after_the_checkpoint_is_kept_when_better_than_the_checkpoints_best(tmp_path):
    # the run was cut after a better point than its last checkpoint knew: the file stays the best
    toy_session(tmp_path, 128, [BestCheckpoint(monitor="cv.loss", mode="max")]).train()
    best = tmp_path / "best.safetensors"
    saved = load_file(best)
    save_file(saved, best, metadata={"monitor": "cv.loss", "mode": "max", "value": "1e9", "samples_seen": "192",
                                     "format": "pt"})
    written = best.read_bytes()
    keeper = BestCheckpoint(monitor="cv.loss", mode="max")
    toy_session(tmp_path, 384, [keeper]).train()
    assert best.read_bytes() == written and keeper.best == 1e9 and keeper.best_samples == 192


def test_a_cross_validation_callback_without_a_source_writes_no_cv_records_to_monitor(tmp_path):
    # CNTK's callback alone fires on schedule without evaluating anything: no cv.error would ever arrive
    callback_only = CrossValidationConfig(callback=lambda *args: True, frequency=64)
    with pytest.raises(ValueError, match="this run writes no cv records"):
        toy_session(tmp_path / "run", 128, [EarlyStopping()], cv_config=callback_only)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("frequency, fragment", [(None, "only once, at its end"),
                                                 (128, "only at its end \\(every 128 samples, max_samples 128\\)")])
def test_early_stopping_on_a_run_that_cross_validates_only_at_its_end_is_refused(tmp_path, frequency, fragment):
    at_the_end = CrossValidationConfig(MinibatchSource(four_class_data(40, 1), randomize=False, max_sweeps=1),
                                       frequency=frequency, minibatch_size=20)
    with pytest.raises(ValueError, match=f"evaluates it {fragment}, so it could never stop early; "
                                         f"expected the cross-validation frequency"):
        toy_session(tmp_path / "run", 128, [EarlyStopping()], cv_config=at_the_end)
    assert not (tmp_path / "run").exists()
    toy_session(tmp_path / "best", 128, [BestCheckpoint()], cv_config=at_the_end).train()  # the end's is a best
    assert (tmp_path / "best" / "best.safetensors").is_file()


def test_a_state_kept_for_another_monitor_or_mode_is_not_taken_back():
    kept = EarlyStopping(monitor="cv.loss", mode="min", patience=2)
    feed(kept, [0.5, 0.6], key="loss")
    state = kept.state_dict()
    assert (state["best"], state["wait"]) == (0.5, 1)
    for other in (EarlyStopping(monitor="cv.loss", mode="max", patience=2), EarlyStopping(patience=2)):
        other.load_state_dict(state)
        assert (other.best, other.wait) == (None, 0)
    same = EarlyStopping(monitor="cv.loss", patience=2)  # min, from the key
    same.load_state_dict(state)
    assert (same.best, same.best_samples, same.wait) == (0.5, 1024, 1)


@pytest.mark.parametrize("duration, seconds", [(90, 90.0), (1.5, 1.5), ("90", 90.0), ("01:30", 90.0),
                                               ("23:30:00", 84600.0), ("1-00:00:10", 86410.0)])
def test_a_time_limit_reads_seconds_and_slurm_clock_times(duration, seconds):
    from dtrain.callbacks.time_limit import seconds_of

    assert seconds_of(duration) == seconds


@pytest.mark.parametrize("duration", [0, -5, "soon", "1:2:3:4", True, "00:00:00"])
def test_a_time_limit_that_is_not_a_positive_duration_is_refused_naming_it(duration):
    from dtrain.callbacks import TimeLimit

    with pytest.raises(ValueError, match=r"TimeLimit max_time"):
        TimeLimit(duration)


def test_a_time_limit_ends_the_run_normally_after_the_step_that_crossed_it(tmp_path, monkeypatch, capsys):
    import dtrain.callbacks.time_limit as time_limit
    from dtrain.callbacks import TimeLimit

    clock = {"now": 1000.0}
    monkeypatch.setattr(time_limit.time, "monotonic", lambda: clock["now"])

    class Ticks(Callback):  # 10 s a step by the patched clock
        def on_step_end(self, run, step):
            clock["now"] += 10.0

    # Ticks runs first, so the limit sees each step's 10 s: the third step's end is 30 s after the start >= 25 s
    result = toy_session(tmp_path, 192, [Ticks(), TimeLimit(25)]).train()
    assert result.stopped_early and result.samples_seen == 48
    assert result.stop_reason == "time limit: 0:00:25 of training passed (TimeLimit max_time)"
    assert result.test is not None and result.last_checkpoint.name == "ckpt-48.pt"  # the stop's checkpoint
    assert "stopped early at 48 samples: time limit" in capsys.readouterr().out


def test_a_time_limit_on_ranks_that_meet_only_at_the_end_is_refused():
    import sys
    from types import SimpleNamespace

    from dtrain.callbacks import TimeLimit

    only_at_end = SimpleNamespace(world_size=2, evaluation_period=lambda kind: sys.maxsize, checkpoint_period=0)
    with pytest.raises(ValueError, match=r"TimeLimit max_time=60: on 2 ranks .* expected session.progress_frequency"):
        TimeLimit(60).check(only_at_end)
    TimeLimit(60).check(SimpleNamespace(**{**vars(only_at_end), "world_size": 1}))  # one process stops at any step
    TimeLimit(60).check(SimpleNamespace(**{**vars(only_at_end), "checkpoint_period": 5000}))


def _two_losses(model, minibatch):
    output = model(minibatch["features"])
    main = torch.nn.functional.cross_entropy(output, minibatch["labels"])
    return main + 0.01 * output.pow(2).mean(), {"main": main}


def _objective_session(run_dir, callbacks):
    from dtrain import CheckpointConfig, training_session

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return training_session(
        model, learner=LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)), objective=_two_losses,
        minibatch_source=MinibatchSource(four_class_data(200, 0), randomize=True, randomization_seed=3),
        minibatch_size=16, max_samples=192, progress_frequency=32,
        cv_config=CrossValidationConfig(MinibatchSource(four_class_data(40, 1), randomize=False, max_sweeps=1),
                                        frequency=32, minibatch_size=20),
        checkpoint_config=CheckpointConfig("ckpt.pt", frequency=0), run_dir=run_dir, tensorboard=False,
        callbacks=callbacks)


def test_a_monitor_of_an_objectives_figure_is_checked_against_its_first_record(tmp_path):
    best = BestCheckpoint(monitor="cv.main", mode="min")
    _objective_session(tmp_path / "figure", [best]).train()
    records = [json.loads(line) for line in (tmp_path / "figure" / "metrics.jsonl").read_text().splitlines()]
    assert best.best == min(record["main"] for record in records if record["kind"] == "cv")
    with pytest.raises(ValueError, match=r"monitor='cv.mian': the cv records have no mian; expected one of the "
                                         r"values the run writes: cv.loss, cv.main"):
        _objective_session(tmp_path / "typo", [BestCheckpoint(monitor="cv.mian", mode="min")]).train()

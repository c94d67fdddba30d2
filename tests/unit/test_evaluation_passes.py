"""The end-of-run evaluation passes: the test's max_samples, progress lines of a long pass, the weight EMA
left untested before its horizon, and cross-validation data evaluated once when it is also the test's."""
from __future__ import annotations

import io
import json

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from dtrain import CrossValidationConfig, LocalLearner, MinibatchSource, TestConfig, training_session
from dtrain.build import _same_data
from dtrain.session.progress import EvaluationProgress, ProgressPrinter

from tests.helpers.toy_data import four_class_data


def _held_out(num_samples: int = 80) -> MinibatchSource:
    return MinibatchSource(four_class_data(num_samples, seed=9), randomize=False, max_sweeps=1)


def _train(tmp_path, *, test=None, cv=None, ema_decay=None, max_samples=96):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    out = io.StringIO()
    session = training_session(model, nn.functional.cross_entropy,
                               LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                               MinibatchSource(four_class_data(), randomization_seed=3), 16, max_samples=max_samples,
                               progress_frequency=0, cv_config=cv, test_config=test, ema_decay=ema_decay,
                               run_dir=tmp_path, tensorboard=False, stream=out)
    return session.train(), out.getvalue()


def _metrics(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_the_test_pass_reads_at_most_its_max_samples(tmp_path) -> None:
    result, _ = _train(tmp_path, test=TestConfig(_held_out(), 16, max_samples=40))
    assert result.test.num_samples == 40
    assert [r["num_samples"] for r in _metrics(tmp_path) if r["kind"] == "test"] == [40]
    whole, _ = _train(tmp_path / "whole", test=TestConfig(_held_out(), 16))
    assert whole.test.num_samples == 80


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "all"])
def test_a_bad_test_max_samples_is_refused_in_one_line(bad) -> None:
    with pytest.raises(ValueError, match=rf"^TestConfig.max_samples={bad!r}: expected") as caught:
        TestConfig(_held_out(), 16, max_samples=bad)
    assert "\n" not in str(caught.value)


def test_a_long_evaluation_prints_a_line_every_interval_on_the_printing_rank_only() -> None:
    now = [100.0]
    out = io.StringIO()
    progress = EvaluationProgress(ProgressPrinter(None, stream=out, live_bar=False), "test", limit=9000,
                                  interval=30.0, clock=lambda: now[0])
    for samples, seconds in ((1000, 10.0), (2000, 29.0), (3000, 31.0), (4000, 50.0), (6000, 62.0)):
        now[0] = 100.0 + seconds
        progress(samples)
    assert out.getvalue().splitlines() == ["test: 3,000 of at most 9,000 samples evaluated in 0:00:31 (97 samples/s)",
                                           "test: 6,000 of at most 9,000 samples evaluated in 0:01:02 (97 samples/s)"]
    silent = io.StringIO()  # every rank but 0
    quiet = EvaluationProgress(ProgressPrinter(None, enabled=False, stream=silent), "test", interval=0.0)
    quiet(10)
    assert silent.getvalue() == ""


def test_every_evaluation_pass_reports_its_progress(tmp_path, monkeypatch) -> None:
    import dtrain.session.progress as progress

    monkeypatch.setattr(progress, "EVALUATION_PROGRESS_SECONDS", 0.0)  # a line after every minibatch
    _, out = _train(tmp_path, test=TestConfig(_held_out(), 16), cv=CrossValidationConfig(_held_out(48), None, 16),
                    ema_decay=0.8)
    assert "cross-validation 0: 16 samples evaluated in" in out and "cross-validation 0: 48 samples" in out
    assert "test of the weight EMA: 80 samples evaluated in" in out and "\ntest: 80 samples evaluated in" in out


def test_a_weight_ema_below_its_horizon_is_not_tested_and_says_why(tmp_path) -> None:
    result, out = _train(tmp_path, test=TestConfig(_held_out(), 16), ema_decay=0.99)  # 6 steps, horizon 100
    assert result.test is not None and result.test_ema is None
    assert ("weight EMA not tested: the weight EMA has taken in 6 optimizer steps, fewer than its horizon of 100 "
            "(1 / (1 - session.ema_decay=0.99)): about 95% of it is still the weights after the first step; "
            "train longer, or lower session.ema_decay") in out
    assert "test of the weight EMA" not in out
    assert [r["kind"] for r in _metrics(tmp_path) if r["kind"].startswith("test")] == ["test"]
    assert (tmp_path / "model_ema.safetensors").exists()  # still saved: a run continued later may use it
    from dtrain.generate import ema_below_horizon  # which python -m dtrain.generate then leaves for the final weights

    assert ema_below_horizon(tmp_path / "model_ema.safetensors").startswith("the weight EMA has taken in 6 optimizer")
    past, out = _train(tmp_path / "past", test=TestConfig(_held_out(), 16), ema_decay=0.8)  # horizon 5
    assert past.test_ema is not None and "not tested" not in out
    assert ema_below_horizon(tmp_path / "past" / "model_ema.safetensors") is None


def test_cross_validation_data_that_is_also_the_test_data_is_evaluated_once_at_the_end(tmp_path) -> None:
    held_out = _held_out()
    reads = []
    next_minibatch = held_out.next_minibatch
    held_out.next_minibatch = lambda *args, **kwargs: reads.append(1) or next_minibatch(*args, **kwargs)
    result, out = _train(tmp_path, test=TestConfig(held_out, 16), cv=CrossValidationConfig(held_out, 64, 16))
    assert result.test is result.last_cross_validation and result.test.num_samples == 80
    assert "the cross-validation at 96 samples evaluated this model on it, so its result is the test's" in out
    assert len(reads) == 2 * 6  # cross-validations at 64 and 96 samples (5 minibatches and the end), no test
    tests = [r for r in _metrics(tmp_path) if r["kind"] == "test"]
    assert len(tests) == 1 and tests[0]["loss"] == result.last_cross_validation.loss


@pytest.mark.parametrize("case", ["another source of the same data", "another max_samples"])
def test_the_test_is_evaluated_when_the_cross_validation_did_not_measure_it(tmp_path, case) -> None:
    held_out = _held_out()
    test = TestConfig(_held_out() if case == "another source of the same data" else held_out, 16,
                      max_samples=48 if case == "another max_samples" else None)
    result, out = _train(tmp_path, test=test, cv=CrossValidationConfig(held_out, None, 16))
    assert "is the test's" not in out and result.test is not result.last_cross_validation
    if case == "another source of the same data":
        assert result.test.loss == pytest.approx(result.last_cross_validation.loss)
    else:
        assert result.test.num_samples == 48


def test_the_command_line_shares_one_source_when_test_and_cross_validation_are_configured_alike() -> None:
    shakespeare = OmegaConf.create({"source": {
        "cv": {"_target_": "dtrain.data.MinibatchSource", "max_sweeps": 1, "deserializer": {"split": "validation"}},
        "test": {"_target_": "dtrain.data.MinibatchSource", "max_sweeps": 1, "deserializer": {"split": "validation"}}}})
    assert _same_data(shakespeare.source.test, shakespeare.source.cv)
    shakespeare.source.test.deserializer.split = "test"
    assert not _same_data(shakespeare.source.test, shakespeare.source.cv)
    assert not _same_data(None, shakespeare.source.cv) and not _same_data(shakespeare.source.test, None)


def test_the_weight_ema_counts_the_optimizer_steps_it_took_in_across_a_resume() -> None:
    from dtrain.session.weight_ema import WeightEMA

    model = nn.Linear(2, 2)
    ema = WeightEMA(model, 0.75)  # horizon 4 steps
    ema.after_step(model, True)
    for _ in range(2):  # a block learner's block of 2 steps: one update, 2 steps
        ema.after_step(model, False)
    assert ema.steps_taken == 1 and "taken in 1 optimizer steps, fewer than its horizon of 4" in ema.too_few_steps()
    ema.after_last_sync(model)
    resumed = WeightEMA(model, 0.75)
    resumed.load_state_dict(ema.state_dict())
    assert resumed.steps_taken == 3 and resumed.too_few_steps() is not None
    resumed.after_step(model, True)
    assert resumed.steps_taken == 4 and resumed.too_few_steps() is None
    older = {key: value for key, value in ema.state_dict().items() if key != "steps_taken"}
    resumed.load_state_dict(older)  # a checkpoint written before the count was kept: its updates
    assert resumed.steps_taken == resumed.updates == 2


@pytest.mark.parametrize("which", ["test", "cv"])
def test_an_evaluation_of_a_source_that_repeats_forever_is_refused_unless_it_has_a_limit(tmp_path, which) -> None:
    """An evaluation reads its source to the end: over a source without max_samples or max_sweeps it would never
    end (the run hung there). Refused in one line before anything is written; a max_samples in the config is a
    limit, and such a run evaluates that many samples."""
    endless = MinibatchSource(four_class_data(40, seed=9), randomize=False)
    assert endless.repeats_forever and not _held_out().repeats_forever
    config = TestConfig(endless, 16) if which == "test" else CrossValidationConfig(endless, 48, 16)
    with pytest.raises(ValueError) as refused:
        _train(tmp_path / "refused", **{which: config})
    message = str(refused.value)
    assert "\n" not in message and "repeats forever" in message and "max_sweeps=1" in message, message
    assert ("TestConfig(max_samples=...)" if which == "test" else "CrossValidationConfig(max_samples=...)") in message
    assert not (tmp_path / "refused").exists()
    limited = TestConfig(endless, 16, max_samples=56) if which == "test" else \
        CrossValidationConfig(endless, 48, 16, max_samples=56)
    result, _ = _train(tmp_path / "limited", **{which: limited})
    evaluated = result.test if which == "test" else result.last_cross_validation
    assert evaluated.num_samples == 56

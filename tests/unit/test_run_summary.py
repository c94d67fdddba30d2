"""The end-of-run summary lines: built from what the run measured, in the order people read them."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from dtrain import LocalLearner
from dtrain.session.evaluate import Evaluation, classification_errors
from dtrain.session.measures import Measures
from dtrain.session.results import TrainingResult
from dtrain.session.summary import RunSummary


def summary_lines(tmp_path: Path, result: TrainingResult, **arguments) -> list[str]:
    model = nn.Linear(2, 2)
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1))
    summary = RunSummary(run_dir=tmp_path, model=model, ema=None, learner=learner,
                         measures=Measures(classification_errors, None, learner.comm), loss_scaler=None,
                         tensorboard_hint=True)
    summary.export_weights(result.samples_seen)
    lines: list[str] = []
    metrics = SimpleNamespace(jsonl_path=tmp_path / "metrics.jsonl", csv_path=tmp_path / "metrics.csv",
                              tensorboard_dir=None)
    summary.print_lines(SimpleNamespace(line=lines.append), result, metrics, **arguments)
    return lines


def test_the_warnings_follow_the_test_line_and_the_files_written_come_last(tmp_path):
    test = Evaluation(loss=0.25, error=0.125, num_samples=64, num_minibatches=2)
    result = TrainingResult(samples_seen=128, minibatches=8, seconds=2.0, stopped_early=False, test=test,
                            last_cross_validation=None, last_checkpoint=tmp_path / "checkpoint_128.pt",
                            metrics_path=None, restored_from=None)
    lines = summary_lines(tmp_path, result, warnings=["warning: a test warning"], skipped_steps=0, profiler=None)
    assert lines[0].startswith("finished: 128 samples in 8 minibatches, ")
    assert lines[1:] == [
        "test: accuracy 87.50% (error 12.50%, loss 0.2500) on 64 samples",
        "warning: a test warning",
        f"checkpoint: {tmp_path / 'checkpoint_128.pt'}",
        f"weights: {tmp_path / 'model.safetensors'}",
        f"metrics: {tmp_path / 'metrics.jsonl'}, metrics.csv (no TensorBoard events: pip install 'dtrain[tensorboard]')",
    ]

"""What the benchmarks read from a finished run (``benchmarks/_run_records.py``): figures from ``metrics.jsonl``
and ``config.yaml``, the one summary figure no record holds read by a pattern that matches dtrain's own
summary, and one line naming what is missing instead of a figure that silently is not there."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from dtrain.session import classification_errors
from dtrain.session.evaluate import Evaluation
from dtrain.session.measures import Measures
from dtrain.session.results import TrainingResult
from dtrain.session.summary import RunSummary
from tests.helpers.config import compose_config

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _benchmark_module(name: str):
    """A benchmarks/ module, loaded from its file as the scripts beside it import it (they run from benchmarks/)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_records = _benchmark_module("_run_records")

RECORDS = [
    {"kind": "train", "samples": 1500, "time": 10.0, "loss": 1.2, "error": 0.3, "period_s": 1.0},
    {"kind": "cv", "samples": 1500, "time": 10.5, "loss": 0.9, "error": 0.2, "accuracy": 0.8},
    {"kind": "train", "samples": 3000, "time": 12.0, "loss": 0.4, "error": 0.1, "period_s": 0.5},
    {"kind": "test_ema", "samples": 3000, "time": 12.5, "loss": 0.15, "error": 0.037, "accuracy": 0.963},
    {"kind": "test", "samples": 3000, "time": 13.0, "loss": 0.26, "error": 0.054, "accuracy": 0.946},
]


def _run_dir(tmp_path: Path, records: list[dict]) -> Path:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return tmp_path


def test_figures_come_from_the_runs_records(tmp_path):
    records = run_records.run_records(_run_dir(tmp_path, RECORDS))
    assert run_records.value(run_records.last_record(records, "test"), "accuracy", 100) == pytest.approx(94.6)
    assert run_records.value(run_records.last_record(records, "test_ema"), "error", 100) == pytest.approx(3.7)
    # the training loop's samples over its periods' wall time, not the last period's rate
    assert run_records.training_rate(records) == pytest.approx(3000 / 1.5)


def test_a_missing_record_or_value_stops_with_one_line_naming_it(tmp_path):
    records = run_records.run_records(_run_dir(tmp_path, RECORDS[:3]))
    with pytest.raises(SystemExit, match=r"^no 'test' record in the run's metrics.jsonl \(it has: cv, train\)$"):
        run_records.last_record(records, "test")
    with pytest.raises(SystemExit, match=r"^the 'cv' record at 1500 samples has no 'wer' \(it has: kind, "):
        run_records.value(records[1], "wer", 100)
    with pytest.raises(SystemExit, match="no 'train' record"):
        run_records.training_rate(records[1:2])


def test_a_missing_or_damaged_metrics_file_stops_with_one_line(tmp_path):
    with pytest.raises(SystemExit, match="metrics.jsonl: no records; expected the metric records of a finished run"):
        run_records.run_records(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(RECORDS[0]) + "\nprogress: 50%\n")
    with pytest.raises(SystemExit, match="line 2 is not JSON"):
        run_records.run_records(tmp_path)


def test_the_lr_scaling_is_read_from_the_runs_config(tmp_path):
    config = compose_config("+recipe=digits", "session.minibatch_size=512", "session.lr_scaling=linear",
                            "session.lr_reference_minibatch_size=32")
    OmegaConf.save(config, tmp_path / "config.yaml", resolve=True)
    assert run_records.lr_scaling_text(tmp_path) == "0.05 x 16 = 0.8 (linear)"
    OmegaConf.save(compose_config("+recipe=digits"), tmp_path / "config.yaml", resolve=True)
    assert run_records.lr_scaling_text(tmp_path) == ""


def _summary(bytes_sent: int, ranks: int) -> str:
    """The summary lines dtrain's rank 0 prints at the end of a run whose learner sent ``bytes_sent``."""
    lines = []
    comm = SimpleNamespace(is_main=True, size=ranks)
    learner = SimpleNamespace(comm=comm, bytes_sent_total=bytes_sent, kind="data_parallel", summary_note=lambda: None)
    summary = RunSummary(run_dir=Path("run"), model=None, ema=None, learner=learner,
                         measures=Measures(classification_errors, None, comm), loss_scaler=None, tensorboard_hint=False)
    test = Evaluation(loss=0.26, error=0.054, num_samples=297, num_minibatches=2)
    result = TrainingResult(30000, 938, 12.0, False, test, None, None, None, None)
    metrics = SimpleNamespace(jsonl_path=Path("run/metrics.jsonl"), csv_path=Path("run/metrics.csv"),
                              tensorboard_dir=None)
    summary.print_lines(SimpleNamespace(line=lines.append), result, metrics, warnings=[], skipped_steps=0, profiler=None)
    return "\n".join(lines)


def test_the_bytes_sent_are_read_from_dtrains_own_summary_line():
    assert run_records.megabytes_sent(_summary(1_234_567_890, ranks=2)) == pytest.approx(1234.6)
    with pytest.raises(SystemExit, match="^no .* line in the run's output: expected the summary of a finished run"):
        run_records.megabytes_sent(_summary(1_234_567_890, ranks=1))  # one process exchanges nothing

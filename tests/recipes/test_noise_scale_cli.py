"""``python -m dtrain.noise_scale`` on the checkpoints of a real command-line run (its estimator and bad inputs:
tests/unit/test_noise_scale.py)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from dtrain.noise_scale import main, samples_ratio
from tests.helpers.cli import run_dtrain


def test_the_command_measures_every_checkpoint_of_a_run(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    trained = run_dtrain("+recipe=digits", "session.max_samples=640", "session.checkpoint.frequency=320",
                         "session.checkpoint.preserve_all=true", "session.progress_frequency=320",
                         f"run_dir={run_dir}", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]

    assert main([str(run_dir), "--minibatches", "16", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 320 |") or line.startswith("| 640 |")]
    assert len(rows) == 2, out
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        b_simple = float(cells[2].split("+-")[0].replace(",", ""))
        assert b_simple > 0 and math.isfinite(float(cells[1]))
        # the ratio column is the empirical model's prediction for this noise scale and minibatch 32
        assert float(cells[4]) == pytest.approx(samples_ratio(b_simple, 32, 16), abs=0.01 + 0.01 * float(cells[4]))

    # the run's data cannot be built (here: a split the deserializer does not have): one line naming it, exit 2
    config = (run_dir / "config.yaml").read_text()
    assert config.count("split: train") == 1
    (run_dir / "config.yaml").write_text(config.replace("split: train", "split: training"))
    assert main([str(run_dir), "--minibatches", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"python -m dtrain.noise_scale: error: source.train of "
                                                         f"{run_dir / 'config.yaml'}: "), err

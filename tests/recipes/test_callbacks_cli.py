"""Callbacks from the command line: the shipped early stopping and best checkpoint on the digits recipe, and the
callback of one's own from docs/examples/target_error, chosen from a --config-dir as the docs show."""
from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from dtrain.build import _instantiate, load_run_config
from dtrain.session.weights import load_weights

from tests.helpers.cli import run_dtrain
from tests.helpers.examples import EXAMPLES

pytestmark = [pytest.mark.timeout(300)]

# a short digits run with cross-validation on the test digits every 320 samples
SHORT = ["+recipe=digits", "run_dir=run", "source.cv=${source.test}", "session.cv.frequency=320",
         "session.progress_frequency=320", "session.tensorboard=false"]


def test_early_stopping_and_the_best_checkpoint_on_digits(tmp_path: Path) -> None:
    # nothing beats the first cross-validation by a whole 100%: the third stops the run (patience 2)
    result = run_dtrain(*SHORT, "session.max_samples=6400", "callbacks=[early_stopping,best_checkpoint]",
                        "callbacks.early_stopping.patience=2", "callbacks.early_stopping.min_delta=1.0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    assert re.search(r"^stopped early at 960 samples: early stopping: cv.error has not improved on [\d.]+% \(at 320 "
                     r"samples\) for 2 cross-validations \(patience 2\)$", result.stdout, re.MULTILINE), result.stdout
    cv = [record for record in map(json.loads, (run / "metrics.jsonl").open()) if record["kind"] == "cv"]
    best = min(cv, key=lambda record: record["error"])
    assert f"best: cv.error {100 * best['error']:.2f}% at {best['samples']} samples: {run / 'best.safetensors'}" \
        in result.stdout
    # best.safetensors loads into the run's model, as model.safetensors does, and says which point it is
    config_path, config = load_run_config(run)
    load_weights(_instantiate(config.model, "model"), run / "best.safetensors")
    with safe_open(str(run / "best.safetensors"), "pt") as weights:
        metadata = weights.metadata()
    assert (metadata["monitor"], int(metadata["samples_seen"]), float(metadata["value"])) == \
        ("cv.error", best["samples"], best["error"])


def docs_command() -> list[str]:
    """The arguments of the command docs/callbacks-and-loggers.md runs its own callback with."""
    page = (EXAMPLES.parent / "callbacks-and-loggers.md").read_text()
    line = next(line for line in page.splitlines() if line.startswith("python -m dtrain --config-dir conf"))
    return shlex.split(line)[3:]


def test_a_callback_of_ones_own_from_a_config_dir_as_the_docs_show(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "target_error", tmp_path, dirs_exist_ok=True)
    arguments = docs_command()
    assert "callbacks=[target_error,best_checkpoint]" in arguments
    # shortened, with a target the first cross-validations reach
    given = {argument.split("=", 1)[0] for argument in arguments}
    shortened = [argument for argument in SHORT if argument.split("=", 1)[0] not in given]
    result = run_dtrain(*arguments, *shortened, "session.max_samples=6400", "callbacks.target_error.error=0.5",
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    stop = re.search(r"^stopped early at (\d+) samples: cross-validation error ([\d.]+)% reached the target 50.00%$",
                     result.stdout, re.MULTILINE)
    assert stop, result.stdout
    cv = [record for record in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open()) if record["kind"] == "cv"]
    first = next(record for record in cv if record["error"] <= 0.5)  # the first at the target is the last
    assert (cv[-1], int(stop.group(1))) == (first, first["samples"])
    assert (tmp_path / "run" / "best.safetensors").is_file()

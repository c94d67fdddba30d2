"""The run directory from the command line: resuming with changed settings, and one job per directory."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import yaml

from dtrain.session import checkpoint

from tests.helpers.cli import run_dtrain
from tests.helpers.mpi import plain_environment

TINY = ("+recipe=digits", "session.progress_frequency=320", "session.tensorboard=false", "model.hidden=32")


@pytest.mark.slow
def test_resuming_with_changed_optimizer_settings_uses_them_says_so_and_records_them(tmp_path):
    first = run_dtrain(*TINY, "run_dir=run", "session.max_samples=640", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    second = run_dtrain(*TINY, "run_dir=run", "session.max_samples=960", "optimizer.momentum=0.0",
                        "optimizer.weight_decay=0.5", "optimizer.lr=0.001", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "at 640 samples" in second.stdout
    changes = next(line for line in second.stdout.splitlines() if "settings changed since the checkpoint" in line)
    for fragment in ("optimizer.lr: 0.05 -> 0.001", "optimizer.momentum: 0.9 -> 0.0",
                     "optimizer.weight_decay: 0.0 -> 0.5", "session.max_samples: 640 -> 960"):
        assert fragment in changes, changes
    # what ran: the optimizer state saved after the resume, and the config written for it
    groups = checkpoint.load(tmp_path / "run" / "checkpoint-960.pt")["learner"]["optimizer"]["param_groups"]
    assert [(g["lr"], g["momentum"], g["weight_decay"]) for g in groups] == [(0.001, 0.0, 0.5)]
    recorded = yaml.safe_load((tmp_path / "run" / "config.1.yaml").read_text())["optimizer"]
    assert (recorded["lr"], recorded["momentum"], recorded["weight_decay"]) == (0.001, 0.0, 0.5)


@pytest.mark.slow  # the default suite keeps to 10 minutes on 2 cores; CI runs the slow set too
def test_hydras_run_dir_override_is_where_the_run_writes(tmp_path):
    result = run_dtrain(*TINY, "hydra.run.dir=elsewhere/run", "session.max_samples=320", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"run directory {tmp_path / 'elsewhere' / 'run'} " in result.stdout
    assert (tmp_path / "elsewhere" / "run" / "model.safetensors").is_file()
    assert not (tmp_path / "outputs").exists()
    # the same directory again resumes it, as run_dir=DIR would
    again = run_dtrain(*TINY, "hydra.run.dir=elsewhere/run", "session.max_samples=640", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "at 320 samples" in again.stdout


@pytest.mark.slow  # the default suite keeps to 10 minutes on 2 cores; CI runs the slow set too
def test_hydras_run_dir_and_another_run_dir_together_are_one_line_exit_2(tmp_path):
    result = run_dtrain(*TINY, "hydra.run.dir=one", "run_dir=two", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "hydra.run.dir=" in lines[0] and "run_dir=two" in lines[0], result.stderr
    assert not (tmp_path / "two").exists()  # nothing written; Hydra itself makes hydra.run.dir, empty
    assert not (tmp_path / "one").exists() or not any((tmp_path / "one").iterdir())


@pytest.mark.slow  # the default suite keeps to 10 minutes on 2 cores; CI runs the slow set too
def test_settings_that_cannot_change_are_refused_naming_them(tmp_path):
    assert run_dtrain(*TINY, "run_dir=run", "session.max_samples=320", cwd=tmp_path).returncode == 0
    for override, fragment in (("seed=1", "seed was 0 in the checkpoint's run and is 1 now"),
                               ("model.hidden=16", "does not fit this model"),
                               ("learner=quantized", "learner.exchange is missing from the checkpoint's config")):
        result = run_dtrain(*TINY, "run_dir=run", "session.max_samples=640", override, cwd=tmp_path)
        assert result.returncode == 2, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0], result.stderr


@pytest.mark.slow  # the default suite keeps to 10 minutes on 2 cores; CI runs the slow set too
def test_a_second_job_into_the_same_run_directory_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path):
    command = [sys.executable, "-m", "dtrain", *TINY, "run_dir=run", "session.max_samples=4000000",
               "session.checkpoint.preemption_signal=null"]
    with subprocess.Popen(command, cwd=tmp_path, env=plain_environment(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL) as first:
        try:
            holder = tmp_path / "run" / ".lock"
            deadline = time.monotonic() + 120
            while not (holder.exists() and f"pid {first.pid} " in holder.read_text()):
                assert time.monotonic() < deadline and first.poll() is None, "the first job did not start"
                time.sleep(0.2)
            second = run_dtrain(*TINY, "run_dir=run", "session.max_samples=320", cwd=tmp_path)
            assert second.returncode == 2, second.stdout + second.stderr
            lines = second.stderr.strip().splitlines()
            assert len(lines) == 1, second.stderr
            assert f"is in use by another dtrain job (pid {first.pid} on host" in lines[0]
            assert first.poll() is None  # the first job was not disturbed
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
    # the killed job's last checkpoint is where the run stands; the third job continues it a little
    written = max(checkpoint.CheckpointFiles(tmp_path / "run" / "checkpoint.pt").existing(), default=(0, None))[0]
    third = run_dtrain(*TINY, "run_dir=run", f"session.max_samples={written + 320}", cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    assert not written or f"at {written} samples" in third.stdout, third.stdout


#: the digits through a Dataset of the user's own, with one record that cannot be read
BAD_RECORD_DATA = '''
from pathlib import Path

import torch
from dtrain.data import Digits

BAD_AT = Path(__file__).with_name("bad_at.txt")  # the bad record's index and problem; the config stays the run's


class DigitsWithABadRecord(torch.utils.data.Dataset):
    def __init__(self):
        digits = Digits("train")
        self.features, self.labels = digits.get(list(range(digits.num_samples)))
        bad = BAD_AT.read_text().split() if BAD_AT.exists() else ["-1"]
        self.bad_at, self.problem = int(bad[0]), (bad[1:] or ["raise"])[0]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        if index != self.bad_at:
            return self.features[index], int(self.labels[index])
        if self.problem == "nan":
            return self.features[index] * float("nan"), int(self.labels[index])
        if self.problem == "label":
            return self.features[index], 12  # the model has 10 outputs, and no num_classes is declared
        raise OSError("corrupt record")
'''

BAD_RECORD_RECIPE = '''# @package _global_
defaults:
  - /model: digits_cnn
  - _self_
recipe_name: bad_record
source:
  train:
    _target_: dtrain.data.MinibatchSource
    deserializer:
      _target_: dtrain.data.DatasetDeserializer
      dataset: {_target_: bad_record_data.DigitsWithABadRecord}
    randomize: false
session:
  minibatch_size: 32
  max_samples: 320
  progress_frequency: 64
  tensorboard: false
'''


def bad_record_project(tmp_path, bad_at: int | str | None = None):
    (tmp_path / "bad_record_data.py").write_text(BAD_RECORD_DATA)
    if bad_at is not None:
        (tmp_path / "bad_at.txt").write_text(str(bad_at))
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "bad_record.yaml").write_text(BAD_RECORD_RECIPE)
    return ["--config-dir", str(tmp_path / "conf"), "+recipe=bad_record"]


def one_line_error(result, fragment: str) -> None:
    lines = [line for line in result.stderr.splitlines() if "dtrain: error:" in line]
    assert result.returncode == 2 and len(lines) == 1 and fragment in lines[0], (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_run_refused_by_a_bad_record_leaves_nothing_behind_and_loses_nothing(tmp_path):
    recipe = bad_record_project(tmp_path, 137)
    new = run_dtrain(*recipe, "run_dir=outputs/new", cwd=tmp_path)
    one_line_error(new, "DigitsWithABadRecord[137] raised OSError: corrupt record")
    assert not (tmp_path / "outputs").exists()  # no config.yaml, no metrics: not even the directory
    (tmp_path / "bad_at.txt").unlink()
    finished = run_dtrain(*recipe, "run_dir=run", "session.max_samples=96", "session.checkpoint.frequency=96",
                          cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr
    before = {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()}
    (tmp_path / "bad_at.txt").write_text("250")
    resumed = run_dtrain(*recipe, "run_dir=run", cwd=tmp_path)
    one_line_error(resumed, "DigitsWithABadRecord[250] raised OSError")
    after = {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()}
    assert after == before  # byte-identical: its config.1.yaml, TensorBoard events and metric records taken back


@pytest.mark.slow
@pytest.mark.parametrize("bad_at", [20, 150])  # in rank 1's share of the first minibatch, of the fifth
def test_a_bad_record_under_mpiexec_ends_every_rank_with_one_line(tmp_path, bad_at):
    from tests.helpers.mpi import run_mpi

    recipe = bad_record_project(tmp_path, bad_at)
    result = run_mpi(2, ["-m", "dtrain", *recipe, f"run_dir={tmp_path / 'outputs' / 'run'}"],
                     env={"PYTHONPATH": str(tmp_path)}, timeout=180)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "dtrain: error:" in line]
    assert result.returncode == 2 and len(lines) == 1, result.report()
    assert f"DigitsWithABadRecord[{bad_at}] raised OSError: corrupt record" in lines[0]
    if bad_at == 20:  # found on the first minibatch, agreed by both ranks, naming the one that read it: nothing written
        assert "dtrain: error: rank 1 of 2: DigitsWithABadRecord[20] raised OSError" in lines[0], result.report()
        assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("problem, fragment", [
    ("nan", "stream 'features': DigitsWithABadRecord[137] (timeline position 137) holds NaN; expected finite numbers"),
    ("label", "session.target='labels': stream 'labels' holds the id 12, but the model has 10 outputs; expected ids "
              "in [0, 10)"),
])
def test_nan_in_the_data_and_labels_past_the_model_are_named_as_data_problems(tmp_path, problem, fragment):
    """Not a divergence to be fixed with the learning rate, not an IndexError: one line, exit 2, nothing left."""
    recipe = bad_record_project(tmp_path, f"137 {problem}")
    result = run_dtrain(*recipe, "run_dir=outputs/run", cwd=tmp_path)
    one_line_error(result, fragment)
    assert not (tmp_path / "outputs").exists()

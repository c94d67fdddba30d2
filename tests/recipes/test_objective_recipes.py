"""Your own objective from the command line (``docs/objectives.md``): a two-loss objective from a ``--config-dir``
group (``+objective=NAME``), dtrain's ``Distillation`` with a teacher loaded from a finished run's
``model.safetensors`` (``objective={...}``), and the bad inputs: one line, exit 2, no run directory left."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import run_dtrain, run_python

pytestmark = pytest.mark.timeout(600)

USER_OBJECTIVES = '''
import torch.nn.functional as F


def two_losses(model, minibatch):
    output = model(minibatch["features"])
    main = F.cross_entropy(output, minibatch["labels"])
    aux = output.pow(2).mean()
    return main + 0.1 * aux, {"main_loss": main, "aux": aux}


def wrong_signature(model):
    return model


def returns_a_vector(model, minibatch):
    return F.cross_entropy(model(minibatch["features"]), minibatch["labels"], reduction="none")
'''

TINY = ["+recipe=digits", "session.max_samples=64", "session.progress_frequency=32", "session.tensorboard=false"]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """A working directory with a module of objectives and a ``--config-dir`` whose ``objective`` group names one."""
    base = tmp_path_factory.mktemp("objective_cli")
    (base / "user_objectives.py").write_text(USER_OBJECTIVES)
    (base / "user_conf" / "objective").mkdir(parents=True)
    (base / "user_conf" / "objective" / "two_losses.yaml").write_text("_target_: user_objectives.two_losses\n")
    return base


@pytest.fixture(scope="module")
def two_loss_run(user_dir) -> Path:
    """``+objective=two_losses`` from the user's config directory; its model is the distillation tests' teacher."""
    finished = run_dtrain(*TINY, "--config-dir", "user_conf", "+objective=two_losses", "run_dir=two_losses",
                          cwd=user_dir)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    return user_dir / "two_losses"


def test_a_two_loss_objective_from_a_config_dir_logs_its_figures(two_loss_run):
    written = records(two_loss_run)
    assert {record["kind"] for record in written} == {"train", "test"}
    for record in written:
        assert {"loss", "main_loss", "aux"} <= set(record) and "error" not in record, record
    config = (two_loss_run / "config.yaml").read_text()
    assert "_target_: user_objectives.two_losses" in config and "loss: null" in config  # what ran, not the recipe's


def test_distillation_from_the_command_line(user_dir, two_loss_run):
    teacher = two_loss_run / "model.safetensors"
    run = run_dtrain(*TINY, f"objective={{_target_: dtrain.session.Distillation, teacher: {{_target_: "
                            f"dtrain.models.DigitsCNN}}, weights: '{teacher}', temperature: 3.0}}", "run_dir=distilled",
                     cwd=user_dir)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "objective dtrain.session.distillation.Distillation(model, minibatch)" in run.stdout
    assert all({"kl", "cross_entropy"} <= set(record) for record in records(user_dir / "distilled"))


@pytest.mark.parametrize("case_id, objective, fragments", [
    ("not-importable", "objective={_target_: user_objectives.nope}",
     ["objective: Error locating target 'user_objectives.nope'", "expected an importable class or function"]),
    ("wrong-signature", "objective={_target_: user_objectives.wrong_signature}",
     ["objective user_objectives.wrong_signature(model) cannot be called as objective(model, minibatch)"]),
    ("returns-a-vector", "objective={_target_: user_objectives.returns_a_vector}",
     ["objective user_objectives.returns_a_vector returned a torch.float32 tensor of shape (32,) at the first "
      "minibatch; expected the mean loss as a scalar tensor"]),
    ("teacher-weights-missing", "objective={_target_: dtrain.session.Distillation, teacher: {_target_: "
                                "dtrain.models.DigitsCNN}, weights: nowhere/model.safetensors}",
     ["objective: Distillation weights='nowhere/model.safetensors': no such file"]),
    ("teacher-weights-foreign", "objective={_target_: dtrain.session.Distillation, teacher: {_target_: "
                                "torch.nn.Linear, in_features: 64, out_features: 10}, weights: {weights}}",
     ["model.safetensors does not fit the teacher (Linear)"]),
])
def test_a_bad_objective_is_one_line_and_exit_2(user_dir, two_loss_run, case_id, objective, fragments):
    run = run_dtrain(*TINY, objective.replace("{weights}", str(two_loss_run / "model.safetensors")),
                     f"run_dir={case_id}", cwd=user_dir)
    report = f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert run.returncode == 2 and "Traceback" not in run.stderr, report
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "dtrain: error:" in line]
    assert len(lines) == 1 and all(fragment in lines[0] for fragment in fragments), report
    assert not (user_dir / case_id).exists(), report  # nothing written


def test_the_noise_scale_tool_refuses_an_objectives_run_with_one_line(two_loss_run):
    run = run_python("-m", "dtrain.noise_scale", str(two_loss_run), cwd=two_loss_run.parent, timeout=240)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stdout + run.stderr
    assert "the run trained with objective user_objectives.two_losses" in run.stdout + run.stderr


@pytest.mark.parametrize("override", ["loss=mse", "metric=top5_error", "loss.label_smoothing=0.1"])
def test_a_loss_or_metric_override_beside_an_objective_is_refused_not_ignored(user_dir, override):
    run = run_dtrain(*TINY, "objective={_target_: user_objectives.two_losses}", override, "run_dir=beside",
                     cwd=user_dir)
    report = f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert run.returncode == 2 and "Traceback" not in run.stderr, report
    assert f"dtrain: error: {override}: this run has an objective, which computes the loss" in run.stdout + run.stderr
    assert not (user_dir / "beside").exists(), report

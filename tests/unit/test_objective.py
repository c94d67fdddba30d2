"""Your own objective in place of ``loss(model(inputs), target)`` (``docs/objectives.md``): its figures in the
train, cross-validation and test records, the one rule for ``loss`` and ``objective``, the bad inputs refused
with one line before anything is written, and the shipped ``Distillation``."""
from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtrain
from dtrain.comm import LocalCommunicator
from dtrain.learners import LocalLearner
from dtrain.session import Distillation, classification_errors
from dtrain.session.weights import save_weights

from tests.helpers.toy_data import four_class_data


def two_losses(model, minibatch):
    output = model(minibatch["features"])
    main = F.cross_entropy(output, minibatch["labels"])
    aux = output.pow(2).mean()
    return main + 0.1 * aux, {"main_loss": main, "aux": aux}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))


def session(run_dir, model=None, evaluate: bool = False, **options):
    model = model if model is not None else make_model()
    held_out = {} if not evaluate else {
        "cv_config": dtrain.CrossValidationConfig(dtrain.MinibatchSource(four_class_data(60, seed=1), max_sweeps=1),
                                                  frequency=120, minibatch_size=32),
        "test_config": dtrain.TestConfig(dtrain.MinibatchSource(four_class_data(60, seed=2), max_sweeps=1), 32)}
    return dtrain.training_session(
        model=model, learner=LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1), LocalCommunicator()),
        minibatch_source=dtrain.MinibatchSource(four_class_data(), randomize=False), minibatch_size=16,
        max_samples=240, progress_frequency=80, run_dir=run_dir, tensorboard=False, stream=io.StringIO(),
        **held_out, **options)


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_figures_are_in_the_train_cv_and_test_records_averaged_like_the_loss(tmp_path):
    result = session(tmp_path, objective=two_losses, evaluate=True).train()
    written = records(tmp_path)
    assert {record["kind"] for record in written} == {"train", "cv", "test"}
    for record in written:
        assert {"loss", "main_loss", "aux"} <= set(record) and "error" not in record, record
        # the loss is main + 0.1 aux per minibatch, so its sample-weighted mean is theirs too
        assert record["loss"] == pytest.approx(record["main_loss"] + 0.1 * record["aux"], rel=1e-6), record
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"main_loss", "aux"} <= set(header) and "error" not in header
    assert result.test.details.keys() == {"main_loss", "aux"} and result.objective == result.test.loss


@pytest.mark.parametrize("precision", ["32", "bf16", "fp16"])
def test_an_objective_computing_the_loss_trains_as_the_loss_does(tmp_path, precision):
    with_loss, with_objective = make_model(), make_model()
    session(tmp_path / "loss", with_loss, loss=F.cross_entropy, micro_batch_size=5, precision=precision).train()
    session(tmp_path / "objective", with_objective, micro_batch_size=5, precision=precision,
            objective=lambda model, minibatch: F.cross_entropy(model(minibatch["features"]), minibatch["labels"])).train()
    for a, b in zip(with_loss.parameters(), with_objective.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    losses = [[r["loss"] for r in records(tmp_path / name) if r["kind"] == "train"] for name in ("loss", "objective")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def wrong_signature(model):
    return model


def returns_a_vector(model, minibatch):
    return F.cross_entropy(model(minibatch["features"]), minibatch["labels"], reduction="none")


def returns_a_column_figure(model, minibatch):
    loss = F.cross_entropy(model(minibatch["features"]), minibatch["labels"])
    return loss, {"error": loss}


@pytest.mark.parametrize("options, fragments", [
    ({"objective": two_losses, "loss": F.cross_entropy}, ["got both loss and objective; give one"]),
    ({}, ["needs a loss", "or an objective"]),
    ({"objective": wrong_signature}, ["objective test_objective.wrong_signature(model) cannot be called as "
                                      "objective(model, minibatch)"]),
    ({"objective": two_losses, "metric": classification_errors}, ["metric error with objective",
                                                                         "return the figure from the objective"]),
    ({"objective": two_losses, "inputs": ["labels"]}, ["session.inputs=['labels'] with objective"]),
])
def test_bad_arguments_are_refused_with_one_line(tmp_path, options, fragments):
    with pytest.raises(ValueError) as refused:
        session(tmp_path / "run", **options)
    message = str(refused.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("objective, fragments", [
    (returns_a_vector, ["objective test_objective.returns_a_vector returned a torch.float32 tensor of shape (16,) "
                        "at the first minibatch; expected the mean loss as a scalar tensor"]),
    (lambda model, minibatch: 0.5, ["returned the number 0.5"]),
    (lambda model, minibatch: (model(minibatch["features"]).mean(), [1.0]), ["returned a tuple of 2"]),
    (returns_a_column_figure, ["returned a figure named 'error', a column of the metrics files"]),
])
def test_a_bad_first_result_is_refused_before_anything_is_written(tmp_path, objective, fragments):
    with pytest.raises(ValueError) as refused:
        session(tmp_path / "run", objective=objective).train()
    message = str(refused.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message
    assert not (tmp_path / "run").exists()


def test_distillation_blends_the_teachers_kl_with_the_labels_cross_entropy(tmp_path):
    save_weights(make_model(7), tmp_path / "teacher.safetensors")
    distillation = Distillation(make_model(1), weights=tmp_path / "teacher.safetensors", temperature=3.0, alpha=0.25)
    teacher = make_model(7)
    assert all(torch.equal(a, b) for a, b in zip(distillation.teacher.parameters(), teacher.parameters()))
    assert not distillation.teacher.training and not any(p.requires_grad for p in distillation.teacher.parameters())
    student = make_model(0)
    minibatch = dtrain.MinibatchSource(four_class_data()).next_minibatch(16)
    loss, figures = distillation(student, minibatch)
    features, labels = minibatch["features"], minibatch["labels"]
    soft_teacher = F.softmax(teacher(features) / 3.0, dim=-1)
    kl = (soft_teacher * (soft_teacher.log() - F.log_softmax(student(features) / 3.0, dim=-1))).sum(-1).mean() * 9.0
    cross_entropy = F.cross_entropy(student(features), labels)
    torch.testing.assert_close(figures["kl"], kl.detach())
    torch.testing.assert_close(loss, 0.25 * kl + 0.75 * cross_entropy)
    loss.backward()
    assert all(p.grad is None for p in distillation.teacher.parameters())


def test_a_distilled_run_keeps_the_teacher_out_of_the_weights(tmp_path):
    save_weights(make_model(7), tmp_path / "teacher.safetensors")
    model = make_model()
    session(tmp_path / "run", model, objective=Distillation(make_model(1), tmp_path / "teacher.safetensors"),
            checkpoint_config=dtrain.CheckpointConfig()).train()
    from safetensors.torch import load_file
    assert set(load_file(tmp_path / "run" / "model.safetensors")) == set(model.state_dict())
    assert {"kl", "cross_entropy"} <= set(records(tmp_path / "run")[0])


def test_distillation_refuses_missing_or_foreign_teacher_weights(tmp_path):
    with pytest.raises(ValueError, match="weights='.*nope.safetensors': no such file; expected the model.safetensors"):
        Distillation(make_model(), weights=tmp_path / "nope.safetensors")
    save_weights(nn.Linear(6, 4), tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="other.safetensors does not fit the teacher"):
        Distillation(make_model(), weights=tmp_path / "other.safetensors")


def test_the_collapse_watch_judges_an_objective_against_its_start_never_against_chance(tmp_path):
    # the objective's loss is a classifier's cross-entropy, but the watch cannot know its classes: no ln C level
    trained = session(tmp_path, objective=lambda model, minibatch: F.cross_entropy(model(minibatch["features"]),
                                                                                     minibatch["labels"]))
    trained.train()
    assert trained._collapse.chance_loss is None and trained._collapse.from_start


def test_batchnorm_statistics_are_recomputed_through_the_objective(tmp_path):
    def batchnorm_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    with_loss, with_objective = batchnorm_model(0), batchnorm_model(0)
    options = {"batchnorm_statistics": "recomputed", "batchnorm_recompute_samples": 120}
    session(tmp_path / "loss", with_loss, loss=F.cross_entropy, **options).train()
    session(tmp_path / "objective", with_objective, objective=two_losses, **options).train()
    batchnorm = with_objective[1]
    assert int(batchnorm.num_batches_tracked) == int(with_loss[1].num_batches_tracked) == 8  # 120 samples, 16 a time
    # the exact mean of the layer's inputs over the 120 training samples (one sweep), with the final weights
    features = dtrain.MinibatchSource(four_class_data(), max_sweeps=1).next_minibatch(120)["features"]
    with torch.no_grad():
        torch.testing.assert_close(batchnorm.running_mean, with_objective[0](features).mean(0), rtol=1e-4, atol=1e-5)


def test_a_resume_with_another_objective_lists_it_among_the_changed_settings(tmp_path):
    from dtrain import CheckpointConfig, LocalLearner, MinibatchSource, training_session
    from tests.helpers.toy_data import four_class_data

    def first(model, minibatch):
        return torch.nn.functional.cross_entropy(model(minibatch["features"]), minibatch["labels"])

    def second(model, minibatch):
        return torch.nn.functional.cross_entropy(model(minibatch["features"]), minibatch["labels"]) * 1.0

    def session(objective, max_samples):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 4)
        return training_session(model, learner=LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                                minibatch_source=MinibatchSource(four_class_data(64, 0)), minibatch_size=16,
                                max_samples=max_samples, objective=objective, run_dir=tmp_path, tensorboard=False,
                                checkpoint_config=CheckpointConfig("ckpt.pt"))

    session(first, 32).train()
    resumed = session(second, 64)
    resumed.restore()
    assert any(change.startswith("objective: ") and "first" in change and "second" in change
               for change in resumed.changed_settings), resumed.changed_settings


def test_with_compile_a_bad_first_result_on_one_rank_is_refused_on_every_rank(tmp_path, monkeypatch):
    """The compile check is where an objective is first called: a first result refused on rank 1 only is the
    refusal of both ranks, with rank 1's line, instead of rank 0 waiting in the check's collective."""
    from dtrain.learners import DataParallelLearner
    from tests.helpers.thread_world import FakeWorld

    class Traced(nn.Module):  # stands in for torch.compile's wrapper: another module over the same parameters
        def __init__(self, model):
            super().__init__()
            self.inner = [model]

        def forward(self, *inputs):
            return self.inner[0](*inputs)

    monkeypatch.setattr(torch, "compile", lambda model, **options: Traced(model))

    def worker(comm):
        def objective(model, minibatch):  # a vector on rank 1 only
            losses = F.cross_entropy(model(minibatch["features"]), minibatch["labels"], reduction="none")
            return losses if comm.rank == 1 else losses.mean()
        model = make_model()
        try:
            dtrain.training_session(
                model=model, learner=DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm),
                minibatch_source=dtrain.MinibatchSource(four_class_data(), randomize=False), minibatch_size=16,
                max_samples=64, objective=objective, compile=True, run_dir=tmp_path / f"rank{comm.rank}",
                tensorboard=False, stream=io.StringIO()).train()
        except ValueError as error:
            return str(error)
        return None

    first, second = FakeWorld(2).run(worker)
    assert first is not None and first == second
    assert "returned a torch.float32 tensor of shape (" in first and "at the first minibatch" in first, first

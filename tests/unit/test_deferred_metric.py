"""An additive metric runs once over many passes (``PeriodSums.add_outputs``) and gives the same
period sums as running it after every pass."""
from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn

from dtrain import LocalLearner, MinibatchSource, training_session
from dtrain.session import ClassificationError, MeanAbsoluteError, classification_errors
from dtrain.session.minibatch_step import PeriodSums

from tests.helpers.toy_data import four_class_data

CPU = torch.device("cpu")


def _passes(count: int, classes: int = 10, seed: int = 0):
    """``count`` passes of (mean loss, logits, labels, samples), of uneven sizes."""
    generator = torch.Generator().manual_seed(seed)
    for index in range(count):
        samples = 7 if index % 5 == 4 else 32
        logits = torch.randn(samples, classes, generator=generator)
        labels = torch.randint(0, classes, (samples,), generator=generator)
        yield torch.rand((), generator=generator), logits, labels, samples


def _per_pass(metric, passes) -> torch.Tensor:
    sums = PeriodSums(CPU, metric)
    for loss, output, labels, samples in passes:
        sums.add(loss, metric(output, labels), samples)
    return sums.as_tensor()


def _deferred(metric, passes, **options) -> torch.Tensor:
    sums = PeriodSums(CPU, metric, **options)
    for loss, output, labels, samples in passes:
        sums.add_outputs(loss, output, labels, samples)
    return sums.as_tensor()


def test_the_deferred_error_count_equals_the_per_pass_one_exactly():
    passes = list(_passes(150))  # two folds of 64 passes and a partial one
    assert torch.equal(_deferred(classification_errors, passes), _per_pass(classification_errors, passes))


def test_a_float_metric_deferred_agrees_to_rounding():
    passes = [(loss, output[:, :1], output[:, 1], samples) for loss, output, _, samples in _passes(100)]
    deferred, per_pass = _deferred(MeanAbsoluteError(), passes), _per_pass(MeanAbsoluteError(), passes)
    assert deferred[0] == per_pass[0] and deferred[2] == per_pass[2]  # the loss and the samples: the same path
    assert float(deferred[1]) == pytest.approx(float(per_pass[1]), rel=1e-6)


def test_kept_outputs_and_labels_are_copies_a_source_may_overwrite():
    passes = list(_passes(20))
    expected = _per_pass(classification_errors, passes)
    sums = PeriodSums(CPU, classification_errors)
    for loss, output, labels, samples in passes:
        sums.add_outputs(loss, output, labels, samples)
        output.zero_()  # a model or source that reuses its buffers for the next pass
        labels.fill_(3)
    assert torch.equal(sums.as_tensor(), expected)


def test_passes_of_another_shape_are_measured_apart():
    """Outputs ``[n, T, C]`` whose ``T`` changes between passes cannot be concatenated: the kept ones
    are measured before a pass of another shape is kept."""
    def token_errors(output, labels):
        return (output.argmax(dim=-1) != labels).sum()

    generator = torch.Generator().manual_seed(1)
    passes = []
    for index in range(30):
        length = 5 if index % 3 else 9
        passes.append((torch.rand(()), torch.randn(4, length, 6, generator=generator),
                       torch.randint(0, 6, (4, length), generator=generator), 4))
    assert torch.equal(_deferred(token_errors, passes), _per_pass(token_errors, passes))


def test_a_pass_too_large_to_keep_is_measured_at_once():
    calls = []

    def counted(output, labels):
        calls.append(len(labels))
        return classification_errors(output, labels)

    passes = list(_passes(10))
    result = _deferred(counted, passes, deferred_output_bytes=1024)  # one 32 x 10 float32 pass is 1,280 bytes
    assert torch.equal(result, _per_pass(classification_errors, passes))
    assert calls[:2] == [32, 32]  # pass by pass, none kept
    calls.clear()
    _deferred(counted, passes)  # the default keeps them all: one call at the end
    assert calls == [sum(samples for *_, samples in passes)]


def _session(run_dir, metric, max_samples=2000, progress_frequency=300):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    return training_session(model, nn.functional.cross_entropy, LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                            MinibatchSource(four_class_data(), randomization_seed=3), minibatch_size=20,
                            max_samples=max_samples, progress_frequency=progress_frequency, metric=metric,
                            run_dir=run_dir, tensorboard=False, stream=io.StringIO())


def test_a_run_reports_the_same_errors_with_the_metric_deferred_or_not(tmp_path):
    """``ClassificationError`` (additive: once per 64 minibatches) against the same count in a function
    without the mark (after every minibatch); periods of 15 minibatches do not line up with 64."""
    def unmarked(output, labels):
        return classification_errors(output, labels)

    unmarked.name, unmarked.percent = "error", True
    records = {}
    for name, metric in (("deferred", ClassificationError()), ("every pass", unmarked)):
        _session(tmp_path / name, metric).train()
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        records[name] = [(r["samples"], r["loss"], r["error"]) for r in map(json.loads, lines) if r.get("kind") != "run"]
    assert len(records["deferred"]) >= 6 and records["deferred"] == records["every pass"]


def test_a_metric_that_cannot_run_fails_on_the_first_minibatch(tmp_path):
    class Broken:
        additive = True

        def __call__(self, output, labels):
            raise ValueError("metric broken: needs 20 classes, the model outputs 4")

    session = _session(tmp_path, Broken())
    with pytest.raises(ValueError, match="metric broken"):
        session.train()
    assert session.learner.samples_seen == 0  # not 64 minibatches later


class _ReusedBuffers:
    """A two-stream deserializer that fills the same two tensors on every read, as one serving from a ring of
    pinned buffers may: what a run keeps of a minibatch past the next read must be its own copy."""

    def __init__(self, data):
        self.data, self.num_samples, self.feature_shape, self.num_classes = data, data.num_samples, (6,), 4
        self._features, self._labels = torch.empty(0, 6), torch.empty(0, dtype=torch.int64)

    def get(self, indices):
        features, labels = self.data.get(indices)
        self._features.resize_(features.shape).copy_(features)
        self._labels.resize_(labels.shape).copy_(labels)
        return self._features, self._labels


def test_a_source_that_reuses_its_buffers_gets_the_same_deferred_errors(tmp_path):
    """The deferred error keeps indexed labels and an eager model's output uncopied (``Minibatch.owns_tensors``);
    a deserializer's own tensors are copied, so its next read cannot change the count."""
    def unmarked(output, labels):
        return classification_errors(output, labels)

    unmarked.name, unmarked.percent = "error", True
    records = {}
    for name, metric, data in (("reused", ClassificationError(), _ReusedBuffers(four_class_data())),
                               ("every pass", unmarked, four_class_data())):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
        training_session(model, nn.functional.cross_entropy, LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                         MinibatchSource(data, randomization_seed=3), minibatch_size=20, max_samples=2000,
                         progress_frequency=300, metric=metric, run_dir=tmp_path / name, tensorboard=False,
                         stream=io.StringIO()).train()
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        records[name] = [(r["samples"], r["loss"], r["error"]) for r in map(json.loads, lines) if r.get("kind") != "run"]
    assert len(records["reused"]) >= 6 and records["reused"] == records["every pass"]


def test_only_minibatches_indexed_out_of_memory_own_their_tensors():
    indexed = MinibatchSource(four_class_data(), randomization_seed=3).next_minibatch(20)
    assert indexed.owns_tensors and indexed.select(0, 5, 5).owns_tensors
    assert not MinibatchSource(_ReusedBuffers(four_class_data())).next_minibatch(20).owns_tensors
    transformed = MinibatchSource(four_class_data(), randomization_seed=3, transform=lambda features, positions, seed: features * 2)
    assert not transformed.next_minibatch(20).owns_tensors  # a transform may hand out a buffer of its own

"""The finite-values check of streams on an accelerator (``dtrain.data.device_checks``): queued without waiting
for the device, looked at once its copies are done, waited for before a checkpoint, a progress point or the end,
and the bad sample named, never reported as a divergence. On the CPU here, with streams taken for an
accelerator's and events whose passing the test decides; ``tests/gpu`` runs it on CUDA."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from dtrain import LocalLearner, MinibatchSource, training_session
from dtrain.data import ArrayDeserializer, DataError, device_checks
from dtrain.data import _checks
from dtrain.data.device_checks import DeferredFiniteChecks


class Event:
    """An event that has passed once the test says so; counts the waits."""

    def __init__(self, passed: bool = False):
        self.passed, self.waits = passed, 0

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.waits += 1
        self.passed = True


def queued_checks():
    events: list[Event] = []

    def make_event(device):
        events.append(Event())
        return events[-1]

    return DeferredFiniteChecks(make_event), events


def test_a_bad_row_is_named_only_once_its_copy_is_done_or_waited_for():
    checks, events = queued_checks()
    good, bad = torch.ones(4, 3), torch.ones(4, 3)
    bad[2, 1] = float("nan")
    checks.add([("features", good)], lambda row: f"sample {row} of minibatch 0")
    checks.add([("features", bad)], lambda row: f"sample {row} of minibatch 1")
    checks.poll()  # nothing has passed: nothing is read, nothing waits
    assert len(checks) == 2 and all(event.waits == 0 for event in events)
    events[0].passed = True
    checks.poll()  # the first is read and dropped; the second is not ready
    assert len(checks) == 1
    with pytest.raises(DataError, match=r"^stream 'features': sample 2 of minibatch 1 holds NaN; expected finite"):
        checks.flush()
    assert events[1].waits == 1 and len(checks) == 0


def test_an_infinity_is_named_as_one_and_the_first_bad_stream_and_row_win():
    checks, events = queued_checks()
    x, y = torch.ones(5, 2), torch.ones(5)
    x[4, 0] = float("inf")
    y[3] = float("-inf")
    checks.add([("x", x), ("y", y)], lambda row: f"row {row}")
    events[0].passed = True
    with pytest.raises(DataError, match=r"^stream 'x': row 4 holds an infinite value"):
        checks.poll()


@pytest.fixture
def streams_taken_for_an_accelerators(monkeypatch):
    """Every stream counts as on an accelerator: the CPU check skips it, the source queues it; its events pass
    when waited for."""
    monkeypatch.setattr(_checks, "on_accelerator", lambda data: True)
    events: list[Event] = []

    def make_event(device):
        events.append(Event())
        return events[-1]

    monkeypatch.setattr(device_checks, "device_event", make_event)
    return events


def nan_at(position: int, samples: int = 64) -> ArrayDeserializer:
    features = np.random.default_rng(0).normal(size=(samples, 4)).astype(np.float32)
    features[position, 2] = np.nan
    return ArrayDeserializer(features, np.arange(samples) % 2, num_classes=2)


def test_the_source_queues_each_minibatch_handed_out_and_names_the_sample_at_the_next_point(
        streams_taken_for_an_accelerators):
    events = streams_taken_for_an_accelerators
    source = MinibatchSource(nan_at(37), randomize=False)
    for _ in range(4):  # samples 0-31: all finite
        source.next_minibatch(8)
    assert len(events) == 4
    source.next_minibatch(8)
    source.next_minibatch(8)  # samples 32-47, 37 among them: nothing waits, so nothing is known yet
    with pytest.raises(DataError, match=r"^stream 'features': sample 37 of ArrayDeserializer \(timeline position "
                                        r"37\) holds NaN"):
        source.check_pending_values()
    assert all(event.waits <= 1 for event in events)


def test_a_position_is_kept_only_past_checked_values(streams_taken_for_an_accelerators):
    source = MinibatchSource(nan_at(5), randomize=False)
    source.next_minibatch(8)
    with pytest.raises(DataError, match=r"sample 5 of ArrayDeserializer"):
        source.get_checkpoint_state()


def test_the_end_of_the_data_waits_for_the_last_checks(streams_taken_for_an_accelerators):
    source = MinibatchSource(nan_at(63), randomize=False, max_sweeps=1)
    for _ in range(8):
        source.next_minibatch(8)
    with pytest.raises(DataError, match=r"sample 63 of ArrayDeserializer"):
        source.next_minibatch(8)


def test_a_session_names_the_sample_instead_of_reporting_a_divergence(streams_taken_for_an_accelerators, tmp_path):
    """The NaN reaches the model (the check has not read back when it trains on it), but the run ends naming the
    sample at its next progress point, before the loss is judged or a checkpoint kept."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1))
    session = training_session(model, torch.nn.functional.cross_entropy, learner,
                               MinibatchSource(nan_at(40), randomize=False), 8, max_samples=64,
                               progress_frequency=32, run_dir=tmp_path, tensorboard=False, stream=io.StringIO())
    with pytest.raises(DataError, match=r"^stream 'features': sample 40 of ArrayDeserializer"):
        session.train()
    assert not list(tmp_path.glob("ckpt-*"))


def test_data_checked_on_the_cpu_queues_nothing():
    source = MinibatchSource(nan_at(3), randomize=False)
    with pytest.raises(DataError, match=r"sample 3 of ArrayDeserializer"):
        source.next_minibatch(8)  # found as it is read, as before
    assert len(source._device_checks) == 0

"""Details of CNTK's API that ported code relies on: a settable ``MinibatchSource.current_position``,
``FULL_DATA_SWEEP`` and ``INFINITELY_REPEAT``, schedules that change once per sweep without an
``epoch_size``, a cross-validation callback told 0 (not NaN) when there is no source, and the distributed
learners' factories called with CNTK's keywords as CNTK's own ``distributed_test.py`` calls them."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from torch import nn

import dtrain.data
from dtrain import CrossValidationConfig, LocalLearner, MinibatchSource, Schedule, training_session
from dtrain.learners import (BlockMomentumLearner, DataParallelLearner, block_momentum_distributed_learner,
                             data_parallel_distributed_learner)
from dtrain.data import FULL_DATA_SWEEP, INFINITELY_REPEAT, StreamArrays

from tests.helpers.toy_data import four_class_data


def plain_source(**options) -> MinibatchSource:
    return MinibatchSource(four_class_data(50), randomization_seed=3, **options)


def sequence_source(**options) -> MinibatchSource:
    lengths = np.random.default_rng(5).integers(1, 9, size=31)
    return MinibatchSource(StreamArrays({"text": [100 * i + np.arange(n) for i, n in enumerate(lengths)],
                                         "label": np.arange(len(lengths))}), randomization_seed=3, **options)


def read(source: MinibatchSource, count: int, size: int = 7, partitions: int = 1, index: int = 0) -> list:
    """The next ``count`` minibatches' contents (features, or each sequence's id), as plain lists."""
    contents = []
    for _ in range(count):
        minibatch = source.next_minibatch(size, partitions, index)
        contents.append(None if minibatch is None else (
            minibatch["label"].tolist() if "text" in minibatch.streams else minibatch.features.tolist()))
    return contents


# -- MinibatchSource.current_position ---------------------------------------------------------------
@pytest.mark.parametrize("make", [plain_source, sequence_source], ids=["plain", "sequences"])
@pytest.mark.parametrize("read_ahead", [False, True])
def test_setting_the_position_the_getter_gave_reads_the_same_minibatches_again(make, read_ahead):
    """CNTK's callbacks save ``current_position`` and set it back around an evaluation of their own."""
    source = make(read_ahead=read_ahead)
    read(source, 3)
    saved = source.current_position
    first = read(source, 9, partitions=2, index=1)  # across a sweep's end
    source.current_position = saved
    assert read(source, 9, partitions=2, index=1) == first
    source.current_position = source.get_checkpoint_state() | {"position": saved}  # CNTK's position is this dict
    assert read(source, 9, partitions=2, index=1) == first
    source.close()


def test_a_position_that_is_not_a_whole_number_is_refused():
    source = plain_source()
    with pytest.raises(ValueError, match="current_position must be >= 0, got -1"):
        source.current_position = -1
    with pytest.raises(TypeError, match="current_position must be an int"):
        source.current_position = 2.5


# -- FULL_DATA_SWEEP and INFINITELY_REPEAT --------------------------------------------------------------
def test_cntk_reading_constants_have_cntks_values_and_meaning():
    assert (FULL_DATA_SWEEP, INFINITELY_REPEAT) == (2**64 - 3, 2**64 - 1)  # SIZE_MAX - 2, SIZE_MAX
    one_sweep = plain_source(max_samples=FULL_DATA_SWEEP)
    assert sum(len(batch) for batch in read(one_sweep, 10) if batch) == 50 and read(one_sweep, 1) == [None]
    sequences = sequence_source(max_samples=FULL_DATA_SWEEP)
    assert sorted(i for batch in read(sequences, 40) if batch for i in batch) == list(range(31))
    # CNTK's defaults of both limits: no limit, so the other may be given
    endless = plain_source(max_samples=INFINITELY_REPEAT, max_sweeps=INFINITELY_REPEAT)
    assert all(batch is not None for batch in read(endless, 30))
    limited = plain_source(max_samples=20, max_sweeps=INFINITELY_REPEAT)
    assert sum(len(batch) for batch in read(limited, 10) if batch) == 20


def test_full_data_sweep_is_refused_where_it_means_nothing():
    with pytest.raises(ValueError, match="max_sweeps=FULL_DATA_SWEEP: expected a number of sweeps"):
        plain_source(max_sweeps=FULL_DATA_SWEEP)
    with pytest.raises(ValueError, match=r"max_samples \(FULL_DATA_SWEEP\) and max_sweeps \(2\) are mutually"):
        plain_source(max_samples=FULL_DATA_SWEEP, max_sweeps=2)


# -- schedules without epoch_size: one value per sweep ---------------------------------------------------
def test_a_schedule_without_epoch_size_changes_once_per_sweep():
    for schedule in (Schedule([1.0, 0.5, 0.25]), Schedule([[2, 1.0], [1, 0.1]], epoch_size=FULL_DATA_SWEEP)):
        with pytest.raises(RuntimeError, match="changes once per sweep"):
            schedule(0)
        schedule.set_sweep_size(50)
    per_sweep = Schedule([1.0, 0.5, 0.25])
    per_sweep.set_sweep_size(50)
    assert [per_sweep(s) for s in (0, 49, 50, 99, 100, 10**6)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    assert Schedule(0.3)(10**6) == 0.3  # a constant needs no unit


def test_a_session_changes_sweep_schedules_at_its_training_sources_sweeps(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []  # (lr, minibatch) of every step
    learner.add_before_optimizer_step(lambda learner: seen.append((learner.optimizer.param_groups[0]["lr"],
                                                                   learner.global_samples)))
    session = training_session(model, nn.functional.cross_entropy, learner, plain_source(),
                               minibatch_size=Schedule([10, 25]), max_samples=150,
                               lr_schedule=Schedule([1.0, 0.5, 0.25]), progress_frequency=0,
                               run_dir=tmp_path, tensorboard=False, stream=io.StringIO())
    session.train()
    expected = [(0.1, 10)] * 5 + [(0.05, 25)] * 2 + [(0.025, 25)] * 2  # sweeps of 50 samples: 0, 1, 2
    assert [size for _, size in seen] == [size for _, size in expected], seen
    assert [lr for lr, _ in seen] == pytest.approx([lr for lr, _ in expected]), seen


def test_a_sweep_schedule_on_a_source_without_sweeps_is_refused_in_one_line(tmp_path):
    class EndlessSource:  # a source of one's own that does not say how many samples a sweep has
        def __init__(self):
            self.inner = plain_source()

        def __getattr__(self, name):
            if name == "samples_per_sweep":
                raise AttributeError(name)
            return getattr(self.inner, name)

    model = nn.Linear(6, 4)
    with pytest.raises(ValueError, match="a schedule without epoch_size changes once per sweep, but the training "
                                         "source \\(EndlessSource\\) does not say") as error:
        training_session(model, nn.functional.cross_entropy, LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                         EndlessSource(), minibatch_size=10, lr_schedule=Schedule([1.0, 0.5]), max_samples=20,
                         run_dir=tmp_path, tensorboard=False)
    assert "\n" not in str(error.value)


class _Reading:
    """A source of one's own with only ``next_minibatch``, reading the four-class data in order."""

    def __init__(self):
        self.inner = plain_source(randomize=False)

    def next_minibatch(self, minibatch_size_in_samples, num_data_partitions=1, partition_index=0):
        return self.inner.next_minibatch(minibatch_size_in_samples, num_data_partitions, partition_index)


class _DeclaredReading(_Reading, dtrain.data.UserMinibatchSource):
    """The same, subclassing CNTK's base for a source of one's own: what it does not override reads as not known."""


def _train_on(source, tmp_path, **options) -> str:
    model = nn.Linear(6, 4)
    stream = io.StringIO()
    training_session(model, nn.functional.cross_entropy, LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                     source, minibatch_size=10, max_samples=40, progress_frequency=20, run_dir=tmp_path,
                     tensorboard=False, stream=stream, **options).train()
    return stream.getvalue()


@pytest.mark.parametrize("make", [_Reading, _DeclaredReading], ids=["plain-object", "UserMinibatchSource"])
def test_a_source_of_ones_own_with_next_minibatch_alone_trains_and_is_told_only_what_it_said(make, tmp_path):
    printed = _train_on(make(), tmp_path / "run")
    assert "40 samples" in printed and "sweeps of" not in printed  # its sweeps are not known: not made up
    from dtrain.session.checkpoint_state import source_identity
    from dtrain.data import as_source

    assert source_identity(as_source(make())) == {"source": f"{__name__}.{make.__qualname__}"}  # as checkpoints had it
    with pytest.raises(ValueError, match=f"the training source \\({make.__name__}\\) does not say how many samples"):
        _train_on(make(), tmp_path / "sweeps", lr_schedule=Schedule([1.0, 0.5]))


def test_a_user_source_declares_what_it_knows_and_the_session_reads_it():
    class Sized(_DeclaredReading):
        samples_per_sweep = 50

        @property
        def streams(self):
            return self.inner.streams

    source = dtrain.data.as_source(Sized())
    assert source is not None and source.samples_per_sweep == 50 and set(source.streams) == {"features", "labels"}
    assert (source.has_sequences, source.deserializer, source.sequence_lengths("features")) == (False, None, None)
    wrapped = dtrain.data.as_source(_Reading())  # a plain object: wrapped once, the base's defaults where it's silent
    assert (wrapped.samples_per_sweep, dict(wrapped.streams), wrapped.has_sequences) == (None, {}, False)
    with pytest.raises(NotImplementedError, match="_DeclaredReading does not say where it is"):
        _DeclaredReading().get_checkpoint_state()


def test_an_object_without_next_minibatch_is_refused_as_a_source_in_one_line(tmp_path):
    with pytest.raises(TypeError, match=r"^a minibatch source must have next_minibatch\(.*got list$"):
        _train_on([1, 2, 3], tmp_path)


# -- the cross-validation callback without a source ------------------------------------------------------
def test_the_cross_validation_callback_without_a_source_gets_zeros_as_cntks(tmp_path):
    calls = []
    model = nn.Linear(6, 4)
    training_session(model, nn.functional.cross_entropy, LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                     plain_source(), minibatch_size=10, max_samples=40, progress_frequency=0,
                     cv_config=CrossValidationConfig(frequency=20, callback=lambda *args: calls.append(args)),
                     run_dir=tmp_path, tensorboard=False, stream=io.StringIO()).train()
    assert calls == [(0, 0.0, 0, 0), (1, 0.0, 0, 0)]
    assert not any(math.isnan(average_error) for _, average_error, _, _ in calls)


def test_the_constants_are_where_cntk_users_look():
    """``cntk.io.FULL_DATA_SWEEP`` and ``cntk.io.INFINITELY_REPEAT``: ``dtrain.data``, beside ``MinibatchSource``."""
    assert {"FULL_DATA_SWEEP", "INFINITELY_REPEAT", "MinibatchSource"} <= set(dtrain.data.__all__)


# -- the distributed learners' factories, with CNTK's keywords --------------------------------------------
#: CNTK's distributed_test.py, its four factory calls as written there (the local learner passed as ``learner=``)
CNTK_FACTORY_CALLS = {
    "data_parallel": (DataParallelLearner, lambda learner: data_parallel_distributed_learner(
        learner=learner, distributed_after=0, use_async_buffered_parameter_update=False, num_quantization_bits=32)),
    "quantized": (DataParallelLearner, lambda learner: data_parallel_distributed_learner(
        learner=learner, distributed_after=100, use_async_buffered_parameter_update=False, num_quantization_bits=1)),
    "block_momentum": (BlockMomentumLearner, lambda learner: block_momentum_distributed_learner(
        learner=learner, block_size=1024, distributed_after=100)),
    "block_momentum_with_time_constant": (BlockMomentumLearner, lambda learner: block_momentum_distributed_learner(
        learner=learner, block_size=1024, block_momentum_as_time_constant=4096, distributed_after=100)),
}


@pytest.mark.parametrize("name", CNTK_FACTORY_CALLS)
def test_cntks_own_factory_calls_build_a_learner_that_trains(tmp_path, name):
    kind, create = CNTK_FACTORY_CALLS[name]
    model = nn.Linear(6, 4)
    learner = create(torch.optim.SGD(model.parameters(), lr=0.1))
    assert type(learner) is kind and learner.distributed_after == (0 if name == "data_parallel" else 100)
    if name == "quantized":  # CNTK's num_quantization_bits is the data-parallel learner's k-bit exchange
        assert learner.exchange.name == "quantized" and learner.exchange.num_bits == 1
    result = training_session(model, nn.functional.cross_entropy, learner, plain_source(), minibatch_size=10,
                              max_samples=40, progress_frequency=0, run_dir=tmp_path, tensorboard=False,
                              stream=io.StringIO()).train()
    assert result.samples_seen == learner.samples_seen == 40 and not result.stopped_early


@pytest.mark.parametrize("value, message", [
    (True, "use_async_buffered_parameter_update=True: expected False (CNTK's default): dtrain's data-parallel "
           "updates are synchronous"),
    ("false", "use_async_buffered_parameter_update='false': expected true or false"),
])
def test_the_asynchronous_buffered_update_is_refused_in_one_line(value, message):
    with pytest.raises(ValueError) as error:
        data_parallel_distributed_learner(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                                          use_async_buffered_parameter_update=value)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("factory", [data_parallel_distributed_learner, block_momentum_distributed_learner])
def test_the_optimizer_is_given_once_under_either_name(factory):
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="got both optimizer and learner"):
        factory(optimizer, learner=optimizer)
    with pytest.raises(TypeError, match="missing the optimizer to wrap"):
        factory()


class _ReadingDigits(_DeclaredReading):
    """A source of one's own that says what it reads: its checkpoints are those of that data."""

    deserializer = None  # set per test


@pytest.mark.parametrize("declared", [True, False], ids=["UserMinibatchSource", "plain-object"])
def test_a_checkpoint_names_the_data_a_source_reads_as_checkpoints_always_did(declared):
    """The identity a checkpoint must match is derived from the deserializer (type and sizes, not where it lies),
    whether the source is dtrain's, a UserMinibatchSource of one's own or a plain object that has a deserializer;
    these exact dictionaries are in every checkpoint written so far, so they must not change."""
    from dtrain.data import Digits, MinibatchSource, as_source
    from dtrain.session.checkpoint_state import source_identity

    digits = {"deserializer": "dtrain.data.digits.Digits", "feature_shape": [1, 8, 8], "num_classes": 10}
    assert source_identity(as_source(MinibatchSource(Digits("train")))) == {**digits, "num_samples": 1500}
    own = _ReadingDigits() if declared else type("Plain", (), {"next_minibatch": lambda self, *a: None})()
    own.deserializer = Digits("test")
    assert source_identity(as_source(own)) == {**digits, "num_samples": 297}
    tensors = torch.utils.data.TensorDataset(torch.zeros(20, 3), torch.arange(20) % 2)
    assert source_identity(as_source(MinibatchSource(dtrain.data.DatasetDeserializer(tensors)))) == {
        "dataset": "torch.utils.data.dataset.TensorDataset", "deserializer": "dtrain.data.dataset.DatasetDeserializer",
        "num_sequences": 20, "streams": ["features: [3] float32 values", "labels: int64 values"]}

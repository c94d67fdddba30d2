"""Sharded data: Parquet, Arrow IPC (the ``datasets`` cache) and WebDataset tar shards read through a
MinibatchSource, every sample exactly once per sweep at any partition count, resumed at another one."""
from __future__ import annotations

import io
import tarfile
import time

import numpy as np
import pytest
import torch

import dtrain
from dtrain.data import DataError, MinibatchSource, ParquetShards, TarShards
from dtrain.data.chunk_order import ChunkedOrder

from tests.helpers.sequence_data import TinyCausalLM
from tests.helpers.shard_data import (add_member, features_of, npy_bytes, shard_sizes, tar_fields, tokens_of,
                                      write_parquet_shards, write_tar_shards)

pytest.importorskip("pyarrow")
pytest.importorskip("webdataset")

KINDS = ["parquet", "arrow", "parquet_lengths", "tar"]


def make_shards(kind: str, directory, sizes=None, sequences: bool = True):
    """A deserializer over freshly written shards of ``kind`` (the same samples in every format); without
    ``sequences``, only the streams with one value per sample."""
    sizes = sizes or shard_sizes()
    if kind == "tar":
        write_tar_shards(directory, sizes)
        fields = tar_fields() if sequences else {"id": "cls", "features": "features.npy"}
        return TarShards(directory, fields=fields, sequences=["tokens"] if sequences else [])
    write_parquet_shards(directory, sizes, arrow=kind == "arrow", lengths_column=kind == "parquet_lengths")
    return ParquetShards(directory, columns=None if sequences else ["id", "features"])


@pytest.mark.parametrize("kind", KINDS)
def test_every_sample_reads_as_written_in_any_order(kind, tmp_path):
    data = make_shards(kind, tmp_path)
    total = sum(shard_sizes())
    assert data.num_sequences == total and data.chunk_sizes().sum() == total
    assert {name: (info.shape, info.dtype, info.is_sequence) for name, info in data.streams.items()} == {
        "id": ((), torch.int64, False), "features": ((2, 3), torch.float32, False), "tokens": ((), torch.int64, True)}
    assert np.array_equal(data.sequence_lengths("tokens"), [len(tokens_of(i)) for i in range(total)])
    indices = np.random.default_rng(0).permutation(total)[:90]
    streams = data.read(indices)
    tokens = streams["tokens"]
    tokens = tokens if isinstance(tokens, list) else tokens.unpadded()
    assert streams["id"].tolist() == indices.tolist()
    assert torch.equal(streams["features"], torch.from_numpy(np.stack([features_of(i) for i in indices])))
    assert all(np.array_equal(np.asarray(t), tokens_of(i)) for t, i in zip(tokens, indices))


def read_ledger(source: MinibatchSource, sizes: list[int], partitions: int, stop_after: int | None = None):
    """``(position, id)`` of every sample the ``partitions`` read, minibatch by minibatch (the size schedule
    ``sizes`` repeated), for ``stop_after`` minibatches or until the source ends."""
    ledger, count = [], 0
    while stop_after is None or count < stop_after:
        size = sizes[count % len(sizes)]
        shares = [source.next_minibatch(size, partitions, k) if k == partitions - 1 else
                  _peek(source, size, partitions, k) for k in range(partitions)]
        if shares[-1] is None:
            break
        for share in shares:
            ledger.extend(zip(share.positions.tolist(), share["id"].tolist()))
        count += 1
    return ledger


def _peek(source: MinibatchSource, size: int, partitions: int, index: int):
    """Partition ``index``'s share of the next minibatch, without advancing (the last partition's call does)."""
    position = source.current_position
    share = source.next_minibatch(size, partitions, index)
    source.current_position = position
    return share


@pytest.mark.parametrize("kind", ["parquet", "tar"])
@pytest.mark.parametrize("sequences", [False, True], ids=["samples", "sequences"])
def test_every_sample_once_per_sweep_at_1_2_and_4_partitions_resumed_at_half_the_same_and_twice(kind, sequences,
                                                                                                tmp_path):
    """A ledger of (position, id): reading 2.5 sweeps (sweeps end inside shards and inside windows) in
    partitions of N, checkpointed after a few minibatches and resumed at N/2, N and 2N partitions, reads
    the global minibatches of one uninterrupted partition, and so every sample exactly once per sweep."""
    data = make_shards(kind, tmp_path, sequences=sequences)
    total = data.num_sequences
    sizes = [23, 64, 7] if not sequences else [60, 150, 31]

    def source(**state):
        kwargs = dict(defining_stream="tokens") if sequences else {}
        built = MinibatchSource(data, randomization_seed=5, randomization_window_in_chunks=3,
                                max_samples=int(2.5 * (sum(data.sequence_lengths("tokens")) if sequences else total)),
                                **kwargs)
        if state:
            built.restore_from_checkpoint(state)
        return built

    reference = read_ledger(source(), sizes, 1)
    sweeps = {}
    for position, sample in reference:
        sweeps.setdefault(position // total, []).append(sample)
    assert [sorted(sweeps[s]) for s in (0, 1)] == [list(range(total))] * 2  # whole sweeps: each sample once
    assert len(set(sweeps[2])) == len(sweeps[2]) > 0  # the partial third: no sample twice
    assert sweeps[0] != sorted(sweeps[0]) and sweeps[0] != sweeps[1]  # shuffled, another order each sweep
    for first, then in ((1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (4, 8)):
        head = source()
        ledger = read_ledger(head, sizes, first, stop_after=5)
        resumed = source(**head.get_checkpoint_state())
        ledger += read_ledger(resumed, sizes[5 % len(sizes):] + sizes[:5 % len(sizes)], then)
        assert sorted(ledger) == sorted(reference), (first, then)


def test_a_minibatch_reads_from_one_window_and_the_reader_keeps_about_a_window(tmp_path):
    data = make_shards("parquet", tmp_path, sizes=[40] * 20, sequences=False)  # 60 row groups of <= 16 rows
    source = MinibatchSource(data, randomization_window_in_chunks=4, max_sweeps=1)
    order = source._chunked
    per_window = []
    while (minibatch := source.next_minibatch(32)) is not None:
        chunks = set(order.chunk_of(minibatch["id"].numpy()).tolist())
        per_window.append(len(chunks))
        assert len(data._cache) <= data._cache.capacity == 4 + 16
    assert max(per_window) <= 2 * 5  # a window of 4 chunks (it closes at the chunk that fills it), two at a boundary
    assert source.randomization_window == -(-800 * 4 // 60)


def test_the_chunked_order_is_a_permutation_per_sweep_and_seeks_without_scanning():
    sizes = np.random.default_rng(1).integers(0, 50, 2_000)
    order = ChunkedOrder(sizes, seed=3, window=500)
    total = int(sizes.sum())
    for sweep in (0, 7):
        full = order.sweep(sweep)
        assert np.array_equal(np.sort(full), np.arange(total))
        assert np.array_equal(order.take(sweep, 1234, 777), full[1234:2011])  # across a window boundary
    _, bounds, chunk_bounds = order._sweep_windows(0)
    assert np.all(np.diff(bounds)[:-1] >= 500) and np.all(np.diff(chunk_bounds) >= 1)

    big = ChunkedOrder(np.full(100_000, 1_000), seed=0, window=100_000)  # 100 M samples: no sweep is ever held
    for sweep, offset in ((0, 0), (3, 99_999_000)):
        began = time.perf_counter()
        indices = big.take(sweep, offset, 512)
        assert time.perf_counter() - began < 1.0
        assert len(set(big.chunk_of(indices).tolist())) <= 200  # one window of 100 chunks, or two
    assert big._window_cache.cache_info().currsize <= 4


def test_a_source_restored_far_into_the_data_reads_its_next_minibatch_within_a_second():
    class Huge:  # 10 M samples in 10,000 chunks, read by id
        streams = {"id": dtrain.data.StreamInfo("id", (), torch.int64)}
        num_sequences = 10_000_000

        def chunk_sizes(self):
            return np.full(10_000, 1_000)

        def sequence_lengths(self, name):
            raise KeyError(name)

        def read(self, indices):
            return {"id": torch.from_numpy(np.asarray(indices))}

    source = MinibatchSource(Huge(), randomization_window_in_samples=50_000)
    timings = []
    for position in (0, 5_000_000, 123 * 10_000_000 + 9_999_000):
        source.current_position = position
        began = time.perf_counter()
        minibatch = source.next_minibatch(4096, 4, 3)
        timings.append(time.perf_counter() - began)
        assert len(minibatch["id"]) == 1024
    assert max(timings) < 1.0, timings


def test_a_sequence_language_model_trains_from_parquet_and_resumes_bit_identical(tmp_path):
    make_shards("parquet", tmp_path / "data")

    def run(model):
        data = ParquetShards(tmp_path / "data", columns=["tokens"], num_classes={"tokens": 13})
        source = MinibatchSource(data, randomization_seed=2, randomization_window_in_chunks=2)
        dtrain.training_session(model, dtrain.session.SequenceCrossEntropy(),
                                dtrain.LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)),
                                source, 40, run_dir=tmp_path / "run", tensorboard=False, stream=io.StringIO(),
                                inputs=["tokens[:-1]"], target="tokens[1:]", max_samples=900,
                                checkpoint_config=dtrain.CheckpointConfig("ckpt.pt", frequency=300,
                                                                          preserve_all=True)).train()

    torch.manual_seed(0)
    straight = TinyCausalLM()
    run(straight)
    checkpoints = sorted((tmp_path / "run").glob("ckpt-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
    for later in checkpoints[1:]:
        later.unlink()
    torch.manual_seed(1)
    resumed = TinyCausalLM()
    run(resumed)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))

    # the shards change: one more row in a shard is named, and nothing is written
    import pyarrow.parquet as pq

    shard = sorted((tmp_path / "data").glob("*.parquet"))[1]
    table = pq.read_table(shard)
    pq.write_table(table.slice(0, table.num_rows - 1), shard, row_group_size=16)
    before = {path.name: path.read_bytes() for path in (tmp_path / "run").iterdir()}
    (tmp_path / "data" / "part-00004.parquet").unlink()
    with pytest.raises(dtrain.CheckpointError) as error:
        run(TinyCausalLM())
    assert one_line(error).endswith(
        "was written for other training shards: 2 shards changed (part-00001.parquet: 48 rows then, 47 now; "
        "part-00004.parquet: 81 rows then, missing now); restore onto the shards it read (the same files, rows and "
        "names), or start a new run directory (run_dir=...) to train on these")
    assert {path.name: path.read_bytes() for path in (tmp_path / "run").iterdir()} == before


def test_a_datasets_save_to_disk_directory_and_parquet_export_read_as_the_dataset():
    datasets = pytest.importorskip("datasets")
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as directory:
        rows = {"label": list(range(300)), "tokens": [tokens_of(i).tolist() for i in range(300)]}
        dataset = datasets.Dataset.from_dict(rows)
        dataset.save_to_disk(Path(directory) / "saved", num_shards=3)
        dataset.to_parquet(str(Path(directory) / "exported.parquet"), batch_size=64)
        for data in (ParquetShards(Path(directory) / "saved"), ParquetShards(Path(directory) / "exported.parquet"),
                     ParquetShards(datasets.load_from_disk(str(Path(directory) / "saved")))):
            assert data.num_sequences == 300
            source = MinibatchSource(data, max_sweeps=1, defining_stream="tokens")
            labels = []
            while (minibatch := source.next_minibatch(100)) is not None:
                labels += minibatch["label"].tolist()
                assert [len(tokens_of(i)) for i in minibatch["label"].tolist()] == minibatch["tokens"].lengths.tolist()
            assert sorted(labels) == list(range(300))


# -- bad input ------------------------------------------------------------------------------------------

def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_missing_truncated_and_mismatched_parquet_shards_are_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(DataError) as error:
        ParquetShards(tmp_path / "nowhere")
    assert f"shard {tmp_path / 'nowhere'} does not exist" in one_line(error)
    with pytest.raises(DataError, match="matches no file"):
        ParquetShards(str(tmp_path / "*.parquet"))
    files = write_parquet_shards(tmp_path / "good", [20, 20])
    with pytest.raises(DataError) as error:
        ParquetShards(files[0], columns=["id", "label"])
    assert one_line(error).endswith(f"shard {files[0]} has no column 'label'; it has id, features, tokens")

    truncated = tmp_path / "cut" / "part.parquet"
    truncated.parent.mkdir()
    truncated.write_bytes(files[0].read_bytes()[:-100])
    with pytest.raises(DataError) as error:
        ParquetShards(truncated)
    assert f"shard {truncated} is not a readable parquet file (truncated or damaged" in one_line(error)

    other = tmp_path / "other"
    other.mkdir()
    pq.write_table(pq.read_table(files[0]), other / "a.parquet")
    pq.write_table(pq.read_table(files[1]).set_column(0, "id", pa.array(range(20), pa.int32())), other / "b.parquet")
    with pytest.raises(DataError) as error:
        ParquetShards(other)
    assert f"column 'id' is int32 in shard {other / 'b.parquet'} and int64 in shard {other / 'a.parquet'}" in \
        one_line(error)
    pq.write_table(pq.read_table(files[1]).drop_columns(["features"]), other / "b.parquet")
    with pytest.raises(DataError) as error:
        ParquetShards(other)
    assert f"shard {other / 'b.parquet'} has no column 'features'" in one_line(error)

    strings = tmp_path / "strings.parquet"
    pq.write_table(pa.table({"text": ["a", "bc"]}), strings)
    with pytest.raises(DataError) as error:
        ParquetShards(strings)
    assert "column 'text' holds string; give decoders={'text': function}" in one_line(error)
    decoded = ParquetShards(strings, decoders={"text": lambda text: np.frombuffer(text.encode(), np.uint8)[:1]})
    assert decoded.read(np.array([1, 0]))["text"].tolist() == [[98], [97]]


def test_truncated_tar_shards_and_samples_without_a_field_are_named(tmp_path):
    files = write_tar_shards(tmp_path / "good", [10, 10])
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "a.tar").write_bytes(files[0].read_bytes()[:1500])
    with pytest.raises(DataError) as error:
        TarShards(cut, fields=tar_fields())
    assert f"shard {cut / 'a.tar'} is not a readable tar file (truncated or damaged" in one_line(error)

    partial = tmp_path / "partial"
    partial.mkdir()
    with tarfile.open(partial / "a.tar", "w") as tar:
        add_member(tar, "k1.cls", b"1")
        add_member(tar, "k1.tokens.npy", npy_bytes(tokens_of(1)))
        add_member(tar, "k2.cls", b"2")  # no tokens
    with pytest.raises(DataError) as error:
        TarShards(partial, fields={"id": "cls", "tokens": "tokens.npy"}, sequences=["tokens"])
    assert one_line(error) == (f"TarShards: sample 'k2' of shard {partial / 'a.tar'} has no tokens.npy file for "
                               f"stream 'tokens' (it has cls)")
    with pytest.raises(DataError) as error:
        TarShards(tmp_path / "good", fields={"id": "cls", "label": "txt"})
    assert "has no txt file for stream 'label' (it has cls, features.npy, tokens.npy)" in one_line(error)


def test_a_window_for_data_that_is_not_chunked_or_not_randomized_is_refused(tmp_path):
    data = make_shards("parquet", tmp_path)
    with pytest.raises(ValueError, match=r"randomization_window_in_chunks=4 applies to randomize=true"):
        MinibatchSource(data, randomize=False, randomization_window_in_chunks=4)
    with pytest.raises(ValueError, match="exclusive"):
        MinibatchSource(data, randomization_window_in_chunks=4, randomization_window_in_samples=100)
    with pytest.raises(ValueError, match=r"randomization_window_in_samples=100: DatasetDeserializer is not chunked"):
        MinibatchSource(torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4)),
                        randomization_window_in_samples=100)
    state = MinibatchSource(data, randomization_window_in_chunks=4).get_checkpoint_state()
    with pytest.raises(ValueError, match="checkpoint state has a randomization window of"):
        MinibatchSource(data, randomization_window_in_chunks=5).restore_from_checkpoint(state)


def test_tar_shards_read_by_worker_processes_equal_the_reading_process(tmp_path):
    """Workers decode in parallel and put the samples back in order. They are forked from a reader that has
    a shard open already (it read sample 0 to learn the streams), so they share that file and its offset:
    reads by position keep one worker's read from moving another's."""
    write_tar_shards(tmp_path, [400, 37])
    reader = TarShards(tmp_path, fields=tar_fields(), sequences=["tokens"])
    with TarShards(tmp_path, fields=tar_fields(), sequences=["tokens"], num_workers=2) as workers:
        assert workers.benefits_from_read_ahead and workers.read_ahead_minibatches == 2
        for seed in range(6):  # the first shard's samples, many at once: both workers in the same file
            indices = np.random.default_rng(seed).permutation(400)[:300]
            alone, together = reader.read(indices), workers.read(indices)
            assert torch.equal(alone["id"], together["id"]) and torch.equal(together["id"], torch.from_numpy(indices))
            assert torch.equal(alone["features"], together["features"])
            assert torch.equal(alone["tokens"].data, together["tokens"].data)


def test_a_json_shard_list_replaces_counting_at_start_up_and_a_wrong_count_is_named(tmp_path):
    import json

    write_tar_shards(tmp_path / "shards", shard_sizes())
    counted = TarShards(tmp_path / "shards", fields=tar_fields(), sequences=["tokens"])
    counted.save_shard_list(tmp_path / "list.json")
    listed = json.loads((tmp_path / "list.json").read_text())["shardlist"]
    assert [entry["nsamples"] for entry in listed] == shard_sizes() and listed[0]["url"] == "shards/shard-00000.tar"
    from_list = TarShards(tmp_path / "list.json", fields=tar_fields(), sequences=["tokens"])
    assert np.array_equal(from_list.chunk_sizes(), counted.chunk_sizes())
    assert from_list.checkpoint_identity() == counted.checkpoint_identity()
    indices = np.arange(from_list.num_sequences)[::7]
    assert torch.equal(from_list.read(indices)["id"], torch.from_numpy(indices))

    listed[2]["nsamples"] += 1  # a list that no longer fits its shards: named when that shard is read
    (tmp_path / "wrong.json").write_text(json.dumps({"shardlist": listed}))
    wrong = TarShards(tmp_path / "wrong.json", fields={"id": "cls"})
    with pytest.raises(DataError) as error:
        wrong.read(np.array([sum(shard_sizes()[:2]) + 1]))
    assert "shard-00002.tar holds 59 samples, 60 when the reader was made" \
        in one_line(error)
    (tmp_path / "bad.json").write_text('{"shards": []}')
    with pytest.raises(DataError) as error:
        TarShards(tmp_path / "bad.json")
    assert one_line(error).startswith(f"TarShards: shard list {tmp_path / 'bad.json'} is not a JSON shard list")

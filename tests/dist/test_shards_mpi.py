"""Shards under a real mpiexec: a run trained at N ranks and resumed from its checkpoint at N/2 or 2N ranks
trains every sample exactly once per sweep, shown by the ledger of what the model was given."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.mpi import run_mpi
from tests.helpers.shard_data import shard_sizes, tokens_of, write_parquet_shards, write_tar_shards

pytest.importorskip("pyarrow")
pytest.importorskip("webdataset")
pytestmark = pytest.mark.timeout(300)

WORKER = Path(__file__).with_name("_shard_ledger_worker.py")


def ledger(directory: Path) -> list[tuple[int, int]]:
    return [tuple(entry) for path in sorted(directory.glob("rank*.json")) for entry in json.loads(path.read_text())]


@pytest.mark.parametrize("kind, first, then", [
    ("parquet", 2, 1),
    ("tar", 1, 2),
    pytest.param("parquet", 4, 2, marks=pytest.mark.slow),
    pytest.param("tar", 2, 4, marks=pytest.mark.slow),
])
def test_a_run_resumed_at_another_world_size_trains_every_sample_once_per_sweep(kind, first, then, tmp_path):
    sizes = shard_sizes()
    total = sum(sizes)
    steps = sum(len(tokens_of(i)) for i in range(total))
    (write_tar_shards if kind == "tar" else write_parquet_shards)(tmp_path / "shards", sizes)
    halfway, end = int(0.8 * steps), int(2.5 * steps)  # the first launch ends inside sweep 0, the second in sweep 2
    for ranks, max_samples, name in ((first, halfway, "first"), (then, end, "then")):
        run_mpi(ranks, [WORKER, kind, tmp_path / "shards", tmp_path / "run", max_samples, tmp_path / name],
                timeout=240, check=True)
    head, tail = ledger(tmp_path / "first"), ledger(tmp_path / "then")
    assert head and tail and max(position for position, _ in head) < min(position for position, _ in tail)
    trained = sorted(head + tail)
    assert [position for position, _ in trained] == list(range(len(trained)))  # every position once, none skipped
    sweeps: dict[int, list[int]] = {}
    for position, sample in trained:
        sweeps.setdefault(position // total, []).append(sample)
    assert sorted(sweeps[0]) == sorted(sweeps[1]) == list(range(total))
    assert len(set(sweeps[2])) == len(sweeps[2]) and 0 < len(sweeps[2]) < total

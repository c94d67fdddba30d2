"""Reading shards bigger than memory: peak memory against the data's size, and samples/s against the libraries'
own loaders reading the same shards with the same workers.

    python benchmarks/shard_reading.py memory --gigabytes 1 8
    python benchmarks/shard_reading.py throughput --rounds 5 --workers 2

``memory``: writes uncompressed Parquet shards of ``--gigabytes`` each (rows of a 1,024-float ``features``
vector and a ``label`` that is the row's id, row groups of 1,024 rows: 4 MiB), then in a fresh process
per size reads one whole shuffled sweep through ``MinibatchSource(ParquetShards(...))`` in minibatches of
256, and prints the process's peak RSS (``getrusage``), its RSS before reading, the rows/s, and whether
every row was read exactly once, side by side.

``throughput``: reads the same data through dtrain and through each format's own loader, rounds alternating
which goes first; the figures are the medians over the rounds, the ratio dtrain / library (>= 1: dtrain
at least as fast):

  * Parquet (the 1 GB shards of ``memory``, made if missing): ``MinibatchSource(ParquetShards)``, its
    read-ahead on, against ``datasets.load_dataset("parquet", streaming=True)`` shuffled with a buffer of
    the same rows as dtrain's window, ``with_format("torch")``, in a ``DataLoader`` with ``--workers``;
  * tar (WebDataset shards of ``--images`` JPEGs of 64x64 with a ``.cls``, written here):
    ``MinibatchSource(TarShards(num_workers=k))`` against ``webdataset.WebDataset(...).shuffle(window)
    .decode("rgb8")`` in a ``DataLoader`` with ``--workers`` (its shards split across the workers).

``uptime``'s load is printed before and after: a shared machine moves these figures.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROW_FLOATS = 1024  # 4 KiB of features per row
ROWS_PER_GROUP = 1024
ROWS_PER_SHARD = 32 * ROWS_PER_GROUP  # 128 MiB shards


def write_parquet(directory: Path, gigabytes: float) -> Path:
    """Uncompressed Parquet shards holding ``gigabytes`` of features (written once, kept for the next run)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = int(gigabytes * 2**30 // (4 * ROW_FLOATS))
    target = directory / f"parquet_{gigabytes:g}gb"
    if (target / "done").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    base = np.arange(ROWS_PER_SHARD * ROW_FLOATS, dtype=np.float32).reshape(ROWS_PER_SHARD, ROW_FLOATS)
    for shard, first in enumerate(range(0, rows, ROWS_PER_SHARD)):
        count = min(ROWS_PER_SHARD, rows - first)
        features = pa.FixedSizeListArray.from_arrays(pa.array((base[:count] + first).ravel()), ROW_FLOATS)
        table = pa.table({"features": features, "label": pa.array(np.arange(first, first + count))})  # the row's id
        pq.write_table(table, target / f"part-{shard:05d}.parquet", row_group_size=ROWS_PER_GROUP,
                       compression="none")
    (target / "done").write_text(str(rows))
    return target


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def read_one_sweep(directory: str) -> None:
    """(In a fresh process) one shuffled sweep of ``directory``'s shards: prints JSON figures."""
    from dtrain.data import MinibatchSource, ParquetShards

    data = ParquetShards(directory)
    source = MinibatchSource(data, max_sweeps=1)
    before = rss_mib()
    seen = np.zeros(data.num_sequences, dtype=np.int32)  # how often each row was read: once, for an exact sweep
    began, rows = time.perf_counter(), 0
    while (minibatch := source.next_minibatch(256)) is not None:
        rows += len(minibatch["label"])
        np.add.at(seen, minibatch["label"].numpy(), 1)
    seconds = time.perf_counter() - began
    print(json.dumps({"rows": rows, "seconds": seconds, "rss_before_mib": before,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "window_rows": source.randomization_window, "exact": bool((seen == 1).all())}))


def memory(arguments) -> None:
    results = {}
    for gigabytes in arguments.gigabytes:
        directory = write_parquet(arguments.data, gigabytes)
        done = subprocess.run([sys.executable, __file__, "_sweep", str(directory)], capture_output=True, text=True,
                              check=True)
        results[gigabytes] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{'data':>8} {'rows':>10} {'RSS before':>11} {'peak RSS':>9} {'rows/s':>9} {'window':>7} sweep exact")
    for gigabytes, figures in results.items():
        print(f"{gigabytes:>6g}GB {figures['rows']:>10,} {figures['rss_before_mib']:>9.0f}Mi {figures['peak_rss_mib']:>7.0f}Mi "
              f"{figures['rows'] / figures['seconds']:>9,.0f} {figures['window_rows']:>7,} {figures['exact']}")


# -- throughput -----------------------------------------------------------------------------------------

def write_tar(directory: Path, images: int, per_shard: int = 256) -> Path:
    from PIL import Image

    target = directory / f"tar_{images}"
    if (target / "done").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    y, x = np.mgrid[0:64, 0:64].astype(np.float32) / 64
    for shard, first in enumerate(range(0, images, per_shard)):
        with tarfile.open(target / f"shard-{shard:05d}.tar", "w") as tar:
            for index in range(first, min(images, first + per_shard)):
                rng = np.random.default_rng(index)
                pixels = np.stack([127 + 100 * np.sin(2 * np.pi * (rng.uniform(0.5, 3) * y + x) + c) for c in range(3)],
                                  axis=-1) + rng.normal(0, 12, (64, 64, 3))
                buffer = io.BytesIO()
                Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
                for extension, data in (("jpg", buffer.getvalue()), ("cls", str(index % 10).encode())):
                    info = tarfile.TarInfo(f"{index:08d}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    (target / "done").write_text(str(images))
    return target


def time_reading(batches, limit: int) -> float:
    """Rows/s over ``limit`` rows of an iterator of batches (its first batch read before the clock starts)."""
    iterator = iter(batches)
    next(iterator)
    began, rows = time.perf_counter(), 0
    for batch in iterator:
        rows += len(batch[-1] if isinstance(batch, (list, tuple)) else batch["label"])
        if rows >= limit:
            break
    return rows / (time.perf_counter() - began)


def dtrain_batches(data, batch: int):
    from dtrain.data import MinibatchSource

    source = MinibatchSource(data)
    while True:
        yield source.next_minibatch(batch)


def throughput(arguments) -> None:
    import datasets
    import torch
    import webdataset as wds

    from dtrain.data import ParquetShards, TarShards

    parquet = write_parquet(arguments.data, 1)
    tar = write_tar(arguments.data, arguments.images)
    parquet_data = ParquetShards(parquet)
    window = -(-parquet_data.num_sequences * parquet_data.randomization_window_in_chunks // len(parquet_data.chunk_sizes()))
    tar_data = TarShards(tar, fields={"image": "jpg", "label": "cls"}, decode="rgb8", num_workers=arguments.workers)
    tar_window = -(-tar_data.num_sequences * tar_data.randomization_window_in_chunks // len(tar_data.chunk_sizes()))

    def hf_parquet():
        stream = datasets.load_dataset("parquet", data_files=sorted(map(str, parquet.glob("*.parquet"))), split="train",
                                       streaming=True).shuffle(seed=0, buffer_size=window).with_format("torch")
        return torch.utils.data.DataLoader(stream, batch_size=arguments.batch, num_workers=arguments.workers)

    def webdataset_tar():
        stream = (wds.WebDataset(sorted(map(str, tar.glob("*.tar"))), shardshuffle=len(list(tar.glob("*.tar"))),
                                 nodesplitter=None, workersplitter=wds.split_by_worker, empty_check=False)
                  .shuffle(tar_window).decode("rgb8").to_tuple("jpg", "cls"))
        return torch.utils.data.DataLoader(stream.batched(arguments.batch), batch_size=None,
                                           num_workers=arguments.workers)

    pipelines = {
        "parquet": (lambda: dtrain_batches(parquet_data, arguments.batch), hf_parquet, arguments.parquet_rows),
        "tar": (lambda: dtrain_batches(tar_data, arguments.batch), webdataset_tar, arguments.images // 2),
    }
    print(f"load before: {os.getloadavg()[0]:.2f}")
    print(f"{'format':>8} {'dtrain rows/s':>14} {'library rows/s':>15} {'ratio':>6}  (medians of {arguments.rounds} rounds)")
    for name, (ours, theirs, limit) in pipelines.items():
        mine, library = [], []
        for round_index in range(arguments.rounds):
            for which in ((0, 1) if round_index % 2 == 0 else (1, 0)):
                figure = time_reading(ours() if which == 0 else theirs(), limit)
                (mine if which == 0 else library).append(figure)
        ratios = [a / b for a, b in zip(mine, library)]
        print(f"{name:>8} {statistics.median(mine):>14,.0f} {statistics.median(library):>15,.0f} "
              f"{statistics.median(ratios):>6.2f}")
    print(f"load after: {os.getloadavg()[0]:.2f}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_sweep":
        read_one_sweep(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["memory", "throughput"])
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "dtrain_shard_benchmark",
                        help="where the shards are written (kept for the next run)")
    parser.add_argument("--gigabytes", type=float, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--images", type=int, default=8192)
    parser.add_argument("--parquet-rows", type=int, default=65536, help="rows read per round (Parquet)")
    arguments = parser.parse_args()
    (memory if arguments.mode == "memory" else throughput)(arguments)


if __name__ == "__main__":
    main()

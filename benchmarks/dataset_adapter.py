"""Samples/s of one image-decoding torch Dataset: MinibatchSource(DatasetDeserializer) vs DataLoader.

    python benchmarks/dataset_adapter.py --workers 2 --rounds 7 --samples 1024 --batch 64
    python benchmarks/dataset_adapter.py --workers 2 --worker-type thread --images 200

Writes ``--images`` JPEGs (``--size`` square, or PNGs with ``--format png``) into a temporary
directory; the Dataset opens one with PIL, decodes it, takes a crop of ``--crop`` pixels whose place
is a function of the index (random-looking, the same in both pipelines) and returns
``(float32 [3, crop, crop] in [0, 1], label)``. Each round reads ``--samples`` samples (whole
minibatches of ``--batch``) through

  * dtrain:     ``MinibatchSource(DatasetDeserializer(ds, num_workers=k))``, its read-ahead on (the
                default with workers: two minibatches ahead, each handed to the workers as it is
                queued, ``DatasetDeserializer.prefetch``), shuffled sweeps;
  * DataLoader: ``DataLoader(ds, batch_size, shuffle=True, num_workers=k, persistent_workers=k > 0)``.

Both start their workers and read one minibatch before the clock starts, and are shut down after it
stops. Rounds alternate which pipeline goes first, so load from other work on the machine hits both
alike; the figures are the medians over ``--rounds``, the ratio is dtrain / DataLoader (>= 1: dtrain
is at least as fast), also as the median of the per-round ratios. ``uptime``'s load is printed before
and after, since a shared machine moves these figures.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dtrain.data import MinibatchSource
from dtrain.data.dataset import DatasetDeserializer


def write_images(root: Path, count: int, size: int, extension: str) -> list[Path]:
    """``count`` smooth, noisy RGB images (so the codec has real work) as ``root/image_<i>.<extension>``."""
    paths = []
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    for index in range(count):
        rng = np.random.default_rng(index)
        channels = [127 + 100 * np.sin(2 * np.pi * (rng.uniform(0.5, 3) * y + rng.uniform(0.5, 3) * x)
                                       + rng.uniform(0, 6.3)) for _ in range(3)]
        pixels = np.stack(channels, axis=-1) + rng.normal(0, 12, (size, size, 3))
        path = root / f"image_{index}.{extension}"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, **(
            {"quality": 90} if extension == "jpg" else {}))
        paths.append(path)
    return paths


class DecodedImages(torch.utils.data.Dataset):
    """Image files decoded with PIL, cropped at a place keyed by the index, as float32 CHW tensors."""

    def __init__(self, paths: list[Path], crop: int) -> None:
        self.paths, self.crop = [str(path) for path in paths], crop

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        with Image.open(self.paths[index]) as image:
            image = image.convert("RGB")
            width, height = image.size
            left, top = int(rng.integers(0, width - self.crop + 1)), int(rng.integers(0, height - self.crop + 1))
            image = image.crop((left, top, left + self.crop, top + self.crop))
            if rng.random() < 0.5:
                image = image.transpose(Image.FLIP_LEFT_RIGHT)
            pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)
        return pixels.float().div_(255), index % 10


def time_dtrain(dataset, samples: int, batch: int, workers: int, worker_type: str, seed: int) -> float:
    """Samples/s of ``samples`` samples (whole minibatches) through a MinibatchSource with read-ahead."""
    deserializer = DatasetDeserializer(dataset, num_workers=workers, worker_type=worker_type)
    source = MinibatchSource(deserializer, randomization_seed=seed)
    source.next_minibatch(batch)  # warm-up: workers start; the read-ahead of the next minibatch begins
    start, seen = time.perf_counter(), 0
    while seen < samples:
        seen += source.next_minibatch(batch).num_samples
    rate = seen / (time.perf_counter() - start)
    source.close()
    deserializer.close()
    return rate


def time_dataloader(dataset, samples: int, batch: int, workers: int, seed: int) -> float:
    """Samples/s of ``samples`` samples (whole batches) through a shuffling DataLoader."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                                         persistent_workers=workers > 0,
                                         generator=torch.Generator().manual_seed(seed))
    batches = iter(loader)
    next(batches)  # warm-up: workers start and prefetch
    start, seen = time.perf_counter(), 0
    while seen < samples:
        for features, _ in batches:
            seen += features.shape[0]
            if seen >= samples:
                break
        else:
            batches = iter(loader)  # the next epoch, on the same (persistent) workers
    rate = seen / (time.perf_counter() - start)
    del batches, loader  # shuts the workers down, so they decode nothing during the next round
    gc.collect()
    return rate


def load() -> str:
    """``uptime``'s load averages (or os.getloadavg's)."""
    try:
        text = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout
        return "load average" + text.split("load average", 1)[1].strip() if "load average" in text else text.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes (or threads) of both, default 2")
    parser.add_argument("--worker-type", choices=("process", "thread"), default="process",
                        help="DatasetDeserializer's workers (DataLoader's are always processes)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (median), default 5")
    parser.add_argument("--samples", type=int, default=512, help="samples read per round and pipeline")
    parser.add_argument("--batch", type=int, default=64, help="minibatch size in samples, default 64")
    parser.add_argument("--images", type=int, default=300, help="image files written")
    parser.add_argument("--size", type=int, default=128, help="image side in pixels")
    parser.add_argument("--crop", type=int, default=112, help="crop side in pixels")
    parser.add_argument("--format", choices=("jpg", "png"), default="jpg")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        dataset = DecodedImages(write_images(Path(root), args.images, args.size, args.format), args.crop)
        before = load()
        rates: dict[str, list[float]] = {"dtrain": [], "DataLoader": []}
        for round_number in range(args.rounds):
            order = ["dtrain", "DataLoader"] if round_number % 2 == 0 else ["DataLoader", "dtrain"]
            for name in order:
                if name == "dtrain":
                    rate = time_dtrain(dataset, args.samples, args.batch, args.workers, args.worker_type, round_number)
                else:
                    rate = time_dataloader(dataset, args.samples, args.batch, args.workers, round_number)
                rates[name].append(rate)
            print(f"  round {round_number + 1}: dtrain {rates['dtrain'][-1]:8.1f}  DataLoader "
                  f"{rates['DataLoader'][-1]:8.1f} samples/s", flush=True)
        after = load()
    ours, theirs = statistics.median(rates["dtrain"]), statistics.median(rates["DataLoader"])
    paired = statistics.median(a / b for a, b in zip(rates["dtrain"], rates["DataLoader"]))
    print(f"{args.images} {args.format.upper()}s {args.size}x{args.size} -> crop {args.crop}, {args.samples} samples a "
          f"round in minibatches of {args.batch}, {args.workers} workers ({args.worker_type} for dtrain), median of "
          f"{args.rounds} alternating rounds, {os.cpu_count()} CPUs")
    print(f"  {'dtrain (MinibatchSource + DatasetDeserializer)':48s} {ours:8.1f} samples/s")
    print(f"  {'DataLoader (shuffle=True)':48s} {theirs:8.1f} samples/s")
    print(f"  {'ratio dtrain / DataLoader':48s} {ours / theirs:8.3f} (median of per-round ratios {paired:.3f})")
    print(f"  before: {before}")
    print(f"  after:  {after}")


if __name__ == "__main__":
    main()

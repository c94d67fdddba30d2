"""Images/s of the image input pipelines on one generated JPEG set: DALI CPU vs native vs DataLoader.

    python benchmarks/image_pipeline.py --images 512 --size 256 --crop 224 --threads 2
    python benchmarks/image_pipeline.py --read-ahead both --step-ms 50 --skip-dali --skip-dataloader

Every pipeline decodes the same JPEGs (``--size`` square), takes a random-area crop, scales it to
``--crop``, flips and normalises, and yields float32 ``[n, 3, crop, crop]`` minibatches:
  * dali:       DaliImageDeserializer + DaliImageAugmentation(device="cpu") in a MinibatchSource;
  * native:     ImageFolderDeserializer (PIL, ``--threads`` decode threads) + ImageAugmentation, with
                the MinibatchSource's read-ahead off and/or on (``--read-ahead off|on|both``);
  * dataloader: torch DataLoader (``--threads`` worker processes), per-image PIL crop/resize/flip.
One untimed warm-up minibatch each, then ``--images`` images are read once. ``--step-ms`` sleeps
that long after each minibatch, standing in for a model step on a GPU (the CPU is free meanwhile):
read-ahead decodes the next minibatch during it, so with a step the rate approaches
``batch / max(step, decode)`` instead of ``batch / (step + decode)``.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch
from PIL import Image

from dtrain.data import ImageAugmentation, ImageFolderDeserializer, MinibatchSource, read_map_file
from dtrain.testing.image_files import write_image_map_files

MEAN, STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]


def _options(crop: int) -> dict:
    return {"crop": "randomarea", "area_ratio": [0.08, 1.0], "aspect_ratio": [0.75, 1.333], "output_size": [crop, crop],
            "flip": True, "mean": MEAN, "std": STD}


def _time_source(source: MinibatchSource, images: int, batch: int, step_seconds: float = 0.0) -> float:
    source.next_minibatch(batch)  # warm-up (pipeline build, thread start)
    source.restore_from_checkpoint({**source.get_checkpoint_state(), "position": 0})
    start, seen = time.perf_counter(), 0
    while seen < images:
        seen += source.next_minibatch(batch).num_samples
        if step_seconds:
            time.sleep(step_seconds)  # the model's step
    return seen / (time.perf_counter() - start)


class _PilDataset(torch.utils.data.Dataset):
    """Per-image PIL pipeline, the usual torchvision-style loop without torchvision."""

    def __init__(self, map_file, crop: int) -> None:
        self.map, self.crop = read_map_file(map_file), crop
        self.mean, self.std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return self.map.num_samples

    def __getitem__(self, index: int):
        rng = np.random.default_rng(index)
        with Image.open(self.map.image_paths[index]) as image:
            image = image.convert("RGB")
            width, height = image.size
            area = rng.uniform(0.08, 1.0) * width * height
            aspect = rng.uniform(0.75, 1.333)
            w = int(min(width, max(1, round(np.sqrt(area * aspect)))))
            h = int(min(height, max(1, round(np.sqrt(area / aspect)))))
            left, top = rng.integers(0, width - w + 1), rng.integers(0, height - h + 1)
            image = image.resize((self.crop, self.crop), Image.BILINEAR, box=(left, top, left + w, top + h))
            if rng.random() < 0.5:
                image = image.transpose(Image.FLIP_LEFT_RIGHT)
            pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float()
        return (pixels - self.mean) / self.std, int(self.map.labels[index])


def _time_dataloader(map_file, images: int, batch: int, crop: int, workers: int, step_seconds: float = 0.0) -> float:
    loader = torch.utils.data.DataLoader(_PilDataset(map_file, crop), batch_size=batch, shuffle=True,
                                         num_workers=workers, persistent_workers=workers > 0)
    iter(loader).__next__()  # warm-up (worker start)
    start, seen = time.perf_counter(), 0
    while seen < images:
        for features, _ in loader:
            seen += features.shape[0]
            if step_seconds:
                time.sleep(step_seconds)  # the model's step
            if seen >= images:
                break
    return seen / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--read-ahead", choices=("off", "on", "both"), default="both",
                        help="the native pipeline's read-ahead of the next minibatch")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="simulated model step after each minibatch (sleep, milliseconds)")
    parser.add_argument("--skip-dali", action="store_true")
    parser.add_argument("--skip-dataloader", action="store_true")
    args = parser.parse_args()
    step = args.step_ms / 1000
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        map_file, _ = write_image_map_files(root, num_train=args.images, num_val=1, size=(args.size, args.size),
                                            num_classes=10, formats=("jpg",))
        results = {}
        try:
            if args.skip_dali:
                raise ImportError("--skip-dali")
            from dtrain.data.dali import DaliImageAugmentation, DaliImageDeserializer

            dali = MinibatchSource(DaliImageDeserializer(map_file), transform=DaliImageAugmentation(
                **_options(args.crop), device="cpu", num_threads=args.threads, max_batch_size=args.batch))
            results["dali (CPU)"] = _time_source(dali, args.images, args.batch, step)
        except ImportError as error:
            print(f"dali: skipped ({error})")
        for read_ahead in {"off": [False], "on": [True], "both": [False, True]}[args.read_ahead]:
            native = MinibatchSource(ImageFolderDeserializer(map_file, num_threads=args.threads), read_ahead=read_ahead,
                                     transform=ImageAugmentation(**_options(args.crop)))
            results[f"native, read-ahead {'on' if read_ahead else 'off'}"] = _time_source(
                native, args.images, args.batch, step)
            native.close()
        if not args.skip_dataloader:
            results["DataLoader (PIL per image)"] = _time_dataloader(map_file, args.images, args.batch, args.crop,
                                                                     args.threads, step)
    print(f"{args.images} JPEGs {args.size}x{args.size} -> {args.crop}x{args.crop}, minibatch {args.batch}, "
          f"{args.threads} threads/workers, model step {args.step_ms:g} ms")
    for name, rate in results.items():
        print(f"  {name:32s} {rate:8.1f} images/s")


if __name__ == "__main__":
    main()

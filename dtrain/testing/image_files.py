"""Write small CNTK map-file image sets (JPEG and PNG), for tests and benchmarks.

``write_image_map_files(root)`` creates ``root/images/{train,val}_<i>.{jpg,png}`` and the map files
``root/train_map.txt`` and ``root/val_map.txt`` (``path<TAB>label``, paths relative to ``root``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def image_pixels(index: int, size: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Deterministic smooth RGB pixels ``[H, W, 3]`` uint8 (smooth so JPEG keeps them close)."""
    height, width = size
    rng = np.random.default_rng(seed * 100003 + index)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    channels = []
    for _ in range(3):
        fy, fx, phase = rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), rng.uniform(0, 2 * np.pi)
        channels.append(127.5 + 120 * np.sin(2 * np.pi * (fy * y / height + fx * x / width) + phase))
    return np.clip(np.stack(channels, axis=-1), 0, 255).astype(np.uint8)


def write_image_map_files(root: str | Path, num_train: int = 12, num_val: int = 6, size: tuple[int, int] = (40, 48),
                          num_classes: int = 3, formats: tuple[str, ...] = ("jpg", "png"),
                          seed: int = 0) -> tuple[Path, Path]:
    """Write the image set; label of image ``i`` is ``i % num_classes``; returns the two map-file paths."""
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    map_paths = []
    for split, count in (("train", num_train), ("val", num_val)):
        lines = []
        for index in range(count):
            extension = formats[index % len(formats)]
            relative = f"images/{split}_{index}.{extension}"
            image = Image.fromarray(image_pixels(index + (0 if split == "train" else 10_000), size, seed))
            image.save(root / relative, **({"quality": 95} if extension == "jpg" else {}))
            lines.append(f"{relative}\t{index % num_classes}")
        map_path = root / f"{split}_map.txt"
        map_path.write_text("\n".join(lines) + "\n")
        map_paths.append(map_path)
    return map_paths[0], map_paths[1]

"""Write small CIFAR-10 data sets in the official binary layout, for tests and benchmarks.

``write_cifar10_binary(root)`` creates ``root/cifar-10-batches-bin/`` with ``data_batch_1..5.bin``,
``test_batch.bin`` and ``batches.meta.txt``; ``cifar10_records`` regenerates the exact contents
so a test can compare what it reads with what was written.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np

CIFAR10_LABEL_NAMES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)
RECORD_BYTES = 3073
_NUM_TRAIN_FILES = 5


def cifar10_records(num_records: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic records: uint8 labels ``[n]`` (cycling 0..9, so every class occurs) and
    uint8 images ``[n, 3, 32, 32]`` of random pixels drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    labels = (np.arange(num_records) % 10).astype(np.uint8)
    images = rng.integers(0, 256, size=(num_records, 3, 32, 32), dtype=np.uint8)
    return labels, images


def encode_records(labels: np.ndarray, images: np.ndarray) -> bytes:
    """Bytes of CIFAR-10 binary records: per record 1 label byte, then 3,072 channel-major pixels."""
    records = np.empty((len(labels), RECORD_BYTES), dtype=np.uint8)
    records[:, 0] = labels
    records[:, 1:] = images.reshape(len(labels), -1)
    return records.tobytes()


def cifar10_train_records(num_train: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The training records ``write_cifar10_binary(root, num_train, seed=seed)`` writes, in order."""
    return cifar10_records(num_train, seed)


def cifar10_test_records(num_test: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The test records ``write_cifar10_binary(root, num_test=num_test, seed=seed)`` writes."""
    return cifar10_records(num_test, seed + 1)


def _layout(num_train: int, num_test: int, seed: int) -> dict[str, bytes]:
    """File name -> contents of the official layout; training records split over 5 files."""
    labels, images = cifar10_train_records(num_train, seed)
    bounds = [num_train * file_number // _NUM_TRAIN_FILES for file_number in range(_NUM_TRAIN_FILES + 1)]
    files = {
        f"data_batch_{file_number + 1}.bin": encode_records(
            labels[bounds[file_number] : bounds[file_number + 1]],
            images[bounds[file_number] : bounds[file_number + 1]],
        )
        for file_number in range(_NUM_TRAIN_FILES)
    }
    files["test_batch.bin"] = encode_records(*cifar10_test_records(num_test, seed))
    files["batches.meta.txt"] = ("\n".join(CIFAR10_LABEL_NAMES) + "\n\n").encode()
    return files


def write_cifar10_binary(root: str | Path, num_train: int = 50, num_test: int = 20, seed: int = 0) -> Path:
    """Write a small CIFAR-10 in the official binary layout under ``root``.

    Training records ``cifar10_train_records(num_train, seed)`` are split in order over
    ``data_batch_1.bin .. data_batch_5.bin`` (sizes differ by at most one record); the test
    records ``cifar10_test_records(num_test, seed)`` go to ``test_batch.bin``.

    Returns:
        The ``root/cifar-10-batches-bin`` directory.
    """
    batches_dir = Path(root) / "cifar-10-batches-bin"
    batches_dir.mkdir(parents=True, exist_ok=True)
    for name, contents in _layout(num_train, num_test, seed).items():
        (batches_dir / name).write_bytes(contents)
    return batches_dir


def write_cifar10_archive(
    path: str | Path, num_train: int = 50, num_test: int = 20, seed: int = 0
) -> tuple[Path, str]:
    """Write a ``cifar-10-binary.tar.gz``-style archive (members under ``cifar-10-batches-bin/``).

    Returns:
        ``(path, md5 hex digest of the archive)``.
    """
    path = Path(path)
    with tarfile.open(path, "w:gz") as tar:
        for name, contents in _layout(num_train, num_test, seed).items():
            member = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
            member.size = len(contents)
            member.mode = 0o644
            tar.addfile(member, io.BytesIO(contents))
    return path, hashlib.md5(path.read_bytes()).hexdigest()

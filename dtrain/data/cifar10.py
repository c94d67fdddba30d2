"""CIFAR-10 deserializer over the official binary files, with a checked download.

Layout (https://www.cs.toronto.edu/~kriz/cifar.html, "binary version"):
``<root>/cifar-10-batches-bin/data_batch_1.bin .. data_batch_5.bin`` (training, 10,000 records
each) and ``test_batch.bin``; a record is 1 label byte (0..9) followed by 3,072 pixel bytes,
the 32x32 red, green and blue planes in that order (row-major within a plane).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import torch

from dtrain.data._checks import check_bool
from dtrain.data.errors import DataError

__all__ = ["CIFAR10_LABEL_NAMES", "Cifar10"]

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"
CIFAR10_LABEL_NAMES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)

_BATCHES_DIR = "cifar-10-batches-bin"
_SPLIT_FILES = {
    "train": tuple(f"data_batch_{number}.bin" for number in range(1, 6)),
    "test": ("test_batch.bin",),
}
_IMAGE_SHAPE = (3, 32, 32)
_RECORD_BYTES = 1 + 3 * 32 * 32  # label byte + pixels
_DOWNLOAD_TIMEOUT_S = 60.0
_DOWNLOAD_CHUNK_BYTES = 1 << 20


def _one_line(reason: object) -> str:
    return " ".join(str(reason).split())


def _file_md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as file:
        while chunk := file.read(_DOWNLOAD_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _read_records(paths: list[Path]) -> np.ndarray:
    """Read record files once into one uint8 array ``[num_records, 3073]`` (no concatenation copy)."""
    sizes = []
    for path in paths:
        size = path.stat().st_size
        if size % _RECORD_BYTES:
            raise DataError(
                f"{path} is {size} bytes; expected a multiple of {_RECORD_BYTES} "
                "(CIFAR-10 binary version records)"
            )
        sizes.append(size)
    records = np.empty(sum(sizes), dtype=np.uint8)
    buffer = memoryview(records)
    offset = 0
    for path, size in zip(paths, sizes):
        with open(path, "rb") as file:
            bytes_read = file.readinto(buffer[offset : offset + size])
        if bytes_read != size:
            raise DataError(f"{path} gave {bytes_read} bytes; expected {size} (file changed while reading?)")
        offset += size
    return records.reshape(-1, _RECORD_BYTES)


class Cifar10:
    """CIFAR-10 (binary version) as a deserializer: uint8 images ``[n, 3, 32, 32]``, labels 0..9.

    All files of the split are read once into memory (about 150 MB for training). When a file is
    missing and ``download`` is True, the archive is downloaded into ``root``, its MD5 checked,
    and it is extracted safely (``tarfile`` filter ``"data"``); concurrent processes sharing
    ``root`` may all do this: every file is moved into place atomically.

    Args:
        root: directory that holds (or will hold) ``cifar-10-batches-bin/``.
        split: ``"train"`` (50,000 records in the official files) or ``"test"`` (10,000).
        download: fetch the archive from ``url`` when files are missing.
        url: where the ``cifar-10-binary.tar.gz`` archive is downloaded from.
        md5: expected MD5 hex digest of that archive.

    Raises:
        TypeError / ValueError: an argument has the wrong type or value.
        DataError: files missing (and not downloadable), a file whose size is not a multiple of
            3,073 bytes, a label byte above 9, or an archive with the wrong checksum.
    """

    feature_shape = _IMAGE_SHAPE
    num_classes = 10
    label_names = CIFAR10_LABEL_NAMES

    def __init__(
        self,
        root: str | os.PathLike,
        split: str = "train",
        download: bool = True,
        url: str = CIFAR10_URL,
        md5: str = CIFAR10_MD5,
    ) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a path (str or os.PathLike), got {type(root).__name__}")
        if split not in _SPLIT_FILES:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if not isinstance(url, str) or not url:
            raise TypeError(f"url must be a non-empty str, got {url!r}")
        if not isinstance(md5, str) or not re.fullmatch(r"[0-9a-fA-F]{32}", md5):
            raise ValueError(f"md5 must be 32 hexadecimal digits, got {md5!r}")
        self.root = Path(root).expanduser()
        self.split = split
        self.download = check_bool("download", download)
        self.url = url
        self.md5 = md5.lower()
        self._mean_image: torch.Tensor | None = None

        paths = [self.root / _BATCHES_DIR / name for name in _SPLIT_FILES[split]]
        missing = [path.name for path in paths if not path.is_file()]
        if missing:
            if not self.download:
                raise DataError(
                    f"CIFAR-10 not found under {self.root / _BATCHES_DIR} (missing "
                    f"{', '.join(missing)}) and download=False; pass download=True or download "
                    f"cifar-10-binary.tar.gz from {self.url} and extract it into {self.root}"
                )
            self._download_and_extract()
            for path in paths:
                if not path.is_file():
                    raise DataError(
                        f"{path} is missing after extracting the archive from {self.url}; "
                        "expected the CIFAR-10 binary version (cifar-10-binary.tar.gz)"
                    )
        self._records = _read_records(paths)
        if len(self._records) and int(self._records[:, 0].max()) >= self.num_classes:
            bad_record = int(np.argmax(self._records[:, 0] >= self.num_classes))
            raise DataError(
                f"{self.root / _BATCHES_DIR} ({split}) record {bad_record} has label byte "
                f"{self._records[bad_record, 0]}; expected 0..9 (CIFAR-10 binary version, not CIFAR-100?)"
            )
        if not len(self._records):
            raise DataError(f"{self.root / _BATCHES_DIR} has no {split} records; expected at least one")

    @property
    def num_samples(self) -> int:
        """Number of records in this split."""
        return int(self._records.shape[0])

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images ``[len(indices), 3, 32, 32]`` and int64 labels of records ``indices``."""
        record_indices = np.asarray(indices, dtype=np.int64)
        pixels = self._records[record_indices, 1:]  # a new contiguous array (one gather copy)
        images = torch.from_numpy(pixels).view(len(record_indices), *_IMAGE_SHAPE)
        labels = torch.from_numpy(self._records[record_indices, 0].astype(np.int64))
        return images, labels

    def mean_image(self) -> torch.Tensor:
        """float32 per-pixel mean ``[3, 32, 32]`` over the TRAINING split (pixel units 0..255).

        For the test split this reads the training files (downloading them if allowed).
        """
        if self._mean_image is None:
            if self.split == "train":
                pixel_sums = self._records[:, 1:].sum(axis=0, dtype=np.float64)
                mean = (pixel_sums / self.num_samples).reshape(_IMAGE_SHAPE)
                self._mean_image = torch.from_numpy(mean.astype(np.float32))
            else:
                training = Cifar10(self.root, "train", self.download, self.url, self.md5)
                self._mean_image = training.mean_image()
        return self._mean_image.clone()

    def _download_and_extract(self) -> None:
        """Download (unless a verified archive is already in root) and extract into root."""
        archive_name = Path(urllib.parse.urlparse(self.url).path).name or "cifar-10-binary.tar.gz"
        archive = self.root / archive_name
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise self._not_downloadable(error) from error
        if not (archive.is_file() and _file_md5(archive) == self.md5):
            self._download(archive)
        self._extract(archive)

    def _not_downloadable(self, reason: object) -> DataError:
        return DataError(
            f"CIFAR-10 not found under {self.root / _BATCHES_DIR} and could not be downloaded "
            f"from {self.url} ({_one_line(reason)}); download cifar-10-binary.tar.gz on a "
            f"machine with network access and extract it into {self.root}"
        )

    def _download(self, archive: Path) -> None:
        # A per-process temporary name: an interrupted or bad download never sits at the
        # archive's name, and processes sharing root do not write into one file.
        partial = archive.with_name(f"{archive.name}.{os.getpid()}.part")
        digest = hashlib.md5()
        try:
            with urllib.request.urlopen(self.url, timeout=_DOWNLOAD_TIMEOUT_S) as response:
                with open(partial, "wb") as file:
                    while chunk := response.read(_DOWNLOAD_CHUNK_BYTES):
                        digest.update(chunk)
                        file.write(chunk)
        except urllib.error.HTTPError as error:
            partial.unlink(missing_ok=True)
            raise self._not_downloadable(f"HTTP {error.code} {error.reason}") from error
        except urllib.error.URLError as error:
            partial.unlink(missing_ok=True)
            raise self._not_downloadable(error.reason) from error
        except (OSError, ValueError) as error:  # timeouts, resets, disk full, malformed URL
            partial.unlink(missing_ok=True)
            raise self._not_downloadable(f"{type(error).__name__}: {error}") from error
        actual_md5 = digest.hexdigest()
        if actual_md5 != self.md5:
            partial.unlink(missing_ok=True)
            raise DataError(
                f"{archive.name} downloaded from {self.url} has MD5 {actual_md5}; expected "
                f"{self.md5} (corrupt or altered download; it was deleted, nothing was extracted)"
            )
        os.replace(partial, archive)

    def _extract(self, archive: Path) -> None:
        staging = Path(tempfile.mkdtemp(prefix=".cifar-10-extract-", dir=self.root))
        try:
            try:
                with tarfile.open(archive, "r:*") as tar:
                    # filter="data" refuses absolute paths, ".." and links leaving the directory.
                    tar.extractall(staging, filter="data")
            except (tarfile.TarError, OSError, EOFError) as error:
                raise DataError(
                    f"{archive} could not be extracted ({_one_line(error)}); expected the "
                    "CIFAR-10 binary version archive (cifar-10-binary.tar.gz)"
                ) from error
            extracted = staging / _BATCHES_DIR
            if not extracted.is_dir():
                raise DataError(
                    f"{archive} has no {_BATCHES_DIR}/ directory; expected the CIFAR-10 binary "
                    "version archive (cifar-10-binary.tar.gz)"
                )
            target = self.root / _BATCHES_DIR
            target.mkdir(exist_ok=True)
            for source_file in extracted.iterdir():
                if source_file.is_file():
                    # Atomic per file: a concurrent reader sees a whole file or none.
                    os.replace(source_file, target / source_file.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

"""Cifar10 deserializer: official binary layout, size checks, mean image and checked download."""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from dtrain.testing.cifar_files import (
    cifar10_test_records,
    cifar10_train_records,
    write_cifar10_archive,
    write_cifar10_binary,
)

from dtrain.data import Cifar10, DataError, ImageTransform, MinibatchSource

NUM_TRAIN, NUM_TEST = 53, 17  # 53 does not divide by 5: the batch files differ in size


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cifar")
    write_cifar10_binary(root, num_train=NUM_TRAIN, num_test=NUM_TEST, seed=3)
    return root


@pytest.fixture
def no_proxy(monkeypatch):
    """Keep urllib from sending requests for the local test server through a proxy."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture
def local_server(tmp_path):
    """Serve tmp_path/"served" over HTTP on 127.0.0.1; yields (directory, base URL)."""
    served = tmp_path / "served"
    served.mkdir()

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # keep test output clean
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(served))
    )
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield served, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_helper_writes_the_official_layout(cifar_root):
    batches = cifar_root / "cifar-10-batches-bin"
    names = sorted(path.name for path in batches.iterdir())
    assert names == sorted([f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin", "batches.meta.txt"])
    sizes = [(batches / f"data_batch_{i}.bin").stat().st_size for i in range(1, 6)]
    assert all(size % 3073 == 0 for size in sizes) and sum(sizes) == NUM_TRAIN * 3073
    assert (batches / "batches.meta.txt").read_text().split()[:2] == ["airplane", "automobile"]


@pytest.mark.parametrize("split, expected_records", [
    ("train", lambda: cifar10_train_records(NUM_TRAIN, seed=3)),
    ("test", lambda: cifar10_test_records(NUM_TEST, seed=3)),
])
def test_records_round_trip(cifar_root, split, expected_records):
    labels, images = expected_records()
    data = Cifar10(cifar_root, split=split, download=False)
    assert data.num_samples == len(labels)
    assert data.feature_shape == (3, 32, 32) and data.num_classes == 10
    order = np.random.default_rng(0).permutation(len(labels))
    features, read_labels = data.get(order)
    assert features.dtype == torch.uint8 and features.shape == (len(labels), 3, 32, 32)
    assert read_labels.dtype == torch.int64
    assert torch.equal(features, torch.from_numpy(images[order]))
    assert read_labels.tolist() == labels[order].tolist()


def test_channel_major_pixel_layout(tmp_path):
    # One record whose red plane is 1, green 2, blue 3, and one bright pixel at (y=4, x=7) of green.
    record = np.zeros(3073, dtype=np.uint8)
    record[0] = 6
    record[1:].reshape(3, 32, 32)[:] = np.array([1, 2, 3], dtype=np.uint8).reshape(3, 1, 1)
    record[1 + 1024 + 4 * 32 + 7] = 200
    batches = tmp_path / "cifar-10-batches-bin"
    batches.mkdir()
    (batches / "test_batch.bin").write_bytes(record.tobytes())
    image, label = Cifar10(tmp_path, split="test", download=False).get(np.array([0]))
    assert label.tolist() == [6]
    assert image[0, 0].unique().tolist() == [1] and image[0, 2].unique().tolist() == [3]
    assert image[0, 1, 4, 7] == 200 and int((image[0, 1] == 200).sum()) == 1


def test_mean_image_is_the_training_mean_for_both_splits(cifar_root):
    _, images = cifar10_train_records(NUM_TRAIN, seed=3)
    expected = torch.from_numpy(images.astype(np.float64).mean(axis=0).astype(np.float32))
    for split in ("train", "test"):
        mean = Cifar10(cifar_root, split=split, download=False).mean_image()
        assert mean.dtype == torch.float32 and mean.shape == (3, 32, 32)
        torch.testing.assert_close(mean, expected)


def test_source_with_test_time_transform_reads_float_images(cifar_root):
    data = Cifar10(cifar_root, split="test", download=False)
    source = MinibatchSource(data, randomize=False, max_sweeps=1,
                             transform=ImageTransform(mean="dataset", scale=1 / 256))
    minibatch = source.next_minibatch(NUM_TEST)
    _, images = cifar10_test_records(NUM_TEST, seed=3)
    expected = (torch.from_numpy(images).float() - data.mean_image()) / 256
    torch.testing.assert_close(minibatch.features, expected)
    assert source.next_minibatch(1) is None


def test_empty_shares_have_image_shape(cifar_root):
    transform = ImageTransform(crop_side_ratio=0.8, flip=True, mean="dataset")
    source = MinibatchSource(Cifar10(cifar_root, split="test", download=False), transform=transform)
    minibatch = source.next_minibatch(2, num_data_partitions=4, partition_index=0)
    assert minibatch.num_samples == 0 and minibatch.features.shape == (0, 3, 32, 32)
    assert minibatch.features.dtype == torch.float32


def test_wrong_file_size_names_the_file(tmp_path):
    batches = write_cifar10_binary(tmp_path, num_train=10, num_test=2)
    bad = batches / "data_batch_3.bin"
    bad.write_bytes(bad.read_bytes() + b"\x00" * 5)
    with pytest.raises(DataError) as raised:
        Cifar10(tmp_path, download=False)
    message = str(raised.value)
    assert message == f"{bad} is {2 * 3073 + 5} bytes; expected a multiple of 3073 (CIFAR-10 binary version records)"


def test_label_out_of_range_is_rejected(tmp_path):
    batches = write_cifar10_binary(tmp_path, num_train=10, num_test=2)
    raw = bytearray((batches / "test_batch.bin").read_bytes())
    raw[3073] = 57  # second record's label byte
    (batches / "test_batch.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="record 1 has label byte 57; expected 0..9"):
        Cifar10(tmp_path, split="test", download=False)


def test_missing_files_without_download(tmp_path):
    with pytest.raises(DataError, match=r"CIFAR-10 not found under .*cifar-10-batches-bin \(missing test_batch.bin\)"):
        Cifar10(tmp_path, split="test", download=False)


def test_failed_download_is_one_actionable_line(tmp_path, no_proxy):
    # Port 9 on 127.0.0.1 (discard) is closed on test machines: the connection is refused at once.
    url = "http://127.0.0.1:9/cifar-10-binary.tar.gz"
    with pytest.raises(DataError) as raised:
        Cifar10(tmp_path / "data", url=url)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        f"CIFAR-10 not found under {tmp_path / 'data' / 'cifar-10-batches-bin'} and could not be "
        f"downloaded from {url} ("
    )
    assert message.endswith(
        "); download cifar-10-binary.tar.gz on a machine with network access and extract it into "
        f"{tmp_path / 'data'}"
    )
    assert not list((tmp_path / "data").glob("*.tar.gz*"))  # no partial archive left behind


def test_download_from_local_server_with_checksum(tmp_path, local_server, no_proxy):
    served, base_url = local_server
    _, md5 = write_cifar10_archive(served / "cifar-10-binary.tar.gz", num_train=20, num_test=6, seed=8)
    root = tmp_path / "data"
    data = Cifar10(root, split="test", url=f"{base_url}/cifar-10-binary.tar.gz", md5=md5)
    labels, images = cifar10_test_records(6, seed=8)
    features, read_labels = data.get(np.arange(6))
    assert torch.equal(features, torch.from_numpy(images)) and read_labels.tolist() == labels.tolist()
    assert (root / "cifar-10-binary.tar.gz").is_file()
    assert not [path.name for path in root.iterdir() if path.name.startswith(".")]  # staging removed
    # The archive is now local: the training split needs no server (a wrong URL proves it).
    (root / "cifar-10-batches-bin" / "data_batch_2.bin").unlink()
    train = Cifar10(root, split="train", url="http://127.0.0.1:9/cifar-10-binary.tar.gz", md5=md5)
    assert train.num_samples == 20


def test_download_with_wrong_checksum_is_refused(tmp_path, local_server, no_proxy):
    served, base_url = local_server
    _, actual_md5 = write_cifar10_archive(served / "cifar-10-binary.tar.gz", num_train=5, num_test=5)
    expected_md5 = "0" * 32
    root = tmp_path / "data"
    with pytest.raises(DataError) as raised:
        Cifar10(root, url=f"{base_url}/cifar-10-binary.tar.gz", md5=expected_md5)
    message = str(raised.value)
    assert "cifar-10-binary.tar.gz" in message and expected_md5 in message and actual_md5 in message
    assert "\n" not in message
    assert not list(root.glob("*.tar.gz*"))  # the bad file is not kept as if it were good
    assert not (root / "cifar-10-batches-bin").exists()


def test_archive_escaping_its_directory_is_not_extracted(tmp_path, local_server, no_proxy):
    import hashlib
    import io
    import tarfile

    served, base_url = local_server
    archive = served / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        member = tarfile.TarInfo("../../escaped.txt")
        member.size = 3
        tar.addfile(member, io.BytesIO(b"bad"))
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    with pytest.raises(DataError, match="could not be extracted"):
        Cifar10(tmp_path / "a" / "b", url=f"{base_url}/evil.tar.gz", md5=md5)
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "a" / "escaped.txt").exists()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"split": "valid"}, ValueError, "split must be 'train' or 'test', got 'valid'"),
    ({"md5": "abc"}, ValueError, "md5 must be 32 hexadecimal digits"),
    ({"download": "no"}, TypeError, "download must be a bool"),
])
def test_constructor_validates_arguments(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        Cifar10(tmp_path, **kwargs)

"""DALI backend: decode, crop, scale and flip with an NVIDIA DALI pipeline, positions kept by dtrain.

dtrain partitions and orders the data itself (``MinibatchSource``: global timeline, per-rank
slice), so DALI never shards or shuffles: for each LOCAL minibatch the pipeline is fed, through
``fn.external_source``, the encoded bytes of exactly the files of that minibatch plus, per
sample, the crop box and flip flag computed by dtrain's position-keyed functions
(``ImageAugmentation.geometry``). The reading position therefore stays dtrain's and is
checkpointed like any source's, and a fixed seed gives the same crops, flips and labels as the
native backend. Colour jitter and normalisation run afterwards in torch, the same code as native.

Pairing: ``DaliImageDeserializer.get`` returns the sample INDICES as its features (int64
``[n]``); ``DaliImageAugmentation`` (the source's transform) turns them into images. Use them
together (``image_deserializer`` / ``image_transform`` with ``backend="dali"`` do).

Crop boxes are in pixels of the deserializer's decode size ``image_size`` and are given to DALI
as relative coordinates, so DALI crops the same region from the image at its stored size and
scales it once (bilinear, no antialiasing); the native backend first resizes to ``image_size``.
When the stored size equals ``image_size`` the two differ only by decoder rounding.

``nvidia.dali`` is imported lazily: install it with ``pip install nvidia-dali-cuda120``
(``dtrain[dali]``). ``device="cpu"`` runs everything on the CPU (``device_id=None``);
``device="gpu"`` decodes with nvJPEG (``"mixed"``) and resizes on the GPU.
"""

from __future__ import annotations


import numpy as np
import torch
from PIL import Image

from dtrain.data._checks import check_int
from dtrain.data.errors import DataError
from dtrain.data.augmentation import ImageAugmentation
from dtrain.data.map_file_images import MapFileImages

__all__ = ["DaliImageAugmentation", "DaliImageDeserializer", "dali_available"]

_DEVICES = ("auto", "cpu", "gpu")


def dali_available() -> bool:
    """True when ``nvidia.dali`` can be imported."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def _import_dali():
    try:
        import nvidia.dali as dali
        from nvidia.dali import fn, types
    except ImportError as error:
        raise ImportError(f"the DALI backend needs NVIDIA DALI ({error}); pip install nvidia-dali-cuda120 "
                          f"(or dtrain[dali]), or set source.backend=native") from error
    return dali, fn, types


class DaliImageDeserializer(MapFileImages):
    """A CNTK map file whose images are decoded later by ``DaliImageAugmentation``.

    ``get(indices)`` returns ``(indices as int64 [n], labels int64 [n])``; ``feature_shape`` is
    ``(3, *image_size)``, the decode size the crop geometry refers to.

    Args:
        map_file: ``path<TAB>label`` map file (see ``dtrain.data.mapfile``).
        image_size: ``[height, width]`` decode size; None: the first image's size.
        num_classes: number of classes; None: largest label + 1.
        check_files: check at construction that every listed file exists.

    Raises:
        DataError: a bad map file, a missing file or a label >= ``num_classes``.
    """

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample indices (int64 ``[n]``, decoded by the transform) and their int64 labels."""
        indices = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(indices.copy()), torch.from_numpy(self.map.labels[indices])

    def read_encoded(self, index: int) -> np.ndarray:
        """The encoded file bytes of sample ``index`` (uint8).

        Raises:
            DataError: the file is missing or unreadable (names the file and map-file line).
        """
        path = self.map.image_paths[index]
        try:
            return np.fromfile(path, dtype=np.uint8)
        except OSError as error:
            raise DataError(f"{self.map.where(index)}: cannot read image file {path} ({error}); fix the map file") from error


class DaliImageAugmentation(ImageAugmentation):
    """``ImageAugmentation`` whose decode, crop, scale and flip run in a DALI pipeline.

    Takes every ``ImageAugmentation`` option, plus:

    Args:
        device: ``"cpu"`` (DALI CPU operators, ``device_id=None``), ``"gpu"`` (nvJPEG ``mixed``
            decoding and GPU resize; outputs on ``cuda:<device_id>``) or ``"auto"`` (gpu when
            torch sees CUDA).
        device_id: CUDA device for ``"gpu"``; None: ``torch.cuda.current_device()``.
        num_threads: DALI CPU worker threads.
        max_batch_size: largest batch fed at once; bigger local minibatches are split.

    Raises:
        ImportError: DALI is not installed (names the pip package and the native fallback).
        ValueError: an option is out of range.
    """

    def __init__(self, *args, device: str = "auto", device_id: int | None = None, num_threads: int = 2,
                 max_batch_size: int = 256, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _import_dali()
        if device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {device!r}")
        if device == "auto":
            device = "gpu" if torch.cuda.is_available() else "cpu"
        if device == "gpu" and not torch.cuda.is_available():
            raise ValueError("device='gpu' needs CUDA, which torch does not see; use device='cpu'")
        self.device = device
        self.device_id = None if device == "cpu" else (
            torch.cuda.current_device() if device_id is None else check_int("device_id", device_id, 0))
        self.num_threads = check_int("num_threads", num_threads, 1)
        self.max_batch_size = check_int("max_batch_size", max_batch_size, 1)
        self._deserializer: DaliImageDeserializer | None = None
        self._pipeline = None

    def setup(self, deserializer: object) -> None:
        """Keep the deserializer whose files are decoded (and do ``ImageAugmentation.setup``).

        Raises:
            TypeError: the deserializer is not a ``DaliImageDeserializer``.
        """
        if not isinstance(deserializer, DaliImageDeserializer):
            raise TypeError(f"DaliImageAugmentation reads a DaliImageDeserializer, got {type(deserializer).__name__}; "
                            f"use backend='dali' for both (image_deserializer and image_transform)")
        super().setup(deserializer)
        self._deserializer = deserializer

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pipeline"] = None  # a built pipeline does not pickle; it is rebuilt on first use
        return state

    def _build(self):
        dali, fn, types = _import_dali()
        output_size = list(self.output_size or self._deserializer.image_size)
        decoder_device = "cpu" if self.device == "cpu" else "mixed"

        @dali.pipeline_def(batch_size=self.max_batch_size, num_threads=self.num_threads,
                           device_id=self.device_id, prefetch_queue_depth=1, exec_dynamic=True)
        def crop_scale_flip():
            encoded = fn.external_source(name="encoded", dtype=types.UINT8)
            roi_start = fn.external_source(name="roi_start", dtype=types.FLOAT)
            roi_end = fn.external_source(name="roi_end", dtype=types.FLOAT)
            flipped = fn.external_source(name="flip", dtype=types.INT32)
            images = fn.decoders.image(encoded, device=decoder_device, output_type=types.RGB)
            # ROI coordinates are (y, x), relative to the decoded image: the same region as the
            # native backend's box on the image_size decode, scaled once, as float pixels.
            images = fn.resize(images, size=output_size, roi_start=roi_start, roi_end=roi_end, roi_relative=True,
                               interp_type=types.INTERP_LINEAR, antialias=False, dtype=types.FLOAT)
            images = fn.flip(images, horizontal=flipped)
            return fn.transpose(images, perm=[2, 0, 1])

        pipeline = crop_scale_flip()
        pipeline.build()
        return pipeline

    def __call__(self, features: torch.Tensor, positions: np.ndarray, seed: int) -> torch.Tensor:
        """Decode and transform the samples whose INDICES are ``features`` (int64 ``[n]``).

        Returns:
            float32 ``[n, 3, *output_size]`` (on the DALI device).

        Raises:
            RuntimeError: ``setup`` was never called.
            ValueError: ``features`` is not an index vector matching ``positions``.
            DataError: an image file cannot be read or decoded (names it).
        """
        if self._deserializer is None:
            raise RuntimeError("DaliImageAugmentation was not set up; call setup(deserializer) first "
                               "(MinibatchSource does this)")
        positions = np.asarray(positions)
        if features.ndim != 1 or positions.shape != tuple(features.shape):
            raise ValueError(f"features must be sample indices [n] matching positions {positions.shape}, got shape "
                             f"{tuple(features.shape)}; pair DaliImageAugmentation with DaliImageDeserializer")
        indices = features.cpu().numpy().astype(np.int64)
        height, width = self._deserializer.image_size
        left, top, crop_width, crop_height, flipped = self.geometry(positions, seed, height, width)
        roi_start = np.stack([top / height, left / width], axis=1).astype(np.float32)
        roi_end = np.stack([(top + crop_height) / height, (left + crop_width) / width], axis=1).astype(np.float32)
        if self._pipeline is None:
            self._pipeline = self._build()
        chunks = []
        for start in range(0, len(indices), self.max_batch_size):
            chunk = slice(start, start + self.max_batch_size)
            chunks.append(self._run(indices[chunk], roi_start[chunk], roi_end[chunk], flipped[chunk]))
        if not chunks:
            out_height, out_width = self.output_size or (height, width)
            images = torch.zeros((0, 3, out_height, out_width), dtype=torch.float32)
        else:
            images = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
        return self.photometric(images, positions, seed)

    def _run(self, indices, roi_start, roi_end, flipped) -> torch.Tensor:
        encoded = [self._deserializer.read_encoded(int(index)) for index in indices]
        pipeline = self._pipeline
        pipeline.feed_input("encoded", encoded)
        pipeline.feed_input("roi_start", list(roi_start))
        pipeline.feed_input("roi_end", list(roi_end))
        pipeline.feed_input("flip", [np.array(int(f), dtype=np.int32) for f in flipped])
        try:
            (output,) = pipeline.run()
        except RuntimeError as error:
            self._pipeline = None  # a failed pipeline is not reused
            raise self._decode_error(indices, error) from error
        if self.device == "cpu":
            return torch.from_numpy(np.array(output.as_tensor()))
        from nvidia.dali.plugin.pytorch import feed_ndarray

        tensor = output.as_tensor()
        result = torch.empty(tensor.shape(), dtype=torch.float32, device=f"cuda:{self.device_id}")
        feed_ndarray(tensor, result, cuda_stream=torch.cuda.current_stream(self.device_id))
        return result

    def _decode_error(self, indices: np.ndarray, error: Exception) -> Exception:
        """A DataError naming the first file of the batch PIL cannot decode, else ``error``."""
        for index in indices:
            path = self._deserializer.map.image_paths[int(index)]
            try:
                with Image.open(path) as image:
                    image.load()
            except Exception as decode_error:  # noqa: BLE001 - any failure names the file
                return DataError(f"{self._deserializer.map.where(int(index))}: cannot decode image {path} "
                                 f"({decode_error})")
        return error

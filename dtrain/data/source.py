"""MinibatchSource: CNTK-style reading of a deserializer along an infinite, partitioned timeline.

Semantics (``docs/semantics.md#minibatch-source``): sizes are global and counted in samples. Every
worker builds the same source (same deserializer, seed, limits) and asks for the same global
minibatch size; each gets its contiguous share of the global minibatch, and all advance the
same global position. A checkpoint is just that position, so a run resumes on any world size.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

from dtrain.data._checks import check_bool, check_int, check_partition
from dtrain.data.partition import partition_bounds, range_to_indices, sweep_order

__all__ = ["Deserializer", "Minibatch", "MinibatchSource"]

# The keys of get_checkpoint_state(); restore requires exactly these.
_STATE_KEYS = ("position", "seed", "samples_per_sweep", "randomize")


class Deserializer(Protocol):
    """What a MinibatchSource reads from.

    Optionally also ``mean_image() -> torch.Tensor``: float32 per-pixel mean over the training
    split, shape ``feature_shape`` (used by ``ImageTransform(mean="dataset")``), and
    ``take(index: torch.Tensor)``: ``get`` for an int64 index tensor, which the source then calls
    with a slice of its cached sweep order (in-memory data, whose read is a few tensor calls); the
    slice is a view of that cache, to be read, never written to.
    """

    num_samples: int  # samples in one sweep
    feature_shape: tuple  # shape of one sample's features
    num_classes: int

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw features ``[len(indices), *feature_shape]`` and labels ``[len(indices), ...]``: int64 class
        indices, or floating-point targets (regression), whose dtype the source keeps."""
        ...


@dataclass
class Minibatch:
    """One partition's share of a global minibatch.

    Attributes:
        features: float32 ``[n, *feature_shape]`` after the transform (``n`` may be 0).
        labels: ``[n]`` int64 class indices (any integer dtype is widened to int64), or the
            deserializer's floating-point targets ``[n, ...]`` in their own dtype (regression).
        global_num_samples: samples in the whole global minibatch (all partitions together).
        sweep_end: True when this global minibatch contains the last sample of a sweep.
        first_position: global timeline position of the first of these samples (the share is contiguous).
        positions: int64 ``[n]`` global timeline positions of these samples (made when first asked
            for: the training loop never needs them, and every array it makes per step costs time).
    """

    features: torch.Tensor
    labels: torch.Tensor
    global_num_samples: int
    sweep_end: bool
    first_position: int

    @property
    def num_samples(self) -> int:
        """Samples in this partition's share (local ``n``)."""
        return int(self.labels.shape[0])

    @functools.cached_property
    def positions(self) -> np.ndarray:
        """``[first_position, first_position + n)`` as int64."""
        return np.arange(self.first_position, self.first_position + self.num_samples, dtype=np.int64)


class MinibatchSource:
    """Read a deserializer as an infinite sequence of sweeps, in global minibatches.

    Sweep ``s`` covers timeline positions ``[s*M, (s+1)*M)`` (``M = samples_per_sweep``) and,
    with ``randomize``, visits the data in a permutation that is a pure function of
    ``(randomization_seed, s)``; without it, in order. Reading stops at ``max_samples`` samples or
    at the end of sweep ``max_sweeps`` (at most one of them may be given); with neither, it
    never stops and minibatches may span a sweep boundary.

    Args:
        deserializer: has ``num_samples``, ``feature_shape``, ``num_classes`` and
            ``get(indices) -> (features, labels)``; see ``Deserializer``.
        randomize: shuffle each sweep (True) or read in data-set order (False).
        randomization_seed: seed of the per-sweep permutations and of random augmentation (>= 0).
        max_samples: total samples to read across all sweeps and partitions, or None.
        max_sweeps: number of sweeps to read, or None.
        transform: callable ``transform(features, positions, seed) -> float32 tensor`` applied to
            each local minibatch; if it has ``setup(deserializer)``, that is called once here.
            Without a transform, features are only converted to float32 (values unchanged).
        read_ahead: after returning a minibatch, read (decode and transform) the next one in a
            background thread, assuming the same size and partitions; a request that differs
            (another size, partition or position, after a restore) discards it and reads anew, so
            the stream is the same with or without. ``None``: on when the deserializer says reads
            are slow (``benefits_from_read_ahead``, e.g. decoding image files).

    Raises:
        TypeError: an argument has the wrong type (e.g. a deserializer without ``get``).
        ValueError: a value is out of range, or both ``max_samples`` and ``max_sweeps`` are given.
    """

    def __init__(
        self,
        deserializer: Deserializer,
        randomize: bool = True,
        randomization_seed: int = 0,
        max_samples: int | None = None,
        max_sweeps: int | None = None,
        transform: Callable[[torch.Tensor, np.ndarray, int], torch.Tensor] | None = None,
        read_ahead: bool | None = None,
    ) -> None:
        for attribute in ("num_samples", "feature_shape", "num_classes", "get"):
            if not hasattr(deserializer, attribute):
                raise TypeError(
                    f"deserializer must have num_samples, feature_shape, num_classes and get(); "
                    f"{type(deserializer).__name__} has no {attribute!r}"
                )
        self._samples_per_sweep = check_int("deserializer.num_samples", deserializer.num_samples, 1)
        self._randomize = check_bool("randomize", randomize)
        self._seed = check_int("randomization_seed", randomization_seed, 0)
        if max_samples is not None and max_sweeps is not None:
            raise ValueError(
                f"max_samples ({max_samples}) and max_sweeps ({max_sweeps}) are mutually exclusive; "
                "give at most one of them"
            )
        # _end_position: first timeline position that is never read (None: read forever).
        self._end_position: int | None = None
        if max_samples is not None:
            self._end_position = check_int("max_samples", max_samples, 0)
        if max_sweeps is not None:
            self._end_position = check_int("max_sweeps", max_sweeps, 0) * self._samples_per_sweep
        if transform is not None and not callable(transform):
            raise TypeError(
                f"transform must be callable as transform(features, positions, seed), got "
                f"{type(transform).__name__}"
            )
        self._deserializer = deserializer
        self._take = getattr(deserializer, "take", None)  # reads by index tensor (see Deserializer)
        self._transform = transform
        if transform is not None and hasattr(transform, "setup"):
            transform.setup(deserializer)
        self._position = 0
        if read_ahead is None:
            read_ahead = bool(getattr(deserializer, "benefits_from_read_ahead", False))
        self._read_ahead = check_bool("read_ahead", read_ahead)
        self._executor: ThreadPoolExecutor | None = None
        # the minibatch being read in the background: (request key, future)
        self._pending: tuple[tuple[int, int, int, int], Future] | None = None

    @property
    def read_ahead(self) -> bool:
        """Whether the next minibatch is read in the background (see the class docstring)."""
        return self._read_ahead

    @property
    def deserializer(self) -> Deserializer:
        """The deserializer this source reads."""
        return self._deserializer

    @property
    def samples_per_sweep(self) -> int:
        """Samples in one sweep (the deserializer's ``num_samples``)."""
        return self._samples_per_sweep

    @property
    def current_position(self) -> int:
        """Global timeline position: samples read so far by all partitions together."""
        return self._position

    def next_minibatch(
        self, minibatch_size_in_samples: int, num_data_partitions: int = 1, partition_index: int = 0
    ) -> Minibatch | None:
        """Read this partition's share of the next global minibatch and advance the position.

        The global minibatch is positions ``[p, p + B)``, clipped at the reading limit; partition
        ``k`` of ``N`` gets the slice ``partition_slice(p, size, N, k)``. Every partition must
        make the same calls: each returns a Minibatch (possibly with 0 local samples) for the
        same number of calls, then None on the same call, and all advance ``p`` by the global
        size.

        Args:
            minibatch_size_in_samples: global minibatch size ``B`` (samples, >= 1).
            num_data_partitions: number of partitions ``N`` (>= 1), usually the world size.
            partition_index: this partition ``k`` (``0 <= k < N``), usually the rank.

        Returns:
            The local Minibatch, or None once the reading limit is reached.

        Raises:
            TypeError / ValueError: an argument is not an int in its range.
        """
        global_size = minibatch_size_in_samples
        # plain ints in range (every call of a training loop) pass without a call; anything else is checked
        if not (type(global_size) is type(num_data_partitions) is type(partition_index) is int
                and global_size >= 1 and 0 <= partition_index < num_data_partitions):
            global_size = check_int("minibatch_size_in_samples", global_size, 1)
            num_data_partitions, partition_index = check_partition(
                "num_data_partitions", num_data_partitions, "partition_index", partition_index)
        request = self._request(self._position, global_size, num_data_partitions, partition_index)
        if request is None:
            self._discard_read_ahead()
            return None
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == request:
            minibatch = pending[1].result()  # an error of the background read is raised here
        else:
            if pending is not None:
                _wait_quietly(pending[1])  # never two reads at once: deserializers need not be thread-safe
            minibatch = self._read(*request)
        self._position = request[0] + request[1]
        if self._read_ahead:
            following = self._request(self._position, global_size, num_data_partitions, partition_index)
            if following is not None:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="dtrain-read-ahead")
                self._pending = (following, self._executor.submit(self._read, *following))
        return minibatch

    def _request(self, start_position: int, global_size: int, num_data_partitions: int,
                 partition_index: int) -> tuple[int, int, int, int] | None:
        """``(start, global size clipped at the reading limit, partitions, index)``; None past the limit."""
        if self._end_position is not None:
            if start_position >= self._end_position:
                return None
            global_size = min(global_size, self._end_position - start_position)
        return start_position, global_size, num_data_partitions, partition_index

    def _read(self, start_position: int, global_size: int, num_data_partitions: int, partition_index: int) -> Minibatch:
        """The minibatch of one request: a pure function of it (no state of the source changes)."""
        local_start, local_stop = partition_bounds(start_position, global_size, num_data_partitions, partition_index)
        features, labels = self._get(local_start, local_stop)
        sweeps_done_before = start_position // self._samples_per_sweep
        sweeps_done_after = (start_position + global_size) // self._samples_per_sweep
        minibatch = Minibatch(features=features, labels=_label_tensor(labels), global_num_samples=global_size,
                              sweep_end=sweeps_done_after > sweeps_done_before, first_position=local_start)
        minibatch.features = self._apply_transform(features, minibatch)
        return minibatch

    def _get(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The deserializer's features and labels of timeline positions ``[start, stop)``: through
        ``take`` with a slice of the sweep's order where it has one and the range lies in one sweep."""
        if self._take is not None and self._randomize:
            sweep, offset = divmod(start, self._samples_per_sweep)
            if offset + stop - start <= self._samples_per_sweep:
                order = _sweep_order_tensor(self._samples_per_sweep, self._seed, sweep)
                return self._take(order[offset:offset + stop - start])
        indices = range_to_indices(start, stop, self._samples_per_sweep, self._seed, self._randomize)
        return self._deserializer.get(indices)

    def _discard_read_ahead(self) -> None:
        """Drops the background read (after it finishes, so no read overlaps the next one)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            _wait_quietly(pending[1])

    def close(self) -> None:
        """Stops the read-ahead thread (reading again starts a new one)."""
        self._discard_read_ahead()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_executor"] = None  # threads and futures do not pickle; a copy reads ahead anew
        state["_pending"] = None
        return state

    def _apply_transform(self, features: torch.Tensor, minibatch: Minibatch) -> torch.Tensor:
        """The transform's float32 features of ``minibatch`` (at its positions); without a transform,
        ``features`` as float32 (no copy, and no call, when they already are)."""
        if self._transform is None:
            return features if features.dtype is torch.float32 else features.to(torch.float32)
        positions = minibatch.positions
        transformed = self._transform(features, positions, self._seed)
        if not isinstance(transformed, torch.Tensor) or transformed.dtype != torch.float32:
            raise TypeError(
                f"transform must return a float32 torch.Tensor, got "
                f"{getattr(transformed, 'dtype', type(transformed).__name__)}"
            )
        if transformed.shape[0] != len(positions):
            raise ValueError(
                f"transform must keep the number of samples ({len(positions)}), got {transformed.shape[0]}"
            )
        return transformed

    def get_checkpoint_state(self) -> dict[str, Any]:
        """Small dict of plain ints/bools that ``restore_from_checkpoint`` replays from.

        Keys: ``position`` (global timeline position), ``seed``, ``samples_per_sweep`` and
        ``randomize`` (the last three guard against restoring into a different stream).
        """
        return {
            "position": self._position,
            "seed": self._seed,
            "samples_per_sweep": self._samples_per_sweep,
            "randomize": self._randomize,
        }

    def restore_from_checkpoint(self, state: dict[str, Any]) -> None:
        """Continue reading from a state saved by ``get_checkpoint_state``.

        The next minibatches equal the ones the saved source would have read next, whatever
        ``num_data_partitions`` is used now (the position is global).

        Raises:
            TypeError: ``state`` is not a dict or a value has the wrong type.
            ValueError: a key is missing or unknown, or the state's seed, sweep size or
                randomize flag differs from this source's (it would replay another stream).
        """
        if not isinstance(state, dict):
            raise TypeError(f"checkpoint state must be a dict, got {type(state).__name__}")
        missing = [key for key in _STATE_KEYS if key not in state]
        unknown = sorted(set(state) - set(_STATE_KEYS))
        if missing or unknown:
            raise ValueError(
                f"checkpoint state must have keys {list(_STATE_KEYS)}; missing {missing}, unknown {unknown}"
            )
        position = check_int("state['position']", state["position"], 0)
        seed = check_int("state['seed']", state["seed"], 0)
        samples_per_sweep = check_int("state['samples_per_sweep']", state["samples_per_sweep"], 1)
        randomize = check_bool("state['randomize']", state["randomize"])
        if seed != self._seed:
            raise ValueError(
                f"checkpoint state has seed {seed} but this source has randomization_seed "
                f"{self._seed}; build the source with randomization_seed={seed}"
            )
        if samples_per_sweep != self._samples_per_sweep:
            raise ValueError(
                f"checkpoint state has samples_per_sweep {samples_per_sweep} but this source's "
                f"deserializer has {self._samples_per_sweep} samples; restore onto the same data set"
            )
        if randomize != self._randomize:
            raise ValueError(
                f"checkpoint state has randomize={randomize} but this source has "
                f"randomize={self._randomize}; build the source with randomize={randomize}"
            )
        self._discard_read_ahead()
        self._position = position


@functools.lru_cache(maxsize=4)  # the sweeps being read by a few streams at once (train, cross-validation, ...)
def _sweep_order_tensor(num_samples: int, seed: int, sweep: int) -> torch.Tensor:
    """``sweep_order`` of a randomized sweep as an int64 tensor (cached: a minibatch reads a slice of it;
    a copy, because the shared order is read-only and torch tensors cannot be)."""
    return torch.from_numpy(sweep_order(num_samples, seed, sweep, True).copy())


def _wait_quietly(future: Future) -> None:
    """Waits for a discarded background read; its result or error is not needed."""
    try:
        future.result()
    except Exception:  # noqa: BLE001 - a read that was not asked for cannot fail the one that was
        pass


def _label_tensor(labels: torch.Tensor) -> torch.Tensor:
    """Integer class labels as int64 (what torch's classification losses take); floating-point
    targets unchanged, so a regression target of 0.25 stays 0.25."""
    if labels.dtype is torch.int64 or labels.dtype.is_floating_point or labels.dtype.is_complex:
        return labels
    return labels.to(torch.int64)

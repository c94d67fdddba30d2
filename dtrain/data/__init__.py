"""Data layer: CNTK-style MinibatchSource over deserializers, partition maths and augmentation.

Sizes are global and counted in samples; each worker reads its share of every global minibatch
(see ``MinibatchSource.next_minibatch``).
"""

from dtrain.data.arrays import ArrayDeserializer
from dtrain.data.augment import ImageTransform
from dtrain.data.cifar10 import Cifar10
from dtrain.data.digits import Digits
from dtrain.data.errors import DataError
from dtrain.data.partition import partition_slice, sweep_order, timeline_to_indices
from dtrain.data.source import Deserializer, Minibatch, MinibatchSource

__all__ = [
    "ArrayDeserializer",
    "Cifar10",
    "DataError",
    "Deserializer",
    "Digits",
    "ImageTransform",
    "Minibatch",
    "MinibatchSource",
    "partition_slice",
    "sweep_order",
    "timeline_to_indices",
]

"""Data layer: CNTK-style MinibatchSource over deserializers, partition maths and augmentation.

Sizes are global and counted in samples; each worker reads its share of every global minibatch
(see ``MinibatchSource.next_minibatch``).
"""

from dtrain.data.arrays import ArrayDeserializer
from dtrain.data.augmentation import ImageAugmentation, crop_geometry
from dtrain.data.char_corpus import CharCorpus
from dtrain.data.cifar10 import Cifar10
from dtrain.data.cmudict import CMUDict
from dtrain.data.composite import CompositeDeserializer
from dtrain.data.ctf import CTFDeserializer
from dtrain.data.dataset import DatasetDeserializer
from dtrain.data.digits import Digits
from dtrain.data.errors import DataError
from dtrain.data.images import ImageFolderDeserializer, image_deserializer, image_transform
from dtrain.data.limits import FULL_DATA_SWEEP, INFINITELY_REPEAT
from dtrain.data.mapfile import MapFile, read_map_file
from dtrain.data.partition import partition_slice, sweep_order, timeline_to_indices
from dtrain.data.deserializer import Deserializer, FeaturesAndLabels, StreamDeserializer
from dtrain.data.minibatch import Minibatch
from dtrain.data.parquet import ParquetShards
from dtrain.data.source import MinibatchSource
from dtrain.data.stream_arrays import NpzStreams, StreamArrays
from dtrain.data.streams import Sequences, StreamInfo, StreamReference
from dtrain.data.tar_shards import TarShards
from dtrain.data.transform import ImageTransform
from dtrain.data.user_source import UserMinibatchSource, as_source

__all__ = [
    "ArrayDeserializer",
    "CMUDict",
    "CTFDeserializer",
    "CharCorpus",
    "Cifar10",
    "CompositeDeserializer",
    "DataError",
    "DatasetDeserializer",
    "Deserializer",
    "FULL_DATA_SWEEP",
    "FeaturesAndLabels",
    "Digits",
    "ImageAugmentation",
    "ImageFolderDeserializer",
    "ImageTransform",
    "INFINITELY_REPEAT",
    "MapFile",
    "Minibatch",
    "MinibatchSource",
    "NpzStreams",
    "ParquetShards",
    "Sequences",
    "StreamArrays",
    "StreamDeserializer",
    "StreamInfo",
    "StreamReference",
    "TarShards",
    "UserMinibatchSource",
    "as_source",
    "crop_geometry",
    "image_deserializer",
    "image_transform",
    "partition_slice",
    "read_map_file",
    "sweep_order",
    "timeline_to_indices",
]

"""Layers that need the job's communicator: synchronized BatchNorm and BatchNorm statistics recomputed at the end."""
from dtrain.nn.sync_batchnorm import BatchNormSync, SyncBatchNorm, batchnorm_layers, convert_sync_batchnorm

__all__ = ["BatchNormSync", "SyncBatchNorm", "batchnorm_layers", "convert_sync_batchnorm"]

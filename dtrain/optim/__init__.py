"""Optimizers for large global minibatches: LARS, LAMB, and RMSprop warm-up then SGD (``docs/large-minibatch.md``)."""
from dtrain.optim.groups import norm_and_bias_groups, optimizer_parameters
from dtrain.optim.lamb import LAMB
from dtrain.optim.lars import LARS
from dtrain.optim.rmsprop_warmup_sgd import RMSpropWarmupSGD

__all__ = ["LAMB", "LARS", "RMSpropWarmupSGD", "norm_and_bias_groups", "optimizer_parameters"]

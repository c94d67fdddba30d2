"""The sharded two-level learner's checkpoint helpers: per-rank tensors moved out of ``dtrain.pt`` into the sharded
files and back, and the outer state's entries of ``W_prev``'s size marked as sharded."""
from __future__ import annotations

import torch

from dtrain.learners.host_shards import (SHARDED, flat_entries, join_tensors, outer_state_markers,
                                         placeholder_templates, sharded_entries, split_tensors)


def test_a_nested_state_splits_into_small_placeholders_and_its_tensors_and_joins_back():
    state = {"name": "quantized", "per_key": {"model": {"num_bits": 4, "worker_residual": torch.arange(6.0),
                                                        "owner_residual": None, "shapes": [(2, 3)]}},
             "factors": [torch.ones(2, 2, dtype=torch.float64), 7]}
    skeleton, tensors = split_tensors(state)
    assert sorted(tensors) == ["/factors/0", "/per_key/model/worker_residual"]
    assert not any(torch.is_tensor(value) for value in _leaves(skeleton))  # nothing big left for rank 0's file
    templates = placeholder_templates(skeleton)
    assert {key: (tuple(value.shape), value.dtype) for key, value in templates.items()} == \
        {"/factors/0": ((2, 2), torch.float64), "/per_key/model/worker_residual": ((6,), torch.float32)}
    joined = join_tensors(skeleton, {key: value.clone() for key, value in tensors.items()})
    assert joined["name"] == "quantized" and joined["per_key"]["model"]["shapes"] == [(2, 3)]
    assert torch.equal(joined["per_key"]["model"]["worker_residual"], torch.arange(6.0))
    assert joined["per_key"]["model"]["owner_residual"] is None and joined["factors"][1] == 7
    assert torch.equal(joined["factors"][0], torch.ones(2, 2, dtype=torch.float64))


def test_the_outer_state_of_w_prevs_size_is_marked_sharded_and_the_rest_kept():
    flat = 10
    state = {"state": {0: {"momentum_buffer": torch.ones(flat), "step": torch.tensor(3.0)}},
             "param_groups": [{"lr": 0.7, "params": [0]}]}
    marked = outer_state_markers(state, flat)
    assert marked["state"][0]["momentum_buffer"] == SHARDED
    assert torch.equal(marked["state"][0]["step"], torch.tensor(3.0)) and marked["param_groups"] == state["param_groups"]
    assert sharded_entries(marked) == [(0, "momentum_buffer")]
    assert [(index, key) for index, key, _ in flat_entries(state, flat)] == [(0, "momentum_buffer")]
    assert sharded_entries(None) == [] and flat_entries({"state": {}}, flat) == []


def _leaves(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value

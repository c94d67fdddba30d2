"""A checkpoint's config identity: a setting added to a schema later restores at its default, and only there; a
checkpoint of the retired quantized learner restores into the data-parallel learner with the same bits."""
from __future__ import annotations

import pytest
import torch

from dtrain.exchange import Quantized
from dtrain.learners import DataParallelLearner
from dtrain.session.checkpoint import CheckpointError
from dtrain.session.checkpoint_state import (check_restorable, describe_config_mismatch, from_the_quantized_learner,
                                             learner_identity)

DEFAULTS = {"model": {"hidden": 128, "batch_norm": False}}


def test_a_setting_the_checkpoint_predates_matches_at_its_default_only():
    saved = {"model": {"hidden": 16}, "seed": 0}  # written before model.batch_norm existed
    assert describe_config_mismatch(saved, {"model": {"hidden": 16, "batch_norm": False}, "seed": 0},
                                    defaults=DEFAULTS) is None
    assert describe_config_mismatch(saved, {"model": {"hidden": 16, "batch_norm": True}, "seed": 0},
                                    defaults=DEFAULTS) == "model.batch_norm is missing from the checkpoint's config"
    # without the schema's defaults (a user's model) the key still decides
    assert describe_config_mismatch(saved, {"model": {"hidden": 16, "batch_norm": False}, "seed": 0}) is not None


def test_values_that_differ_are_refused_whatever_the_defaults():
    assert describe_config_mismatch({"model": {"hidden": 16}}, {"model": {"hidden": 128}}, defaults=DEFAULTS) \
        == "model.hidden was 16 in the checkpoint's run and is 128 now"


def _quantized_learners_checkpoint(model: torch.nn.Module, bits: int) -> dict:
    """What the retired quantized learner (kind ``quantized``, its bits beside) wrote, cut to what a restore reads."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    learner = {"kind": "quantized", "optimizer": optimizer.state_dict(), "samples_seen": 640, "distributed_after": 0,
               "exchange_world_size": 2, "num_quantization_bits": bits}
    identity = {"model_type": "torch.nn.modules.linear.Linear", "train_data": {"num_samples": 1500},
                "learner": {"kind": "quantized", "num_quantization_bits": bits, "optimizer": "torch.optim.sgd.SGD"}}
    return {"model": model.state_dict(), "learner": learner, "learner_kind": "quantized", "source": {}, "per_rank": [],
            "world_size": 2, "samples_seen": 640, "minibatches": 10, "cv_index": 0, "identity": identity}


def test_a_checkpoint_of_the_quantized_learner_restores_into_the_data_parallel_learner_with_its_bits():
    model = torch.nn.Linear(4, 2)
    state = from_the_quantized_learner(_quantized_learners_checkpoint(model, bits=2))
    for bits, restores in ((2, True), (1, False)):
        learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      exchange=Quantized(bits))
        expected = {"model_type": "torch.nn.modules.linear.Linear", "learner": learner_identity(learner),
                    "train_data": {"num_samples": 1500}}
        if restores:
            check_restorable("old.pt", state, model, learner, expected)
            learner.load_state_dict(state["learner"])
            assert learner.samples_seen == 640
        else:
            with pytest.raises(CheckpointError, match="learner.exchange.num_bits was 2 in the checkpoint's run and "
                                                      "is 1 now"):
                check_restorable("old.pt", state, model, learner, expected)
    other = {"learner_kind": "data_parallel", "learner": {"kind": "data_parallel"}}
    assert from_the_quantized_learner(other) is other  # any other checkpoint as it was

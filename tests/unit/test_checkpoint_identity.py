"""A checkpoint's config identity: a setting added to a schema later restores at its default, and only there."""
from __future__ import annotations

from dtrain.session.checkpoint_state import describe_config_mismatch

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

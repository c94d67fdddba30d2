"""Values the schemas' types let through that a rule must refuse: switches written as anything but
true or false, and the options of the torch losses and metrics outside the ranges torch documents."""
from __future__ import annotations

import copy
import dataclasses
import typing
import functools

import pytest
from omegaconf import DictConfig, OmegaConf

from dtrain import config
from dtrain.config import validate

from tests.helpers.config import compose_config

# (overrides that bring the key into the config, the switch's dotted key); every switch of every schema
SWITCHES = [
    (("learner=fsdp",), "learner.reshard_after_forward"),
    (("learner=fsdp",), "learner.cpu_offload"),
    (("learner=fsdp",), "learner.activation_checkpointing"),
    (("learner=two_level_diloco",), "learner.shard"),
    (("learner=two_level_block_momentum",), "learner.shard"),
    (("learner=two_level_local_sgd",), "learner.shard"),
    (("learner=block_momentum",), "learner.use_nesterov_momentum"),
    (("learner=block_momentum",), "learner.reset_sgd_momentum_after_aggregation"),
    (("learner=diloco",), "learner.outer_nesterov"),
    (("learner=two_level_diloco",), "learner.outer_nesterov"),
    (("learner=two_level_block_momentum",), "learner.use_nesterov_momentum"),
    (("learner=two_level_block_momentum",), "learner.reset_sgd_momentum_after_aggregation"),
    (("learner=block_momentum",), "learner.momentum_correction"),
    (("learner=two_level_block_momentum",), "learner.momentum_correction"),
    (("learner=diloco",), "learner.momentum_correction"),
    (("learner=two_level_diloco",), "learner.momentum_correction"),
    (("learner=block_momentum",), "learner.overlap"),
    (("learner=two_level_block_momentum",), "learner.overlap"),
    (("learner=diloco",), "learner.overlap"),
    (("learner=two_level_diloco",), "learner.overlap"),
    (("learner=local_sgd",), "learner.overlap"),
    (("learner=two_level_local_sgd",), "learner.overlap"),
    (("learner/exchange=quantized",), "learner.exchange.error_feedback"),
    (("learner=powersgd",), "learner.exchange.use_error_feedback"),
    (("learner=powersgd",), "learner.exchange.warm_start"),
    ((), "optimizer.nesterov"),
    (("optimizer=lars",), "optimizer.exclude_norm_and_bias"),
    (("optimizer=lamb",), "optimizer.exclude_norm_and_bias"),
    (("optimizer=lamb",), "optimizer.bias_correction"),
    (("model=resnet50",), "model.zero_init_residual"),
    (("+recipe=cifar10",), "source.train.transform.flip"),
    ((), "source.train.randomize"),
    ((), "source.train.read_ahead"),
    ((), "session.checkpoint.restore"),
    ((), "session.checkpoint.preserve_all"),
    ((), "session.unit_gain_momentum"),
    ((), "session.tensorboard"),
    ((), "session.progress_bar"),
    ((), "session.keep_host_memory"),
    ((), "session.compile"),
    ((), "session.profile.enabled"),
    ((), "session.sync_batchnorm"),
    ((), "model.batch_norm"),
    (("learner=local_sgd", "learner.block_size=640", "learner.distributed_after=0", "session.max_samples=6400",
      "fault_tolerance.lighthouse=http://localhost:29510", "fault_tolerance.replica_id=a"), "fault_tolerance.enabled"),
]

#: 0 and 1 are refused too: the Python API refuses them (checks.boolean), and one rule for both means a
#: value copied from a config into code (or back) means the same thing
NOT_SWITCHES = [2, "yes", 1.0, 1, 0, "true"]


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    recipe = () if any(item.startswith("+recipe=") for item in overrides) else ("+recipe=digits",)
    return compose_config(*recipe, *overrides)


def _with(overrides: tuple[str, ...], key: str, value) -> DictConfig:
    cfg = copy.deepcopy(_composed(overrides))
    OmegaConf.update(cfg, key, value, merge=False)
    return cfg


@pytest.mark.parametrize("overrides, key", SWITCHES, ids=[key for _, key in SWITCHES])
def test_a_switch_is_true_or_false_and_nothing_else(overrides, key):
    for value in NOT_SWITCHES:
        problems = validate(_with(overrides, key, value), check_run_dir=False)
        assert problems == [f"{key}={value!r}: expected true or false" + (" or null" if _nullable(key) else "")]
    for accepted in (True, False) + ((None,) if _nullable(key) else ()):
        assert validate(_with(overrides, key, accepted), check_run_dir=False) == []


def _nullable(key: str) -> bool:
    return key.rsplit(".", 1)[1] in ("read_ahead", "tensorboard", "progress_bar", "use_error_feedback")


def _with_nested_sections(schemas: set[type]) -> set[type]:
    """The schemas and every dataclass their fields are typed with (``session.checkpoint``, schedules, ...)."""
    found, todo = set(), list(schemas)
    while todo:
        schema = todo.pop()
        if schema in found:
            continue
        found.add(schema)
        hints = typing.get_type_hints(schema)
        todo += [kind for hint in hints.values() for kind in (hint, *typing.get_args(hint))
                 if isinstance(kind, type) and dataclasses.is_dataclass(kind)]
    return found


def test_every_switch_of_every_schema_is_kept_as_written_and_tested_above():
    """A switch typed ``bool`` would be converted by OmegaConf (2 -> true) before any rule sees it."""
    schemas = _with_nested_sections(set(config.SCHEMAS.values()))
    switches = {(schema.__name__, item.name) for schema in schemas for item in dataclasses.fields(schema)
                if item.name != "_partial_" and ("bool" in str(item.type).lower())}
    assert all(item.type in ("StrictBool", "Optional[StrictBool]")
               for schema in schemas for item in dataclasses.fields(schema)
               if (schema.__name__, item.name) in switches), "a schema switch typed bool"
    by_target = {item.default: schema.__name__ for schema in schemas for item in dataclasses.fields(schema)
                 if item.name == "_target_"}
    tested = set()
    for overrides, key in SWITCHES:
        parent_key, name = key.rsplit(".", 1)
        parent = OmegaConf.select(_composed(overrides), parent_key)
        schema = parent._metadata.object_type
        tested.add((schema.__name__ if dataclasses.is_dataclass(schema) else by_target[parent._target_], name))
    assert tested == switches


@pytest.mark.parametrize("overrides, problem", [
    (("loss.label_smoothing=-0.1",), "loss.label_smoothing=-0.1: expected a number in [0.0, 1.0]"),
    (("loss.label_smoothing=1.5",), "loss.label_smoothing=1.5: expected a number in [0.0, 1.0]"),
    (("loss=sequence_cross_entropy", "loss.label_smoothing=1.0"),
     "loss.label_smoothing=1.0: expected a number in [0.0, 1.0)"),
    (("loss=sequence_cross_entropy", "loss.label_smoothing=-0.5"),
     "loss.label_smoothing=-0.5: expected a number in [0.0, 1.0)"),
    (("metric=top5_error", "metric.k=0"), "metric.k=0: expected a whole number of classes of at least 1"),
], ids=["smoothing-negative", "smoothing-above-1", "sequence-smoothing-1", "sequence-smoothing-negative", "top-k-0"])
def test_loss_and_metric_options_outside_torchs_ranges_are_refused(overrides, problem):
    assert validate(_composed(overrides), check_run_dir=False) == [problem]


def test_the_ends_of_torchs_label_smoothing_range_are_accepted():
    for value in ("0.0", "1.0"):
        assert validate(_composed((f"loss.label_smoothing={value}",)), check_run_dir=False) == []

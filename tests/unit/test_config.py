"""The shipped config tree: every recipe composes and instantiates with every learner; typos fail early."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from _cifar_files import write_cifar10_binary
from _image_files import write_image_map_files
from dtrain.cli import config_dir
from dtrain.comm import LocalCommunicator
from dtrain.config import register_schemas, validate

CONF = Path(config_dir())
RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))
LEARNERS = sorted(p.stem for p in (CONF / "learner").glob("*.yaml"))


def compose_config(*overrides: str):
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_the_tree_ships_the_documented_recipes_and_learners():
    assert {"digits", "cifar10"} <= set(RECIPES)
    assert {"local", "data_parallel", "quantized", "block_momentum"} <= set(LEARNERS)


@pytest.mark.parametrize("learner", LEARNERS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_instantiates_with_every_learner(recipe, learner, tmp_path):
    write_cifar10_binary(tmp_path, num_train=20, num_test=10)
    write_image_map_files(tmp_path, num_train=8, num_val=4)  # recipe imagenet's map files
    cfg = compose_config(f"+recipe={recipe}", f"learner={learner}", f"data.root={tmp_path}")
    assert validate(cfg) == []
    OmegaConf.resolve(cfg)
    model = instantiate(cfg.model)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    learner_object = instantiate(cfg.learner, optimizer=optimizer, comm=LocalCommunicator())
    assert learner_object.optimizer is optimizer
    for name in ("train", "test", "cv"):
        if cfg.source[name] is not None:
            source = instantiate(cfg.source[name])
            batch = source.next_minibatch(4)
            output = model.eval()(batch.features)
            assert output.shape == (batch.num_samples, cfg.model.num_classes)
            assert batch.labels.dtype == torch.int64


def test_cifar10_recipe_converts_cntk_schedule_to_per_minibatch_rates():
    cfg = compose_config("+recipe=cifar10")
    assert cfg.session.minibatch_size == 64 and cfg.optimizer.lr == 0.1
    from dtrain.schedules import Schedule

    lr = Schedule(OmegaConf.to_container(cfg.session.lr_schedule["values"]), cfg.session.lr_schedule.epoch_size)
    per_sample = [0.0015625, 0.00046875, 0.00015625, 0.000046875, 0.000015625]
    for epoch, expected in zip((0, 20, 40, 60, 70), per_sample):
        assert cfg.optimizer.lr * lr(epoch * 50000) == pytest.approx(expected * 64)


@pytest.mark.parametrize("override, fragment", [
    ("session.minibatch_sise=5", "minibatch_sise"),
    ("learner.block_learning_rate=abc", "block_learning_rate"),
    ("session.max_samples=many", "max_samples"),
    ("optimizer.lrr=0.1", "lrr"),
])
def test_typos_and_wrong_types_fail_at_compose_time_naming_the_key(override, fragment):
    overrides = ["+recipe=digits", override]
    if override.startswith("learner.block"):
        overrides.insert(1, "learner=block_momentum")
    with pytest.raises(ConfigCompositionException, match=fragment):
        compose_config(*overrides)


def test_unknown_recipe_lists_the_available_ones():
    with pytest.raises(ConfigCompositionException, match=r"Could not find 'recipe/imagenette'(.|\n)*cifar10\n\tdigits"):
        compose_config("+recipe=imagenette")


@pytest.mark.parametrize("overrides, fragment", [
    ((), "no recipe chosen"),
    (("+recipe=digits", "session.minibatch_size=0"), "session.minibatch_size=0: expected a positive"),
    (("+recipe=digits", "session.max_samples=-10"), "session.max_samples=-10"),
    (("+recipe=digits", "learner=quantized", "learner.num_quantization_bits=0"), "num_quantization_bits=0: expected 1 to 32"),
    (("+recipe=digits", "learner=quantized", "learner.num_quantization_bits=33"), "expected 1 to 32"),
    (("+recipe=digits", "learner=block_momentum", "learner.block_momentum_as_time_constant=-3"), "time_constant=-3.0"),
    (("+recipe=digits", "learner=block_momentum", "+learner.num_quantization_bits=1"), "cannot be combined"),
    (("+recipe=digits", "comm.backend=mpi"), "comm.backend='mpi'"),
    (("+recipe=digits", "learner=quantized", "learner.distributed_after=-1"),
     "learner.distributed_after=-1: expected a non-negative integer"),
    # block_size and distributed_after also take "auto", so a word other than that is refused here
    (("+recipe=digits", "learner=block_momentum", "learner.block_size=abc"),
     "learner.block_size='abc': expected a positive number of samples or auto"),
    (("+recipe=digits", "learner=quantized", "learner.distributed_after=soon"),
     "learner.distributed_after='soon': expected a non-negative integer"),
    (("+recipe=digits", "session.checkpoint.preemption_signal=SIG_IGN"), "preemption_signal='SIG_IGN'"),
    (("+recipe=digits", "optimizer.lr=0"), "optimizer.lr=0"),
])
def test_out_of_range_values_are_all_reported_before_anything_runs(overrides, fragment):
    problems = validate(compose_config(*overrides))
    assert any(fragment in problem for problem in problems), problems

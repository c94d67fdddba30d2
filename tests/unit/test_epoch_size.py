"""``session.epoch_size``: one key for CNTK's ``-e``, which a recipe's max_samples, frequencies and schedules
refer to (``${session.epoch_size}``, ``${epochs:N}``); refused when nothing refers to it."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from dtrain.config import validate

from tests.helpers.config import compose_config

# what each recipe resolved to before it named its epoch: its behaviour by default must not change
BEFORE = {
    "cifar10": {"max_samples": 8000000, "progress_frequency": 50000, "checkpoint.frequency": 50000,
                "lr_schedule.epoch_size": 50000, "momentum_time_constant_schedule.epoch_size": 50000},
    "digits": {"max_samples": 30000, "progress_frequency": 7500, "checkpoint.frequency": 15000,
               "lr_schedule.epoch_size": 1500},
    "imagenet": {"max_samples": 115305030, "progress_frequency": 1281167, "checkpoint.frequency": 1281167,
                 "lr_schedule.epoch_size": 1281167},
}


def sizes(*overrides: str, recipe: str = "cifar10") -> dict:
    session = compose_config(f"+recipe={recipe}", *overrides).session
    return {key: OmegaConf.select(session, key) for key in BEFORE[recipe]}


@pytest.mark.parametrize("recipe", sorted(BEFORE))
def test_every_recipe_resolves_to_the_sizes_it_had(recipe):
    assert sizes(recipe=recipe) == BEFORE[recipe]
    assert validate(compose_config(f"+recipe={recipe}"), check_run_dir=False) == []


def test_one_key_sets_cntks_epoch_size_everywhere():
    assert sizes("session.epoch_size=10000") == {
        "max_samples": 1600000, "progress_frequency": 10000, "checkpoint.frequency": 10000,
        "lr_schedule.epoch_size": 10000, "momentum_time_constant_schedule.epoch_size": 10000}
    assert sizes("session.max_samples=${epochs:10}")["max_samples"] == 500000  # CNTK's -n 10


@pytest.mark.parametrize("overrides, problem", [
    (("session.epoch_size=2000", "session.max_samples=6000", "session.progress_frequency=600",
      "session.checkpoint.frequency=600", "session.lr_schedule.epoch_size=1500"),
     "session.epoch_size=2000: no setting of this config refers to it, so it would change nothing"),
    (("session.max_samples=${epochs:0.0001}",), "session.max_samples: ValueError raised while resolving interpolation: "
                                               "${epochs:0.0001} is 0.15 samples of session.epoch_size=1500"),
    (("session.max_samples=${epochs:-2}",), "${epochs:-2}=-2: expected a positive finite number of epochs"),
])
def test_an_epoch_size_that_would_change_nothing_or_a_bad_count_is_refused(overrides, problem):
    problems = validate(compose_config("+recipe=digits", *overrides), check_run_dir=False)
    assert any(line.startswith(problem) or problem in line for line in problems), problems
    assert all("\n" not in line for line in problems)

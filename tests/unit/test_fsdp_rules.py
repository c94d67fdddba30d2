"""``learner=fsdp``'s settings and wrapping policy, without processes: the config's one-line refusals, which modules
become units, parameters tied across units, and one process training as the local learner."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.config import validate
from dtrain.learners import fsdp_learner
from dtrain.learners.fsdp import tied_across_units, wrapped_units
from dtrain.models.char_transformer import CharTransformer

from tests.helpers.config import compose_config


@pytest.mark.parametrize("override, problem", [
    ("learner.wrap=layers", "learner.wrap='layers': expected blocks, children or a list of module class names"),
    ("learner.wrap=[]", "learner.wrap=[]: expected blocks, children or a list of module class names"),
    ("learner.param_dtype=float16", "learner.param_dtype='float16': expected one of float32, bfloat16"),
    ("learner.reduce_dtype=fp32", "learner.reduce_dtype='fp32': expected one of float32, bfloat16"),
    ("learner.shard_over=rack", "learner.shard_over='rack': expected one of job, host"),
])
def test_a_bad_setting_is_one_line(override, problem):
    problems = validate(compose_config("+recipe=shakespeare_char", "learner=fsdp", override), check_run_dir=False)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_the_shipped_settings_and_a_class_list_are_accepted():
    for override in ("learner.wrap=children", "learner.wrap=[_Block]", "learner.param_dtype=bfloat16",
                     "learner.shard_over=host"):
        assert validate(compose_config("+recipe=shakespeare_char", "learner=fsdp", override), check_run_dir=False) == []


def test_units_by_policy():
    model = CharTransformer(20, context_length=16, layers=3, heads=2, width=8)
    assert [name for name, _ in wrapped_units(model, "blocks")] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [name for name, _ in wrapped_units(model, ["_Block"])] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [name for name, _ in wrapped_units(model, ["_Block", "Linear"])] == ["blocks.0", "blocks.1", "blocks.2",
                                                                                  "read_out"]
    assert "token_embedding" in [name for name, _ in wrapped_units(model, "children")]
    with pytest.raises(ValueError, match=r"learner.wrap=blocks matches no module of Sequential \(it has no "
                                         r"nn.ModuleList of blocks\)"):
        wrapped_units(nn.Sequential(nn.Linear(2, 2)), "blocks")


def test_tied_parameters_across_units_are_named():
    model = CharTransformer(20, context_length=16, layers=2, heads=2, width=8)
    assert tied_across_units(model, wrapped_units(model, "blocks")) is None  # both users outside every unit
    assert tied_across_units(model, wrapped_units(model, "children")) == \
        "read_out.weight is tied to a parameter of token_embedding"
    assert tied_across_units(model, wrapped_units(model, ["Linear"])) == \
        "token_embedding.weight (outside every unit) is tied to a parameter of read_out"


def test_one_process_is_the_local_learner():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    learner = fsdp_learner(torch.optim.SGD(model.parameters(), lr=0.1))
    learner.prepare(model)
    assert not learner.shards_model and "one process" in learner.describe()
    before = [p.detach().clone() for p in model.parameters()]
    learner.begin_minibatch(5, 5)
    model(torch.randn(5, 3)).sum().backward()
    learner.step()
    assert learner.samples_seen == 5 and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))

"""The two-level gradient learner without processes: its refusals (one process, one host), the unequal
hosts it accepts, the wrapper's type check, and the presets composing with their defaults and rules."""
from __future__ import annotations

import pytest
import torch

from dtrain.comm.base import HostGroups
from dtrain.comm.local import LocalCommunicator
from dtrain.config import validate
from dtrain.exchange import BetweenHosts, Quantized
from dtrain.learners import TwoLevelDataParallelLearner
from dtrain.learners.two_level import host_layout

from tests.helpers.config import compose_config
from tests.helpers.two_level_runs import FakeJob


def test_one_process_is_refused_naming_the_one_level_learners() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"needs several hosts; this job runs on 1 host x 1 rank .* "
                                         r"\(e\.g\. learner=quantized or learner=powersgd\)"):
        TwoLevelDataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1), LocalCommunicator(),
                                    exchange=Quantized())


def test_one_host_is_refused_and_unequal_hosts_are_taken() -> None:
    with pytest.raises(ValueError, match="needs several hosts; this job runs on 1 host x 3 ranks"):
        host_layout(FakeJob([[0, 1, 2]], local_size=3), None, equal_hosts=False)
    assert host_layout(FakeJob([[0, 1, 2], [3, 4]]), None, equal_hosts=False)[0] == [[0, 1, 2], [3, 4]]


def test_the_wrapper_takes_only_a_plain_strategy() -> None:
    groups = HostGroups(LocalCommunicator(), LocalCommunicator())
    with pytest.raises(TypeError, match="inner must be a dtrain.exchange.Exchange strategy between hosts"):
        BetweenHosts("quantized", groups)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got BetweenHosts"):
        BetweenHosts(BetweenHosts(Quantized(), groups), groups)
    wrapper = BetweenHosts(Quantized(num_bits=2), groups)
    assert (wrapper.lossless, wrapper.stateful, wrapper.needs_warm_start) == (False, True, True)
    assert wrapper.identity() == {"name": "quantized", "num_bits": 2, "between_hosts": True}  # keys as the user sets them


@pytest.mark.parametrize("preset, expected", [
    ("two_level_quantized", {"_target_": "dtrain.exchange.Quantized", "num_bits": 1}),
    ("two_level_powersgd", {"_target_": "dtrain.exchange.PowerSGD", "matrix_approximation_rank": "auto",
                            "start_powersgd_iter": "auto"}),
])
def test_the_presets_compose_with_the_one_level_defaults(preset: str, expected: dict) -> None:
    cfg = compose_config("+recipe=digits", f"learner={preset}")
    assert cfg.learner._target_ == "dtrain.learners.TwoLevelDataParallelLearner"
    assert {key: cfg.learner.exchange[key] for key in expected} == expected
    assert validate(cfg, check_run_dir=False) == []
    bad = compose_config("+recipe=digits", f"learner={preset}", "learner.bucket_size_mb=0")
    assert any("learner.bucket_size_mb=0" in problem for problem in validate(bad, check_run_dir=False))
    bits = compose_config("+recipe=digits", "learner=two_level_quantized", "learner.exchange.num_bits=4")
    assert bits.learner.exchange.num_bits == 4

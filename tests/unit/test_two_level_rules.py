"""The two-level learners without processes: the host layouts they refuse (one host, unequal hosts),
and the presets composing with their rules."""
from __future__ import annotations

import pytest
import torch

from dtrain.comm.local import LocalCommunicator
from dtrain.config import validate
from dtrain.learners import TwoLevelDiLoCoLearner
from dtrain.learners.two_level import host_layout

from tests.helpers.config import compose_config
from tests.helpers.two_level_runs import FakeJob


def test_equal_hosts_are_taken() -> None:
    assert host_layout(FakeJob([[0, 1], [2, 3]]), None) == ([[0, 1], [2, 3]], "the mpi launcher")


@pytest.mark.parametrize("job, expected", [
    (FakeJob([[0, 1, 2]], local_size=3), "needs several hosts; this job runs on 1 host x 3 ranks (from the mpi launcher)"),
    (FakeJob([[0, 1, 2], [3, 4]]), "needs the same number of ranks on every host (each host's model is weighted equally); "
                                   "this job runs on 2 hosts (3, 2 ranks)"),
])
def test_one_host_and_unequal_hosts_are_refused(job, expected: str) -> None:
    with pytest.raises(ValueError, match=r"^a two-level learner " + expected.replace("(", r"\(").replace(")", r"\)")):
        host_layout(job, None)


def test_one_process_is_refused() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="needs several hosts; this job runs on 1 host x 1 rank"):
        TwoLevelDiLoCoLearner(torch.optim.AdamW(model.parameters()), LocalCommunicator(), block_size=8)


@pytest.mark.parametrize("preset", ["two_level_diloco", "two_level_local_sgd"])
def test_the_presets_compose_and_their_rules_apply(preset: str) -> None:
    cfg = compose_config("+recipe=digits", f"learner={preset}", "learner.block_size=0")
    assert cfg.learner._target_.startswith("dtrain.learners.TwoLevel")
    assert any("learner.block_size=0" in problem for problem in validate(cfg, check_run_dir=False))


def test_only_a_block_learner_nests_and_only_once() -> None:
    from dtrain.learners import DataParallelLearner
    from dtrain.learners.two_level import TwoLevel

    with pytest.raises(TypeError, match="TwoLevel nests a block learner"):
        type("GradientsBetweenHosts", (TwoLevel, DataParallelLearner), {})
    with pytest.raises(TypeError):  # two levels inside two levels: no consistent method order
        type("TwoLevelTwice", (TwoLevel, TwoLevelDiLoCoLearner), {})

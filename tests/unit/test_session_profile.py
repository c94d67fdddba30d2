"""``profile``: a torch.profiler trace of the configured minibatches, on the CPU, in ``run_dir/profile/``."""
from __future__ import annotations

import io
import json
import re

import pytest
import torch
from torch import nn

from dtrain import LocalLearner, MinibatchSource, training_session
from dtrain.session.configs import device_and_profile_options
from dtrain.session.profiling import ProfileConfig
from tests.helpers.config import compose_config
from tests.helpers.toy_data import four_class_data


def train(run_dir, max_samples: int, profile: ProfileConfig):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))
    stream = io.StringIO()
    training_session(model, nn.functional.cross_entropy, LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                     MinibatchSource(four_class_data()), 20, max_samples=max_samples, run_dir=run_dir,
                     tensorboard=False, stream=stream, profile=profile).train()
    return stream.getvalue()


def test_the_trace_of_the_window_is_chrome_json_with_the_models_operators(tmp_path):
    output = train(tmp_path, max_samples=120, profile=ProfileConfig(wait=1, warmup=1, active=2))
    traces = list((tmp_path / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1, list((tmp_path / "profile").iterdir())
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"aten::linear", "aten::relu", "ProfilerStep#2", "ProfilerStep#3"} <= names  # the model, minibatches 3-4
    assert "ProfilerStep#4" not in names  # stopped after its window
    assert "dtrain: profiling minibatches 3-4 on rank 0 into " + str(tmp_path / "profile") in output
    assert f"profile: {traces[0]} (chrome://tracing" in output


def test_a_run_that_ends_before_the_window_says_so(tmp_path):
    output = train(tmp_path, max_samples=40, profile=ProfileConfig(wait=2, warmup=1, active=1))
    assert not list(tmp_path.glob("profile/*.json"))
    assert "profile: none written, the run ended after 2 minibatches, before minibatch 4" in output


@pytest.mark.parametrize("options, problem", [
    ({"active": 0}, "profile.active=0: expected a whole number of minibatches of at least 1"),
    ({"wait": -1}, "profile.wait=-1: expected"),
    ({"ranks": "some"}, "profile.ranks='some': expected one of main, all"),
])
def test_a_bad_window_is_refused_naming_it(options, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        ProfileConfig(**options)


def test_the_command_line_passes_the_session_sections_device_and_profile():
    enabled = compose_config("+recipe=digits", "session.profile.enabled=true", "session.profile.active=2",
                             "session.profile.ranks=all", "session.device=cpu").session
    assert device_and_profile_options(enabled) == {"device": "cpu", "profile": ProfileConfig(1, 1, 2, "all")}
    assert device_and_profile_options(compose_config("+recipe=digits").session) == {"device": "auto", "profile": None}

"""``device`` (``session.device``): auto keeps the communicator's device, cpu/cuda/cuda:N are checked
against the machine and against what the job's collectives can exchange, each refusal in one line."""
from __future__ import annotations

import io
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dtrain import LocalLearner, MinibatchSource, training_session
from dtrain.comm import LocalCommunicator
from dtrain.config import validate
from dtrain.session.device import resolve_device

from tests.helpers.config import compose_config
from tests.helpers.toy_data import four_class_data


def ranks(size: int, device: str, backend: str) -> SimpleNamespace:
    """What ``resolve_device`` reads of a communicator of ``size`` ranks."""
    return SimpleNamespace(size=size, device=torch.device(device), backend=backend)


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two CUDA devices, as far as the device checks can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_auto_is_the_communicators_device_and_cpu_trains_on_the_cpu(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    for setting in ("auto", "cpu"):
        session = training_session(model, nn.functional.cross_entropy,
                                   LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1), LocalCommunicator("cpu")),
                                   MinibatchSource(four_class_data()), 20, max_samples=40, run_dir=tmp_path / setting,
                                   tensorboard=False, stream=io.StringIO(), device=setting)
        assert session.device == torch.device("cpu") and session.train().samples_seen == 40
    assert resolve_device("auto", ranks(2, "cuda:1", "nccl")) == torch.device("cuda:1")  # today's rule, kept


@pytest.mark.parametrize("setting, problem", [
    ("gpu", "session.device='gpu': expected auto, cpu, cuda or cuda:N (N the index of a GPU)"),
    ("cuda:x", "session.device='cuda:x': expected auto, cpu, cuda or cuda:N"),
    ("cuda:01", "session.device='cuda:01': expected auto, cpu, cuda or cuda:N"),
    ("CPU", "session.device='CPU': expected auto, cpu, cuda or cuda:N"),
])
def test_a_malformed_device_is_refused(setting, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        resolve_device(setting, ranks(1, "cpu", "local"))
    problems = validate(compose_config("+recipe=digits", f"session.device={setting}"), check_run_dir=False)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("setting", ["cuda", "cuda:0"])
def test_cuda_on_a_machine_without_it_is_refused_before_anything_runs(setting):
    expected = (f"session.device='{setting}': expected a machine with CUDA (torch.cuda.is_available() is False here); "
                f"use session.device=cpu or auto")
    assert validate(compose_config("+recipe=digits", f"session.device={setting}"), check_run_dir=False) == [expected]
    with pytest.raises(ValueError, match=r"expected a machine with CUDA"):
        resolve_device(setting, ranks(1, "cpu", "local"))


def test_a_gpu_index_this_machine_lacks_is_refused(two_gpus):
    with pytest.raises(ValueError, match=r"session.device='cuda:2': this machine has 2 GPUs; expected cuda:0 to cuda:1"):
        resolve_device("cuda:2", ranks(1, "cuda:0", "local"))


def test_one_process_trains_on_the_gpu_it_names(two_gpus):
    assert resolve_device("cuda:1", ranks(1, "cuda:0", "local")) == torch.device("cuda:1")
    assert resolve_device("cuda", ranks(1, "cpu", "local")) == torch.device("cuda:0")
    assert two_gpus == [torch.device("cuda:1"), torch.device("cuda:0")]


def test_several_ranks_train_where_their_collectives_exchange(two_gpus):
    assert resolve_device("cuda", ranks(2, "cuda:1", "nccl")) == torch.device("cuda:1")  # each rank its own GPU
    with pytest.raises(ValueError, match=r"session.device='cuda:0' with 2 ranks: every rank would train on one GPU; "
                                         r"expected session.device=cuda \(each rank on its local rank's GPU, here cuda:1\)"):
        resolve_device("cuda:0", ranks(2, "cuda:1", "nccl"))
    with pytest.raises(ValueError, match=r"session.device='cuda' with comm.backend gloo: its collectives exchange CPU "
                                         r"tensors; expected comm.backend=nccl"):
        resolve_device("cuda", ranks(2, "cpu", "gloo"))
    with pytest.raises(ValueError, match=r"session.device='cpu' with comm.backend nccl: NCCL exchanges CUDA tensors "
                                         r"only; add comm.backend=gloo"):
        resolve_device("cpu", ranks(2, "cuda:0", "nccl"))
    assert resolve_device("cpu", ranks(2, "cpu", "mpi")) == torch.device("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("setting, expected", [("cpu", "cpu"), ("cuda", "cuda"), ("auto", "cuda")])
def test_one_process_on_a_gpu_machine_trains_where_it_is_told(tmp_path, setting, expected):
    """The communicator of one process on a GPU machine is cuda:0 (auto); cpu keeps the model on the CPU."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1), LocalCommunicator("cuda:0"))
    result = training_session(model, nn.functional.cross_entropy, learner, MinibatchSource(four_class_data()), 20,
                              max_samples=60, progress_frequency=20, run_dir=tmp_path, tensorboard=False,
                              stream=io.StringIO(), device=setting).train()
    assert result.samples_seen == 60 and {p.device.type for p in model.parameters()} == {expected}

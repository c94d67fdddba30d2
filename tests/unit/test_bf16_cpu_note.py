"""``precision=bf16`` on a CPU without native bfloat16 matrix units says at start-up, in one line, that
float32 trains faster there (autocast adds casts, not faster products)."""
from __future__ import annotations

import io
import platform

import pytest
import torch
from torch import nn

from dtrain import LocalLearner, MinibatchSource, training_session
from dtrain.session import precision

from tests.helpers.toy_data import four_class_data

NOTE = ("dtrain: note: precision bf16 on a CPU without native bfloat16 matrix units (AMX on x86, BF16 on ARM) is "
        "usually slower than float32; session.precision=32 trains faster here")


def start_up_lines(tmp_path, precision_setting: str) -> list[str]:
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    stream = io.StringIO()
    training_session(model, nn.functional.cross_entropy, LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                     MinibatchSource(four_class_data()), 20, max_samples=20, run_dir=tmp_path / precision_setting,
                     tensorboard=False, stream=stream, precision=precision_setting).train()
    return [line for line in stream.getvalue().splitlines() if line.startswith("dtrain:")]


@pytest.mark.parametrize("native", [False, True])
def test_bf16_on_a_cpu_says_whether_float32_is_faster(tmp_path, monkeypatch, native):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    lines = start_up_lines(tmp_path, "bf16")
    assert (NOTE in lines) is not native, lines
    assert NOTE not in start_up_lines(tmp_path, "32")


def test_native_bf16_is_amx_on_x86():
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("an x86 CPU")
    assert precision.cpu_has_native_bf16() is torch.cpu._is_amx_tile_supported()

"""A composite source from a config: two CTF files joined by sequence key, trained from the command line, and a
key one file lacks refused in one line."""
from __future__ import annotations

import re

import numpy as np

from tests.helpers.cli import run_dtrain

MODEL = """
import torch


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x)
"""

RECIPE = """# @package _global_
recipe_name: composite
model: {_target_: composite_model.Linear}
source:
  train:
    _target_: dtrain.data.MinibatchSource
    deserializer:
      _target_: dtrain.data.CompositeDeserializer
      deserializers:
        - {_target_: dtrain.data.CTFDeserializer, path: features.ctf, streams: {x: {dim: 4}}}
        - {_target_: dtrain.data.CTFDeserializer, path: labels.ctf, streams: {labels: {dim: 3, format: sparse, ids: true}}}
session:
  inputs: x
  minibatch_size: 16
  max_samples: 480
  tensorboard: false
"""


def test_a_composite_source_from_a_config_trains_and_a_missing_key_is_one_line(tmp_path):
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "composite.yaml").write_text(RECIPE)
    (tmp_path / "composite_model.py").write_text(MODEL)
    generator = np.random.default_rng(0)
    x = generator.normal(size=(96, 4))
    classes = np.argmax(x[:, :3], axis=1)  # learnable from x alone
    keys = [f"u{i}" for i in range(96)]
    (tmp_path / "features.ctf").write_text("".join(f"{key} |x {' '.join(f'{v:.4f}' for v in row)}\n"
                                                   for key, row in zip(keys, x)))
    order = generator.permutation(96)  # the labels in another order: joined by key, not by line
    (tmp_path / "labels.ctf").write_text("".join(f"{keys[i]} |labels {classes[i]}:1\n" for i in order))

    result = run_dtrain("--config-dir", "conf", "+recipe=composite", "run_dir=run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "dtrain: model(x), loss and metric against labels" in result.stdout, result.stdout
    error = float(re.search(r"error +([0-9.]+)%", result.stdout).group(1))
    assert error < 50, result.stdout  # each x with its own label: far from the 67% of labels joined by line

    (tmp_path / "labels.ctf").write_text("".join(f"{keys[i]} |labels {classes[i]}:1\n" for i in order if i != 5))
    refused = run_dtrain("--config-dir", "conf", "+recipe=composite", "run_dir=refused", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    errors = [line for line in refused.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "key 'u5' (sequence 5 of deserializer 0 (CTFDeserializer features.ctf), the " \
                                 "primary) is not in deserializer 1 (CTFDeserializer labels.ctf)" in errors[0], refused.stderr
    assert not (tmp_path / "refused").exists()

"""The imagenet recipe end to end on a tiny map-file set written by the test, with each image backend."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dtrain.testing.image_files import write_image_map_files


@pytest.mark.parametrize("backend", ["native", pytest.param("dali", marks=pytest.mark.slow)])
def test_imagenet_recipe_runs_end_to_end_on_a_tiny_map_file_set(tmp_path, backend):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    write_image_map_files(tmp_path, num_train=16, num_val=4)
    command = [sys.executable, "-m", "dtrain", "+recipe=imagenet", f"data.root={tmp_path}", f"run_dir={tmp_path}/run",
               f"source.backend={backend}", "model.width=4", "model.num_classes=3", "source.image_size=[40,40]",
               "source.crop_size=[32,32]", "session.minibatch_size=8", "session.max_samples=32",
               "session.tensorboard=false"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "finished: 32 samples" in result.stdout and "test: accuracy" in result.stdout

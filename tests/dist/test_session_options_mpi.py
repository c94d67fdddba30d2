"""Session settings under a real ``mpiexec -n 2``: micro-batches (one exchange per minibatch) and
gradient clipping on the global gradient, for every learner (see ``_session_options_worker.py``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import run_mpi

WORKER = str(Path(__file__).with_name("_session_options_worker.py"))


@pytest.mark.timeout(200)
def test_micro_batches_clipping_and_fp16_under_mpiexec(tmp_path: Path) -> None:
    result = run_mpi(2, [WORKER, tmp_path], timeout=180)
    assert result.returncode == 0, result.report()
    results = {record["scenario"]: record for record in
               (json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT "))}
    assert set(results) == {"micro_batches", "clipping", "fp16"}, result.report()

    micro = results["micro_batches"]
    assert micro["largest_pass"] == 2 and micro["passes"] > micro["minibatches"]
    # every bucket all-reduced exactly once per minibatch, however many passes computed it
    assert micro["bucket_allreduces"] == micro["num_buckets"] * micro["minibatches"], micro
    assert micro["moved"] > 0.1
    assert micro["difference_to_uncapped"] < 1e-5 and micro["difference_to_one_process"] < 1e-5, micro
    assert micro["differing_parameters"] == [], micro

    clipping = results["clipping"]
    assert clipping["clip_changes_the_result"] > 0.01  # the clip is active in this run
    for learner in ("data_parallel", "quantized"):
        assert clipping[learner]["difference_to_one_process"] < 1e-5, clipping
        assert clipping[learner]["differing_parameters"] == [], clipping
    block = clipping["block_momentum"]
    assert block["local_steps"] > 0 and block["largest_norm_stepped"] <= 0.05 * (1 + 1e-5), block
    assert block["differing_parameters"] == [], block

    # fp16: rank 1's overflow skips the step on both ranks, and both halve the loss scale
    for learner in ("data_parallel", "quantized", "block_momentum"):
        record = results["fp16"][learner]
        assert record["skipped_and_scale_per_rank"] == [[1, 32768.0], [1, 32768.0]], (learner, record)
        assert record["finite"] and record["differing_parameters"] == [], (learner, record)

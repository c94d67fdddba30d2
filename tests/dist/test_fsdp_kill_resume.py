"""``learner=fsdp`` from the command line under a real mpiexec, killed: one rank SIGKILLed after its sharded
checkpoints began, the job ends, and the same command again resumes from the newest whole checkpoint to exactly
the uninterrupted run's weights; the same killed run resumed on one process ends as close to them as a fresh
one-process run does (the ranks' sums round otherwise, and AdamW carries that over 200 steps)."""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.mpi import kill_session, mpi_command, mpiexec_path, run_mpi, start_ranks

#: a small character transformer sharded over the ranks, a sharded checkpoint every 10 minibatches of 2,048
#: characters, 200 minibatches in all
RUN = ["-m", "dtrain", "+recipe=shakespeare_char", "learner=fsdp", "model.width=64", "model.layers=2",
       "model.heads=2", "session.epoch_size=20480", "session.max_samples=409600",
       "session.checkpoint.frequency=20480", "session.cv.frequency=0",
       "session.tensorboard=false"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model.safetensors")


def killed_run(run_dir: Path) -> int:
    """Runs RUN on 2 ranks until its second sharded checkpoint is whole, then SIGKILLs rank 1; returns the samples
    of the newest checkpoint the job left."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONUNBUFFERED": "1"}
    job, ranks = start_ranks(mpi_command(2, [*RUN, f"run_dir={run_dir}"]), env)
    with job:
        try:
            deadline = time.monotonic() + 180
            while not (run_dir / "checkpoint-40960.pt" / "dtrain.pt").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(ranks[1], signal.SIGKILL)
            stdout, stderr = job.communicate(timeout=60)
        except BaseException:
            kill_session(job.pid)
            raise
    assert job.returncode != 0, stdout + stderr  # the job ended with its rank, before the end of training
    assert not (run_dir / "model.safetensors").exists(), stdout
    newest = newest_checkpoint(run_dir)
    assert 40960 <= newest < 409600, newest
    return newest


def newest_checkpoint(run_dir: Path) -> int:
    """The samples of the newest checkpoint in ``run_dir``."""
    return max(int(path.name.removeprefix("checkpoint-").removesuffix(".pt")) for path in run_dir.glob("checkpoint-*.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    if mpiexec_path() is None:
        pytest.skip("mpiexec not found")
    base = tmp_path_factory.mktemp("fsdp_kill")
    whole = run_mpi(2, [*RUN, f"run_dir={base / 'whole'}"], timeout=240)
    assert whole.returncode == 0, whole.report()
    return base


def test_a_killed_sharded_run_resumes_to_exactly_the_uninterrupted_weights(runs: Path):
    run_dir = runs / "killed"
    newest = killed_run(run_dir)
    shutil.copytree(run_dir, runs / "killed_copy")  # resumed on one process below
    resumed = run_mpi(2, [*RUN, f"run_dir={run_dir}"], timeout=240)  # the same command again
    assert resumed.returncode == 0, resumed.report()
    assert f"at {newest} samples" in resumed.stdout, resumed.report()
    expected, got = weights(runs / "whole"), weights(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs from the uninterrupted run"


def test_the_killed_run_resumes_on_one_process_to_float_rounding(runs: Path):
    run_dir = runs / "killed_copy"
    if not run_dir.exists():
        pytest.skip("the killed run above did not get so far")
    newest = newest_checkpoint(run_dir)
    resumed = run_mpi(1, [*RUN, f"run_dir={run_dir}"], timeout=240)
    assert resumed.returncode == 0, resumed.report()
    assert f"at {newest} samples" in resumed.stdout, resumed.report()
    expected, got = weights(runs / "whole"), weights(run_dir)
    # a fresh one-process run ends 2.2e-4 from the 2-rank run (the largest tensor's relative difference), this
    # resumed one 1.9e-4; a resume that lost or replayed data is off by orders more
    for name in expected:
        difference = float((expected[name] - got[name]).norm() / expected[name].norm().clamp(min=1e-12))
        assert difference <= 1e-3, f"{name}: relative difference {difference:.2e}"

"""Checkpoints under real mpiexec: bit-exact resume for every learner (tests/helpers/learners.py), another world size,
preemption by a signal, and one clear line for bad input with nothing overwritten."""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.cli_runs import CliRuns, launch_cli_runs
from tests.helpers.learners import learners, preset, shipped_learners
from tests.helpers.mpi import mpi_command, mpiexec_path, run_mpi, start_ranks

from dtrain.session import checkpoint
from dtrain.learners.outer import saved_first_moment

#: every shipped one-level learner and the combinations whose state is easiest to lose (two-level learners:
#: tests/dist/test_two_level.py; the checkpoints of earlier releases: test_checkpoints_from_before.py)
RESUMED = learners("data_parallel", "quantized", "powersgd", "block_momentum", "diloco", "local_sgd", "bmuf_4bit",
                   "diloco_4bit", "bmuf_momentum_kept", "data_parallel_lars", "block_momentum_lamb", "diloco_lamb",
                   "local_sgd_outer_adam", "sparseloco", "diloco_overlap_4bit")
# 640-sample checkpoints; both halves of an interrupted run end on a checkpoint boundary, as the
# uninterrupted run checkpoints (and block momentum synchronises) at the same sample counts
COMMON_OVERRIDES = ["+recipe=digits", "session.minibatch_size=64", "session.checkpoint.frequency=640",
                    "session.progress_frequency=640", "session.tensorboard=false", "model.hidden=32"]
COMMON = ["-m", "dtrain", *COMMON_OVERRIDES]


def dtrain_job(nprocs: int, run_dir: Path, *overrides: str, timeout: float = 240):
    return run_mpi(nprocs, [*COMMON, f"run_dir={run_dir}", *overrides], timeout=timeout)


def parameters(path: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(path)["model"]


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str = "") -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}{name} differs after resume"


def assert_same_state(a, b, where: str) -> None:
    """Nested checkpoint state (dicts, lists, tensors, numbers) equal to the bit, naming the first entry that is not."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), \
            f"{where} differs after resume: keys {list(a)} / {list(b) if isinstance(b, dict) else type(b).__name__}"
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), \
            f"{where} differs after resume: {type(a).__name__} of {len(a)} / {type(b).__name__} {b!r:.200}"
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{index}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs after resume"
    else:
        assert a == b, f"{where} differs after resume: {a!r} / {b!r}"


def test_every_shipped_learner_is_resumed_here_or_in_its_own_module():
    resumed = {preset(overrides) for overrides in RESUMED.values()}
    elsewhere = {name for name in shipped_learners() if name.startswith("two_level_")} | {"local"}  # one process
    elsewhere |= {"fsdp"}  # sharded checkpoints: tests/dist/test_fsdp_checkpoints.py
    assert set(shipped_learners()) - elsewhere <= resumed, set(shipped_learners()) - elsewhere - resumed


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory) -> tuple[Path, CliRuns]:
    """Every learner's uninterrupted run and its resumed run, all from one ``mpiexec -n 2`` launch
    (``tests.helpers.cli_runs``: the command lines of ``python -m dtrain``, run one after the other in one process
    per rank: Python's, torch's and the config's start-up paid once, not 24 times)."""
    base = tmp_path_factory.mktemp("resumed")
    jobs = {learner: [  # the command lines of dtrain_job, without "-m dtrain"
        ("whole", [*COMMON_OVERRIDES, f"run_dir={base / learner / 'whole'}", *overrides, "session.max_samples=1920"]),
        ("split", [*COMMON_OVERRIDES, f"run_dir={base / learner / 'split'}", *overrides, "session.max_samples=1920",
                   f"session.checkpoint.restore_from={base / learner / 'whole' / 'checkpoint-1280.pt'}"]),
    ] for learner, overrides in RESUMED.items()}
    return base, launch_cli_runs(2, jobs, base, timeout=120 + 45 * len(jobs))


@pytest.mark.slow
@pytest.mark.parametrize("learner", list(RESUMED))
def test_a_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(learner, resumed_runs):
    """Two ranks: the uninterrupted run's checkpoint at 1,280 samples (a periodic one, as an interruption leaves
    behind) restored in another run directory trains on to exactly its parameters, optimizer state, residuals,
    outer state and weight average at 1,920. (Every learner's two runs come from one launch: ``resumed_runs``.)"""
    base, runs = resumed_runs
    whole, split = (runs.run_ended(learner, run) for run in ("whole", "split"))  # fails here if either run failed
    overrides = RESUMED[learner]
    compressed = "learner/exchange=quantized" in overrides
    if compressed:
        assert "quantized:" in whole.stdout and "kB sent/sync" in whole.stdout, whole.report()
    saved = base / learner / "whole" / "checkpoint-1280.pt"
    assert f"restored {saved} at 1280 samples" in split.stdout, split.report()
    a = checkpoint.load(base / learner / "whole" / "checkpoint-1920.pt")
    b = checkpoint.load(base / learner / "split" / "checkpoint-1920.pt")
    assert_identical(a["model"], b["model"])
    assert len(b["per_rank"]) == 2  # both ranks' own random numbers, and their own learner state where it has any
    if preset(overrides) != "data_parallel":  # residuals, factors, local optimizer state, the block's
        assert all(entry["learner"] for entry in b["per_rank"])
    # the docstring's promise: optimizer state, outer state (learner), residuals and each rank's own state (per_rank)
    assert_same_state(a["learner"], b["learner"], "learner")
    assert_same_state(a["per_rank"], b["per_rank"], "per_rank")
    if "session.ema_decay=0.9" in overrides:
        assert_identical(a["weight_ema"], b["weight_ema"], "the weight EMA's ")
        assert "test of the weight EMA (decay 0.9)" in split.stdout, split.report()
        assert (base / learner / "split" / "model_ema.safetensors").is_file()
    if preset(overrides) in ("block_momentum", "diloco") or "learner/outer_optimizer=adam" in overrides:
        assert all(entry["learner"]["optimizer"]["state"] for entry in b["per_rank"])
        assert float(saved_first_moment(b["learner"]["block"]["outer_optimizer"]).abs().sum()) > 0
    if compressed:
        assert all(entry["learner"]["exchange"]["per_key"] for entry in b["per_rank"])
    if preset(overrides) == "sparseloco":  # every rank's own error feedback came back
        assert all(float(entry["learner"]["exchange"]["errors"]["model"].abs().sum()) > 0 for entry in b["per_rank"])


@pytest.mark.slow
def test_a_finished_run_continues_in_its_run_directory_to_a_larger_max_samples_as_one_run(tmp_path):
    """One process: the run ends at 1,280 samples; the same command with a larger ``max_samples`` restores its
    final checkpoint from the run directory and ends where the uninterrupted run does, bit for bit."""
    whole = dtrain_job(1, tmp_path / "whole", "session.max_samples=1920")
    assert whole.returncode == 0, whole.report()
    first = dtrain_job(1, tmp_path / "split", "session.max_samples=1280")
    assert first.returncode == 0, first.report()
    second = dtrain_job(1, tmp_path / "split", "session.max_samples=1920")
    assert second.returncode == 0, second.report()
    assert "restored" in second.stdout and "at 1280 samples" in second.stdout
    assert_identical(parameters(tmp_path / "whole" / "checkpoint-1920.pt"),
                     parameters(tmp_path / "split" / "checkpoint-1920.pt"))


@pytest.mark.slow  # a long multi-process case; .ci/run runs the slow set
def test_restoring_at_another_world_size_continues_and_says_so(tmp_path):
    first = dtrain_job(2, tmp_path, "learner=quantized", "session.max_samples=640")
    assert first.returncode == 0, first.report()
    second = dtrain_job(1, tmp_path, "learner=quantized", "session.max_samples=1280")
    assert second.returncode == 0, second.report()
    assert "restoring a checkpoint of 2 workers on 1" in second.stdout
    assert "per-rank state (random numbers, the exchange strategy's residuals and factors) reset" in second.stdout
    state = checkpoint.load(tmp_path / "checkpoint-1280.pt")
    assert state["world_size"] == 1 and state["samples_seen"] == 1280
    assert state["source"]["position"] == 1280  # the global position carried over


@pytest.mark.parametrize("learner", [pytest.param("data_parallel", marks=pytest.mark.slow),
                                     pytest.param("block_momentum", marks=pytest.mark.slow)])
def test_sigterm_on_one_rank_checkpoints_all_and_exits_75_then_resumes(tmp_path, learner):
    """Block momentum (its defaults: a warm start, then blocks) agrees on the signal only where
    the ranks meet, at most a block later; the job still checkpoints and exits 75."""
    if mpiexec_path() is None:
        pytest.skip("mpiexec not found")
    command = mpi_command(2, [*COMMON, f"run_dir={tmp_path}", f"learner={learner}", "session.max_samples=200000"])
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONUNBUFFERED": "1"}
    job, ranks = start_ranks(command, env)
    with job:
        try:
            deadline = time.monotonic() + 120
            while not list(tmp_path.glob("checkpoint-*.pt")) and time.monotonic() < deadline:
                time.sleep(0.2)  # training is under way once the first periodic checkpoint exists
            os.kill(ranks[-1], signal.SIGTERM)
            stdout, stderr = job.communicate(timeout=60)
        except BaseException:
            os.killpg(job.pid, signal.SIGKILL)
            raise
    assert job.returncode == 75, stdout + stderr
    assert "preempted by SIGTERM" in stdout
    saved = max(checkpoint.CheckpointFiles(tmp_path / "checkpoint.pt").existing())
    assert 0 < saved[0] < 200000
    resumed = dtrain_job(2, tmp_path, f"learner={learner}", f"session.max_samples={saved[0] + 640}")
    assert resumed.returncode == 0, resumed.report()
    assert f"at {saved[0]} samples" in resumed.stdout


@pytest.mark.parametrize("overrides, fragment", [
    pytest.param(["learner=nope"], "Could not find 'learner/nope'", marks=pytest.mark.slow),
    pytest.param(["session.minibatch_size=-64"], "session.minibatch_size=-64", marks=pytest.mark.slow),
    pytest.param(["learner=quantized", "learner.exchange.num_bits=0"], "learner.exchange.num_bits=0",
                 marks=pytest.mark.slow),
    pytest.param(["learner=block_momentum", "learner.block_size=1"], "block_size", marks=pytest.mark.slow),
    pytest.param(["+recipe=cifar10", "data.root=/nonexistent/cifar", "+source.train.deserializer.url=http://127.0.0.1:9/x.tgz"],
                 "cifar-10-batches-bin", marks=pytest.mark.slow),
    (["learner=data_parallel"], "checkpoint-64.pt could not be read"),
    pytest.param(["learner=block_momentum", "learner.block_size=640", "session.checkpoint.restore=false"], "already exists",
                 marks=pytest.mark.slow),
])
def test_bad_input_under_mpiexec_is_one_line_and_changes_nothing(overrides, fragment, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint-64.pt").write_bytes(b"garbage")
    (run / "config.yaml").write_text("earlier: true\n")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    own_recipe = any(o.startswith("+recipe=") for o in overrides)
    args = ["-m", "dtrain"] if own_recipe else COMMON
    result = run_mpi(2, [*args, f"run_dir={run}", *overrides], timeout=120)
    assert result.returncode != 0
    # Open MPI adds its own MPI_ABORT banner; what matters is dtrain's one line naming the value
    errors = {line.split("dtrain: error: ", 1)[1] for line in result.stderr.splitlines() if "dtrain: error: " in line}
    assert len(errors) == 1 and fragment in errors.pop(), result.report()
    assert "Traceback" not in result.stderr, result.report()
    assert len([line for line in result.stderr.splitlines() if line.startswith(("dtrain: error", "[rank"))]) <= 2
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


@pytest.mark.slow  # a long multi-process case; .ci/run runs the slow set
def test_damaged_newest_checkpoint_falls_back_and_another_model_is_refused_under_mpiexec(tmp_path, resumed_runs):
    base, runs = resumed_runs
    runs.run_ended("data_parallel", "whole")  # a finished 2-rank run to 1,920 samples: checkpoints at 640, 1280, 1920
    shutil.copytree(base / "data_parallel" / "whole", tmp_path, dirs_exist_ok=True)
    newest = tmp_path / "checkpoint-1920.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) - 1000])  # a write cut short by a crash of the file system
    learner = RESUMED["data_parallel"]
    other_model = dtrain_job(2, tmp_path, *learner, "session.max_samples=2560", "model.hidden=48")
    assert other_model.returncode != 0
    assert "does not fit this model: parameter classifier.1.weight has shape (32, 1024) in the checkpoint, " \
           "(48, 1024) in the model" in other_model.stderr, other_model.report()
    other_seed = dtrain_job(2, tmp_path, *learner, "session.max_samples=2560", "seed=5")
    assert other_seed.returncode != 0
    assert "belongs to another configuration: seed was 0 in the checkpoint's run and is 5 now" in other_seed.stderr
    resumed = dtrain_job(2, tmp_path, *learner, "session.max_samples=2560")
    assert resumed.returncode == 0, resumed.report()
    assert "truncated" in resumed.stderr and "using the previous checkpoint checkpoint-1280.pt" in resumed.stderr
    assert "at 1280 samples" in resumed.stdout
    assert checkpoint.load(tmp_path / "checkpoint-2560.pt")["samples_seen"] == 2560


@pytest.mark.slow
def test_restore_from_a_renamed_checkpoint_on_two_ranks_equals_an_uninterrupted_run(tmp_path, resumed_runs):
    base, runs = resumed_runs
    runs.run_ended("data_parallel", "whole")
    whole = base / "data_parallel" / "whole"
    best = tmp_path / "best.pt"  # the whole run's periodic checkpoint at 1,280, under another name outside its directory
    shutil.copyfile(whole / "checkpoint-1280.pt", best)
    learner = RESUMED["data_parallel"]
    other_model = dtrain_job(2, tmp_path / "other", *learner, "session.max_samples=1920", "model.hidden=48",
                             f"session.checkpoint.restore_from={best}")
    assert other_model.returncode == 2, other_model.report()
    errors = {line.split("dtrain: error: ", 1)[1] for line in other_model.stderr.splitlines() if "dtrain: error: " in line}
    assert len(errors) == 1 and errors.pop().startswith(f"checkpoint {best} does not fit this model"), other_model.report()
    second = dtrain_job(2, tmp_path / "second", *learner, "session.max_samples=1920",
                        f"session.checkpoint.restore_from={best}")
    assert second.returncode == 0, second.report()
    assert f"restored {best} at 1280 samples (session.checkpoint.restore_from:" in second.stdout
    assert_identical(parameters(whole / "checkpoint-1920.pt"), parameters(tmp_path / "second" / "checkpoint-1920.pt"))

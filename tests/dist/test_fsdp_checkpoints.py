"""Sharded checkpoints of ``learner=fsdp`` (torch.distributed.checkpoint) under a real mpiexec: written on 2 ranks,
resumed on 2 (bit-exact), on 1 and on 4 (slow), by data_parallel, and from data_parallel's."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checks import CheckLaunch, launch_checks

WORKER = Path(__file__).with_name("_fsdp_checkpoint_worker.py")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fsdp_checkpoints")


@pytest.fixture(scope="module")
def written(run_dir) -> CheckLaunch:
    return launch_checks(2, [WORKER, run_dir, "write"], run_dir / "checks_write", timeout=280)


def test_a_sharded_checkpoint_is_a_directory_every_rank_wrote(written: CheckLaunch) -> None:
    figures = written.result("write")
    assert figures["half_checkpoint_is_directory"], figures
    assert figures["half_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "dtrain.pt"], figures


def test_a_resume_at_the_same_world_size_is_bit_exact(written: CheckLaunch) -> None:
    figures = written.result("write")
    assert figures["resumed_from"] == "checkpoint-130.pt" and figures["resume_bit_exact"], figures


def test_a_damaged_checkpoint_is_refused_and_the_one_before_is_used(written: CheckLaunch) -> None:
    figures = written.result("write")
    assert "fails its checksum: the file is damaged); using the previous checkpoint" in figures["damaged_warning"]
    assert figures["damaged_bit_exact"], figures


def test_replicated_and_sharded_checkpoints_restore_each_other(written: CheckLaunch) -> None:
    figures = written.result("write")
    assert figures["dp_checkpoint_is_file"], figures
    assert figures["data_parallel_from_sharded"] <= 2e-6, figures
    assert figures["fsdp_from_replicated"] <= 2e-6, figures


@pytest.mark.parametrize("nprocs", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_a_sharded_checkpoint_resumes_at_another_world_size(nprocs: int, written: CheckLaunch, run_dir: Path) -> None:
    written.result("write")
    figures = launch_checks(nprocs, [WORKER, run_dir, "resume"], run_dir / f"checks_resume{nprocs}",
                            timeout=280).result("resume")
    assert figures["restored_from"] == "checkpoint-130.pt" and figures["relative_difference"] <= 1e-5, figures

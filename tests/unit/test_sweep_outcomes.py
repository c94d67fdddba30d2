"""A sweep's bookkeeping in one process: its exit status, how jobs are numbered and named, and how
the ranks of a failed job agree (ranks as threads over a real rendezvous store)."""
from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass

import pytest
import torch.distributed as dist

from dtrain.sweep import JobOutcome, agree_on_failure, exit_status
from dtrain.sweep.outcomes import count_jobs, swept_keys


def outcome(job: int, status: str = "finished", code: int = 0) -> JobOutcome:
    return JobOutcome(job, f"optimizer.lr={job}", f"/sweep/{job}", status, 0.1 if status == "finished" else None, code)


@pytest.mark.parametrize("outcomes, status", [
    ([outcome(0), outcome(1)], 0),
    ([outcome(0), outcome(1, "failed", 2), outcome(2, "diverged", 2)], 2),  # every failure a bad input or divergence
    ([outcome(0, "failed", 2), outcome(1, "failed", 1)], 1),
])
def test_the_sweep_exits_non_zero_when_a_job_failed(outcomes, status):
    assert exit_status(outcomes) == status


def test_the_basic_sweepers_jobs_are_counted_and_the_swept_keys_name_each_job():
    overrides = ["+recipe=digits", "optimizer.lr=0.05,-1,0.02", "seed=0,1", "hydra.sweep.dir=x"]
    assert count_jobs(overrides) == 6
    assert swept_keys(overrides) == ["optimizer.lr", "seed"]
    assert swept_keys(["optimizer.lr=interval(0.01,0.1)", "model.hidden=32"]) == ["optimizer.lr"]
    assert count_jobs(["hydra/sweeper=optuna", "optimizer.lr=interval(0.01,0.1)"]) is None  # Optuna: n_trials


@dataclass
class StoreRank:
    """What ``agree_on_failure`` uses of a communicator: its rank, size and rendezvous store."""

    rank: int
    size: int
    store_endpoint: tuple[str, int]


def agree(reports: dict[int, tuple], size: int, timeout_s: float) -> dict[int, tuple | None]:
    """Ranks ``reports`` (rank -> (message, code, kind, secondary)) run ``agree_on_failure`` as threads."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    results: dict[int, tuple | None] = {}

    def rank_thread(rank: int) -> None:
        message, code, kind, secondary = reports[rank]
        results[rank] = agree_on_failure(StoreRank(rank, size, ("127.0.0.1", master.port)), message, code, kind,
                                         secondary=secondary, timeout_s=timeout_s)

    threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in reports]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_ranks_that_all_failed_agree_on_the_first_hand_failure_of_the_lowest_rank():
    reports = {0: ("RuntimeError: Connection closed by peer", 1, "failed", True),
               1: ("training diverged: the mean loss is nan", 2, "diverged", False),
               2: ("training diverged: the mean loss is nan", 2, "diverged", False)}
    results = agree(reports, 3, timeout_s=10)
    assert results == {rank: ("training diverged: the mean loss is nan", 2, "diverged") for rank in range(3)}


def test_a_failure_of_one_rank_alone_is_no_agreement():
    results = agree({1: ("RuntimeError: injected", 1, "failed", False)}, 2, timeout_s=0.5)
    assert results == {1: None}


def test_a_preempted_sweep_is_continued_by_the_same_sweep_with_its_directory_pinned():
    from types import SimpleNamespace

    from dtrain.cli import continue_command

    one_process = SimpleNamespace(size=1, launcher=None)
    argv = ["-m", "+recipe=digits", "optimizer.lr=0.02,0.05", "hydra.sweep.dir=sweeps/lr"]
    assert continue_command(one_process, "/abs/sweeps/lr/1", argv, sweep_dir="/abs/sweeps/lr") == \
        "python -m dtrain -m +recipe=digits optimizer.lr=0.02,0.05 hydra.sweep.dir=/abs/sweeps/lr"
    assert continue_command(one_process, "/abs/run", ["+recipe=digits", "run_dir=run"]) == \
        "python -m dtrain +recipe=digits run_dir=/abs/run"


def test_an_earlier_summary_is_kept_under_the_first_free_number(tmp_path):
    from dtrain.sweep.outcomes import keep_earlier_summary

    where = tmp_path / "sweep_summary.csv"
    assert keep_earlier_summary(where) is None
    for text in ("first\n", "second\n", "third\n"):
        where.write_text(text)
        kept = keep_earlier_summary(where)
        assert not where.exists() and kept.read_text() == text
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "sweep_summary.1.csv", "sweep_summary.2.csv", "sweep_summary.3.csv"]
    (tmp_path / "sweep_summary.4.csv").symlink_to(tmp_path / "elsewhere.csv")  # a link, even dangling, is taken
    where.write_text("fourth\n")
    assert keep_earlier_summary(where).name == "sweep_summary.5.csv"
    assert (tmp_path / "sweep_summary.4.csv").is_symlink()

"""A problem in one rank's share of the first minibatch, under a real ``mpiexec -n 2``: every rank raises the
same error naming that rank, of the error's own type, before rank 0 writes anything."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.mpi import run_mpi

WORKER = Path(__file__).with_name("_first_minibatch_worker.py")


@pytest.mark.parametrize("problem, line", [
    ("shape", "DataError: rank 1 of 2: stream 'features': Samples[20] has shape [3] but sample 0 has [6]"),
    pytest.param("raise", "DataError: rank 1 of 2: Samples[20] raised OSError: corrupt record",
                 marks=pytest.mark.slow),  # the default suite keeps to 10 minutes on 2 cores; CI runs the slow set
    ("oserror", "OSError: rank 1 of 2: the disk went away"),  # the user's own read: its type, not a data error
])
def test_a_problem_only_rank_1_reads_is_refused_on_every_rank_naming_it_before_anything_is_written(run_dir, problem,
                                                                                                   line):
    result = run_mpi(2, [WORKER, problem, run_dir], timeout=180)
    assert result.returncode == 0, result.report()
    for rank in (0, 1):
        said = [text for text in result.stdout.splitlines() if text.startswith(f"RANK {rank} ")]
        assert said[0].startswith(f"RANK {rank} {line}"), result.report()
        assert said[1] == f"RANK {rank} run directory exists: False", result.report()

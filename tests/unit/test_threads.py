"""The torch thread count a training process chooses (``dtrain.threads``), and the start-up line naming it."""
from __future__ import annotations

import pytest

from dtrain.threads import choose_threads


def test_one_process_on_a_loaded_machine_takes_only_the_cpus_nobody_else_keeps_busy():
    # the measured case: 2 CPUs, 2 busy processes; torch's default of 2 threads ran 19-54x slower than 1
    choice = choose_threads(None, 1, torch_default=2, environment={}, cpus=2, load=2.3)
    assert choice.threads == 1
    assert "2 CPUs, 2 kept busy by other processes (load 2.3)" in choice.reason
    assert choose_threads(None, 1, torch_default=8, environment={}, cpus=8, load=2.6).threads == 5
    assert choose_threads(None, 1, torch_default=2, environment={}, cpus=2, load=7.0).threads == 1


def test_one_process_on_an_idle_machine_takes_torchs_default():
    assert choose_threads(None, 1, torch_default=2, environment={}, cpus=2, load=0.2).threads == 2
    assert choose_threads(None, 1, torch_default=8, environment={}, cpus=16, load=0.0).threads == 8  # physical cores


def test_several_ranks_divide_the_cpus_and_an_explicit_setting_wins():
    assert choose_threads(None, 4, torch_default=8, environment={}, cpus=16, load=9.0, node_cpus=16).threads == 4
    assert choose_threads(None, 3, torch_default=2, environment={}, cpus=2, load=0.0, node_cpus=2).threads == 1
    bound = choose_threads(None, 2, torch_default=8, environment={}, cpus=1, load=0.0, node_cpus=16)  # mpiexec -n 2
    assert bound.threads == 1 and bound.reason == "16 CPUs / 2 processes on this node, bound to 1 CPU"
    assert choose_threads(3, 1, torch_default=2, environment={}, cpus=2, load=5.0).threads == 3
    assert choose_threads(None, 1, torch_default=2, environment={"OMP_NUM_THREADS": "4"}, cpus=2, load=5.0).threads == 4


@pytest.mark.parametrize("per_process, expected", [(False, "1 torch thread ("), (True, "1 torch thread per process (")])
def test_the_start_up_line_names_the_count_and_the_reason(per_process, expected):
    line = choose_threads(None, 1, torch_default=2, environment={}, cpus=2, load=2.0).describe(per_process)
    assert line.startswith(expected) and "session.num_threads=N" in line

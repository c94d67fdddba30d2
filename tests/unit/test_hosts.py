"""Host detection and the hierarchical setting, without processes: the pure rules and the one-process case."""
from __future__ import annotations

import pytest
import torch

from dtrain.comm import LocalCommunicator
from dtrain.comm.hierarchical import hierarchical_setting, make_hierarchical
from dtrain.comm.hosts import describe_hosts, node_label, ranks_by_block, ranks_by_label
from dtrain.comm.launcher import detect_launcher


def test_ranks_by_label_groups_hosts_in_order_of_their_lowest_rank() -> None:
    assert ranks_by_label(["b", "a", "b", "c", "a"]) == [[0, 2], [1, 4], [3]]


def test_ranks_by_block_makes_consecutive_hosts_and_refuses_what_does_not_divide() -> None:
    assert ranks_by_block(6, 2) == [[0, 1], [2, 3], [4, 5]]
    for bad in (0, -1, 4, True, 1.5):
        with pytest.raises(ValueError, match="comm.ranks_per_host"):
            ranks_by_block(6, bad)


def test_describe_hosts_names_even_and_uneven_layouts() -> None:
    assert describe_hosts([[0, 1], [2, 3]]) == "2 hosts x 2 ranks"
    assert describe_hosts([[0, 1], [2]]) == "2 hosts (2, 1 ranks)"


def test_node_labels_come_from_torchrun_and_slurm_variables() -> None:
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h0", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "1"}
    assert detect_launcher(torchrun).node == node_label("torchrun", torchrun) == "torchrun-node-1"
    slurm = {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0"}
    assert detect_launcher(slurm).node == "slurm-node-1"
    assert node_label("mpi", {"OMPI_COMM_WORLD_RANK": "0"}) is None  # found from MPI's shared-memory split


def test_hierarchical_setting_accepts_auto_true_false_only() -> None:
    assert [hierarchical_setting(v) for v in ("auto", True, False)] == ["auto", True, False]
    for bad in ("true", "yes", 1, None):
        with pytest.raises(ValueError, match="comm.hierarchical"):
            hierarchical_setting(bad)


def test_one_process_splits_into_itself_and_refuses_a_forced_hierarchy() -> None:
    comm = LocalCommunicator()
    local, leaders = comm.host_groups()
    assert (local.size, leaders.size) == (1, 1)
    assert comm.split(None) is None
    with pytest.raises(ValueError, match="split color"):
        comm.split(-2)
    assert local.reduce(torch.ones(2)).tolist() == [1.0, 1.0]
    assert make_hierarchical(comm, "auto") == (comm, "")
    assert make_hierarchical(comm, False) == (comm, "")
    with pytest.raises(ValueError, match="comm.hierarchical=true needs a job of several processes"):
        make_hierarchical(comm, True)

"""A CTF stream kept sparse (``layout: sparse``) under a real ``mpiexec -n 2``: data-parallel training
gives the model one process gives, and the model the dense layout gives."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dtrain.comm import LocalCommunicator

from tests.dist._ctf_sparse_worker import TEXT, trained
from tests.helpers.mpi import run_mpi

WORKER = Path(__file__).with_name("_ctf_sparse_worker.py")


def test_a_sparse_stream_trains_data_parallel_as_one_process_and_as_the_dense_layout(tmp_path):
    result = run_mpi(2, [WORKER, tmp_path / "run"], timeout=240)
    assert result.returncode == 0, result.report()
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    two = json.loads(line[len("RESULT "):])
    assert two["size"] == 2 and not two["differing"] and two["difference"] <= 1e-6
    (tmp_path / "one.ctf").write_text(TEXT)
    one = trained("sparse", LocalCommunicator(), tmp_path / "one.ctf", tmp_path / "one")
    assert torch.allclose(torch.cat([p.detach().flatten() for p in one.parameters()]),
                          torch.tensor(two["parameters"]), atol=1e-6)

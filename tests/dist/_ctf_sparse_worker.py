"""Worker run by tests/dist/test_ctf_sparse_mpi.py under mpiexec: ``python _ctf_sparse_worker.py RUN_DIR``.

A CTF file whose sparse features are kept sparse (``layout: sparse``) trains a ``Linear`` model
data-parallel on the ranks, and the same file made dense (``layout: dense``) trains it too; rank 0
prints ``RESULT {json}`` with the largest difference between the two models, whether every rank
ended with the same parameters, and the sparse model's flat parameters (against one process's).
"""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import torch

from dtrain import MinibatchSource, create_communicator, data_parallel_distributed_learner, training_session
from dtrain.data import CTFDeserializer

from tests.helpers.compare import differing_on_ranks, max_difference

#: 20 samples of 6 sparse inputs (an empty one among them) and 3 classes, written as CTF
TEXT = "|x 0:1.5 5:2 |y 1:1\n|x |y 0:1\n|x 3:-1 |y 2:1\n|x 5:0.5 1:4 |y 1:1\n" * 5


def trained(layout: str, comm, path: Path, run_dir: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    streams = {"x": {"dim": 6, "format": "sparse", "layout": layout}, "y": {"dim": 3, "format": "sparse", "ids": True}}
    source = MinibatchSource(CTFDeserializer(path, streams, features="x", labels="y"), randomization_seed=2)
    learner = data_parallel_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    training_session(model, torch.nn.CrossEntropyLoss(), learner, source, 8, max_samples=40,
                     run_dir=run_dir / layout, tensorboard=False, stream=io.StringIO()).train()
    return model


def main() -> None:
    run_dir = Path(sys.argv[1])
    comm = create_communicator()
    path = run_dir.parent / "sparse.ctf"  # beside the run directory, which the sessions create
    if comm.is_main:
        path.write_text(TEXT)
    comm.barrier()
    sparse, dense = trained("sparse", comm, path, run_dir), trained("dense", comm, path, run_dir)
    differing = differing_on_ranks(comm, dict(sparse.named_parameters()))
    if comm.is_main:
        print("RESULT " + json.dumps({"size": comm.size, "difference": max_difference(sparse, dense),
                                      "differing": differing,
                                      "parameters": torch.cat([p.detach().flatten() for p in sparse.parameters()])
                                      .tolist()}), flush=True)
    comm.finalize()


if __name__ == "__main__":
    main()

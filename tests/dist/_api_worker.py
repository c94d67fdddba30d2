"""Worker run by tests/dist/test_api_mpi.py under mpiexec: ``python _api_worker.py MODE RUN_DIR``.

``single``: docs/python-api.md's one-process snippet (a ``Learner`` without a communicator); the
session must refuse it, since every rank would train its own copy into one folder.
``distributed``: docs/python-api.md's distributed snippet (``create_communicator`` and a data-parallel
learner); rank 0 prints ``RESULT {json}`` with the test accuracy and whether every rank ended
with the same parameters.
"""
from __future__ import annotations

import json
import sys

import torch

from dtrain import (CheckpointConfig, LocalLearner, MinibatchSource, TestConfig, create_communicator,
                    data_parallel_distributed_learner, training_session)
from dtrain.data import Digits
from dtrain.models import DigitsCNN


def main() -> None:
    mode, run_dir = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    comm = create_communicator() if mode == "distributed" else None
    learner = data_parallel_distributed_learner(optimizer, comm) if comm is not None else LocalLearner(optimizer)
    train = MinibatchSource(Digits("train"), randomize=True, randomization_seed=0)
    test = MinibatchSource(Digits("test"), randomize=False, max_sweeps=1)
    result = training_session(
        model, torch.nn.functional.cross_entropy, learner, train, minibatch_size=32, max_samples=3000,
        progress_frequency=1500, checkpoint_config=CheckpointConfig("checkpoint.pt"), test_config=TestConfig(test),
        run_dir=run_dir, tensorboard=False,
    ).train()
    copies = comm.allgather_object({name: p.detach().clone() for name, p in model.named_parameters()})
    same = all(torch.equal(copy[name], copies[0][name]) for copy in copies for name in copies[0])
    if comm.is_main:
        print("RESULT " + json.dumps({"accuracy": result.test.accuracy, "same_parameters": same,
                                      "size": comm.size, "samples_seen": result.samples_seen}), flush=True)
    comm.finalize()


if __name__ == "__main__":
    main()

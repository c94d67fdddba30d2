"""Worker run by tests/dist/test_first_minibatch_mpi.py under mpiexec: ``python _first_minibatch_worker.py PROBLEM
RUN_DIR``. Sample 20 of the data, in rank 1's share of the first minibatch of 32 (rank 0 reads 0-15), is bad:
``shape`` (a Dataset's sample of another shape), ``raise`` (a Dataset's ``__getitem__`` that raises) or ``oserror``
(a deserializer of the user's whose ``read`` raises OSError). Each rank prints ``RANK r TypeName: message``
for the error its ``train()`` raised, and whether the run directory exists after it."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dtrain import CheckpointConfig, MinibatchSource, create_communicator, data_parallel_distributed_learner, \
    training_session
from dtrain.data import StreamInfo

BAD = 20


class Samples(torch.utils.data.Dataset):
    """64 samples of 6 features and 4 classes; sample ``BAD`` has 3 features or raises."""

    def __init__(self, problem: str):
        generator = torch.Generator().manual_seed(0)
        self.features, self.labels = torch.randn(64, 6, generator=generator), torch.arange(64) % 4
        self.problem = problem

    def __len__(self):
        return 64

    def __getitem__(self, index):
        if index == BAD and self.problem == "raise":
            raise OSError("corrupt record")
        features = self.features[index][:3] if index == BAD else self.features[index]
        return features, int(self.labels[index])


class FailingReads:
    """A stream deserializer of the user's whose read of sample ``BAD`` fails on the disk."""

    streams = {"features": StreamInfo("features", (6,), torch.float32),
               "labels": StreamInfo("labels", (), torch.int64, num_classes=4)}
    num_sequences = 64

    def read(self, indices):
        if BAD in indices:
            raise OSError("the disk went away")
        return {"features": torch.zeros(len(indices), 6), "labels": torch.as_tensor(np.asarray(indices) % 4)}


def main() -> None:
    problem, run_dir = sys.argv[1], Path(sys.argv[2])
    comm = create_communicator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    learner = data_parallel_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    data = FailingReads() if problem == "oserror" else Samples(problem)
    session = training_session(model, nn.functional.cross_entropy, learner, MinibatchSource(data, randomize=False),
                               32, max_samples=128, progress_frequency=32, run_dir=run_dir, tensorboard=False,
                               checkpoint_config=CheckpointConfig("checkpoint.pt", frequency=64))
    try:
        session.train()
    except Exception as error:  # noqa: BLE001 - reported for the test
        print(f"RANK {comm.rank} {type(error).__name__}: {error}", flush=True)
    comm.barrier()
    print(f"RANK {comm.rank} run directory exists: {run_dir.exists()}", flush=True)
    comm.finalize()


if __name__ == "__main__":
    main()

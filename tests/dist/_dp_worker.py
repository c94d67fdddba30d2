"""Worker run by tests/dist/test_data_parallel_mpi.py under mpiexec: ``python _dp_worker.py RUN_DIR``.

Every check trains through the public API (``training_session`` + ``MinibatchSource``, the
session partitioning each global minibatch over the ranks) and returns its figures, which the
test asserts one check per test id (``tests.helpers.checks``). The checks share one launch because
starting the ranks costs far more than the checks themselves.

Checks:
  equivalence      an MLP trained by N ranks equals one process with the same global minibatches
                   (uneven shares and ranks with 0 samples included); parameters identical on all
                   ranks; a BatchNorm model ends with identical parameters AND buffers.
  distributed_after  a dropout model trained locally first, then data-parallel: identical after the switch.
"""
from __future__ import annotations

import io
import os
import sys
from functools import partial
from pathlib import Path

import torch
from torch import nn

import dtrain
from dtrain.comm import LocalCommunicator, create_communicator
from dtrain.learners import Learner, LocalLearner, data_parallel_distributed_learner

from tests.helpers.checks import run_checks
from tests.helpers.compare import differing_on_ranks, max_difference
from tests.helpers.toy_data import four_class_data

# global minibatch sizes by samples seen: 7 (uneven over 2 and 4 ranks), 1 (a rank or three get 0
# samples), 3 (over 4 ranks: rank 0 gets 0), then 13; the last minibatch is clipped by max_samples
MINIBATCH_SCHEDULE = dtrain.Schedule([[2, 7], [1, 1], [1, 3], [1, 13]], epoch_size=7)
MAX_SAMPLES = 200


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank, as the CLI does
    middle = {"plain": [], "batchnorm": [nn.BatchNorm1d(32)], "dropout": [nn.Dropout(0.3)]}[kind]
    return nn.Sequential(nn.Linear(6, 32), *middle, nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def train(model: nn.Module, learner: Learner, run_dir: Path, minibatch_size, max_samples: int) -> None:
    dtrain.training_session(
        model=model, loss=nn.functional.cross_entropy, learner=learner,
        minibatch_source=dtrain.MinibatchSource(four_class_data(), randomize=True, randomization_seed=5),
        minibatch_size=minibatch_size, max_samples=max_samples, run_dir=run_dir, tensorboard=False,
        stream=io.StringIO(), independent_processes=learner.comm.size == 1,  # the per-rank one-process reference
    ).train()


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def check_equivalence(comm, run_dir: Path) -> dict:
    model = make_model("plain")
    # a tiny bucket size (1,572 bytes), so the model spans several buckets, the in-order launch is
    # exercised, and the 2,048-byte weight is reduced in place (a gradient of at least the bucket limit)
    learner = data_parallel_distributed_learner(optimizer_of(model), comm, bucket_size_mb=0.0015)
    train(model, learner, run_dir / "distributed", MINIBATCH_SCHEDULE, MAX_SAMPLES)
    num_buckets = len(getattr(learner, "buckets", []))
    num_in_place = sum(type(bucket).__name__ == "InPlaceBucket" for bucket in getattr(learner, "buckets", []))

    # the reference: one process, the same global minibatches (every rank computes it for itself)
    reference = make_model("plain")
    train(reference, LocalLearner(optimizer_of(reference), LocalCommunicator()), run_dir / f"reference{comm.rank}",
          MINIBATCH_SCHEDULE, MAX_SAMPLES)
    difference_to_one_process = max_difference(model, reference)
    moved = max_difference(model, make_model("plain"))  # proof that training did something

    batchnorm = make_model("batchnorm")
    train(batchnorm, data_parallel_distributed_learner(optimizer_of(batchnorm), comm, bucket_size_mb=0.002),
          run_dir / "batchnorm", 16, 96)
    return {
        "size": comm.size,
        "samples_seen": learner.samples_seen,
        "num_buckets": num_buckets,
        "num_in_place_buckets": num_in_place,
        "max_difference_to_one_process": difference_to_one_process,
        "parameters_moved_by": moved,
        "differing_parameters": differing_on_ranks(comm, dict(model.named_parameters())),
        "differing_batchnorm_state": differing_on_ranks(comm, batchnorm.state_dict()),
    }


def check_distributed_after(comm, run_dir: Path) -> dict:
    model = make_model("dropout")
    torch.manual_seed(100 + comm.rank)  # different dropout masks: ranks drift apart while local
    learner = data_parallel_distributed_learner(optimizer_of(model), comm, distributed_after=48)
    states = []
    original_step = learner.step

    def step_and_record() -> None:
        was_distributed = learner.is_distributed()
        original_step()
        if not was_distributed and learner.is_distributed():  # the last local step: ranks should differ now
            states.append(differing_on_ranks(comm, dict(model.named_parameters())))

    learner.step = step_and_record
    train(model, learner, run_dir / "distributed_after", 16, 160)
    return {
        "samples_seen": learner.samples_seen,
        "differing_before_switch": states[0] if states else None,
        "differing_parameters": differing_on_ranks(comm, dict(model.named_parameters())),
    }


def main() -> None:
    run_dir = Path(sys.argv[1])
    torch.set_num_threads(1)  # several ranks share two cores
    # CPU tensors, also on a GPU machine
    comm = create_communicator(backend=os.environ.get("WORKER_BACKEND", "gloo"), timeout_s=60)
    run_checks(comm, {"equivalence": partial(check_equivalence, run_dir=run_dir),
                      "distributed_after": partial(check_distributed_after, run_dir=run_dir)})
    comm.finalize()


if __name__ == "__main__":
    main()

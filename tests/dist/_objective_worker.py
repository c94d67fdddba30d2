"""Worker run by tests/dist/test_objective_mpi.py under mpiexec: ``python _objective_worker.py RUN_DIR``.

Your own objective with real ranks: a two-loss objective and a distillation objective under data_parallel
give the parameters and the logged figures of one process on the same global minibatches (uneven shares,
ranks with no samples), also in micro-batches; a resume from a checkpoint ends bit-identical.

Checks:
  two_losses    data_parallel at 2 ranks, uncapped and with passes of 2 samples, against one process.
  distillation  the same with ``dtrain.session.Distillation`` and a frozen teacher loaded from safetensors.
  resume        data_parallel with the two-loss objective, resumed from its first checkpoint (about 96 samples), against
                the uninterrupted run: the same parameters, bit for bit.
  bad_first_result  an objective whose first result is a vector on rank 1 only: every rank refuses with
                rank 1's line before any step.
"""
from __future__ import annotations

import io
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import dtrain
from dtrain.comm import LocalCommunicator, create_communicator
from dtrain.learners import LocalLearner, data_parallel_distributed_learner
from dtrain.session import Distillation
from dtrain.session.weights import save_weights

from tests.helpers.checks import run_checks
from tests.helpers.compare import differing_on_ranks, max_difference
from tests.helpers.toy_data import four_class_data

MINIBATCH_SCHEDULE = dtrain.Schedule([[2, 7], [1, 1], [1, 3], [1, 13]], epoch_size=7)
MAX_SAMPLES = 200


def two_losses(model, minibatch):
    """Cross-entropy and an auxiliary penalty on the logits, both logged."""
    output = model(minibatch["features"])
    main = F.cross_entropy(output, minibatch["labels"])
    aux = output.pow(2).mean()
    return main + 0.1 * aux, {"main_loss": main, "aux": aux}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model: nn.Module, learner, run_dir: Path, objective, **options) -> list[dict]:
    """Trains and returns the train records of metrics.jsonl (rank 0; the other ranks: none)."""
    dtrain.training_session(
        model=model, objective=objective, learner=learner,
        minibatch_source=dtrain.MinibatchSource(four_class_data(), randomize=True, randomization_seed=5),
        minibatch_size=MINIBATCH_SCHEDULE, max_samples=MAX_SAMPLES, progress_frequency=50, run_dir=run_dir,
        tensorboard=False, stream=io.StringIO(), independent_processes=learner.comm.size == 1, **options,
    ).train()
    path = run_dir / "metrics.jsonl"
    if not learner.comm.is_main or not path.is_file():
        return []
    return [record for record in map(json.loads, path.read_text().splitlines()) if record["kind"] == "train"]


def figure_difference(records: list[dict], reference: list[dict]) -> float:
    """The largest difference of the loss and the figures between two runs' train records."""
    assert [r["samples"] for r in records] == [r["samples"] for r in reference], (records, reference)
    keys = [key for key in ("loss", "main_loss", "aux", "kl", "cross_entropy") if key in reference[0]]
    return max(abs(r[key] - q[key]) for r, q in zip(records, reference) for key in keys)


def compare_with_one_process(comm, run_dir: Path, objective) -> dict:
    one_process = make_model()
    reference = train(one_process, LocalLearner(optimizer_of(one_process), LocalCommunicator()),
                      run_dir / f"reference{comm.rank}", objective)
    results = {}
    for name, options in (("uncapped", {}), ("micro_batches", {"micro_batch_size": 2})):
        model = make_model()
        records = train(model, data_parallel_distributed_learner(optimizer_of(model), comm), run_dir / name,
                        objective, **options)
        results[name] = {"difference_to_one_process": max_difference(model, one_process),
                         "differing_parameters": differing_on_ranks(comm, dict(model.named_parameters())),
                         "figures": sorted(records[0]) if records else None,
                         "figure_difference": figure_difference(records, reference) if records else None}
    results["moved"] = max_difference(one_process, make_model())
    return results


def check_two_losses(comm, run_dir: Path) -> dict:
    return compare_with_one_process(comm, run_dir / "two_losses", two_losses)


def check_distillation(comm, run_dir: Path) -> dict:
    teacher_weights = run_dir / f"teacher{comm.rank}.safetensors"
    run_dir.mkdir(parents=True, exist_ok=True)
    save_weights(make_model(seed=7), teacher_weights)
    distillation = Distillation(make_model(seed=1), weights=teacher_weights, temperature=2.0, alpha=0.7)
    loaded = max_difference(distillation.teacher, make_model(seed=7))
    teacher_before = [parameter.clone() for parameter in distillation.teacher.parameters()]
    results = compare_with_one_process(comm, run_dir / "distillation", distillation)
    results["teacher_loaded"] = loaded
    results["teacher_unchanged"] = all(torch.equal(a, b) for a, b in zip(teacher_before,
                                                                          distillation.teacher.parameters()))
    results["teacher_frozen"] = not any(p.requires_grad for p in distillation.teacher.parameters()) \
        and not distillation.teacher.training
    return results


def check_resume(comm, run_dir: Path) -> dict:
    def checkpoints(**more):
        return dtrain.CheckpointConfig("checkpoint.pt", frequency=96, preserve_all=True, **more)
    whole = make_model()
    train(whole, data_parallel_distributed_learner(optimizer_of(whole), comm), run_dir / "whole", two_losses,
          micro_batch_size=2, checkpoint_config=checkpoints())
    first = min((run_dir / "whole").glob("checkpoint-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
    resumed = make_model(seed=3)  # the checkpoint brings the weights
    train(resumed, data_parallel_distributed_learner(optimizer_of(resumed), comm), run_dir / "resumed", two_losses,
          micro_batch_size=2,
          checkpoint_config=checkpoints(restore_from=str(first)))
    return {"restored_at": int(first.stem.split("-")[1]),
            "bit_identical": all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters())),
            "moved": max_difference(whole, make_model())}


def check_bad_first_result(comm, run_dir: Path) -> dict:
    def objective(model, minibatch):  # a vector on rank 1 only: both ranks must refuse, with rank 1's line
        losses = F.cross_entropy(model(minibatch["features"]), minibatch["labels"], reduction="none")
        return losses if comm.rank == 1 else losses.mean()
    model = make_model()
    try:
        train(model, data_parallel_distributed_learner(optimizer_of(model), comm), run_dir / "bad", objective)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return {"refusals": comm.allgather_object(refusal),
            "unchanged": comm.allgather_object(max_difference(model, make_model()) == 0.0)}


def main() -> None:
    run_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    comm = create_communicator(backend="gloo", timeout_s=60)  # CPU tensors, also on a GPU machine
    run_checks(comm, {name: partial(check, run_dir=run_dir) for name, check in (
        ("two_losses", check_two_losses), ("distillation", check_distillation), ("resume", check_resume),
        ("bad_first_result", check_bad_first_result))})
    comm.finalize()


if __name__ == "__main__":
    main()

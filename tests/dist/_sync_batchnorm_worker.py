"""Worker run by tests/dist/test_sync_batchnorm_mpi.py under mpiexec: ``python _sync_batchnorm_worker.py RUN_DIR``.

A Conv-BatchNorm model (``DigitsCNN(batch_norm=True)`` on 8x8 digits, in float64) trained with the data-parallel
learner on global minibatches of 11 and 5 samples (uneven shares at 2 and 4 ranks; a rank without
samples at 4 ranks in the minibatches of 3: 1+1+1+0), compared with one process.

Checks:
  equal_to_one_process     sync_batchnorm: parameters and running statistics after every run equal one
                           process's, on every rank; without it they differ (the check can fail).
  micro_batches            sync_batchnorm with micro_batch_size: the ranks make as many passes as the busiest
                           one (no hang) and stay identical; at 4 ranks (cap 2, every share one pass) they
                           equal one process without a cap (at 2 ranks the cap of 1 makes several passes).
  recomputed               batchnorm_statistics=recomputed: the running statistics equal the exact mean and
                           unbiased variance of each layer's inputs over the samples, measured independently
                           on one process; the source's position is unchanged.
  eval_without_traffic     cross-validation and test with different batch counts per rank issue no
                           BatchNorm collective.
  compile_and_bf16         (run alone) session.compile=true gives the eager run's model; precision=bf16 keeps
                           float32 statistics, identical on every rank.
"""
from __future__ import annotations

import io
import sys
from pathlib import Path

import torch
from torch import nn

import dtrain
from dtrain.comm import LocalCommunicator, create_communicator
from dtrain.data.digits import Digits
from dtrain.learners import LocalLearner, data_parallel_distributed_learner
from dtrain.models import DigitsCNN

from tests.helpers.checks import run_checks
from tests.helpers.compare import differing_on_ranks
from tests.helpers.toy_data import four_class_data

SCHEDULE = dtrain.Schedule([[2, 11], [1, 5], [1, 3]], epoch_size=11)
#: plain BatchNorm1d needs 2 samples per rank: shares of at least 2 at 4 ranks
PLAIN_SCHEDULE = dtrain.Schedule([[2, 11], [1, 9]], epoch_size=11)
MAX_SAMPLES = 120
RECOMPUTE = 99  # in minibatches of 3 (the schedule's size at 120 samples): none of a single sample


class Float64(nn.Module):
    """The model in float64, its float32 inputs converted: a float32 run of these minibatches of 1-3 samples is
    chaotic (a relative change of 1e-6 in the start grows to 5e-3 at lr 0.05 on an AVX2 CPU, as a max-pool picks
    another of two nearly equal inputs), so another reduction order alone would fail a comparison of 1e-4."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model.double()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs.double())


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Float64(DigitsCNN(hidden=16, batch_norm=True))


def source() -> dtrain.MinibatchSource:
    return dtrain.MinibatchSource(Digits("train"), randomize=True, randomization_seed=3)


def train(model, learner, run_dir: Path, minibatch_size=SCHEDULE, **options):
    session = dtrain.training_session(
        model=model, loss=nn.functional.cross_entropy, learner=learner, minibatch_source=source(),
        minibatch_size=minibatch_size, max_samples=MAX_SAMPLES, run_dir=run_dir, tensorboard=False,
        stream=io.StringIO(), independent_processes=learner.comm.size == 1, **options)
    session.train()
    return session


def one_process(run_dir: Path, comm, **options) -> nn.Module:
    model = make_model()
    train(model, LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), LocalCommunicator()),
          run_dir / f"one{comm.rank}", **options)
    return model


def distributed(run_dir: Path, comm, name: str, **options) -> tuple[nn.Module, dtrain.TrainingSession]:
    model = make_model()
    learner = data_parallel_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm)
    session = train(model, learner, run_dir / name, **options)
    return model, session


def largest_difference(a: nn.Module, b: nn.Module) -> dict[str, float]:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    return {key: float((state_a[key].double() - state_b[key].double()).abs().max()) for key in state_a}


def relative_difference(a: nn.Module, b: nn.Module) -> dict[str, float]:
    """Each state entry's largest difference, relative to the entry's largest magnitude (at least 1)."""
    scale = {key: max(1.0, float(value.double().abs().max())) for key, value in b.state_dict().items()}
    return {key: difference / scale[key] for key, difference in largest_difference(a, b).items()}


def check_equal_to_one_process(comm, run_dir: Path) -> dict:
    reference = one_process(run_dir, comm)
    synchronized, _ = distributed(run_dir, comm, "sync", sync_batchnorm=True)
    plain, _ = distributed(run_dir, comm, "plain", minibatch_size=PLAIN_SCHEDULE)
    plain_reference = one_process(run_dir / "plain", comm, minibatch_size=PLAIN_SCHEDULE)
    return {"sync": relative_difference(synchronized, reference), "plain": relative_difference(plain, plain_reference),
            "moved": max(largest_difference(reference, make_model()).values()),
            "differing_on_ranks": differing_on_ranks(comm, synchronized.state_dict())}


def check_micro_batches(comm, run_dir: Path) -> dict:
    # shares within the cap at 4 ranks (8 = 2+2+2+2, 6 = 2+2+1+1): one pass each, whose union is one process's
    # minibatch; at 2 ranks (8 = 4+4 with a cap of 3) two passes each, which one process does not make. (Minibatches
    # of 3 would make this run chaotic: a change of 1e-6 in the start grows to 1e-2.)
    small = dtrain.Schedule([[1, 8], [1, 6]], epoch_size=8)
    cap = 2 if comm.size == 4 else 3
    reference = one_process(run_dir, comm, minibatch_size=small)
    capped, _ = distributed(run_dir, comm, "micro", minibatch_size=small, sync_batchnorm=True, micro_batch_size=cap)
    # 10 = 3+3+2+2 at 4 ranks: two passes on ranks 0 and 1, one and an empty one on ranks 2 and 3
    padded, _ = distributed(run_dir, comm, "padded", minibatch_size=10, sync_batchnorm=True, micro_batch_size=cap)
    return {"difference": max(relative_difference(capped, reference).values()),
            "differing_on_ranks": differing_on_ranks(comm, capped.state_dict()),
            "padded_differing_on_ranks": differing_on_ranks(comm, padded.state_dict())}


def check_recomputed(comm, run_dir: Path) -> dict:
    model, session = distributed(run_dir, comm, "recomputed", batchnorm_statistics="recomputed",
                                 batchnorm_recompute_samples=RECOMPUTE, sync_batchnorm=True)
    position = session.source.get_checkpoint_state()["position"]
    # independently: one process, the final weights, the next RECOMPUTE samples at once, batch statistics in train mode
    # for the BatchNorm layers through plain BatchNorm layers of a fresh copy (no dtrain code)
    plain = make_model()
    plain.load_state_dict(model.state_dict())
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach().double()))
             for layer in plain.modules() if isinstance(layer, nn.modules.batchnorm._BatchNorm)]
    data = source()
    data.restore_from_checkpoint(session.source.get_checkpoint_state())
    differences = []
    size = int(SCHEDULE(MAX_SAMPLES))
    plain.eval()
    for layer in plain.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.train()
    read, per_layer = 0, None
    with torch.no_grad():
        while read < RECOMPUTE:
            batch = data.next_minibatch(min(size, RECOMPUTE - read), 1, 0)
            read += batch.global_num_samples
            inputs.clear()
            plain(batch.streams["features"])
            chunks = [x.transpose(0, 1).reshape(x.shape[1], -1) for x in inputs]
            per_layer = chunks if per_layer is None else [torch.cat([a, b], 1) for a, b in zip(per_layer, chunks)]
    for hook in hooks:
        hook.remove()
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for layer, values in zip(layers, per_layer):
        differences.append(float((layer.running_mean.double() - values.mean(1)).abs().max()))
        differences.append(float((layer.running_var.double() - values.var(1, unbiased=True)).abs().max()))
    return {"differences": differences, "position_unchanged": position == session.learner.samples_seen,
            "running_mean": [float(v) for v in layers[0].running_mean[:4]],
            "differing_on_ranks": differing_on_ranks(comm, model.state_dict())}


def check_eval_without_traffic(comm, run_dir: Path) -> dict:
    model = make_model()
    learner = data_parallel_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    test = dtrain.MinibatchSource(Digits("test"), randomize=False, max_sweeps=1)
    session = dtrain.training_session(
        model=model, loss=nn.functional.cross_entropy, learner=learner, minibatch_source=source(),
        minibatch_size=11, max_samples=22, run_dir=run_dir / "eval", tensorboard=False, stream=io.StringIO(),
        sync_batchnorm=True, test_config=dtrain.TestConfig(test, minibatch_size=7 * comm.size + 1))
    sync = session.batchnorm_sync
    calls = []
    original = sync.allreduce
    sync.allreduce = lambda values: (calls.append(model.training), original(values))[1]
    result = session.train()
    return {"collectives_in_eval": sum(1 for training in calls if not training), "collectives": len(calls),
            "test_samples": result.test.num_samples}


def check_compile_and_bf16(comm, run_dir: Path) -> dict:
    def run(name, **options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
        learner = data_parallel_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm)
        dtrain.training_session(
            model=model, loss=nn.functional.cross_entropy, learner=learner,
            minibatch_source=dtrain.MinibatchSource(four_class_data(), randomize=True, randomization_seed=5),
            minibatch_size=13, max_samples=130, run_dir=run_dir / name, tensorboard=False, stream=io.StringIO(),
            sync_batchnorm=True, **options).train()
        return model

    eager, compiled, bf16 = run("eager"), run("compiled", compile=True), run("bf16", precision="bf16")
    return {"compiled_difference": max(largest_difference(compiled, eager).values()),
            "bf16_difference": max(relative_difference(bf16, eager).values()),
            "bf16_statistics_dtype": str(bf16[1].running_var.dtype),
            "differing_on_ranks": differing_on_ranks(comm, compiled.state_dict()) + differing_on_ranks(comm, bf16.state_dict())}


def main() -> None:
    run_dir, chosen = Path(sys.argv[1]), sys.argv[2:]  # optional: the names of the checks to run
    checks = {
        "equal_to_one_process": lambda comm: check_equal_to_one_process(comm, run_dir),
        "micro_batches": lambda comm: check_micro_batches(comm, run_dir),
        "recomputed": lambda comm: check_recomputed(comm, run_dir),
        "eval_without_traffic": lambda comm: check_eval_without_traffic(comm, run_dir),
        "compile_and_bf16": lambda comm: check_compile_and_bf16(comm, run_dir),
    }
    chosen = chosen or [name for name in checks if name != "compile_and_bf16"]  # compiling takes minutes
    with create_communicator() as comm:
        run_checks(comm, {name: check for name, check in checks.items() if name in chosen})


if __name__ == "__main__":
    main()

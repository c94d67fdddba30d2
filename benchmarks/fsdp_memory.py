"""Per-rank memory of a sharded model (``learner=fsdp``) against a replicated one (``data_parallel``), and step time.

    python benchmarks/fsdp_memory.py --ranks 2 4
    python benchmarks/fsdp_memory.py --ranks 2 --model large --steps 6
    python benchmarks/fsdp_memory.py --ranks 4 --two-level --steps 100

Starts ``mpiexec -n N`` itself for each rank count and learner. Every rank builds the character transformer of
``+recipe=shakespeare_char`` (``--model base``: 4 layers, 128 wide; ``large``: ``model=char_transformer_large``,
8 layers, 512 wide), AdamW as the recipe has it, and trains ``--steps`` global minibatches of 2,048 tokens of
the shipped corpus through ``training_session``. Then each rank counts the bytes it holds of the parameters,
their gradients and the optimizer's state (a sharded tensor: its local shard), and the table prints the largest
rank's total against ``data_parallel``'s, and the median seconds per step after the first (which includes the
start), side by side, and how far the second learner's parameters end from the first's. ``--two-level``:
``two_level_diloco`` on 2 simulated hosts, unsharded and with ``learner.shard=true``, the bytes of the outer state
(``W_prev`` and DiLoCo's momentum) counted too. ``uptime``'s load is printed: a shared machine moves the step times.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _mpiexec import mpi_environment, mpiexec_command

MODELS = {"base": {"layers": 4, "heads": 4, "width": 128}, "large": {"layers": 8, "heads": 8, "width": 512}}


def local_bytes(tensor) -> int:
    """Bytes this rank holds of ``tensor`` (its shard, for a sharded one)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


#: ``--two-level``: DiLoCo between 2 simulated hosts (``ranks_per_host`` = ranks / 2), a sync every 2 global minibatches
TWO_LEVEL = ("two_level_diloco", "two_level_diloco shard")


def build_learner(learner_name: str, optimizer, comm):
    """The learner the row is about."""
    from dtrain.learners import FSDPLearner, TwoLevelDiLoCoLearner, data_parallel_distributed_learner

    if learner_name == "fsdp":
        return FSDPLearner(optimizer, comm)
    if learner_name.startswith("two_level_diloco"):
        return TwoLevelDiLoCoLearner(optimizer, comm, ranks_per_host=comm.size // 2, block_size=2 * 2048,
                                     distributed_after=0, shard=learner_name.endswith("shard"), wrap="blocks")
    return data_parallel_distributed_learner(optimizer, comm)


def outer_bytes(learner) -> int:
    """Bytes this rank holds of a block learner's outer state: ``W_prev`` and the outer optimizer's state (0 else)."""
    prev = getattr(learner, "prev_parameters", None)
    if prev is None:
        return 0
    state = learner.outer_optimizer.state.values() if learner.outer_optimizer is not None else []
    return local_bytes(prev) + sum(local_bytes(value) for per_parameter in state for value in per_parameter.values()
                                   if hasattr(value, "numel") and value.dim() > 0)


def worker(learner_name: str, model_name: str, steps: int, out: str) -> None:
    import numpy as np
    import torch

    import dtrain
    from dtrain.comm import create_communicator
    from dtrain.data import CharCorpus, MinibatchSource
    from dtrain.models import CharTransformer
    from dtrain.session import SequenceCrossEntropy
    from dtrain.session.callbacks import Callback

    torch.set_num_threads(1)
    comm = create_communicator(backend="gloo", timeout_s=120)
    torch.manual_seed(0)
    model = CharTransformer(vocab_size=73, context_length=128, dropout=0.0, **MODELS[model_name])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.002, betas=(0.9, 0.99), weight_decay=0.1)
    learner = build_learner(learner_name, optimizer, comm)
    step_times: list[float] = []

    class StepClock(Callback):
        all_ranks = True

        def on_step_end(self, run, step):
            step_times.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as run_dir:
        dtrain.training_session(model, SequenceCrossEntropy(), learner, MinibatchSource(CharCorpus()), 2048,
                                max_samples=2048 * steps, inputs=["text[:-1]"], target="text[1:]", run_dir=run_dir,
                                tensorboard=False, stream=io.StringIO(), callbacks=[StepClock()]).train()
    parameters = sum(local_bytes(p) for p in model.parameters())
    gradients = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(local_bytes(value) for per_parameter in optimizer.state.values() for value in per_parameter.values()
                if isinstance(value, torch.Tensor))
    figures = {"rank": comm.rank, "parameters": parameters, "gradients": gradients, "optimizer_state": state,
               "outer": outer_bytes(learner),
               "step_s": float(np.median(np.diff(step_times))) if len(step_times) > 2 else None,
               "parameter_count": sum(p.numel() for p in model.parameters())}
    everyone = comm.allgather_object(figures)
    whole = {name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()
             for name, tensor in model.state_dict().items()}  # gathered: a collective
    if comm.rank == 0:
        Path(out).write_text(json.dumps(everyone))
        torch.save(whole, out + ".pt")
    comm.finalize()


def relative_difference(got: dict, expected: dict) -> float:
    """The largest ``max|a - b| / max|b|`` over the floating-point tensors."""
    return max(float((got[name].double() - tensor.double()).abs().max() / tensor.double().abs().max().clamp_min(1e-30))
               for name, tensor in expected.items() if tensor.is_floating_point() and tensor.numel())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", choices=sorted(MODELS), default="base")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--two-level", action="store_true",
                        help="two_level_diloco on 2 hosts of ranks/2, unsharded and learner.shard=true, instead of "
                             "data_parallel and fsdp")
    arguments = parser.parse_args()
    learners = TWO_LEVEL if arguments.two_level else ("data_parallel", "fsdp")
    print(f"load before: {os.getloadavg()[0]:.2f}")
    rows = []
    for ranks in arguments.ranks:
        results = {}
        weights = {}
        for learner in learners:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                command = mpiexec_command(ranks, [__file__, "_worker", learner, arguments.model, str(arguments.steps),
                                                  out.name])
                env = mpi_environment(PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
                subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
                results[learner] = json.loads(Path(out.name).read_text())
                weights[learner] = torch.load(out.name + ".pt")
                os.unlink(out.name + ".pt")
        rows.append((ranks, results, relative_difference(weights[learners[1]], weights[learners[0]])))
    print(f"{'ranks':>5} {'learner':>22} {'params MiB':>10} {'grads MiB':>9} {'optim MiB':>9} {'outer MiB':>9} "
          f"{'total MiB':>9} {'of first':>8} {'s/step':>7}")

    def total(figures) -> int:
        return figures["parameters"] + figures["gradients"] + figures["optimizer_state"] + figures["outer"]

    for ranks, results, difference in rows:
        replicated = max(total(r) for r in results[learners[0]])
        for learner, per_rank in results.items():
            largest = max(per_rank, key=total)
            step = statistics.median(r["step_s"] for r in per_rank if r["step_s"] is not None)
            print(f"{ranks:>5} {learner:>22} {largest['parameters'] / 2**20:>10.2f} {largest['gradients'] / 2**20:>9.2f} "
                  f"{largest['optimizer_state'] / 2**20:>9.2f} {largest['outer'] / 2**20:>9.2f} "
                  f"{total(largest) / 2**20:>9.2f} {total(largest) / replicated:>8.3f} {step:>7.3f}")
        print(f"{ranks:>5} parameters after {arguments.steps} steps, {learners[1]} against {learners[0]}: "
              f"{difference:.1e} (largest tensor's max|a - b| / max|b|)")
    print(f"model: {arguments.model}, {rows[0][1][learners[1]][0]['parameter_count']:,} parameters; "
          f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

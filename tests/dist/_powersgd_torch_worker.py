"""Worker for ``test_powersgd_vs_torch.py``: dtrain's PowerSGD against PyTorch's ``powerSGD_hook``.

Every rank trains a small model a few steps under ``DistributedDataParallel`` with
``register_comm_hook(PowerSGDState, powerSGD_hook)`` through a wrapper that records, per step
and bucket, the hook's input (this rank's gradients), the tensor shapes, its output and the
state it leaves (P, Q, error). Then dtrain's :class:`dtrain.exchange.PowerSGD` is fed the same
per-rank inputs (divided by the world size: dtrain hands over gradients whose SUM is the mean)
bucket by bucket, step by step, on the same process group, and must give the same outputs, P
and Q (and the hook's error divided by N) to float tolerance. Prints ``PASS rank r/N``.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from dtrain.comm import create_communicator
from dtrain.exchange import PowerSGD

STEPS = 6
START_ITER = 2  # torch's minimum with error feedback / warm start under DDP


def record_torch(comm, rank_r: int) -> list[list[dict]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 4 * 4, 24), torch.nn.ReLU(), torch.nn.Linear(24, 10))
    ddp = DistributedDataParallel(model)
    state = PowerSGDState(process_group=None, matrix_approximation_rank=rank_r, start_powerSGD_iter=START_ITER,
                          min_compression_rate=2, random_seed=0)
    steps: list[list[dict]] = []

    def recording_hook(state, bucket):  # unannotated: DDP checks a real annotation, not a string
        entry = {"index": bucket.index(), "input": bucket.buffer().detach().clone(),
                 "shapes": [tuple(gradient.shape) for gradient in bucket.gradients()]}
        steps[-1].append(entry)

        def after(future):
            entry["output"] = future.value().detach().clone()
            index = entry["index"]
            for name, memory in (("p", state.p_memory_dict), ("q", state.q_memory_dict), ("error", state.error_dict)):
                if index in memory:
                    entry[name] = memory[index].detach().clone()
            return future.value()

        return powerSGD_hook(state, bucket).then(after)

    ddp.register_comm_hook(state, recording_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(10 + comm.rank)
    for _ in range(STEPS):
        steps.append([])
        optimizer.zero_grad()
        images, labels = torch.randn(6, 3, 6, 6, generator=generator), torch.randint(0, 10, (6,), generator=generator)
        torch.nn.functional.cross_entropy(ddp(images), labels).backward()
        optimizer.step()
    return steps


def compare(comm, rank_r: int) -> int:
    steps = record_torch(comm, rank_r)
    exchange = PowerSGD(matrix_approximation_rank=rank_r, start_powersgd_iter=START_ITER, min_compression_rate=2,
                        random_seed=0)
    exchange.bind(comm)
    compared = 0
    for step, buckets in enumerate(steps):
        exchange.begin_step()
        for entry in buckets:
            flat = entry["input"] / comm.size
            exchange.start(entry["index"], flat, entry["shapes"]).wait()
            where = f"rank {rank_r}, step {step}, bucket {entry['index']}"
            torch.testing.assert_close(flat, entry["output"], rtol=1e-5, atol=1e-6, msg=lambda m: f"output {where}: {m}")
            if step >= START_ITER:
                key = entry["index"]
                torch.testing.assert_close(exchange.p_memory[key], entry["p"], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"P {where}: {m}")
                torch.testing.assert_close(exchange.q_memory[key], entry["q"], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"Q {where}: {m}")
                torch.testing.assert_close(exchange.errors[key] * comm.size, entry["error"], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"error {where}: {m}")
                assert exchange.p_memory[key].numel() > 0, "nothing was compressed: the test would prove nothing"
                compared += 1
    exchange.close()
    return compared


def main() -> None:
    torch.set_num_threads(1)
    comm = create_communicator(backend="gloo", timeout_s=60)  # CPU tensors, also on a GPU machine
    assert dist.is_initialized()
    compared = {rank_r: compare(comm, rank_r) for rank_r in (1, 3)}  # 3: torch orthogonalises by QR
    print(f"PASS rank {comm.rank}/{comm.size} compared={compared}", flush=True)
    comm.finalize()


if __name__ == "__main__":
    sys.exit(main())

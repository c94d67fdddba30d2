"""Bytes on the wire and time per gradient exchange: float32 all-reduce vs bf16/fp16, k-bit and PowerSGD.

    mpiexec -n 2 python benchmarks/bytes_on_wire.py                     # ConvNetCIFAR10, 32/8/4/2/1 bits
    mpiexec -n 4 --oversubscribe python benchmarks/bytes_on_wire.py --model digits --repeats 50

(As root, Open MPI also needs OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.)

The gradient is a real one: each rank back-propagates the model's loss on its own random
minibatch. Rows:

* ``32 (all-reduce)``: ``comm.allreduce`` of the flat float32 gradient, as the data-parallel
  learner does. Its bytes are the ring all-reduce's 2(N-1)/N * 4 bytes per value (Gloo does not
  report what it sends).
* ``32 (two-phase)``: the quantized exchange in its lossless 32-bit mode, CNTK's two phases: measured
  bytes, which should match the line above plus 8 bytes per column of scales.
* ``k``: ``QuantizedExchange`` at k bits with its default (on 2 ranks, and at 1 bit up to 8, every
  rank's codes all-gathered and summed by every rank, two phases otherwise, at 1 bit with the sum at
  2 bits); bytes are what this rank hands to the transport, measured by the exchange.
* ``1 (two phases)``: 1 bit with each stripe's sum re-quantized (phase 1 through ``all_to_all_single``).
* ``1 (all-gather a2a)``: the same with phase 1 built from all-gather (the fallback).
* ``bf16`` / ``fp16``: :class:`dtrain.exchange.CompressedAllReduce` (the all-reduce in 16 bits).
* ``powersgd rR``: :class:`dtrain.exchange.PowerSGD` at rank R from the first step (the learner's
  ``start_powersgd_iter`` all-reduce phase skipped), the whole gradient as one bucket; bytes are
  the three all-reduces (uncompressed vectors, P, Q) of a ring. ``--ranks`` chooses R.

The strategies run through the same interface the data-parallel learner uses
(``exchange.start(key, flat, shapes).wait()``).

A second table is the outer step of the block learners: a real ``DiLoCoLearner`` (AdamW inner
steps, ``--block-minibatches`` minibatches of 32 samples per rank per block) whose block delta
travels float32 or k-bit with error feedback (``learner/exchange=quantized``); bytes are what the
learner reports for its last sync, and "per minibatch" divides them by the minibatches of a block,
to compare with the data-parallel rows above, which pay their bytes every minibatch.

Time: the slowest rank's wall-clock seconds per exchange (quantize, pack, both phases, unpack,
decode), median over ``--repeats`` after 2 warm-up exchanges. Error: ``|sum - exact| / |exact|``
of the first exchange (no residual yet), the error that error feedback then carries forward.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from dtrain.comm import create_communicator
from dtrain.exchange import CompressedAllReduce, PowerSGD, Quantized, full_precision_allreduce_bytes
from dtrain.exchange.quantized import QuantizedExchange
from dtrain.learners import DiLoCoLearner
from dtrain.models import ConvNetCIFAR10, DigitsCNN

MODELS = {
    # name: (factory, input shape)
    "cifar": (lambda: ConvNetCIFAR10(dropout=0.0), (3, 32, 32)),
    "digits": (lambda: DigitsCNN(), (1, 8, 8)),
}


def real_gradients(name: str, rank: int, minibatch: int = 32) -> list[torch.Tensor]:
    """The gradient of the mean loss on a random minibatch (a different one on every rank)."""
    factory, shape = MODELS[name]
    torch.manual_seed(0)  # one model on every rank
    model = factory()
    generator = torch.Generator().manual_seed(rank + 1)
    images = torch.randn(minibatch, *shape, generator=generator) * 64
    labels = torch.randint(0, 10, (minibatch,), generator=generator)
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    return [parameter.grad.detach().clone() for parameter in model.parameters()]


def timed(comm, operation, repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's seconds for ``operation()``."""
    for _ in range(2):
        operation()
    seconds = []
    for _ in range(repeats):
        comm.barrier()
        started = time.perf_counter()
        operation()
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        seconds.append(float(comm.allreduce(elapsed, op="max")))
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="cifar")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4, 2, 1])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="PowerSGD ranks")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--block-minibatches", type=int, default=16, help="DiLoCo: minibatches per block")
    args = parser.parse_args()

    comm = create_communicator(backend="gloo")
    if comm.size < 2:
        raise SystemExit("run under mpiexec with at least 2 ranks: mpiexec -n 2 python benchmarks/bytes_on_wire.py")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.local_size))  # as the CLI does: cores shared by ranks
    gradients = real_gradients(args.model, comm.rank)
    numel = sum(gradient.numel() for gradient in gradients)
    exact = torch.cat([gradient.reshape(-1) for gradient in gradients])
    comm.allreduce(exact, op="sum")
    full_bytes = full_precision_allreduce_bytes(numel, comm.size)
    rows = []

    flat = torch.cat([gradient.reshape(-1) for gradient in gradients])
    seconds = timed(comm, lambda: comm.allreduce(flat.clone(), op="sum"), args.repeats)
    rows.append(("32 (all-reduce)", full_bytes, seconds, 0.0))

    def quantized_row(label: str, bits: int, all_to_all: str = "torch", requantize_sum: bool | str = "auto") -> None:
        first = QuantizedExchange(comm, bits, all_to_all=all_to_all, requantize_sum=requantize_sum)
        result = first.allreduce_([gradient.clone() for gradient in gradients])
        error = float((torch.cat([r.reshape(-1) for r in result]) - exact).norm() / exact.norm())
        exchange = QuantizedExchange(comm, bits, all_to_all=all_to_all, requantize_sum=requantize_sum)
        seconds = timed(comm, lambda: exchange.allreduce_([gradient.clone() for gradient in gradients]), args.repeats)
        rows.append((label, exchange.bytes_sent_last_step, seconds, error))

    quantized_row("32 (two-phase)", 32, requantize_sum=True)
    for bits in args.bits:
        quantized_row(str(bits), bits)
    quantized_row("1 (two phases)", 1, requantize_sum=True)
    quantized_row("1 (all-gather a2a)", 1, all_to_all="allgather", requantize_sum=True)

    shapes = [gradient.shape for gradient in gradients]

    def strategy_row(label: str, make) -> None:
        def exchange_once(strategy) -> torch.Tensor:
            strategy.begin_step()
            flat = torch.cat([gradient.reshape(-1) for gradient in gradients])
            return strategy.allreduce_(0, flat, shapes)

        first = make()
        first.bind(comm)
        error = float((exchange_once(first) - exact).norm() / exact.norm())
        strategy = make()
        strategy.bind(comm)
        seconds = timed(comm, lambda: exchange_once(strategy), args.repeats)
        rows.append((label, strategy.bytes_sent_last_step, seconds, error))
        first.close()
        strategy.close()

    for dtype in ("bf16", "fp16"):
        strategy_row(dtype, lambda dtype=dtype: CompressedAllReduce(dtype))
    for rank in args.ranks:
        strategy_row(f"powersgd r{rank}", lambda rank=rank: PowerSGD(matrix_approximation_rank=rank,
                                                                      start_powersgd_iter=0))

    if comm.is_main:
        layout = QuantizedExchange(comm, 1)._layout_for([tuple(gradient.shape) for gradient in gradients])
        print(f"model {args.model}: {numel:,} gradient values in {len(gradients)} tensors, "
              f"{layout.columns.num_columns} columns; {comm.size} ranks (Gloo, CPU); "
              f"{torch.get_num_threads()} torch threads per rank; time = median of {args.repeats}, slowest rank")
        header = ("exchange (bits)", "bytes sent/step/rank", "vs 32-bit", "ms/exchange", "rel. error")
        print(f"{header[0]:>20} | {header[1]:>20} | {header[2]:>9} | {header[3]:>11} | {header[4]:>10}")
        print("-" * 84)
        for label, sent, seconds, error in rows:
            print(f"{label:>20} | {sent:>20,} | {full_bytes / sent:>8.1f}x | {1e3 * seconds:>11.2f} | {error:>10.2e}")
    outer_rows = [diloco_sync(comm, args.model, bits, args.block_minibatches) for bits in (32, 8, 4)]
    if comm.is_main:
        print(f"\nDiLoCo outer step (block delta of the {numel:,} parameters; a block = {args.block_minibatches} "
              f"minibatches of 32 per rank):")
        header = ("outer exchange", "bytes sent/sync/rank", "vs 32-bit", "bytes/minibatch", "vs data-parallel 32")
        print(f"{header[0]:>20} | {header[1]:>20} | {header[2]:>9} | {header[3]:>15} | {header[4]:>19}")
        print("-" * 96)
        for label, sent in outer_rows:
            per_minibatch = sent / args.block_minibatches
            print(f"{label:>20} | {sent:>20,} | {outer_rows[0][1] / sent:>8.1f}x | {per_minibatch:>15,.0f} | "
                  f"{full_bytes / per_minibatch:>18.1f}x")
    comm.finalize()


def diloco_sync(comm, name: str, bits: int, block_minibatches: int) -> tuple[str, int]:
    """Trains one DiLoCo block on random data; returns (label, bytes this rank sent in its sync)."""
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    exchange = Quantized(num_bits=bits) if bits < 32 else None
    local, global_size = 32, 32 * comm.size
    learner = DiLoCoLearner(torch.optim.AdamW(model.parameters(), lr=1e-3), comm,
                            block_size=global_size * block_minibatches, distributed_after=0, exchange=exchange)
    learner.prepare(model)
    generator = torch.Generator().manual_seed(comm.rank + 1)
    while learner.syncs < 1:
        learner.begin_minibatch(local, global_size)
        images = torch.randn(local, *shape, generator=generator)
        labels = torch.randint(0, 10, (local,), generator=generator)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        learner.step()
    label = "float32 all-reduce" if bits == 32 else f"{bits}-bit quantized"
    return label, learner.bytes_sent_last_step


if __name__ == "__main__":
    main()

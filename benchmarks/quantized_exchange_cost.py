"""CPU cost of one step of the k-bit quantized exchange, without the network.

    python benchmarks/quantized_exchange_cost.py                       # 1 bit, ConvNet and 25 MB MLP
    python benchmarks/quantized_exchange_cost.py --bits 1 2 8 --repeats 30

One process runs rank 0 of a 2-rank ``QuantizedExchange`` (``dtrain.exchange.quantized``) on the gradients
of a model, with a loopback communicator: every collective returns this rank's own bytes as
the other rank's, so the exchange does all of its real work (flatten, quantize with error
feedback, pack, unpack, dequantize, sum, re-quantize, unpack all stripes, unflatten) and no
transport. Each figure is the median wall time of ``--repeats`` exchanges after 3 warm-up ones,
with one torch thread (``--threads``). The columns: ms per exchange, the same as ns per
gradient value, and the float32 bytes of the gradients.

The script uses only the public ``dtrain.compress`` API, so the same script times another
revision of the package: ``PYTHONPATH=/path/to/other/checkout python benchmarks/quantized_exchange_cost.py``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

MODELS = ("conv", "mlp")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS),
                        help="conv: CNTK's CIFAR-10 ConvNet (0.95 M parameters); mlp: 1024-2048-2048-10 (6.3 M)")
    parser.add_argument("--bits", nargs="+", type=int, default=[1], help="bits per value, default 1")
    parser.add_argument("--repeats", type=int, default=20, help="timed exchanges (median), default 20")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, default 1")
    return parser.parse_args()


class LoopbackCommunicator:
    """Rank 0 of a job of ``size`` ranks in which every rank sends exactly what this one sends."""

    def __init__(self, size: int = 2):
        self.rank, self.size, self.device = 0, size, torch.device("cpu")

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.clone() for _ in range(self.size)]


def model_shapes(name: str) -> list[tuple[int, ...]]:
    """The parameter shapes of the benchmark's models (as ``benchmarks/ddp_comparison.py`` builds them)."""
    from dtrain.models import ConvNetCIFAR10

    if name == "conv":
        model = ConvNetCIFAR10(dropout=0.0)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                    torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    return [tuple(parameter.shape) for parameter in model.parameters()]


def exchange_ms(shapes: list[tuple[int, ...]], bits: int, repeats: int) -> float:
    from dtrain.exchange.quantized import QuantizedExchange

    exchange = QuantizedExchange(LoopbackCommunicator(), bits, all_to_all="allgather")
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(shape, generator=generator) for shape in shapes]
    times = []
    for index in range(repeats + 3):
        start = time.perf_counter()
        exchange.allreduce_(gradients, scale=0.5)
        if index >= 3:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    import dtrain

    print(f"quantized exchange, rank 0 of 2 over a loopback (no transport), {args.threads} thread(s), "
          f"median of {args.repeats}; dtrain from {dtrain.__file__}")
    print(f"{'model':<7}{'values':>12}{'MB fp32':>9}{'bits':>6}{'ms/step':>10}{'ns/value':>10}")
    for name in args.models:
        shapes = model_shapes(name)
        numel = sum(torch.Size(shape).numel() for shape in shapes)
        for bits in args.bits:
            ms = exchange_ms(shapes, bits, args.repeats)
            print(f"{name:<7}{numel:>12,}{4 * numel / 1e6:>9.1f}{bits:>6}{ms:>10.2f}{1e6 * ms / numel:>10.2f}",
                  flush=True)


if __name__ == "__main__":
    main()

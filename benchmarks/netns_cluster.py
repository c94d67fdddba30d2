"""Two simulated hosts on a shaped link: measured all-reduce, step and epoch times next to a cost model.

    sudo python benchmarks/netns_cluster.py                          # 1gbit and 100mbit, all parts
    sudo python benchmarks/netns_cluster.py --rate 1gbit --parts allreduce
    sudo python benchmarks/netns_cluster.py --rate 100mbit --samples 6400 --steps 20

Needs root (network namespaces; see dtrain/testing/netns.py). For each ``--rate`` a 2-host
``NamespaceCluster`` is built (a bridge, one veth per host, ``tbf`` at that rate on each host's
egress) and this script runs again as the worker, one rank per host, under ``mpiexec``. Rank 0
prints its figures as ``RESULT {json}`` lines; the driver prints three tables:

(a) ``allreduce``: Gloo all-reduce of float32 payloads vs the ring model
    ``T(n) = 2(N-1)/N * n / B + 2(N-1) * alpha``, where B is the link rate times the TCP payload
    share of what the link carries (tbf counts whole frames: 1448 payload bytes per 1514-byte
    frame, plus the reverse flow's ACKs, so B = 0.936 x rate) and alpha (one message's latency)
    is fitted from the 4-byte all-reduce: alpha = T(4 B) / (2(N-1)).
    Messages within tbf's bucket (1 ms of traffic, >= 16 KiB) may beat the model. Payloads up to
    1 MiB get 10x the repeats: their times are bimodal on a 2-core machine (a ~3 ms mode appears
    even at 40gbit, i.e. scheduling, not the link), so compare their "best" column too.
(b) ``step``: one step of ``DataParallelLearner`` on ``ConvNetCIFAR10`` (synthetic data, global
    minibatch 64, 1 thread per rank) vs the compute-only step (forward, backward, SGD; both ranks
    computing at once, as in training) plus T(gradient bytes). One gradient bucket (25 MiB > the
    model), so nothing overlaps: the model is compute + T(gradient bytes).
(c) ``epoch``: ``training_session(...).train()`` time for ``--samples`` samples (from train()'s own
    clock: no start-up, no interpreter or MPI launch) for each learner: local compute only (each
    rank trains its half with no communication: the floor), ``data_parallel``,
    ``quantized`` (num_quantization_bits=1) and ``block_momentum`` (block_size ``--block-size``).
    Model: minibatches x compute step + communication (data_parallel: every minibatch T(P*4);
    quantized: the bytes the learner reports sending per step / B, plus latency; block momentum:
    one T(P*4) per block). A learner that cannot be imported is skipped with a note. For the
    quantized learner the table is followed by its exchange's compute and transport time (last
    step) and the ratio of its epoch time to data_parallel's. ``quantized`` has the learner's
    default warm start (``distributed_after="auto"``: float32 all-reduce for the first quarter of
    the samples, then 1-bit); ``--learners ...,quantized_no_warm_start`` adds the 1-bit learner
    with ``distributed_after=0``, every minibatch through the 1-bit exchange: the cost of an
    epoch after the warm start (where a long run spends nearly all its time: the warm start is
    capped at 5 sweeps); ``quantized_local_warm_start`` the learner with ``warm_start_mode="local"``
    (CNTK's: every rank trains the full stream alone during the warm start). With both
    ``data_parallel`` and ``quantized_no_warm_start`` timed, a last line projects the whole
    ``recipes/cifar10.yaml`` run with quantized's defaults from the two: its warm start (the learners'
    own rule on the recipe's figures: 5 of its 160 epochs) at data_parallel's speed, the rest at
    the 1-bit epoch's.

Each rank fixes glibc malloc's thresholds first, as ``python -m dtrain`` does
(``dtrain/host_memory.py``); ``--glibc-malloc`` leaves them.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# TCP payload share of what a host's link carries during an all-reduce: a 1514-byte Ethernet frame
# carries 1448 payload bytes (MTU 1500, TCP timestamps), and since data flows both ways at once
# the same link also carries a 66-byte ACK per 2 frames of the reverse flow (delayed ACKs). tc's
# byte counters agree: 16 MiB all-reduces put 1.065 wire bytes per payload byte on each link.
PAYLOAD_SHARE = 1448 / (1514 + 66 / 2)
DEFAULT_SIZES = "4,65536,262144,1048576,4194304,16777216"
GLOBAL_MINIBATCH = 64
SMALL_PAYLOAD_BYTES = 1 << 20


# -- the cost model --------------------------------------------------------------------------------
def ring_allreduce_seconds(num_bytes: float, ranks: int, bits_per_s: float, alpha_s: float) -> float:
    """Ring all-reduce time in seconds: ``2(N-1)/N * bytes / B + 2(N-1) * alpha``.

    ``bits_per_s`` is the link rate (the payload share of frames is applied here); ``alpha_s`` the
    per-message latency in seconds.
    """
    payload_bytes_per_s = bits_per_s / 8 * PAYLOAD_SHARE
    return 2 * (ranks - 1) / ranks * num_bytes / payload_bytes_per_s + 2 * (ranks - 1) * alpha_s


def transfer_seconds(num_bytes: float, bits_per_s: float) -> float:
    """Seconds to send ``num_bytes`` of TCP payload over a link of ``bits_per_s``."""
    return num_bytes / (bits_per_s / 8 * PAYLOAD_SHARE)


# -- worker side (one process per rank, started by mpiexec) ----------------------------------------
def _emit(comm, part: str, **values) -> None:
    if comm.rank == 0:
        print("RESULT " + json.dumps({"part": part, **values}), flush=True)


def worker_allreduce(comm, sizes: list[int], repeats: int) -> None:
    """Median and best seconds of ``repeats`` all-reduces of each payload size (bytes), after a warm-up."""
    import torch

    for num_bytes in sizes:
        payload = torch.ones(max(1, num_bytes // 4), dtype=torch.float32)
        comm.allreduce(payload)
        times = []
        # small payloads are cheap and noisy (2 shared cores): 10x the repeats up to 1 MiB
        for _ in range(repeats * 10 if num_bytes <= SMALL_PAYLOAD_BYTES else repeats):
            comm.barrier()
            started = time.perf_counter()
            comm.allreduce(payload)
            times.append(time.perf_counter() - started)
        # every rank's time: the all-reduce is done when the slowest rank has it
        slowest = [max(column) for column in zip(*comm.allgather_object(times))]
        _emit(comm, "allreduce", bytes=payload.numel() * 4, median_s=statistics.median(slowest), best_s=min(slowest))


def _cifar_model_and_data(seed: int = 0):
    import torch

    from dtrain.models import ConvNetCIFAR10

    torch.manual_seed(seed)
    model = ConvNetCIFAR10(dropout=0.0)
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(512, 3, 32, 32, generator=generator) * 64
    labels = torch.randint(0, 10, (512,), generator=generator)
    return model, features, labels


def _slowest_median(comm, times: list[float]) -> float:
    """Median over steps of the slowest rank's seconds (a synchronous step ends with the slowest rank)."""
    return statistics.median(max(column) for column in zip(*comm.allgather_object(times)))


def _timed_alternating(comm, steps_by_name: dict, steps: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each ``step(index)`` in ``steps_by_name``, run in turns so load changes hit all alike."""
    for index in range(warmup):
        for step in steps_by_name.values():
            step(index)
    times: dict[str, list[float]] = {name: [] for name in steps_by_name}
    for index in range(steps):
        for name, step in steps_by_name.items():
            comm.barrier()
            started = time.perf_counter()
            step(index)
            times[name].append(time.perf_counter() - started)
    return {name: _slowest_median(comm, values) for name, values in times.items()}


def worker_step(comm, steps: int) -> None:
    """Compute-only step vs data-parallel step on the CIFAR ConvNet (two identical models, in turns),
    and a bare all-reduce of its gradient bytes."""
    import torch

    from dtrain.learners import data_parallel_distributed_learner

    local = GLOBAL_MINIBATCH // comm.size
    plain_model, features, labels = _cifar_model_and_data()
    plain_optimizer = torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9)
    model, _, _ = _cifar_model_and_data()
    learner = data_parallel_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), comm)
    learner.prepare(model)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    gradients = torch.zeros(parameters)

    def batch(index: int):
        begin = (index * GLOBAL_MINIBATCH + comm.rank * local) % (len(features) - local)
        return features[begin:begin + local], labels[begin:begin + local]

    def compute_step(index: int) -> None:
        images, targets = batch(index)
        plain_optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(plain_model(images), targets).backward()
        plain_optimizer.step()

    def data_parallel_step(index: int) -> None:
        images, targets = batch(index)
        learner.begin_minibatch(local, GLOBAL_MINIBATCH)
        torch.nn.functional.cross_entropy(model(images), targets).backward()
        learner.step()

    measured = _timed_alternating(comm, {"compute": compute_step, "data_parallel": data_parallel_step,
                                         "allreduce": lambda _: comm.allreduce(gradients)}, steps)
    learner.finalize()
    _emit(comm, "step", parameters=parameters, local_minibatch=local, compute_s=measured["compute"],
          data_parallel_s=measured["data_parallel"], gradient_allreduce_s=measured["allreduce"])


def _make_learner(kind: str, optimizer, comm, block_size: int):
    """The learner of ``kind`` (``local``, ``data_parallel``, ``quantized``, ``quantized_no_warm_start``,
    ``quantized_local_warm_start``, ``block_momentum``)."""
    if kind == "local":
        from dtrain.learners import LocalLearner

        return LocalLearner(optimizer)  # a size-1 communicator: no communication at all
    if kind == "quantized_no_warm_start":  # every minibatch through the 1-bit exchange: its steady-state cost
        from dtrain.learners import data_parallel_distributed_learner

        return data_parallel_distributed_learner(optimizer, comm, num_quantization_bits=1, distributed_after=0)
    if kind == "quantized_local_warm_start":  # CNTK's warm start: every rank on the full stream, no communication
        from dtrain.learners import data_parallel_distributed_learner

        return data_parallel_distributed_learner(optimizer, comm, num_quantization_bits=1, warm_start_mode="local")
    if kind in ("data_parallel", "quantized"):
        from dtrain.learners import data_parallel_distributed_learner

        return data_parallel_distributed_learner(optimizer, comm, num_quantization_bits=1 if kind == "quantized" else 32)
    from dtrain.learners import block_momentum_distributed_learner

    return block_momentum_distributed_learner(optimizer, comm, block_size=block_size)


def _train_epoch(comm, kind: str, samples: int, block_size: int) -> dict:
    """``train()`` seconds (the slowest rank's) for ``samples`` global samples with learner ``kind``.

    ``local``: each rank trains its share (``samples / N`` at minibatch ``64 / N``) with no
    communication, the same per-rank work as the distributed learners. Raises ImportError or
    AttributeError when the learner is not there.
    """
    import torch

    from dtrain import MinibatchSource, training_session
    from dtrain.data import ArrayDeserializer

    model, features, labels = _cifar_model_and_data()
    learner = _make_learner(kind, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), comm, block_size)
    shares = comm.size if kind == "local" else 1
    source = MinibatchSource(ArrayDeserializer(features, labels, num_classes=10), randomize=True)
    with tempfile.TemporaryDirectory() as run_dir:
        session = training_session(model, torch.nn.functional.cross_entropy, learner, source,
                                   GLOBAL_MINIBATCH // shares, max_samples=samples // shares, progress_frequency=0,
                                   run_dir=run_dir, tensorboard=False, stream=io.StringIO(),
                                   independent_processes=kind == "local")  # the no-communication baseline
        comm.barrier()
        result = session.train()
    split = {}
    if kind.startswith("quantized"):  # the 1-bit exchange's compute vs wire of its last step
        split = {"exchange_compute_s": learner.exchange.compute_seconds_last_step,
                 "exchange_transport_s": learner.exchange.transport_seconds_last_step,
                 "messages_per_step": 2 if learner.exchange.requantizes_sums() else 1}  # per peer, on 2 ranks
    warm = -(-getattr(learner, "distributed_after", 0) // GLOBAL_MINIBATCH)
    float32_warm = getattr(learner, "warm_start_exchange", None) is not None
    return {"seconds": max(comm.allgather_object(result.seconds)), "minibatches": result.minibatches,
            "warm_start_minibatches": warm if float32_warm else 0, "local_warm_start_minibatches": 0 if float32_warm else warm,
            "bytes_sent_per_step": getattr(learner, "bytes_sent_last_step", None),
            **{key: max(comm.allgather_object(value)) for key, value in split.items()}}


def worker_epoch(comm, samples: int, block_size: int, learners: list[str], rounds: int = 1) -> None:
    """Each learner's epoch right after a local (no communication) epoch, so both see the same machine load;
    ``rounds`` times, the learners' order rotating every round (the driver takes medians)."""
    skipped: set[str] = set()
    for round_index in range(rounds):
        shift = round_index % len(learners)
        for kind in learners[shift:] + learners[:shift]:
            if kind in skipped:
                continue
            try:
                baseline = _train_epoch(comm, "local", samples, block_size)
                measured = _train_epoch(comm, kind, samples, block_size)
            except (ImportError, AttributeError) as error:  # a learner still being written
                skipped.add(kind)
                _emit(comm, "epoch", learner=kind, skipped=f"{type(error).__name__}: {error}")
                continue
            _emit(comm, "epoch", learner=kind, round=round_index, local_seconds=baseline["seconds"], **measured)


def worker_main(args: argparse.Namespace) -> None:
    import torch

    from dtrain.comm import create_communicator
    from dtrain.host_memory import keep_freed_host_memory

    torch.set_num_threads(1)  # 2 ranks on a 2-core machine: one core each
    keep_freed_host_memory(not args.glibc_malloc)  # as python -m dtrain does
    comm = create_communicator(backend="gloo", timeout_s=600)
    parts = args.parts.split(",")
    if "allreduce" in parts:
        worker_allreduce(comm, [int(size) for size in args.sizes.split(",")], args.repeats)
    if "step" in parts:
        worker_step(comm, args.steps)
    if "epoch" in parts:
        worker_epoch(comm, args.samples, args.block_size, args.learners.split(","), args.epoch_rounds)
    comm.finalize()


# -- driver side (root: builds the cluster, runs the worker, prints tables) ------------------------
def run_on_cluster(rate: str, args: argparse.Namespace) -> list[dict]:
    """Build a 2-host cluster at ``rate``, run this script's worker on it and return rank 0's results."""
    from dtrain.testing.netns import NamespaceCluster

    worker = [sys.executable, str(Path(__file__).resolve()), "--worker", "--parts", args.parts, "--sizes", args.sizes,
              "--repeats", str(args.repeats), "--steps", str(args.steps), "--samples", str(args.samples),
              "--block-size", str(args.block_size), "--learners", args.learners, "--epoch-rounds", str(args.epoch_rounds),
              *(["--glibc-malloc"] if args.glibc_malloc else [])]
    env = {"PYTHONPATH": str(REPO)}
    with NamespaceCluster(num_hosts=2, rate=rate) as cluster:
        result = cluster.run(cluster.mpiexec_args(npernode=1, export=list(env)) + worker, timeout=args.timeout, env=env)
    if result.returncode != 0:
        raise SystemExit(f"the benchmark failed on the cluster:\n{result.report()}")
    return [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.2f}"


def print_allreduce(rate: str, bits_per_s: float, results: list[dict]) -> float:
    """Table (a); returns the fitted per-message latency alpha in seconds."""
    rows = [r for r in results if r["part"] == "allreduce"]
    smallest = min(rows, key=lambda r: r["bytes"])
    alpha = smallest["median_s"] / 2  # 2(N-1) = 2 messages on 2 ranks
    print(f"\n(a) all-reduce, 2 hosts at {rate}: model 2(N-1)/N*n/B + 2(N-1)*alpha, "
          f"B = {bits_per_s * PAYLOAD_SHARE / 1e6:.0f} Mbit/s payload, alpha = {alpha * 1e6:.0f} us (fitted)")
    print(f"{'bytes':>10} {'median ms':>10} {'best ms':>10} {'model ms':>10} {'meas/model':>10} {'busbw Mbit/s':>13}")
    for row in sorted(rows, key=lambda r: r["bytes"]):
        model = ring_allreduce_seconds(row["bytes"], 2, bits_per_s, alpha)
        busbw = row["bytes"] * 8 / row["median_s"] / 1e6  # 2(N-1)/N = 1 on 2 ranks
        print(f"{row['bytes']:>10} {_ms(row['median_s'])} {_ms(row['best_s'])} {_ms(model)} "
              f"{row['median_s'] / model:>10.2f} {busbw:>13.1f}")
    return alpha


def print_step(rate: str, bits_per_s: float, alpha: float, results: list[dict]) -> dict | None:
    """Table (b); returns the step result (for the epoch model)."""
    row = next((r for r in results if r["part"] == "step"), None)
    if row is None:
        return None
    gradient_bytes = row["parameters"] * 4
    comm_model = ring_allreduce_seconds(gradient_bytes, 2, bits_per_s, alpha)
    model = row["compute_s"] + comm_model
    print(f"\n(b) data-parallel step, ConvNetCIFAR10 ({row['parameters']:,} parameters, "
          f"{gradient_bytes / 1e6:.2f} MB of gradients), global minibatch {GLOBAL_MINIBATCH} "
          f"({row['local_minibatch']} per rank), 2 hosts at {rate}")
    print(f"{'compute ms':>10} {'allreduce ms':>12} {'model comm ms':>13} {'model step ms':>13} "
          f"{'measured ms':>11} {'meas/model':>10}")
    print(f"{_ms(row['compute_s'])} {row['gradient_allreduce_s'] * 1e3:12.2f} {comm_model * 1e3:13.2f} "
          f"{model * 1e3:13.2f} {row['data_parallel_s'] * 1e3:11.2f} {row['data_parallel_s'] / model:>10.2f}")
    return row


def epoch_model_seconds(row: dict, step: dict, bits_per_s: float, alpha: float, block_size: int,
                        samples: int) -> float | None:
    """Model epoch time (s): the adjacent local epoch (same compute, no communication) + the learner's traffic."""
    gradient_bytes = step["parameters"] * 4
    if row["learner"] == "data_parallel":
        communication = row["minibatches"] * ring_allreduce_seconds(gradient_bytes, 2, bits_per_s, alpha)
    elif row["learner"].startswith("quantized") and row.get("bytes_sent_per_step"):
        # the float32 warm start's all-reduces, then per step one all-gather of every rank's packed bits
        # (N - 1 messages), or CNTK's two phases (reduce-scatter, all-gather: 2(N - 1)) where sums are re-quantized
        warm = min(row.get("warm_start_minibatches", 0), row["minibatches"])
        local = min(row.get("local_warm_start_minibatches", 0), row["minibatches"])  # each rank computes 2 shares
        communication = (warm * ring_allreduce_seconds(gradient_bytes, 2, bits_per_s, alpha)
                         + local * row["local_seconds"] / row["minibatches"]
                         + (row["minibatches"] - warm - local)
                         * (transfer_seconds(row["bytes_sent_per_step"], bits_per_s)
                            + row.get("messages_per_step", 2) * alpha))
    elif row["learner"] == "block_momentum":
        communication = samples // block_size * ring_allreduce_seconds(gradient_bytes, 2, bits_per_s, alpha)
    else:
        return None
    return row["local_seconds"] + communication


def _median_rows(rows: list[dict]) -> list[dict]:
    """One row per learner, in first-seen order: the median of each timing over its rounds, plus ``rounds``."""
    by_learner: dict[str, list[dict]] = {}
    for row in rows:
        by_learner.setdefault(row["learner"], []).append(row)
    merged = []
    for learner, runs in by_learner.items():
        row = dict(runs[-1])
        if "skipped" not in row:
            for key in ("seconds", "local_seconds", "exchange_compute_s", "exchange_transport_s"):
                if key in row:
                    row[key] = statistics.median(run[key] for run in runs)
            row["rounds"] = [run["seconds"] for run in runs]
        merged.append(row)
    return merged


def print_epoch(rate: str, bits_per_s: float, alpha: float, step: dict | None, results: list[dict],
                args: argparse.Namespace) -> None:
    """Table (c): one row per learner, the medians over ``--epoch-rounds`` (every round's seconds listed)."""
    rows = _median_rows([r for r in results if r["part"] == "epoch"])
    if not rows:
        return
    print(f"\n(c) time per {args.samples:,} samples (training_session.train(), no start-up), 2 hosts at {rate}; "
          f"'local' = the same work with no communication, run just before")
    print(f"{'learner':<16} {'minibatches':>11} {'local s':>8} {'seconds':>8} {'samples/s':>9} {'model s':>8} "
          f"{'meas/model':>10} {'sent/step':>10}" + ("  every round (s)" if args.epoch_rounds > 1 else ""))
    for row in rows:
        if "skipped" in row:
            print(f"{row['learner']:<16} skipped: {row['skipped']}")
            continue
        model = epoch_model_seconds(row, step, bits_per_s, alpha, args.block_size, args.samples) if step else None
        name = {"quantized": "quantized 1-bit", "quantized_no_warm_start": "1-bit, no warm",
                "quantized_local_warm_start": "1-bit, local warm",
                "block_momentum": f"block_mom {args.block_size}"}.get(row["learner"], row["learner"])
        sent = f"{row['bytes_sent_per_step'] / 1e3:8.1f}kB" if row.get("bytes_sent_per_step") else f"{'':>10}"
        model_text = f"{model:8.2f} {row['seconds'] / model:>10.2f}" if model else f"{'':>8} {'':>10}"
        rounds = "  " + "/".join(f"{seconds:.2f}" for seconds in row["rounds"]) if len(row["rounds"]) > 1 else ""
        print(f"{name:<16} {row['minibatches']:>11} {row['local_seconds']:8.2f} {row['seconds']:8.2f} "
              f"{args.samples / row['seconds']:9.0f} {model_text} {sent}{rounds}")
    for row in rows:
        if "exchange_compute_s" in row:
            print(f"{row['learner']} exchange, last step (slowest rank): compute {1e3 * row['exchange_compute_s']:.1f} "
                  f"ms (quantize, pack, unpack, dequantize), transport {1e3 * row['exchange_transport_s']:.1f} ms "
                  f"(the two collectives, waiting for the peer included)")
    by_learner = {row["learner"]: row for row in rows if "skipped" not in row}
    for kind in ("quantized", "quantized_local_warm_start", "quantized_no_warm_start"):
        if kind in by_learner and "data_parallel" in by_learner:
            ratio = by_learner[kind]["seconds"] / by_learner["data_parallel"]["seconds"]
            pairs = list(zip(by_learner[kind]["rounds"], by_learner["data_parallel"]["rounds"]))
            paired = (f" (median of the {len(pairs)} rounds' ratios: "
                      f"{statistics.median(ours / theirs for ours, theirs in pairs):.2f})" if len(pairs) > 1 else "")
            print(f"{kind} / data_parallel epoch time at {rate}: {ratio:.2f}{paired}")
    if "quantized_no_warm_start" in by_learner and "data_parallel" in by_learner:
        one_bit = by_learner["quantized_no_warm_start"]["seconds"] / by_learner["data_parallel"]["seconds"]
        warm, total = recipe_warm_start()
        projected = (warm + (total - warm) * one_bit) / total
        print(f"the cifar10 recipe with quantized's defaults ({total:,} samples, the first {warm:,} of them the "
              f"float32 warm start at data_parallel's speed, the rest 1-bit at {one_bit:.2f}): "
              f"quantized / data_parallel {projected:.2f} for the whole run, projected at {rate}")


def recipe_warm_start(recipe: Path = REPO / "recipes" / "cifar10.yaml") -> tuple[int, int]:
    """(warm-start samples, samples) of a run of ``recipe`` as written: the learners' own rule
    (``auto_warm_start``) on the recipe's samples, minibatch size and epoch (its schedules' epoch_size)."""
    from omegaconf import OmegaConf

    from dtrain.learners.base import RunFacts, auto_warm_start

    session = OmegaConf.load(recipe).session
    facts = RunFacts(samples_per_sweep=session.lr_schedule.epoch_size, max_samples=session.max_samples,
                     minibatch_size=session.minibatch_size)
    return auto_warm_start(facts), facts.max_samples


def driver_main(args: argparse.Namespace) -> None:
    from dtrain.testing.netns import available, parse_rate

    ok, reason = available()
    if not ok:
        raise SystemExit(f"cannot build a namespace cluster: {reason}")
    for rate in args.rate or ["1gbit", "100mbit"]:
        bits_per_s = parse_rate(rate)
        started, load_before = time.monotonic(), os.getloadavg()[0]
        results = run_on_cluster(rate, args)
        # the load average says how much else ran on the machine meanwhile (2 of it is ours)
        print(f"\n=== 2 hosts (network namespaces), tbf {rate} per host egress, 1 rank and 1 thread per host; "
              f"run took {time.monotonic() - started:.0f} s; 1-min load average {load_before:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after ===")
        alpha = print_allreduce(rate, bits_per_s, results) if any(r["part"] == "allreduce" for r in results) else 0.0
        step = print_step(rate, bits_per_s, alpha, results)
        print_epoch(rate, bits_per_s, alpha, step, results, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", action="append", help="tc rate per host link, repeatable (default: 1gbit and 100mbit)")
    parser.add_argument("--parts", default="allreduce,step,epoch", help="comma-separated: allreduce,step,epoch")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="all-reduce payloads in bytes, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed all-reduces per size")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps in (b)")
    parser.add_argument("--samples", type=int, default=6400, help="global samples per epoch in (c)")
    parser.add_argument("--block-size", type=int, default=6400, help="block momentum's block size in samples")
    parser.add_argument("--learners", default="data_parallel,quantized,block_momentum",
                        help="comma-separated learners timed in (c), default data_parallel,quantized,block_momentum")
    parser.add_argument("--epoch-rounds", type=int, default=1,
                        help="rounds of (c), the learners' order rotating; the table gives medians (default 1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per rate")
    parser.add_argument("--glibc-malloc", action="store_true",
                        help="leave glibc malloc's adaptive thresholds (default: fixed, as python -m dtrain does)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
    else:
        if "epoch" in args.parts and "step" not in args.parts:
            args.parts += ",step"  # the epoch model needs the compute-only step time
        driver_main(args)


if __name__ == "__main__":
    main()

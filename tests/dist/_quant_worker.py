"""Worker run by tests/dist/test_quantized.py under mpiexec: ``python _quant_worker.py``.

Every rank runs, in order, these named checks (``tests.helpers.checks``; each its own test id):

1. ``exchange``: the real two-phase exchange (torch all_to_all_single, and the all-gather
   fallback) against a direct computation from every rank's full-precision gradients.
2. ``learner``: a few steps of ``DataParallelLearner`` with the ``Quantized`` exchange at 1/2/4/8 bits with uneven
   shares (one rank empty): parameters identical on all ranks after EVERY step, bytes per
   step below a float32 all-reduce's. Returns ``{bits: {"sent", "full", "ratio", "seconds"}}``.
3. ``warm_start``: local steps (ranks drift apart), then the switch: identical from then on.
4. ``converge``: 1-bit SGD with error feedback on a least-squares problem reaches the
   full-precision run's loss. Returns the losses and the distance to the full-precision model.

Any failed check raises, which ends the job.
"""
from __future__ import annotations

import torch

from dtrain.comm import create_communicator, install_fail_fast
from dtrain.compress import StripeLayout
from dtrain.exchange import Quantized
from dtrain.exchange.quantized import QuantizedExchange
from dtrain.learners import DataParallelLearner

from tests.helpers.checks import run_checks
from tests.helpers.quantized_reference import ReferenceExchange

SHAPES = [(24, 50), (24,), (16, 3, 3, 3), (10, 24), (10,)]


def gradients_of(rank: int, step: int, shapes=SHAPES) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(97 * step + rank)
    return [torch.randn(shape, generator=generator) * (1 + rank) for shape in shapes]


def assert_same_on_all_ranks(comm, tensor: torch.Tensor, what: str) -> None:
    gathered = comm.allgather(tensor.detach().reshape(-1).contiguous())
    for rank, other in enumerate(gathered):
        if not torch.equal(other, gathered[0]):
            difference = float((other - gathered[0]).abs().max())
            raise AssertionError(f"{what}: rank {rank} differs from rank 0 by {difference}")


# -- 1. the exchange against a direct computation ---------------------------------------------------


def check_exchange(comm) -> dict[str, dict[str, int]]:
    """Returns the bytes each way of exchanging sent in its last step, by number of bits."""
    bytes_sent = {}
    # (a single bias is one column: every stripe but rank 0's is empty, so messages of 0 bytes travel)
    # (owner bits None: the workers' own; 2 at 1 bit: auto's form beyond 8 workers)
    for bits, shapes, requantize, owner_bits in (
            (1, SHAPES, True, None), (3, SHAPES, True, None), (8, SHAPES, True, None), (2, [(5,)], True, None),
            (1, SHAPES, False, None), (2, [(5,)], False, None), (1, SHAPES, True, 2)):
        layout = StripeLayout(shapes, comm.size)
        via_torch = QuantizedExchange(comm, bits, all_to_all="torch", requantize_sum=requantize, owner_bits=owner_bits)
        via_allgather = QuantizedExchange(comm, bits, all_to_all="allgather", requantize_sum=requantize,
                                          owner_bits=owner_bits)
        reference = ReferenceExchange(layout, bits, requantize, owner_bits)
        for step in range(3):
            # the direct computation, from every rank's gradients (all ranks can make them)
            expected = reference.step([gradients_of(rank, step, shapes) for rank in range(comm.size)])
            for exchange in (via_torch, via_allgather):
                grads = gradients_of(comm.rank, step, shapes)
                exchange.allreduce_(grads)
                result = layout.flatten(grads)
                if not torch.equal(result, expected):
                    raise AssertionError(f"{bits}-bit exchange via {exchange.all_to_all} differs from the direct "
                                         f"computation at step {step} by {float((result - expected).abs().max())}")
                assert_same_on_all_ranks(comm, result, f"{bits}-bit exchange result")
        if shapes is SHAPES and requantize and owner_bits is None:
            bytes_sent[str(bits)] = {"torch": via_torch.bytes_sent_last_step,
                                     "allgather": via_allgather.bytes_sent_last_step}
        # the fallback sends every message to every rank; all_to_all_single sends each message once
        assert via_torch.bytes_sent_last_step <= via_allgather.bytes_sent_last_step
        if not requantize:  # one all-gather of every message, whichever phase-1 transport was asked for
            assert via_torch.bytes_sent_last_step == via_allgather.bytes_sent_last_step
    return bytes_sent


# -- 2. the learner keeps ranks identical --------------------------------------------------------------


class SmallNet(torch.nn.Module):
    """Conv + BatchNorm + Linear: columns of several lengths, 1-column biases, float buffers."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 3)
        self.norm = torch.nn.BatchNorm2d(16)
        self.head = torch.nn.Linear(16 * 4 * 4, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(images))).flatten(1))


def local_share(rank: int, size: int, step: int) -> int:
    """Uneven shares; the last rank gets nothing on odd steps."""
    return 0 if (rank == size - 1 and step % 2) else 3 + rank


def train(comm, bits: int, steps: int, distributed_after: int = 0, check_every_step: bool = True):
    torch.manual_seed(100 + comm.rank)  # different initial models: prepare must broadcast rank 0's
    model = SmallNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    learner = DataParallelLearner(optimizer, comm, distributed_after=distributed_after, exchange=Quantized(bits))
    learner.prepare(model)
    generator = torch.Generator().manual_seed(comm.rank)
    identical_after = []
    for step in range(steps):
        local = local_share(comm.rank, comm.size, step)
        total = sum(local_share(rank, comm.size, step) for rank in range(comm.size))
        learner.begin_minibatch(local, total)
        distributed = learner.is_distributed()
        if local:
            images = torch.randn(local, 3, 6, 6, generator=generator)
            labels = torch.randint(0, 10, (local,), generator=generator)
            torch.nn.functional.cross_entropy(model(images), labels).backward()
        learner.step()
        if check_every_step:
            flat = torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])
            gathered = comm.allgather(flat)
            identical = all(torch.equal(other, gathered[0]) for other in gathered)
            if distributed and not identical:
                raise AssertionError(f"{bits}-bit step {step}: parameters differ between ranks")
            identical_after.append(identical)
    learner.synchronize()
    for buffer in model.buffers():
        assert_same_on_all_ranks(comm, buffer, "buffer after synchronize")
    return learner, identical_after


def check_learner(comm) -> dict[str, dict[str, float]]:
    figures = {}
    for bits in (1, 2, 4, 8):
        learner, _ = train(comm, bits, steps=4)
        sent = learner.bytes_sent_last_step
        full = learner.exchange.full_precision_bytes_last_step
        assert 0 < sent < full, f"{bits} bits sent {sent} bytes, a float32 all-reduce {full}"
        figures[str(bits)] = {"sent": sent, "full": full, "ratio": learner.compression_ratio,
                              "seconds": learner.exchange.seconds_last_step}
    return figures


def check_warm_start(comm) -> None:
    # shares of 3..3+N-1 samples (odd steps: the last rank 0); 3 float32 all-reduce steps, then 1-bit
    per_step = [sum(local_share(rank, comm.size, step) for rank in range(comm.size)) for step in range(3)]
    learner, _ = train(comm, bits=1, steps=3, distributed_after=sum(per_step))
    assert learner.exchange.bytes_sent_last_step == 0, "the 1-bit exchange ran during the warm start"
    assert learner.bytes_sent_last_step > 0 and learner.compression_ratio == 1.0  # float32 all-reduce
    _, identical = train(comm, bits=1, steps=6, distributed_after=sum(per_step))
    assert all(identical), identical  # one model on every rank, during the warm start and after it


# -- 4. convergence on a convex problem --------------------------------------------------------------


def least_squares() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1024, 32, generator=generator)
    weight, bias = torch.randn(4, 32, generator=generator), torch.randn(4, generator=generator)
    targets = features @ weight.T + bias + 0.1 * torch.randn(1024, 4, generator=generator)
    return features, targets


def fit(comm, bits: int | None, steps: int = 150, minibatch: int = 64, feedback: bool = True):
    """SGD on the global minibatches; ``bits=None``: one process on the whole minibatch (the reference)."""
    features, targets = least_squares()
    torch.manual_seed(1)
    model = torch.nn.Linear(32, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    learner = None
    if bits is not None:
        learner = DataParallelLearner(optimizer, comm, exchange=Quantized(bits))
        learner.prepare(model)
    order = torch.Generator().manual_seed(5)
    for _ in range(steps):
        batch = torch.randint(0, len(features), (minibatch,), generator=order)
        if learner is None:
            optimizer.zero_grad()
        else:
            batch = batch[comm.rank::comm.size]
            learner.begin_minibatch(len(batch), minibatch)
        torch.nn.functional.mse_loss(model(features[batch]), targets[batch]).backward()
        if learner is None:
            optimizer.step()
        else:
            if not feedback:
                learner.exchange.reset()  # forget the residuals: plain 1-bit quantization
            learner.step()
    with torch.no_grad():
        loss = float(torch.nn.functional.mse_loss(model(features), targets))
        return loss, torch.cat([model.weight.reshape(-1), model.bias])


def check_convergence(comm) -> dict[str, float]:
    reference_loss, reference = fit(comm, bits=None)
    loss, parameters = fit(comm, bits=1)
    no_feedback_loss, _ = fit(comm, bits=1, feedback=False)
    distance = float((parameters - reference).norm() / reference.norm())
    assert loss < 1.05 * reference_loss, (loss, reference_loss)
    assert distance < 0.01, distance
    assert no_feedback_loss > loss  # error feedback is what makes 1 bit work
    return {"full_precision_loss": reference_loss, "one_bit_loss": loss, "one_bit_no_feedback_loss": no_feedback_loss,
            "relative_distance": distance}


def main() -> None:
    comm = create_communicator(backend="gloo", timeout_s=60)
    install_fail_fast(comm)
    torch.set_num_threads(1)  # oversubscribed ranks on a small machine
    run_checks(comm, {"exchange": check_exchange, "learner": check_learner, "warm_start": check_warm_start,
                      "convergence": check_convergence})
    comm.finalize()


if __name__ == "__main__":
    main()

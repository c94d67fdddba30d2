"""The quantized data-parallel learner: 1-bit SGD (and k-bit) with error feedback, CNTK-style.

One thing, three names: the config option ``learner=quantized`` (``learner.num_quantization_bits``,
1 by default) and the API call ``data_parallel_distributed_learner(num_quantization_bits=k)``
with k < 32 (CNTK's factory) both build a :class:`QuantizedDataParallelLearner` (CNTK's
``QuantizedDataParallelDistributedLearner``). Every minibatch the gradients are summed over
workers through :class:`dtrain.compress.QuantizedExchange` (k-bit packed on the wire, two
error-feedback buffers), and every worker applies the same decoded sum with its local optimizer;
see ``docs/semantics.md#quantized-gradients``.
"""
from __future__ import annotations

from typing import Any

import torch

from dtrain.compress import QuantizedExchange
from dtrain.compress.bitpack import check_bits
from dtrain.learners.base import AUTO, RunFacts, auto_warm_start
from dtrain.learners.replicated import ReplicatedLearner, unique_tensors

class QuantizedDataParallelLearner(ReplicatedLearner):
    """Synchronous data-parallel SGD on k-bit quantized gradients with error feedback (1-bit SGD).

    Built by ``learner=quantized`` in a config, or ``data_parallel_distributed_learner(
    num_quantization_bits=k)`` with k < 32 from Python; constructing it directly is the same.

    Each rank back-propagates the mean loss over its ``local_samples``; ``step()`` scales that
    gradient by ``local_samples / global_samples`` (so the SUM over ranks is the gradient of the
    mean loss over the global minibatch, dtrain's convention), sums it over ranks through
    :class:`~dtrain.compress.QuantizedExchange`, writes the decoded sum into ``.grad`` and calls
    the optimizer. All ranks decode the same bytes, so their parameters stay bit-identical.
    A parameter that got no gradient on a rank contributes zeros; after the exchange every
    trainable parameter has a ``.grad``.

    Warm start: while ``samples_seen < distributed_after`` every rank steps on its own gradient
    without communication (CNTK reads the full stream on every rank then). At the first
    distributed minibatch (and at a ``synchronize()`` in between) rank 0's parameters, buffers
    and optimizer state are broadcast, so training continues from one model. The residuals start
    at zero when distributed steps begin.

    Args:
        optimizer: the torch optimizer of the model's parameters.
        comm: the job's communicator; with one rank this is the local learner.
        distributed_after: global samples of local-only training before quantized exchange begins;
            ``"auto"`` (the default) = :func:`auto_warm_start` of the run's facts (set by ``plan``).
        num_quantization_bits: bits per gradient value on the wire, 1 to 32 (32 is lossless and
            only useful for comparison: ``data_parallel_distributed_learner`` uses a plain
            all-reduce for 32).
        error_feedback: keep the quantization error for the next step (``False`` only to measure its worth).

    Raises:
        ValueError: ``num_quantization_bits`` outside 1..32 or a negative ``distributed_after``.
        TypeError: ``optimizer`` is not a torch optimizer.
    """

    kind = "quantized"

    def __init__(self, optimizer: torch.optim.Optimizer, comm=None, distributed_after: int | str = AUTO,
                 num_quantization_bits: int = 1, error_feedback: bool = True):
        super().__init__(optimizer, comm, distributed_after)  # parameters broadcast in 25 MiB chunks
        self.num_quantization_bits = check_bits(num_quantization_bits, "num_quantization_bits")
        self.exchange = QuantizedExchange(self.comm, num_quantization_bits, error_feedback=error_feedback)

    def checkpoint_identity(self) -> dict:
        """The kind and the bits per value: a checkpoint restores only into the same quantization."""
        return {"kind": self.kind, "num_quantization_bits": self.num_quantization_bits}

    def auto_distributed_after(self, facts: RunFacts) -> int:
        """``distributed_after="auto"``: :func:`auto_warm_start` (0 with one process)."""
        return auto_warm_start(facts) if self.comm.size > 1 else 0

    # -- statistics --------------------------------------------------------------------------------
    @property
    def bytes_sent_last_step(self) -> int:
        """Bytes this rank sent in the last distributed step's gradient exchange (0 before any)."""
        return self.exchange.bytes_sent_last_step

    @property
    def compression_ratio(self) -> float:
        """A float32 all-reduce's bytes over the bytes actually sent, last step (nan before any)."""
        return self.exchange.compression_ratio

    # -- progress ------------------------------------------------------------------------------------
    def progress_note(self) -> str:
        """Bytes this rank sent in the last exchange and the saving against a 32-bit all-reduce."""
        if not self.bytes_sent_last_step:
            return ""
        return (f"{self.num_quantization_bits}-bit: {self.bytes_sent_last_step / 1e3:,.0f} kB sent/step "
                f"({self.compression_ratio:.1f}x less than 32-bit)")

    # -- one minibatch -----------------------------------------------------------------------------
    def distributed_update(self) -> None:
        """Sums the scaled gradients over ranks through the quantized exchange, then steps.

        Before ``distributed_after`` (or with one rank) ``step`` makes the local learner's update instead.
        """
        if self.global_samples > 0:  # every rank knows the global count, so all skip an empty step together
            gradients = self._gradients()
            if self.loss_scale != 1.0 and self._overflow_on_any_rank(gradients):
                self.found_inf = True  # skipped everywhere, before an inf reaches the error-feedback residuals
                return
            # unscaled (fp16 loss scaling) as they are quantized
            self.exchange.allreduce_(gradients, scale=self.local_samples / self.global_samples / self.loss_scale)
            self._step_optimizer(gradients_unscaled=True)

    def _overflow_on_any_rank(self, gradients: list[torch.Tensor]) -> bool:
        """Whether any rank's gradient has an inf or NaN (a collective: one verdict for all ranks)."""
        local = not bool(torch.stack([torch.isfinite(gradient).all() for gradient in gradients]).all()) \
            if gradients else False
        flag = torch.tensor([1.0 if local else 0.0], device=self.comm.device)
        return bool(self.comm.allreduce(flag, op="max").item())

    def _gradients(self) -> list[torch.Tensor]:
        """Every trainable parameter's ``.grad`` (zeros where backward gave none), in optimizer order."""
        gradients = []
        for parameter in unique_tensors(self.parameters):  # tied weights once
            if not parameter.requires_grad:
                continue
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter, memory_format=torch.contiguous_format)
            elif not parameter.grad.is_contiguous():  # e.g. channels_last: the exchange writes flat views
                parameter.grad = parameter.grad.contiguous()
            gradients.append(parameter.grad)
        return gradients

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The replicated state (optimizer, samples seen) plus the number of bits; no residuals."""
        return {**super().state_dict(), "num_quantization_bits": self.num_quantization_bits}

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own state: both error-feedback residuals (see ``QuantizedExchange.state_dict``)."""
        return self.exchange.state_dict()

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`local_state_dict`'s output (saved at this or another world size)."""
        self.exchange.load_state_dict(state)


__all__ = ["QuantizedDataParallelLearner"]

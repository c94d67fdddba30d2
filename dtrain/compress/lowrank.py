"""PowerSGD's low-rank maths (Vogels et al. 2019): orthogonalisation, the worth-compressing test, and the
automatic rank (the smallest power of two whose best approximation keeps the gradient's relative error low).

The functions of PyTorch's ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``
that do not talk; the exchange that uses them is :class:`dtrain.exchange.powersgd.PowerSGD`.
"""
from __future__ import annotations

import math

import torch


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalises the columns of each matrix of a ``[batch, rows, rank]`` tensor in place.

    The hook's ``_orthogonalize``: Gram-Schmidt for rank <= 2 (and half precision), else
    ``torch.linalg.qr``. ``epsilon`` is added to each column's norm (0: a zero column divides by 0).
    """
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            column = matrices[:, :, i:i + 1]
            if epsilon == 0:
                column /= torch.norm(column, dim=1, keepdim=True)
            else:
                column /= torch.norm(column, dim=1, keepdim=True) + epsilon
            if i + 1 < rank:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(column * rest, dim=1, keepdim=True) * column
    else:
        torch.linalg.qr(matrices, out=(matrices, torch.empty(matrices.shape[0], rank, rank, device=matrices.device,
                                                               dtype=matrices.dtype)))


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """Whether a ``rows x cols`` matrix is worth compressing at ``rank`` (the hook's ``_should_compress``)."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


CANDIDATE_RANKS = tuple(2 ** k for k in range(11))
"""The ranks ``matrix_approximation_rank="auto"`` chooses among: 1, 2, 4, ..., 1024 (the hook's advice: double the rank)."""

AUTO_RANK_ERROR = 0.2
"""``"auto"``: the largest relative error (Frobenius norm) of the exchanged gradient that the chosen rank's best
approximation may leave. Set between what held and what lost on dtrain's recipes, measured at the switch
(docs/exchange-strategies.md#powersgd-rank): digits' CNN kept float32 accuracy at 0.28-0.33 (rank 2); the language
model lost 0.058 nats at 0.28-0.35 (rank 8) and stays within 0.03 at 0.14-0.18 (rank 16)."""


def tail_energies(matrices: list[torch.Tensor], min_compression_rate: float,
                  ranks: tuple[int, ...] = CANDIDATE_RANKS) -> tuple[dict[int, float], float]:
    """What rank-r approximations of ``matrices`` leave out, for each of ``ranks``: the squared Frobenius norm of
    the best rank-r approximation's error summed over the matrices (Eckart-Young: the squares of the singular values
    beyond the r-th), counting 0 for a matrix the exchange would send whole at that rank (:func:`should_compress`);
    and the matrices' total squared norm. The squared singular values are the eigenvalues of the float64 Gram
    matrix of the shorter side (2-4x faster than ``svdvals`` on the CPU, within 1e-5 of the largest); a matrix sent
    whole even at rank 1 (every vector and bias) needs only its norm."""
    tails = {rank: 0.0 for rank in ranks}
    total = 0.0
    for matrix in matrices:
        rows, cols = matrix.shape
        wide = matrix.detach().to(torch.float64)
        if not should_compress(rows, cols, 1, min_compression_rate):
            total += float(wide.square().sum())
            continue
        if rows > cols:
            wide = wide.T
        squares = torch.linalg.eigvalsh(wide @ wide.T).flip(0).clamp_min(0)  # descending
        energy = float(squares.sum())
        total += energy
        kept = torch.cumsum(squares, 0)
        for rank in ranks:
            effective = min(rows, cols, rank)
            if should_compress(rows, cols, effective, min_compression_rate):
                tails[rank] += max(energy - float(kept[effective - 1]), 0.0)
    return tails, total


def choose_rank(tails: dict[int, float], total: float, max_error: float = AUTO_RANK_ERROR) -> tuple[int, float]:
    """The smallest rank of ``tails`` (from :func:`tail_energies`) whose relative error ``sqrt(tail / total)`` is
    at most ``max_error``, and that error (rank 1 and 0.0 for an all-zero gradient; the largest rank when none is)."""
    if total <= 0:
        return min(tails), 0.0
    for rank in sorted(tails):
        error = math.sqrt(tails[rank] / total)
        if error <= max_error:
            return rank, error
    rank = max(tails)
    return rank, math.sqrt(tails[rank] / total)


__all__ = ["AUTO_RANK_ERROR", "CANDIDATE_RANKS", "choose_rank", "orthogonalize_", "should_compress", "tail_energies"]

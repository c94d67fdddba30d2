"""PowerSGD's low-rank maths (Vogels et al. 2019): orthogonalisation and the worth-compressing test.

The functions of PyTorch's ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``
that do not talk; the exchange that uses them is :class:`dtrain.exchange.powersgd.PowerSGD`.
"""
from __future__ import annotations

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


__all__ = ["orthogonalize_", "should_compress"]

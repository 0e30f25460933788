"""Launcher for the second stage of column reductions."""

from __future__ import annotations

import torch

from ... import _runtime as rt
from .kernels import _column_sum_kernel

_kernel = rt.Kernel(_column_sum_kernel)


def column_sum(part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``part.sum(0)`` into ``out`` (1-D, any float dtype) in a fixed order; returns ``out``.

    ``part`` is a [P, M] float32/float64 buffer with unit column stride, as stage one writes it.
    """
    P, M = part.shape
    if M == 0:
        return out
    BLOCK_M = min(rt.next_pow2(M), 256)
    BLOCK_P = min(rt.next_pow2(P), max(1, 4096 // BLOCK_M))
    grid = (rt.cdiv(M, BLOCK_M),)
    _kernel[grid](
        part, out, P, M, part.stride(0), out.stride(0),
        BLOCK_P=BLOCK_P, BLOCK_M=BLOCK_M, ACC=rt.tl_acc_dtype(part.dtype),
    )
    return out

"""Launcher for the second stage of column reductions."""

from __future__ import annotations

import functools

import torch

from ... import _runtime as rt
from .kernels import _column_sum_kernel

_kernel = rt.Kernel(_column_sum_kernel)

# Narrow column blocks, many programs: the buffer was just written by stage one and sits in L2, so latency,
# not bandwidth, limits this launch (docs/weighted-sum.md, "column_sum").
_BLOCK_M = 16  # columns per program
_BLOCK_P = 64  # partial rows per loop step
_NUM_WARPS = 4


def column_sum(part: torch.Tensor, out: torch.Tensor, out2: torch.Tensor | None = None) -> torch.Tensor:
    """Write ``part.sum(0)`` into ``out`` (1-D, any float dtype) in a fixed order; returns ``out``.

    ``part`` is a [P, M] float32/float64 buffer with unit column stride, as stage one writes it. With
    ``out2``, the first ``len(out)`` column sums go to ``out`` and the remaining ``len(out2)`` to ``out2``
    (two reductions, one launch).
    """
    P, M = part.shape
    M1 = M if out2 is None else out.shape[0]
    if M1 + (0 if out2 is None else out2.shape[0]) != M:
        raise ValueError(f"column_sum: outputs of {M1} + {M - M1 if out2 is None else out2.shape[0]} "
                         f"elements for a partial buffer of {M} columns")
    if M == 0:
        return out
    BLOCK_M, BLOCK_P, num_warps = _plan(rt.hint(P), rt.hint(M))
    _kernel[(rt.cdiv(M, BLOCK_M),)](
        part, out, out2, P, M, M1, part.stride(0), out.stride(0), out2.stride(0) if out2 is not None else 0,
        BLOCK_P=BLOCK_P, BLOCK_M=BLOCK_M, HAS_OUT2=out2 is not None, ACC=rt.tl_acc_dtype(part.dtype),
        num_warps=num_warps,
    )
    return out


@functools.lru_cache(maxsize=1024)
def _plan(P: int, M: int) -> tuple[int, int, int]:
    return min(rt.next_pow2(M), _BLOCK_M), min(rt.next_pow2(P), _BLOCK_P), _NUM_WARPS

"""Launcher for the second stage of column reductions."""

from __future__ import annotations

import functools

import torch

from ... import _runtime as rt
from .kernels import _column_sum_kernel

_kernel = rt.Kernel(_column_sum_kernel)

_MIN_BLOCK_M = 32
_TILE = 4096  # elements of the partial buffer a program sums per step (32 per thread at 4 warps)
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
    BLOCK_M, BLOCK_P, num_warps = _plan(P, M, rt.sm_count(part.device))
    _kernel[(rt.cdiv(M, BLOCK_M),)](
        part, out, out2, P, M, M1, part.stride(0), out.stride(0), out2.stride(0) if out2 is not None else 0,
        BLOCK_P=BLOCK_P, BLOCK_M=BLOCK_M, HAS_OUT2=out2 is not None, ACC=rt.tl_acc_dtype(part.dtype),
        num_warps=num_warps,
    )
    return out


@functools.lru_cache(maxsize=1024)
def _plan(P: int, M: int, sms: int) -> tuple[int, int, int]:
    # Columns per program: narrow enough that there is about one program per SM (a [264, 4096] partial
    # buffer over 16 programs of 256 columns took 13 us on an H200, a fifth of the bandwidth), but at least
    # 32 float32 columns, so each row segment a program reads is a whole 128-byte line.
    BLOCK_M = min(rt.next_pow2(M), max(_MIN_BLOCK_M, min(256, rt.next_pow2(rt.cdiv(M, sms)))))
    BLOCK_P = min(rt.next_pow2(P), max(1, _TILE // BLOCK_M))
    return BLOCK_M, BLOCK_P, _NUM_WARPS

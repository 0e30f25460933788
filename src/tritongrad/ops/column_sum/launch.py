"""Launchers of the second stage of column reductions: ``column_sum`` (tritongrad's own kernels) and the public
``reduce_partials`` and ``partial_rows`` (public as ``tritongrad.reduce_partials``, ``tritongrad.partial_rows``).
"""

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
_PROGRAMS_PER_SM = 4  # partial_rows: programs of stage one per SM (bounds P, the rows stage two adds)


def column_sum(part: torch.Tensor, out: torch.Tensor, out2: torch.Tensor | None = None, *, scale: float = 1.0,
               acc: torch.dtype | None = None) -> torch.Tensor:
    """Write ``scale * part.sum(0)`` into ``out`` (1-D, any float dtype) in a fixed order; returns ``out``.

    ``part`` is a [P, M] float buffer with unit column stride, as stage one writes it. With ``out2``, the first
    ``len(out)`` column sums go to ``out`` and the remaining ``len(out2)`` to ``out2`` (two reductions, one
    launch). ``acc``: the accumulation dtype (default: float32, float64 for a float64 ``part``).
    """
    P, M = part.shape
    M1 = M if out2 is None else out.shape[0]
    if M1 + (0 if out2 is None else out2.shape[0]) != M:
        raise ValueError(f"column_sum: outputs of {M1} + {M - M1 if out2 is None else out2.shape[0]} "
                         f"elements for a partial buffer of {M} columns")
    if M == 0:
        return out
    BLOCK_M, BLOCK_P, num_warps = _plan(rt.hint(P), rt.hint(M))
    scale_hi, scale_lo = rt.split_float(float(scale))
    _kernel[(rt.cdiv(M, BLOCK_M),)](
        part, out_ptr=out, out2_ptr=out2, P=P, M=M, M1=M1, stride_part_row=part.stride(0), stride_out=out.stride(0),
        stride_out2=out2.stride(0) if out2 is not None else 0, scale_hi=scale_hi, scale_lo=scale_lo,
        BLOCK_P=BLOCK_P, BLOCK_M=BLOCK_M, HAS_OUT2=out2 is not None, HAS_SCALE=scale != 1.0,
        ACC=rt.tl_acc_dtype(acc or part.dtype), num_warps=num_warps,
    )
    return out


@functools.lru_cache(maxsize=1024)
def _plan(P: int, M: int) -> tuple[int, int, int]:
    return min(rt.next_pow2(M), _BLOCK_M), min(rt.next_pow2(P), _BLOCK_P), _NUM_WARPS


def reduce_partials(partials: torch.Tensor, dtype: torch.dtype | None = None, *, scale: float = 1.0,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The second stage of a reduction over rows: ``scale * partials.sum(0)``, deterministic.

    Call it from a launcher (a backward's, typically), after a kernel wrote one row of partial sums per program
    into ``partials`` (:func:`partial_rows` makes the buffer; ``tritongrad.language.store_partial`` writes a
    program's row). It launches one Triton kernel through :func:`tritongrad.kernel`, so torch.compile and
    torch.export see it like the op's own kernels.

    Args:
        partials: ``[P, D]``, any float dtype (float32 from :func:`partial_rows`), any strides (a buffer of
            non-unit column stride is copied first).
        dtype: the result's dtype (default: partials'); ignored when ``out`` is given.
        scale: multiplies the sum once, before the one rounding to ``dtype`` (e.g. ``1 / N`` for a mean).
        out: optional ``[D]`` tensor, any strides, written in place and returned.

    Returns:
        ``[D]`` in ``dtype``. Accumulated in float32 (float64 where partials or the result is float64), over
        the P rows in the same order on every run: bitwise reproducible, no atomics.
    """
    if partials.dim() != 2 or not partials.is_floating_point():
        raise ValueError(f"tritongrad.reduce_partials: partials must be a 2-D float tensor [P, D], got "
                         f"{partials.dtype} of shape {tuple(partials.shape)}")
    D = partials.shape[1]
    if out is None:
        out = torch.empty(D, dtype=dtype or partials.dtype, device=partials.device)
    elif out.dim() != 1 or out.shape[0] != D or out.device != partials.device:
        raise ValueError(f"tritongrad.reduce_partials: out must be [{D}] on {partials.device}, got "
                         f"{tuple(out.shape)} on {out.device}")
    if partials.shape[0] == 0:
        return out.zero_()
    if partials.stride(1) != 1 and D > 1:
        partials = partials.contiguous()
    acc = torch.float64 if torch.float64 in (partials.dtype, out.dtype) else torch.float32
    if not rt.uses_triton(partials.device):  # the PyTorch path (a CPU tensor without the interpreter)
        return out.copy_(partials.to(acc).sum(0).mul_(scale))
    return column_sum(partials, out, scale=scale, acc=acc)


def partial_rows(N: int, D: int, device, *, dtype: torch.dtype = torch.float32, block_n: int = 1,
                 programs: int | None = None) -> tuple[torch.Tensor, int]:
    """A buffer for the first stage of a reduction over N rows of D columns, and the rows each program sums.

    Returns ``(partials, rows_per_program)``: ``partials`` is an empty ``[P, D]`` tensor of the accumulation
    dtype (float32, float64 for ``dtype`` float64), ``P = cdiv(N, rows_per_program)``; program ``p`` of the
    kernel's first grid axis sums rows ``[p * rows_per_program, (p + 1) * rows_per_program)`` into row ``p``.
    ``rows_per_program`` is a multiple of ``block_n`` (the kernel's row tile), so only the last program's chunk
    is ragged; P is at most ``programs`` (default: a few per SM of ``device``), so the second stage
    (:func:`reduce_partials`) stays cheap whatever N is. Sizes may be symbolic (torch.compile's dynamic
    shapes): the split is planned on their hints, the buffer sized on the sizes.
    """
    device = torch.device(device)
    if programs is None:
        programs = _PROGRAMS_PER_SM * rt.sm_count(device)
    n = max(1, rt.hint(N))
    chunks = min(rt.cdiv(n, block_n), max(1, programs))
    rows = rt.cdiv(rt.cdiv(n, chunks), block_n) * block_n
    return torch.empty((rt.cdiv(N, rows), D), dtype=rt.acc_dtype(dtype), device=device), rows

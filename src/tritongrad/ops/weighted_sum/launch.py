"""weighted_sum: launch plans, the forward and backward launchers, and the op's declaration.

Bytes each pass must move (the bandwidth floor; ``tritongrad bench`` uses these):
  forward : read x + read w + write y                       = N*D*sx + D*sw + N*sy
  backward: read x + read g + read w + write gx + write gw  = N*D*(sx + sx) + N*sg + D*(sw + sw)
            (only the gradients asked for are written; grad_w alone reads x, grad_x alone does not)

The backward's two gradients are independent streams: grad_x = g * w only writes, grad_w = sum_n x * g only
reads. Small inputs, and inputs of few rows, take both in one launch; large inputs of many rows take two
launches, a read-only pass and then a write-only pass: the same bytes in less time (docs/weighted-sum.md).
Reading first lets the backward of an op that ran last in the forward find the tail of x still in L2.
"""

from __future__ import annotations

import functools

import torch

from ... import _runtime as rt
from ..._pattern import kernel, op
from ..column_sum import column_sum
from . import kernels
from .reference import weighted_sum_reference

_fwd_kernel = kernel(kernels._weighted_sum_fwd_kernel)
_bwd_kernel = kernel(kernels._weighted_sum_bwd_kernel)

# Launch knobs, chosen by sweeps on an H200 (docs/weighted-sum.md). Keyed by element size: 16-bit inputs
# move half the bytes per element, so they want different pipelining than float32.
# The forward, by element size: (bytes of x per program step, warps, pipelining depth of the D loop).
_FWD = {2: (16384, 8, 1), 4: (32768, 8, 2), 8: (16384, 4, 1)}
_TILE_BYTES = 16384   # bytes of x a backward program moves per row step: several 16-byte loads per thread
_NUM_WARPS = 4                         # warps of the backward launches
_BWD_STAGES = {2: 2, 4: 3, 8: 1}       # pipelining depth of the one-launch backward's row loop
_BWD_PROGS_PER_SM = {2: 8, 4: 4, 8: 4}  # one-launch backward programs per SM (bounds the grad_w partial rows)
_GW_STAGES = 2                         # the read-only grad_w pass: pipelining depth ...
_GW_PROGS_PER_SM = 4                   # ... and programs per SM
_FWD_PROGS_PER_SM = 8                  # forward programs per SM when rows are too few and D is split
_FWD_MASKED_MAX = 0.625                # forward steps using at most this share of their lanes ...
_FWD_MIN_EXACT_BLOCK_D = 512           # ... step over the widest power of two dividing D, if this wide
_BWD_BLOCK_D = 128                     # backward column block ...
_FEW_ROWS, _FEW_ROWS_BLOCK_D = 64, 1024  # ... and with this many rows or fewer (programs then loop over rows)
_GX_MAX_BLOCK_D = 1024                 # the write-only grad_x pass: widest column block
_SPLIT_BWD_BYTES = 192 << 20           # x at least this large ...
_SPLIT_BWD_ROWS = 4096                 # ... with at least this many rows: grad_x and grad_w in two passes
_MAX_GRID_Y = 65535                    # CUDA's limit on the grid's second axis (the column blocks)


@functools.lru_cache(maxsize=1024)
def _fwd_config(N: int, D: int, elem: int, sms: int):
    """``(BLOCK_N, BLOCK_D, split, d_per_split, stages, warps)`` of the forward; N is a plan hint."""
    tile_bytes, warps, stages = _FWD[elem]
    tile = tile_bytes // elem
    # Whole rows per step up to a tile (one reduction per row and step); longer rows loop over D.
    BLOCK_D = min(rt.next_pow2(D), tile)
    # Rows whose steps would leave many lanes masked (5120 in one step of 8192: 37.5%) step over a power of
    # two that divides D instead (five steps of 1024), when one that wide exists (docs/weighted-sum.md).
    exact = min(D & -D, tile)
    if D <= _FWD_MASKED_MAX * rt.cdiv(D, BLOCK_D) * BLOCK_D and exact >= _FWD_MIN_EXACT_BLOCK_D:
        BLOCK_D = exact
    BLOCK_N = min(tile // BLOCK_D, rt.next_pow2(N))
    row_tiles = rt.cdiv(N, BLOCK_N)
    # Too few rows to fill the GPU: split each row's D across programs, then add the splits in order.
    split = min(rt.cdiv(D, BLOCK_D), max(1, _FWD_PROGS_PER_SM * sms // row_tiles))
    d_per_split = rt.cdiv(rt.cdiv(D, split), BLOCK_D) * BLOCK_D
    split = rt.cdiv(D, d_per_split)
    return BLOCK_N, BLOCK_D, split, d_per_split, stages, warps


def _column_block(D: int, block_d: int) -> int:
    # Wider blocks where D would otherwise need more than CUDA's 65535 blocks on the grid's second axis.
    return max(block_d, rt.next_pow2(rt.cdiv(D, _MAX_GRID_Y)))


@functools.lru_cache(maxsize=1024)
def _bwd_config(N: int, D: int, elem: int, sms: int, fused: bool = True):
    """The launch that writes grad_w's partial rows (and grad_x too when ``fused``): ``(BLOCK_N, BLOCK_D,
    d_blocks, rows_per_prog, stages)``; N is a plan hint, the row chunks are ``cdiv(N, rows_per_prog)``."""
    tile = _TILE_BYTES // elem
    # Few rows (e.g. 16 x 1M): wide column blocks of a few rows, so that each program still moves full tiles
    # and loops over several row steps (one-step programs of all the rows cannot pipeline their loads).
    BLOCK_D = _column_block(D, min(rt.next_pow2(D), _FEW_ROWS_BLOCK_D if N <= _FEW_ROWS else _BWD_BLOCK_D))
    BLOCK_N = max(1, min(tile // BLOCK_D, rt.next_pow2(N)))
    d_blocks = rt.cdiv(D, BLOCK_D)
    progs_per_sm = _BWD_PROGS_PER_SM[elem] if fused else _GW_PROGS_PER_SM
    _, rows_per_prog = rt.row_split(N, BLOCK_N, sms, d_blocks, progs_per_sm)
    stages = _BWD_STAGES[elem] if fused else _GW_STAGES
    return BLOCK_N, BLOCK_D, d_blocks, rows_per_prog, stages


@functools.lru_cache(maxsize=1024)
def _gx_config(N: int, D: int, elem: int):
    """The write-only grad_x launch, ``(BLOCK_N, BLOCK_D, d_blocks)``: one program per tile, nothing to
    reduce, so no persistent grid."""
    BLOCK_D = _column_block(D, min(rt.next_pow2(D), _GX_MAX_BLOCK_D))
    BLOCK_N = max(1, min(_TILE_BYTES // elem // BLOCK_D, rt.next_pow2(N)))
    return BLOCK_N, BLOCK_D, rt.cdiv(D, BLOCK_D)


def _validate(x, w) -> None:
    if x.dim() == 0:
        raise ValueError("tritongrad.weighted_sum: x must have at least 1 dim [..., D], got a 0-d tensor")
    if w.dim() != 1:
        raise ValueError(f"tritongrad.weighted_sum: w must be 1-D [D], got shape {tuple(w.shape)}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"tritongrad.weighted_sum: last dim of x {tuple(x.shape)} must equal the length of w "
            f"{tuple(w.shape)} ({x.shape[-1]} != {w.shape[0]})"
        )


def _native(x, w):
    # A matrix-vector product (cuBLAS, float32 accumulation): one kernel forward, two backward, one autograd
    # node, against eager (x * w).sum(-1)'s five kernels and two nodes.
    # matmul would take a 2-D w (a matrix product); it raises on a 0-d x and on mismatched lengths itself.
    if w.dim() != 1 or w.numel() > rt.NATIVE_MAX_D:
        return NotImplemented
    return torch.matmul(x, w)


# Under CUDA autocast float32, as (x * w).sum(-1) there: autocast runs sum in float32.
@op("tritongrad::weighted_sum", reference=weighted_sum_reference, validate=_validate, native=_native,
    autocast=torch.float32)
def weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``y = (x * w).sum(-1)`` with Triton kernels for forward and backward.

    Args:
        x: ``[..., D]``, float16/bfloat16/float32/float64, any strides.
        w: ``[D]``, floating, same device as x.

    Returns:
        y: ``[...]`` in ``torch.promote_types(x.dtype, w.dtype)`` (float32 under CUDA autocast, as
        ``(x * w).sum(-1)`` there); accumulated in float32 (float64 for float64). Differentiable in x and w;
        gradients come back in each input's dtype, and grad_w is bitwise reproducible.
    """
    out_dtype = torch.promote_types(x.dtype, w.dtype)
    y = torch.empty(x.shape[:-1], dtype=out_dtype, device=x.device)
    x2 = rt.as_rows(x)
    N, D = x2.shape
    if N == 0 or D == 0:
        return y.zero_()
    D = int(D)
    BLOCK_N, BLOCK_D, split, d_per_split, stages, warps = _fwd_config(
        rt.hint(N), D, x.element_size(), rt.sm_count(x.device)
    )
    out = y if split == 1 else torch.empty((split, N), dtype=rt.acc_dtype(out_dtype), device=x.device)
    _fwd_kernel[(rt.cdiv(N, BLOCK_N), split)](
        x2, w, out, N, D, x2.stride(0), x2.stride(1), w.stride(0), out.stride(0) if split > 1 else 0,
        d_per_split, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, STAGES=stages, ACC=rt.tl_acc_dtype(out_dtype),
        ALIGN=rt.align(D, int(x2.stride(0))), num_warps=warps,
    )
    if split > 1:
        column_sum(out, y.view(-1))
    return y


@weighted_sum.backward
def _weighted_sum_backward(ctx, grad_y: torch.Tensor):
    x, w = ctx.x, ctx.w
    need_x, need_w = ctx.needs_input_grad
    gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
    gw = torch.empty(w.shape, dtype=w.dtype, device=w.device) if need_w else None
    x2 = rt.as_rows(x)
    N, D = x2.shape
    if N == 0 or D == 0:
        return gx, (gw.zero_() if need_w else None)
    D = int(D)
    g = grad_y.reshape(N)  # a view for contiguous or expanded (stride 0) grad_y
    elem = x.element_size()
    acc = rt.tl_acc_dtype(torch.promote_types(x.dtype, w.dtype))
    gx2 = gx.view(N, D) if need_x else None
    n_plan = rt.hint(N)
    fused = need_x and need_w and (n_plan * D * elem < _SPLIT_BWD_BYTES or n_plan < _SPLIT_BWD_ROWS)
    align = rt.align(D, int(x2.stride(0)))  # grad_x and the partial buffer have rows of D
    if need_w:  # grad_w's partial rows (and grad_x too when fused)
        BLOCK_N, BLOCK_D, d_blocks, rows_per_prog, stages = _bwd_config(
            n_plan, D, elem, rt.sm_count(x.device), fused
        )
        chunks = rt.cdiv(N, rows_per_prog)
        part = gw if chunks == 1 else torch.empty((chunks, D), dtype=rt.acc_dtype(x.dtype), device=x.device)
        _bwd_kernel[(chunks, d_blocks)](
            x2, w, g, gx2 if fused else None, part, N, D, x2.stride(0), x2.stride(1), w.stride(0), g.stride(0),
            gx2.stride(0) if fused else 0, part.stride(0) if chunks != 1 else 0, rows_per_prog,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HAS_GX=fused, HAS_GW=True, STAGES=stages, ACC=acc, ALIGN=align,
            num_warps=_NUM_WARPS,
        )
        if chunks != 1:
            column_sum(part, gw)
    if need_x and not fused:  # the write-only pass, after the read-only one
        BLOCK_N, BLOCK_D, d_blocks = _gx_config(n_plan, D, elem)
        _bwd_kernel[(rt.cdiv(N, BLOCK_N), d_blocks)](
            x2, w, g, gx2, None, N, D, x2.stride(0), x2.stride(1), w.stride(0), g.stride(0), gx2.stride(0), 0,
            BLOCK_N, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HAS_GX=True, HAS_GW=False, STAGES=1, ACC=acc, ALIGN=align,
            num_warps=_NUM_WARPS,
        )
    return gx, gw

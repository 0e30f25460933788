"""weighted_sum: the forward and backward launchers, and the op's declaration (plans: plans.py).

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

import torch

from ... import _runtime as rt
from ..._pattern import kernel, op
from ..column_sum import column_sum
from . import kernels
from . import plans as P
from .reference import weighted_sum_reference

_fwd_kernel = kernel(kernels._weighted_sum_fwd_kernel)
_bwd_kernel = kernel(kernels._weighted_sum_bwd_kernel)


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
    native_grad=True, autocast=torch.float32)
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
    p = P.fwd_plan(rt.hint(N), D, x.element_size(), rt.device_props(x.device), P.table())
    split = p.split
    out = y if split == 1 else torch.empty((split, N), dtype=rt.acc_dtype(out_dtype), device=x.device)
    _fwd_kernel[(rt.cdiv(N, p.BLOCK_N), split)](
        x2, w, out, N=N, D=D, stride_x_row=x2.stride(0), stride_x_col=x2.stride(1), stride_w=w.stride(0),
        stride_out_split=out.stride(0) if split > 1 else 0, D_PER_SPLIT=p.d_per_split, BLOCK_N=p.BLOCK_N,
        BLOCK_D=p.BLOCK_D, STAGES=p.STAGES, ACC=rt.tl_acc_dtype(out_dtype), ALIGN=rt.align(D, int(x2.stride(0))),
        num_warps=p.num_warps,
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
    n_plan, table = rt.hint(N), P.table()
    fused = need_x and need_w and P.fused_bwd(n_plan, D, elem, table)
    align = rt.align(D, int(x2.stride(0)))  # grad_x and the partial buffer have rows of D
    strides = dict(N=N, D=D, stride_x_row=x2.stride(0), stride_x_col=x2.stride(1), stride_w=w.stride(0),
                   stride_g=g.stride(0))
    if need_w:  # grad_w's partial rows (and grad_x too when fused)
        p = P.bwd_plan(n_plan, D, elem, rt.device_props(x.device), fused, table)
        chunks = rt.cdiv(N, p.rows_per_prog)
        part = gw if chunks == 1 else torch.empty((chunks, D), dtype=rt.acc_dtype(x.dtype), device=x.device)
        _bwd_kernel[(chunks, p.d_blocks)](
            x2, w, g, gx_ptr=gx2 if fused else None, gw_ptr=part, **strides,
            stride_gx_row=gx2.stride(0) if fused else 0, stride_gw_part=part.stride(0) if chunks != 1 else 0,
            ROWS_PER_PROG=p.rows_per_prog, BLOCK_N=p.BLOCK_N, BLOCK_D=p.BLOCK_D, HAS_GX=fused, HAS_GW=True,
            STAGES=p.STAGES, ACC=acc, ALIGN=align, num_warps=p.num_warps,
        )
        if chunks != 1:
            column_sum(part, gw)
    if need_x and not fused:  # the write-only pass, after the read-only one
        p = P.gx_plan(n_plan, D, elem, table)
        _bwd_kernel[(rt.cdiv(N, p.BLOCK_N), p.d_blocks)](
            x2, w, g, gx_ptr=gx2, gw_ptr=None, **strides, stride_gx_row=gx2.stride(0), stride_gw_part=0,
            ROWS_PER_PROG=p.BLOCK_N, BLOCK_N=p.BLOCK_N, BLOCK_D=p.BLOCK_D, HAS_GX=True, HAS_GW=False, STAGES=1,
            ACC=acc, ALIGN=align, num_warps=p.num_warps,
        )
    return gx, gw

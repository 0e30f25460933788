r"""The residual add fused with the RMSNorm after it, as a decoder layer computes them:

    s = round(x + residual)                       (x's dtype: the residual stream the layer passes on)
    r[n] = 1 / sqrt( (1/D) \sum_d s[n, d]^2 + eps )
    w' = o + w                                    (o = weight_offset, added in float32: Gemma's 1 + w)
    y = w' * round(s * r)                         (cast_before_weight: Hugging Face's LlamaRMSNorm on s,
                                                   in promote(x, w))
    y = round(s * r * w')                         (otherwise: F.rms_norm's, Gemma's and Olmo2's norms, the
                                                   product in float32, rounded once to x's dtype)

returned as ``(y, s)``. Backward, given dy and ds_out = dL/ds from the stream's later uses (zeros where s is
not used), with xhat = s * r, g = dy * w' and c1[n] = (1/D) \sum_j g[n, j] xhat[n, j]:

    dL/ds = r * (g - xhat * c1) + ds_out,         dL/dx = dL/dresidual = dL/ds
    dL/dw[d] = \sum_n dy[n, d] * round(xhat[n, d])    (cast_before_weight; otherwise xhat unrounded)

(the norm's gradient is llama_rms_norm's or rms_norm's, kernels.py; the add passes dL/ds to both inputs). The
two inputs' gradients are two tensors, each stored by the kernel: the caller owns every gradient it receives.

Bytes (s-byte elements, x: [N, D]): forward reads x and residual and writes s and y, 4*N*D*s, where the add
and the norm apart move 5*N*D*s (the add writes s, the norm reads it back). The backward reads s, dy and
ds_out and writes the two gradients, 5*N*D*s, plus dw's float partial rows; apart, the norm's backward moves
3*N*D*s and autograd's sum of the two gradients of s another 3*N*D*s.

One register tile per row (rows up to ``NormTable.BWD_MAX_BLOCK_D`` columns, plans.add_norm); longer rows
run the add apart and the norm's kernels (launch.py), the same function.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import _runtime as rt
from ..._pattern import kernel, op
from ...language import store_partial
from .._tl import aligned, float_arg, round_to
from ..column_sum import partial_rows, reduce_partials
from . import plans as P
from .launch import _backward, _forward
from .reference import llama_rms_norm_reference, rms_norm_reference


@triton.jit
def _add_rms_fwd_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr, N, D, stride_x_row, stride_x_col,
                        stride_r_row, stride_r_col, stride_w, eps, eps_lo, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, ACC: tl.constexpr, ALIGN: tl.constexpr, CAST_FIRST: tl.constexpr,
                        W_OFFSET: tl.constexpr):
    # BLOCK_N whole rows per program: x and residual read once, s and y written once (s and y contiguous).
    D, stride_x_row, stride_r_row = aligned(D, ALIGN), aligned(stride_x_row, ALIGN), aligned(stride_r_row, ALIGN)
    o_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    mask = (o_n < N)[:, None] & m_d[None, :]
    b_x = tl.load(x_ptr + o_n[:, None] * stride_x_row + o_d[None, :] * stride_x_col, mask=mask, other=0.0)
    b_r = tl.load(r_ptr + o_n[:, None] * stride_r_row + o_d[None, :] * stride_r_col, mask=mask, other=0.0)
    b_s = round_to(b_x.to(ACC) + b_r.to(ACC), s_ptr.dtype.element_ty)  # the stream's own rounding
    o = o_n[:, None] * D + o_d[None, :]
    tl.store(s_ptr + o, b_s, mask=mask)
    b_sf = b_s.to(ACC)
    b_rstd = tl.rsqrt(tl.sum(b_sf * b_sf, axis=1) / D + float_arg(eps, eps_lo, ACC))
    tl.store(rstd_ptr + o_n, b_rstd, mask=o_n < N)
    b_xhat = b_sf * b_rstd[:, None]
    if CAST_FIRST:  # Llama's: xhat rounded to the stream's dtype, then the weight
        b_xhat = round_to(b_xhat, s_ptr.dtype.element_ty).to(ACC)
    b_w = tl.load(w_ptr + o_d * stride_w, mask=m_d, other=0.0).to(ACC)
    if W_OFFSET != 0.0:
        b_w = b_w + W_OFFSET
    tl.store(y_ptr + o, round_to(b_w[None, :] * b_xhat, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_bwd_kernel(s_ptr, w_ptr, rstd_ptr, dy_ptr, ds_ptr, dx_ptr, dr_ptr, part_ptr, N, D, stride_dy_row,
                        stride_dy_col, stride_ds_row, stride_ds_col, stride_w, ROWS, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, HAS_DX: tl.constexpr, HAS_DR: tl.constexpr,
                        HAS_DW: tl.constexpr, ACC: tl.constexpr, ALIGN: tl.constexpr, STAGES: tl.constexpr,
                        CAST_FIRST: tl.constexpr, W_OFFSET: tl.constexpr):
    D, stride_dy_row, stride_ds_row = aligned(D, ALIGN), aligned(stride_dy_row, ALIGN), aligned(stride_ds_row, ALIGN)
    # Program p: rows [p * ROWS, (p + 1) * ROWS) (ROWS a multiple of BLOCK_N, partial_rows), whole rows in
    # one tile; its dw partial sums stay in registers until the one store into row p of the partial buffer.
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_w = tl.load(w_ptr + o_d * stride_w, mask=m_d, other=0.0).to(ACC)
    if W_OFFSET != 0.0:
        b_w = b_w + W_OFFSET
    acc_dw = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    start = tl.program_id(0).to(tl.int64) * ROWS
    # Software-pipelined (STAGES - 1 row tiles in flight): few programs per SM, each streaming its rows.
    for r0 in tl.range(start, tl.minimum(start + ROWS, N), BLOCK_N, num_stages=STAGES):
        o_n = r0 + tl.arange(0, BLOCK_N)
        mask = (o_n < N)[:, None] & m_d[None, :]
        o = o_n[:, None] * D + o_d[None, :]
        b_rstd = tl.load(rstd_ptr + o_n, mask=o_n < N, other=0.0).to(ACC)
        b_xhat = tl.load(s_ptr + o, mask=mask, other=0.0).to(ACC) * b_rstd[:, None]
        b_dy = tl.load(dy_ptr + o_n[:, None] * stride_dy_row + o_d[None, :] * stride_dy_col, mask=mask,
                       other=0.0).to(ACC)
        if HAS_DX or HAS_DR:
            b_g = b_dy * b_w[None, :]
            b_c1 = tl.sum(b_g * b_xhat, axis=1) / D
            b_ds = tl.load(ds_ptr + o_n[:, None] * stride_ds_row + o_d[None, :] * stride_ds_col, mask=mask,
                           other=0.0).to(ACC)
            b_ds += (b_g - b_xhat * b_c1[:, None]) * b_rstd[:, None]
            if HAS_DX:
                tl.store(dx_ptr + o, round_to(b_ds, dx_ptr.dtype.element_ty), mask=mask)
            if HAS_DR:
                tl.store(dr_ptr + o, round_to(b_ds, dr_ptr.dtype.element_ty), mask=mask)
        if HAS_DW:
            if CAST_FIRST:
                acc_dw += b_dy * round_to(b_xhat, s_ptr.dtype.element_ty).to(ACC)
            else:
                acc_dw += b_dy * b_xhat
    if HAS_DW:
        store_partial(part_ptr, acc_dw, o_d, D)


_fwd = kernel(_add_rms_fwd_kernel)
_bwd = kernel(_add_rms_bwd_kernel)


def fused_add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float = 1e-6, *, weight_offset: float = 0.0, cast_before_weight: bool = True
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` in their dtype, then Hugging Face's LlamaRMSNorm of s (``cast_before_weight``) or
    rms_norm's with ``weight_offset``: ``(y, s)``, contiguous as the op's are (where x is strided, ``x +
    residual`` would follow x's layout, and a decoder's later ``view`` of the stream can fail)."""
    s = (residual + x).contiguous()
    if cast_before_weight:
        return llama_rms_norm_reference(s, weight, eps), s
    return rms_norm_reference(s, [s.shape[-1]], weight, eps, weight_offset), s


def _validate(x, residual, weight, eps, weight_offset, cast_before_weight) -> None:
    if x.dim() == 0 or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"tritongrad.fused_add_rms_norm: x and residual must share a shape [..., D] and a dtype, "
                         f"got {tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"tritongrad.fused_add_rms_norm: weight must be [D] = [{x.shape[-1]}] for x of shape "
                         f"{tuple(x.shape)}, got {tuple(weight.shape)}")
    if type(eps) is not float:
        raise TypeError(f"tritongrad.fused_add_rms_norm: eps must be a float, got {eps!r}")
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float)) or not (
            -math.inf < weight_offset < math.inf):  # not math.isfinite: dynamo traces this
        raise TypeError(f"tritongrad.fused_add_rms_norm: weight_offset must be a finite float, got {weight_offset!r}")
    if weight_offset and cast_before_weight:
        raise ValueError(f"tritongrad.fused_add_rms_norm: weight_offset={weight_offset} is for the norm that "
                         "multiplies in float32 (cast_before_weight=False, Gemma's); Llama's norm has no offset")


def _plan(x2: torch.Tensor, weight: torch.Tensor, weight_offset: float, cast_before_weight: bool) -> P.AddNormPlan:
    return P.add_norm(N=rt.hint(x2.shape[0]), D=int(x2.shape[1]), x_dtype=x2.dtype, w_dtype=weight.dtype,
                      props=rt.device_props(x2.device), t=P.table(), w_offset=float(weight_offset),
                      cast_first=bool(cast_before_weight))


@op("tritongrad::fused_add_rms_norm", reference=fused_add_rms_norm_reference, validate=_validate,
    outputs=("y", "residual_out"), residuals=("rstd",), save=("residual_out", "weight", "rstd"))
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                       weight_offset: float = 0.0, cast_before_weight: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer's ``residual + h`` and the RMSNorm after it, in one kernel each way.

    ``residual_out = x + residual`` (rounded to their dtype, as the layer's own add), then the norm of it,
    ``xhat = residual_out / sqrt(mean(residual_out**2, -1) + eps)``: with ``cast_before_weight``, ``y =
    weight * xhat.to(x.dtype)`` (Hugging Face's LlamaRMSNorm); without, ``y = (xhat * (weight_offset +
    weight)).to(x.dtype)`` in float32 (:func:`tritongrad.rms_norm`'s: Gemma's norm with ``weight_offset=1``,
    Olmo2's with 0). What ``s = residual + h; y = norm(s)`` computes, with ``s`` and ``y`` written in one pass
    over x and residual.

    Args:
        x, residual: ``[..., D]``, one shape and one dtype (float16/bfloat16/float32/float64), any strides.
        weight: ``[D]``, any floating dtype.
        eps: added to the mean square.
        weight_offset: added to the weight in float32 (only without ``cast_before_weight``).
        cast_before_weight: Llama's order (normalised value rounded to x's dtype, then the weight); False:
            the product in float32, rounded once.

    Returns:
        ``(y, residual_out)``: y in ``torch.promote_types(x.dtype, weight.dtype)`` with
        ``cast_before_weight``, else in x's dtype; residual_out in x's dtype; both of x's shape and
        contiguous. Differentiable in x, residual and weight (the gradients of x and residual are equal values
        in two tensors); the weight gradient is bitwise reproducible.
    """
    x2, r2 = rt.as_rows(x, 1), rt.as_rows(residual, 1)
    plan = _plan(x2, weight, weight_offset, cast_before_weight)
    if not plan.fused:  # a row longer than one tile: the add, then the norm's kernels
        s = (x + residual).contiguous()  # the add follows its inputs' layout; the op returns contiguous s
        y, rstd = _forward(s, 1, weight, None, eps, layer_norm=False, llama=cast_before_weight,
                           w_offset=float(weight_offset))
        return y, s, rstd
    N, D = x2.shape
    y = torch.empty(x.shape, dtype=plan.out_dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=plan.acc, device=x.device)
    if N == 0:
        return y, s, rstd
    eps_hi, eps_lo = rt.split_float(eps)
    _fwd[(rt.cdiv(N, plan.fwd["BLOCK_N"]),)](
        x_ptr=x2, r_ptr=r2, w_ptr=weight, y_ptr=y, s_ptr=s, rstd_ptr=rstd, N=N, D=D,
        stride_x_row=x2.stride(0), stride_x_col=x2.stride(1), stride_r_row=r2.stride(0),
        stride_r_col=r2.stride(1), stride_w=weight.stride(0), eps=eps_hi, eps_lo=eps_lo,
        ALIGN=rt.align(D, int(x2.stride(0)), int(r2.stride(0))), **plan.fwd)
    return y, s, rstd


@fused_add_rms_norm.backward
def _fused_add_rms_norm_backward(ctx, grad_y, grad_residual_out):
    need_x, need_r, need_w = ctx.needs_input_grad[:3]
    s, weight = ctx.residual_out, ctx.weight
    s2 = rt.as_rows(s, 1)
    plan = _plan(s2, weight, ctx.weight_offset, ctx.cast_before_weight)
    if not plan.fused:  # the norm's backward, then the stream's own gradient added
        dn, dw, _ = _backward(grad_y, s, 1, weight, None, None, ctx.rstd, (need_x or need_r, need_w, False),
                              layer_norm=False, llama=ctx.cast_before_weight, w_offset=float(ctx.weight_offset))
        ds = dn + grad_residual_out if dn is not None else None
        return (ds if need_x else None), ((ds.clone() if need_x else ds) if need_r else None), dw
    N, D = s2.shape
    dx = torch.empty(s.shape, dtype=s.dtype, device=s.device) if need_x else None
    dr = torch.empty(s.shape, dtype=s.dtype, device=s.device) if need_r else None
    if N == 0:
        return dx, dr, torch.zeros_like(weight) if need_w else None
    dy2, ds2 = rt.as_rows(grad_y, 1), rt.as_rows(grad_residual_out, 1)  # views of expanded or strided ones
    part, rows = partial_rows(N, D, s.device, dtype=plan.acc, block_n=plan.BLOCK_N_BWD)
    _bwd[(part.shape[0],)](
        s_ptr=s2, w_ptr=weight, rstd_ptr=ctx.rstd, dy_ptr=dy2, ds_ptr=ds2, dx_ptr=dx, dr_ptr=dr, part_ptr=part,
        N=N, D=D, stride_dy_row=dy2.stride(0), stride_dy_col=dy2.stride(1), stride_ds_row=ds2.stride(0),
        stride_ds_col=ds2.stride(1), stride_w=weight.stride(0), ROWS=rows, HAS_DX=need_x, HAS_DR=need_r,
        HAS_DW=need_w, ALIGN=rt.align(D, int(dy2.stride(0)), int(ds2.stride(0))), **plan.bwd)
    return dx, dr, reduce_partials(part, weight.dtype) if need_w else None

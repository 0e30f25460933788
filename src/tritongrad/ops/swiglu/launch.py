"""swiglu: the forward and backward launchers and the op's declaration.

Bytes each pass must move (the bandwidth floor), gate and up [N, D] of element sizes sg, su, out of so:
  forward : read gate + read up + write out                          = N*D*(sg + su + so)
  backward: read gate + read up + read dout + write dgate + write dup = N*D*(sg + su + so + sg + su)
            (dup alone reads gate and dout and writes dup: N*D*(sg + so + su))
At Llama-8B's MLP, 16384 tokens x 14336 in bfloat16: 1.41 GB forward, 2.35 GB backward, 3.76 GB in all.
Nothing else is read or written: no copies of strided inputs (the halves of
a fused projection are read in place), no intermediate silu(gate), no residuals. docs/swiglu-rope.md.
"""

from __future__ import annotations

import torch

from ... import _runtime as rt
from ..._pattern import kernel, op
from . import kernels
from . import plans as P
from .reference import swiglu_reference

_fwd_kernel = kernel(kernels._swiglu_fwd_kernel)
_bwd_kernel = kernel(kernels._swiglu_bwd_kernel)


def _validate(gate, up, inplace_backward) -> None:
    if gate.shape != up.shape:
        raise ValueError(
            f"tritongrad.swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape "
            f"(got dtypes {gate.dtype} and {up.dtype}); swiglu does not broadcast"
        )


def _plan(N, D: int, *tensors: torch.Tensor) -> P.Tile:
    # The narrowest element sets the tile, so that each of its loads is still a 16-byte vector.
    return P.tile(rt.hint(N), D, min(t.element_size() for t in tensors))


@op("tritongrad::swiglu", reference=swiglu_reference, validate=_validate)
def swiglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """SwiGLU's gated product ``silu(gate) * up`` (``F.silu(gate) * up``) with Triton kernels for forward
    and backward.

    Args:
        gate: ``[..., D]``, float16/bfloat16/float32/float64, any strides (e.g. ``proj[..., :I]`` of a fused
            ``[..., 2I]`` projection: read in place, never copied when its leading dims merge into one
            stride).
        up: the same shape as gate (no broadcasting), any floating dtype and strides, on gate's device.
        inplace_backward: opt in to the backward writing each gradient over its input, for callers that own
            gate and up and never read them after the backward, e.g. an MLP whose projections feed swiglu
            alone: the backward then allocates nothing (2 N D elements less at its peak). Taken only in eager
            mode, for an input that is an intermediate result (not a leaf, not a view), contiguous, sharing
            no storage with the other input or the incoming gradient; its version counter is bumped, so any
            other use of it saved for backward raises instead of reading the gradient. Compiled code plans
            its own buffers instead.

    Returns:
        out: gate's shape, contiguous, in ``torch.promote_types(gate.dtype, up.dtype)``. Computed in
        float32 (float64 when an input is float64) and rounded once. Differentiable in gate and up; each
        gradient comes back contiguous in its input's dtype. Inputs are never written unless
        ``inplace_backward``.
    """
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    # read gate + read up + write out: N*D*(sg + su + so) bytes.
    g2, u2 = rt.as_rows(gate), rt.as_rows(up)
    N, D = g2.shape
    if N == 0 or D == 0:
        return out
    D = int(D)
    t = _plan(N, D, gate, up)
    d_blocks = rt.cdiv(D, t.BLOCK_D)
    _fwd_kernel[(rt.cdiv(N, t.BLOCK_N) * d_blocks,)](
        g2, u2, out, N, D, g2.stride(0), g2.stride(1), u2.stride(0), u2.stride(1), d_blocks,
        BLOCK_N=t.BLOCK_N, BLOCK_D=t.BLOCK_D, ACC=rt.tl_acc_dtype(out.dtype),
        ALIGN=rt.align(D, int(g2.stride(0)), int(u2.stride(0))), num_warps=t.num_warps,
    )
    return out


@swiglu.backward
def _swiglu_backward(ctx, grad_out: torch.Tensor):
    # read gate + read up + read dout + write dgate + write dup: N*D*(sg + su + so + sg + su) bytes; dup
    # alone skips up and dgate.
    gate, up = ctx.gate, ctx.up
    need_g, need_u = ctx.needs_input_grad[:2]
    reuse_g = need_g and ctx.inplace_backward and _reusable(gate, ctx, up, grad_out)
    reuse_u = need_u and ctx.inplace_backward and _reusable(up, ctx, gate, grad_out)
    dg = (gate.detach() if reuse_g else torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)) if need_g else None
    du = (up.detach() if reuse_u else torch.empty(up.shape, dtype=up.dtype, device=up.device)) if need_u else None
    g2, u2, do2 = rt.as_rows(gate), rt.as_rows(up), rt.as_rows(grad_out)  # do2: a view even when expanded
    N, D = g2.shape
    if N == 0 or D == 0 or not (need_g or need_u):
        return dg, du
    D = int(D)
    t = _plan(N, D, gate, up, grad_out)
    d_blocks = rt.cdiv(D, t.BLOCK_D)
    _bwd_kernel[(rt.cdiv(N, t.BLOCK_N) * d_blocks,)](
        g2, u2, do2, dg, du, N, D, g2.stride(0), g2.stride(1), u2.stride(0), u2.stride(1), do2.stride(0),
        do2.stride(1), d_blocks, BLOCK_N=t.BLOCK_N, BLOCK_D=t.BLOCK_D, HAS_DG=need_g, HAS_DU=need_u,
        ACC=rt.tl_acc_dtype(torch.promote_types(gate.dtype, up.dtype)),
        ALIGN=rt.align(D, int(g2.stride(0)), int(u2.stride(0)), int(do2.stride(0))), num_warps=t.num_warps,
    )
    for t_, reused in ((gate, reuse_g), (up, reuse_u)):
        if reused:  # a later unpack of it elsewhere raises rather than reading the gradient
            torch.autograd.graph.increment_version(t_)
    return dg, du


def _reusable(t: torch.Tensor, ctx, *others: torch.Tensor) -> bool:
    """t's storage may take its own gradient (``inplace_backward``): eager autograd runs the backward, and t
    is an intermediate result (not a leaf, not a view), contiguous, sharing no storage with ``others``."""
    if not ctx.eager or t.grad_fn is None or t._base is not None or not t.is_contiguous():
        return False
    mine = t.untyped_storage().data_ptr()
    return all(o.untyped_storage().data_ptr() != mine for o in others)

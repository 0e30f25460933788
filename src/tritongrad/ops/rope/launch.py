"""apply_rotary_pos_emb: the launcher shared by forward and backward, and the op's declaration.

Bytes each pass must move (the bandwidth floor), q [B, HQ, T, Dh] and k [B, HK, T, Dh] of element sizes
sq, sk, cos and sin [Bc, T, Dh] (Bc = 1 or B) of sc, outputs of so (q_embed, k_embed: promoted dtypes):
  forward : read q + read k + read cos + read sin + write q_embed + write k_embed
            = B*T*Dh*(HQ*(sq + so) + HK*(sk + so)) + 2*Bc*T*Dh*sc
  backward: read dq_embed + read dk_embed + read cos + read sin + write dq + write dk: the same count
            (only the gradients asked for: dk alone reads dk_embed, cos and sin and writes dk).
cos and sin are read from HBM once and from L2 (or L1) by every other head block of the same tokens. At Llama-8B's attention, 16384 tokens x (32 + 8) heads x 128 in bfloat16 with [B, T, Dh] tables:
336 MB of q and k plus 8.4 MB of cos and sin each way, 0.69 GB in all, 0.16 ms at 4.25 TB/s.
docs/swiglu-rope.md.
"""

from __future__ import annotations

import torch

from ... import _runtime as rt
from ..._pattern import kernel, op
from . import kernels
from . import plans as P
from .reference import apply_rotary_pos_emb_reference

_kernel = kernel(kernels._rope_kernel)
_NAME = "tritongrad.apply_rotary_pos_emb"


def _dim(unsqueeze_dim) -> int:
    """1 ([B, H, T, Dh] q and k) or 2 ([B, T, H, Dh]); -3 and -2 name the same dims of 3-D cos/sin."""
    if type(unsqueeze_dim) is not int or unsqueeze_dim not in (1, 2, -3, -2):
        raise ValueError(f"{_NAME}: unsqueeze_dim must be 1 (q, k as [B, H, T, Dh]) or 2 ([B, T, H, Dh]), "
                         f"got {unsqueeze_dim!r}")
    return unsqueeze_dim % 3 if unsqueeze_dim < 0 else unsqueeze_dim


def _validate(q, k, cos, sin, unsqueeze_dim) -> None:
    dim = _dim(unsqueeze_dim)
    layout = "[B, H, T, Dh]" if dim == 1 else "[B, T, H, Dh]"
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 4:
            raise ValueError(f"{_NAME}: {name} must be 4-D {layout} (unsqueeze_dim={unsqueeze_dim}), got shape "
                             f"{tuple(x.shape)} ({x.dtype})")
    h = dim  # the heads' dim of q and k
    qs, ks = tuple(q.shape), tuple(k.shape)
    if [s for i, s in enumerate(qs) if i != h] != [s for i, s in enumerate(ks) if i != h]:
        raise ValueError(f"{_NAME}: q {qs} and k {ks} must agree in every dim of {layout} but H")
    HQ, HK, Dh = qs[h], ks[h], qs[3]
    if HK == 0 or HQ % HK != 0:
        raise ValueError(f"{_NAME}: k's {HK} heads must divide q's {HQ} (grouped-query attention); q {qs}, k {ks}")
    if Dh % 2 != 0:
        raise ValueError(f"{_NAME}: the head dim Dh must be even (rotate_half splits it in halves), got "
                         f"{Dh}: q {qs}, k {ks}")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"{_NAME}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    B, T = qs[0], qs[3 - h]
    if cos.dim() != 3 or cos.shape[0] not in (1, B) or cos.shape[1] != T or cos.shape[2] != Dh:
        raise ValueError(f"{_NAME}: cos and sin must be [B, T, Dh] = [{B}, {T}, {Dh}] or [1, {T}, {Dh}] for q {qs} "
                         f"and k {ks} ({layout}), got {tuple(cos.shape)}")


def _bthd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """q or k (or a gradient of their shape) as a [B, T, H, Dh] view."""
    return x.transpose(1, 2) if dim == 1 else x


def _empty_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A dense tensor of x's shape whose dims are laid out in x's stride order: the output of a transposed
    view of a [B, T, H, Dh] projection is [B, T, H, Dh] in memory too, so that writes follow reads, and its
    gradient's transpose and reshape back to the projection's shape are views, not copies. The order is
    read from stride hints (no guard under torch.compile); any order is correct."""
    order = sorted(range(x.dim()), key=lambda i: -rt.hint(x.stride(i)))
    y = torch.empty([x.shape[i] for i in order], dtype=dtype, device=x.device)
    return y.permute(sorted(range(x.dim()), key=order.__getitem__))


def _strides(x: torch.Tensor | None) -> tuple:
    return tuple(x.stride()) if x is not None else (0, 0, 0, 0)


def _rope(xq, xk, yq, yk, cos, sin, dim: int, backward: bool) -> None:
    """y = rope(x) (forward) or its adjoint (backward) for q and k in one launch; yq or yk None: skipped."""
    xq, xk = _bthd(xq, dim), _bthd(xk, dim)
    yq = _bthd(yq, dim) if yq is not None else None
    yk = _bthd(yk, dim) if yk is not None else None
    B, T, HQ, Dh = xq.shape
    HK = xk.shape[2]
    if B == 0 or T == 0 or Dh == 0:
        return
    HQ, HK, Dh = int(HQ), int(HK), int(Dh)
    # Heads left out (the backward of k alone) do not size the tile: k's blocks then take more tokens.
    p = P.plan(rt.hint(T), HQ if yq is not None else 0, HK if yk is not None else 0, Dh,
               min(xq.element_size(), xk.element_size()))
    q_blocks = rt.cdiv(HQ, p.BLOCK_HQ) if yq is not None else 0
    h_blocks = q_blocks + (rt.cdiv(HK, p.BLOCK_HK) if yk is not None else 0)
    if h_blocks == 0:
        return
    # cos and sin of one row for the whole batch: batch stride 0.
    cs_b = (0,) if cos.shape[0] == 1 else ()
    c_strides = (*cs_b, *cos.stride()[len(cs_b):])
    s_strides = (*cs_b, *sin.stride()[len(cs_b):])
    q_strides, k_strides, qo_strides, ko_strides = map(_strides, (xq, xk, yq, yk))
    # Token and head strides (not Dh's: its half offset is a constexpr) decide the vector width.
    align = rt.align(*[int(s) for st in (q_strides, k_strides, qo_strides, ko_strides) for s in st[:3]],
                     *[int(s) for s in (*c_strides[:2], *s_strides[:2])])
    acc = torch.float64 if torch.float64 in (xq.dtype, xk.dtype, cos.dtype, sin.dtype) else torch.float32
    _kernel[(rt.cdiv(T, p.BLOCK_T) * h_blocks, B)](
        xq, xk, yq, yk, cos, sin, T, HQ, HK, *q_strides, *k_strides, *qo_strides, *ko_strides,
        *c_strides, *s_strides, q_blocks, h_blocks, HALF=Dh // 2, BLOCK_T=p.BLOCK_T, BLOCK_HQ=p.BLOCK_HQ,
        BLOCK_HK=p.BLOCK_HK, BLOCK_HALF=p.BLOCK_HALF, HAS_Q=yq is not None, HAS_K=yk is not None,
        BACKWARD=backward, ACC=rt.tl_acc_dtype(acc), ALIGN=align, num_warps=p.num_warps,
    )


@op("tritongrad::apply_rotary_pos_emb", reference=apply_rotary_pos_emb_reference, validate=_validate,
    outputs=("q_embed", "k_embed"), save=("cos", "sin"), nondiff=("cos", "sin"))
def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb`` (``rotate_half`` convention) with one Triton kernel for q and
    k together, forward and backward.

    ``q_embed = q * cos + rotate_half(q) * sin`` and the same for k, cos and sin unsqueezed at
    ``unsqueeze_dim`` to broadcast over the heads; ``rotate_half([x1, x2]) = [-x2, x1]``.

    Args:
        q: ``[B, HQ, T, Dh]`` (``unsqueeze_dim=1``) or ``[B, T, HQ, Dh]`` (``unsqueeze_dim=2``),
            float16/bfloat16/float32/float64, Dh even, any strides: the usual transposed view of a
            ``[B, T, HQ, Dh]`` projection is read in place, never copied.
        k: like q with HK heads, HK dividing HQ (grouped-query attention); same B, T and Dh; any floating
            dtype and strides.
        cos, sin: ``[B, T, Dh]``, or ``[1, T, Dh]`` for all the batch (Hugging Face's tables for shared
            position ids); any floating dtype and strides. They get no gradient: passing one that requires
            grad is an error (detach it).
        unsqueeze_dim: 1 or 2, as in Hugging Face's function.

    Returns:
        ``(q_embed, k_embed)``: q's and k's shapes, in ``torch.promote_types(x.dtype, cos.dtype, sin.dtype)``
        each, laid out in memory like q and k (a transposed view of [B, T, H, Dh] gives one too). Computed
        in float32 (float64 when any input is float64), rounded once. Differentiable in q and k; inputs
        are never written.
    """
    dim = _dim(unsqueeze_dim)
    cs = torch.promote_types(cos.dtype, sin.dtype)
    q_embed = _empty_as(q, torch.promote_types(q.dtype, cs))
    k_embed = _empty_as(k, torch.promote_types(k.dtype, cs))
    _rope(q, k, q_embed, k_embed, cos, sin, dim, backward=False)
    return q_embed, k_embed


@apply_rotary_pos_emb.backward
def _apply_rotary_pos_emb_backward(ctx, grad_q_embed: torch.Tensor, grad_k_embed: torch.Tensor):
    # dq and dk in the gradients' dtype (q_embed's and k_embed's) and memory order (q's and k's in practice):
    # the pattern's backward sees neither q nor k (saving them would keep the projections alive for
    # nothing). Where q's dtype is narrower (bfloat16 q, float32 cos), autograd casts dq to it.
    need_q, need_k = ctx.needs_input_grad[:2]
    dq = _empty_as(grad_q_embed, grad_q_embed.dtype) if need_q else None
    dk = _empty_as(grad_k_embed, grad_k_embed.dtype) if need_k else None
    _rope(grad_q_embed, grad_k_embed, dq, dk, ctx.cos, ctx.sin, _dim(ctx.unsqueeze_dim), backward=True)
    return dq, dk, None, None

"""apply_rotary_pos_emb: the launcher shared by forward and backward, and the op's declaration (the formula
and its gradients: kernels.py).

Bytes each pass must move (the bandwidth floor), q [B, HQ, T, D] and k [B, HK, T, D] of element sizes
sq, sk, cos and sin [Bc, T, R] (Bc = 1 or B, R <= D rotated features) of sc, outputs of so (q_embed,
k_embed: promoted dtypes); passed features are read and written like rotated ones:
  forward : read q + read k + read cos + read sin + write q_embed + write k_embed
            = B*T*D*(HQ*(sq + so) + HK*(sk + so)) + 2*Bc*T*R*sc
  backward: read dq_embed + read dk_embed + read cos + read sin + write dq + write dk: the same count
            (only the gradients asked for: dk alone reads dk_embed, cos and sin and writes dk).
cos and sin are read from HBM once and from L2 (or L1) by every other head block of the same tokens. At
Llama-8B's attention, 16384 tokens x (32 + 8) heads x 128 in bfloat16 with [B, T, 128] tables: 336 MB of q
and k plus 8.4 MB of cos and sin each way, 0.69 GB in all. docs/swiglu-rope.md.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import _runtime as rt
from ..._pattern import kernel, op
from . import kernels
from . import plans as P
from .reference import apply_rotary_pos_emb_reference

_kernel = kernel(kernels._rope_kernel)
_NAME = "tritongrad.apply_rotary_pos_emb"


_LAYOUT = {1: "[B, H, T, D]", 2: "[B, T, H, D]"}


def _shapes(q, k, cos, sin) -> str:
    return ", ".join(f"{n} {tuple(t.shape)}" for n, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin))
                     if isinstance(t, torch.Tensor))


def _dim(unsqueeze_dim, q=None, k=None, cos=None, sin=None) -> int:
    """The dim of the 4-D ``cos.unsqueeze(unsqueeze_dim)`` (3-D cos: negative values count from the 4-D
    result, as torch.unsqueeze does): 1 for q and k [B, H, T, D], 2 for [B, T, H, D]."""
    d = unsqueeze_dim + 4 if type(unsqueeze_dim) is int and unsqueeze_dim < 0 else unsqueeze_dim
    if type(unsqueeze_dim) is not int or d not in (1, 2):
        raise ValueError(
            f"{_NAME}: unsqueeze_dim must be 1 or -3 (cos.unsqueeze at dim 1 of 4: q, k as [B, H, T, D]) or 2 "
            f"or -2 (dim 2: [B, T, H, D]), got {unsqueeze_dim!r}"
            f"{f' (dim {d} of the 4-D result)' if type(unsqueeze_dim) is int else ''}; {_shapes(q, k, cos, sin)}")
    return d


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _validate(q, k, cos, sin, unsqueeze_dim, *, interleaved=False, out_dtype=None) -> None:
    dim = _dim(unsqueeze_dim, q, k, cos, sin)
    if type(interleaved) is not bool:
        raise TypeError(f"{_NAME}: interleaved must be a bool, got {interleaved!r}")
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise TypeError(f"{_NAME}: out_dtype must be None or one of float16, bfloat16, float32, float64, got "
                        f"{out_dtype!r}; {_shapes(q, k, cos, sin)}")
    layout = _LAYOUT[dim]
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 4:
            raise ValueError(f"{_NAME}: {name} must be 4-D {layout} (unsqueeze_dim={unsqueeze_dim}), got shape "
                             f"{tuple(x.shape)} ({x.dtype})")
    h = dim  # the heads' dim of q and k
    qs, ks = tuple(q.shape), tuple(k.shape)
    if [s for i, s in enumerate(qs) if i != h] != [s for i, s in enumerate(ks) if i != h]:
        raise ValueError(f"{_NAME}: q {qs} and k {ks} must agree in every dim of {layout} but H")
    HQ, HK, D = qs[h], ks[h], qs[3]
    if HK == 0 or HQ % HK != 0:
        raise ValueError(f"{_NAME}: k's {HK} heads must divide q's {HQ} (grouped-query attention); q {qs}, k {ks}")
    _validate_tables(cos, sin, qs, ks, h, layout)


def _validate_tables(cos, sin, qs: tuple, ks: tuple, h: int, layout: str) -> None:
    """cos and sin against q's shape ``qs`` (heads at dim ``h``) and k's ``ks``."""
    D = qs[3]
    cs, ss = tuple(cos.shape), tuple(sin.shape)
    if cs != ss:
        what = " (their rotary widths R differ)" if cos.dim() == sin.dim() and cs[:-1] == ss[:-1] else ""
        raise ValueError(f"{_NAME}: cos {cs} and sin {ss} must have the same shape{what}")
    B, T = qs[0], qs[3 - h]
    R = cs[-1] if cos.dim() == 3 else D
    if cos.dim() != 3 or cs[0] not in (1, B) or cs[1] != T:
        raise ValueError(f"{_NAME}: cos and sin must be [B, T, R] or [1, T, R] (R <= D rotated features) = "
                         f"[{B}, {T}, {R}] or [1, {T}, {R}] for q {qs} and k {ks} ({layout}), got {cs}")
    if R > D:
        raise ValueError(f"{_NAME}: cos and sin {cs} rotate R = {R} features, more than the head dim D = {D} of "
                         f"q {qs} and k {ks} ({layout})")
    if R % 2 != 0 or R < 2:
        raise ValueError(f"{_NAME}: the rotary width R = cos.shape[-1] must be even and at least 2 (features "
                         f"rotate in pairs), got R = {R}: cos {cs}, q {qs}, k {ks}")


def _bthd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """q or k (or a gradient of their shape) as a [B, T, H, Dh] view."""
    return x.transpose(1, 2) if dim == 1 else x


def _empty_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A dense tensor of x's shape whose dims are laid out in x's stride order: the output of a transposed
    view of a [B, T, H, Dh] projection is [B, T, H, Dh] in memory too, so that writes follow reads, and its
    gradient's transpose and reshape back to the projection's shape are views, not copies. Plain tensors:
    ``empty_like`` (x's strides where x is dense, else a dense layout in x's stride order); traced ones: the
    order read from stride hints (no guard under torch.compile). Any order is correct."""
    if type(x) in rt.PLAIN_TENSORS:
        return torch.empty_like(x, dtype=dtype)
    order = sorted(range(x.dim()), key=lambda i: -rt.hint(x.stride(i)))
    y = torch.empty([x.shape[i] for i in order], dtype=dtype, device=x.device)
    return y.permute(sorted(range(x.dim()), key=order.__getitem__))


def _strides(x: torch.Tensor | None) -> tuple:
    return tuple(x.stride()) if x is not None else (0, 0, 0, 0)


def _named(name: str, strides: tuple) -> dict:
    """A tensor's strides as the kernel's arguments ``stride_<name>_b/t/h/d`` (cos and sin: b, t, d)."""
    dims = "btd" if len(strides) == 3 else "bthd"
    return {f"stride_{name}_{d}": s for d, s in zip(dims, strides)}


_LAUNCHES = rt.Memo()


def _rope(xq, xk, yq, yk, cos, sin, dim: int, backward: bool, interleaved: bool) -> None:
    """y = rope(x) (forward) or its adjoint (backward) for q and k in one launch; yq or yk None: skipped.
    Every tensor is read and written through its strides, whatever they are (no view, no copy). Plain
    tensors' launches are kept per shapes, strides, dtypes and flags (docs/host-path.md)."""
    if type(xq) not in rt.PLAIN_TENSORS:  # traced: the views the kernel reads, as the graph records them
        bound = _bind(xq, xk, yq, yk, cos, sin, dim, backward, interleaved)
        if bound is not None:
            bound(*[_bthd(x, dim) if x is not None else None for x in (xq, xk, yq, yk)], cos, sin)
        return
    key = (xq.shape, xq.stride(), xq.dtype, xk.shape, xk.stride(), xk.dtype, cos.shape, cos.stride(), cos.dtype,
           sin.stride(), sin.dtype, xq.device, dim, backward, interleaved, P.table(),
           None if yq is None else (yq.stride(), yq.dtype), None if yk is None else (yk.stride(), yk.dtype))
    bound = _LAUNCHES.get(key)
    if bound is None:
        bound = _LAUNCHES.put(key, _bind(xq, xk, yq, yk, cos, sin, dim, backward, interleaved))
    if bound is not None:  # the tensors, not their [B, T, H, D] views: the bound launch reads their data alone
        bound(xq, xk, yq, yk, cos, sin)


def _bind(xq, xk, yq, yk, cos, sin, dim: int, backward: bool, interleaved: bool) -> rt.Bound | None:
    """The launch for these shapes, strides, dtypes and flags (None: nothing to do)."""
    xq, xk = _bthd(xq, dim), _bthd(xk, dim)
    yq = _bthd(yq, dim) if yq is not None else None
    yk = _bthd(yk, dim) if yk is not None else None
    B, T, HQ, D = xq.shape
    HK = xk.shape[2]
    if B == 0 or T == 0 or D == 0:
        return None
    HQ, HK, D, R = int(HQ), int(HK), int(D), int(cos.shape[-1])
    # Heads left out (the backward of k alone) do not size the tile: k's blocks then take more tokens.
    p = P.plan(rt.hint(T), HQ if yq is not None else 0, HK if yk is not None else 0, D, R,
               min(xq.element_size(), xk.element_size()), P.table())
    q_blocks = rt.cdiv(HQ, p.BLOCK_HQ) if yq is not None else 0
    h_blocks = q_blocks + (rt.cdiv(HK, p.BLOCK_HK) if yk is not None else 0)
    if h_blocks == 0:
        return None
    # cos and sin of one row for the whole batch: batch stride 0.
    cs_b = (0,) if cos.shape[0] == 1 else ()
    c_strides = (*cs_b, *cos.stride()[len(cs_b):])
    s_strides = (*cs_b, *sin.stride()[len(cs_b):])
    q_strides, k_strides, qo_strides, ko_strides = map(_strides, (xq, xk, yq, yk))
    # Token and head strides (not D's: the pair and pass offsets are constexprs) decide the vector width.
    align = rt.align(*[int(s) for st in (q_strides, k_strides, qo_strides, ko_strides) for s in st[:3]],
                     *[int(s) for s in (*c_strides[:2], *s_strides[:2])])
    dtypes = (xq.dtype, xk.dtype, cos.dtype, sin.dtype, *(y.dtype for y in (yq, yk) if y is not None))
    acc = torch.float64 if torch.float64 in dtypes else torch.float32
    return _kernel.bind(
        (rt.cdiv(T, p.BLOCK_T) * h_blocks, B),
        xq, k_ptr=xk, qo_ptr=yq, ko_ptr=yk, cos_ptr=cos, sin_ptr=sin, T=T, HQ=HQ, HK=HK,
        **_named("q", q_strides), **_named("k", k_strides), **_named("qo", qo_strides), **_named("ko", ko_strides),
        **_named("c", c_strides), **_named("s", s_strides), Q_BLOCKS=q_blocks, H_BLOCKS=h_blocks, HALF=R // 2, PASS=D - R, BLOCK_T=p.BLOCK_T,
        BLOCK_HQ=p.BLOCK_HQ, BLOCK_HK=p.BLOCK_HK, BLOCK_HALF=p.BLOCK_HALF, BLOCK_PASS=p.BLOCK_PASS,
        INTERLEAVED=bool(interleaved), HAS_Q=yq is not None, HAS_K=yk is not None, BACKWARD=backward,
        ACC=rt.tl_acc_dtype(acc), ALIGN=align, num_warps=p.num_warps,
    )


@op("tritongrad::apply_rotary_pos_emb", reference=apply_rotary_pos_emb_reference, validate=_validate,
    outputs=("q_embed", "k_embed"), save=("cos", "sin"), nondiff=("cos", "sin"))
def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1, *, interleaved: bool = False,
                         out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb`` with one Triton kernel for q and k together, forward and
    backward: the ``rotate_half`` convention, full or partial rotary, or the interleaved one.

    With ``R = cos.shape[-1]`` (R even, 2 <= R <= D), cos and sin unsqueezed at ``unsqueeze_dim`` to broadcast
    over the heads, and x = q, then k::

        x_embed = cat([x[..., :R] * cos + rot(x[..., :R]) * sin, x[..., R:]], dim=-1)

    - ``interleaved=False``: ``rot = rotate_half``, ``[x1, x2] -> [-x2, x1]`` over the R features. With
      R = D this is Llama's ``apply_rotary_pos_emb`` (``transformers.models.llama.modeling_llama``, and the
      many models that copy it); with R < D it is GPT-NeoX's and Phi-3's (``partial_rotary_factor``), which
      rotate ``q[..., :cos.shape[-1]]`` and pass the rest, and what StableLM and Persimmon compute by calling
      Llama's function on ``q[..., :rotary_ndims]`` and concatenating the rest.
    - ``interleaved=True``: ``rot(x)[2i] = -x[2i + 1]``, ``rot(x)[2i + 1] = x[2i]`` (GPT-J's
      ``rotate_every_two``, GLM's and Helium's ``rotate_half``), full or partial. cos and sin are used per
      feature as passed: GLM's ``apply_rotary_pos_emb`` (partial) and Helium's (full width) equal this op
      called with ``cos[..., :R // 2].repeat_interleave(2, -1)`` (and the same for sin) in place of their cos
      and sin, the rewrite their own code does first; GPT-J's equals it with its per-pair tables
      repeat-interleaved.

    Args:
        q: ``[B, HQ, T, D]`` (``unsqueeze_dim`` 1 or -3) or ``[B, T, HQ, D]`` (2 or -2),
            float16/bfloat16/float32/float64, any strides: the usual transposed view of a ``[B, T, HQ, D]``
            projection is read in place, never copied.
        k: like q with HK heads, HK dividing HQ (grouped-query attention); same B, T and D; any floating
            dtype and strides.
        cos, sin: ``[B, T, R]``, or ``[1, T, R]`` for all the batch (Hugging Face's tables for shared
            position ids), one shape; any floating dtype and strides. They get no gradient: passing one that
            requires grad is an error (detach it).
        unsqueeze_dim: as in Hugging Face's function: the dim of ``cos.unsqueeze(unsqueeze_dim)`` (negative
            values count from the 4-D result, as torch.unsqueeze does) that broadcasts over the heads: 1 or -3,
            or 2 or -2. Any other value is an error.
        interleaved: keyword-only; the rotation's pairing, above.
        out_dtype: keyword-only; both outputs' dtype. None (default): each output in
            ``torch.promote_types(x.dtype, cos.dtype, sin.dtype)``, as Hugging Face's ``q * cos`` gives. A
            model that multiplies bfloat16 q by float32 tables and casts the result back to q's dtype (Olmo2's
            ``q_embed.to(q_type)``) is this op with ``out_dtype=q.dtype``: one rounding, no float32 copy.

    Returns:
        ``(q_embed, k_embed)``: q's and k's shapes, in ``out_dtype`` or the promoted dtypes, laid out in
        memory like q and k (a transposed view of [B, T, H, D] gives one too). Computed in float32 (float64
        when any input or output is float64), rounded once; passed features copied exactly (rounded once
        where ``out_dtype`` is narrower than x).
        Differentiable in q and k (the gradient of the passed features is the upstream gradient itself);
        upstream gradients of any strides (expanded, transposed, permuted) are read as they are. Inputs are
        never written.
    """
    dim = _dim(unsqueeze_dim)
    cs = torch.promote_types(cos.dtype, sin.dtype)
    q_embed = _empty_as(q, out_dtype or torch.promote_types(q.dtype, cs))
    k_embed = _empty_as(k, out_dtype or torch.promote_types(k.dtype, cs))
    _rope(q, k, q_embed, k_embed, cos, sin, dim, backward=False, interleaved=interleaved)
    return q_embed, k_embed


@apply_rotary_pos_emb.backward
def _apply_rotary_pos_emb_backward(ctx, grad_q_embed: torch.Tensor, grad_k_embed: torch.Tensor):
    # dq and dk in the gradients' dtype (q_embed's and k_embed's) and memory order (q's and k's in practice):
    # the pattern's backward sees neither q nor k (saving them would keep the projections alive for
    # nothing). Where q's dtype is narrower (bfloat16 q, float32 cos), autograd casts dq to it.
    need_q, need_k = ctx.needs_input_grad[:2]
    dq = _empty_as(grad_q_embed, grad_q_embed.dtype) if need_q else None
    dk = _empty_as(grad_k_embed, grad_k_embed.dtype) if need_k else None
    _rope(grad_q_embed, grad_k_embed, dq, dk, ctx.cos, ctx.sin, _dim(ctx.unsqueeze_dim), backward=True,
          interleaved=ctx.interleaved)
    return dq, dk, None, None

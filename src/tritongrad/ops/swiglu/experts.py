"""The experts of a mixture-of-experts layer whose experts are gated MLPs, as transformers' ``grouped_mm``
experts implementation computes them, with a backward that keeps one activation where autograd keeps four.

For token t (hidden state x_t) routed to experts e_{t,1..K} with weights w_{t,1..K}, each pair r = (t, k):

    pre_r  = x_t B_gu[e]                 [gate_r; up_r], 2I        (B: a weight as the product reads it,
    post_r = act(gate_r) * up_r          I                           [in, out]: W^T, or W where is_transposed)
    y_r    = post_r B_d[e]               H
    out_t  = sum_k w_{t,k} y_{t,k}

computed as ``transformers.integrations.moe.grouped_mm_experts_forward`` does: the pairs sorted by expert,
each product one grouped product over them (transformers' own dispatch: ``torch.nn.functional.grouped_mm``, or
its fallback), ``w * y`` in their promoted dtype, the pairs put back in token order and summed over k. So the
forward is that function's, rounding for rounding; act(gate) * up is swiglu's or geglu's kernel.

Gradients, for dout_t (d_r = dout_t of r's token, in the dtype of w * y):

    G_r      = d_r B_d[e]^T                          (one grouped product, as for d post in autograd)
    dpost_r  = w_r G_r                               dw_r = sum_i G_{r,i} post_{r,i}    (= sum_h d_{r,h} y_{r,h})
    dB_d[e]  = sum_{r in e} post_r^T (w_r d_r)        dpre_r = act'(...) from dpost_r    (swiglu's backward)
    dB_gu[e] = sum_{r in e} x_t^T dpre_r              dx_t = sum_k dpre_r B_gu[e]^T

dw through G (y_r = post_r B_d) needs neither y nor a product more. What the backward keeps: pre ([S, 2I],
S = T K pairs), the sort and the weights; post and the gathered x are made again from them (an elementwise
pass, a gather). Autograd on transformers' function keeps the gathered x [S, H], pre, post [S, I] and y
[S, H] besides. dx sums each token's K rows in token order in float32 (deterministic; autograd's gather
backward accumulates them in place). Eager, pre's gradient is written over pre where the graph is not kept.

On Triton's path, the elementwise work between the backward's products is two kernels
(kernels._experts_bwd_kernel, kernels._rows_sum_kernel): dw, dpost and dpre in one pass over pre and G
(post made again in registers, rounded as stored), and dx's gather and sum in one; the PyTorch ops take six
passes and three float32 copies of [S, I] for the same. Traced, the backward is one custom op around the
same code, so that the partitioner saves what the function saves, not the rows and the gated product it
makes again.
docs/swiglu-rope.md#moe-experts.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch.autograd.function import once_differentiable

from ... import _runtime as rt
from ..._pattern import _tracing, kernel, under_transform
from . import kernels
from . import plans as P
from .launch import GELU_APPROXIMATIONS, _graph_kept, activation, gate_grads, geglu, swiglu

APPROXIMATIONS = (None, *GELU_APPROXIMATIONS)  # None: SiLU (swiglu); "none", "tanh": GELU's (geglu)


_MOE = [sys.modules.get("transformers.integrations.moe")]


def _moe():
    """``transformers.integrations.moe``, imported once (``patch`` and every eager call resolve it). Where the
    first call is traced, the import names the module itself: Dynamo refuses transformers' lazy packages as an
    import's result (torch 2.11: a graph break), and a look into sys.modules before the import is a guard that
    the import then fails (torch 2.13: an internal error)."""
    if _MOE[0] is None:
        from transformers.integrations.moe import _grouped_mm
        _MOE[0] = sys.modules[_grouped_mm.__module__]
    return _MOE[0]


def _require_moe():
    """:func:`_moe`, or an ImportError that says what the op needs."""
    try:
        return _moe()
    except ImportError as e:
        raise ImportError("grouped_experts: its grouped products are transformers' own "
                          f"(transformers.integrations.moe, transformers 5), which does not import here: {e}") from e


def _gated(pre: torch.Tensor, approximate: str | None) -> torch.Tensor:
    """``act(gate) * up`` of pre's two halves: swiglu's kernel, or geglu's with ``approximate``."""
    gate, up = pre.chunk(2, dim=-1)
    return swiglu(gate, up) if approximate is None else geglu(gate, up, approximate=approximate)


def _weights(w: torch.Tensor, is_transposed: bool) -> torch.Tensor:
    """The product's [E, in, out] operand, as transformers' ``_grouped_linear`` reads the weight."""
    return w if is_transposed else w.transpose(-2, -1)


@torch.library.custom_op("tritongrad::grouped_mm_weight_grad", mutates_args=())
def _weight_grad_loop(a: torch.Tensor, d: torch.Tensor, offs: torch.Tensor, experts: int) -> torch.Tensor:
    """``[E, A, D]``: for each group of rows (``offs``: cumulative ends), ``a_e^T d_e``; zeros for an empty one.
    A custom op (one host read of the offsets), so that torch.compile takes it whole, as transformers' fallback."""
    out = torch.zeros((experts, a.shape[1], d.shape[1]), dtype=d.dtype, device=d.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(a[start:end].t(), d[start:end], out=out[e])
        start = end
    return out


@_weight_grad_loop.register_fake
def _(a, d, offs, experts):
    return a.new_empty((experts, a.shape[1], d.shape[1]), dtype=d.dtype)


def _aligned(t: torch.Tensor) -> bool:
    """Strides grouped_mm takes: the unit-stride dim's neighbour a multiple of 16 bytes, the data 16-aligned."""
    per = 16 // t.element_size()
    s0, s1 = t.stride()
    lead = s1 if s0 == 1 else s0
    return lead % per == 0 and (torch.compiler.is_compiling() or t.data_ptr() % 16 == 0)


def _weight_grad(a: torch.Tensor, d: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[E, A, D]`` in ``weight``'s dtype, group e's ``a_e^T d_e``: the 2-D x 2-D grouped product autograd
    takes for grouped_mm's weight, where the product takes these operands; else a loop of products."""
    a, d = a.to(weight.dtype), d.to(weight.dtype)
    if (d.is_cuda and d.dtype == torch.bfloat16 and hasattr(torch.nn.functional, "grouped_mm")
            and _aligned(a.t()) and _aligned(d)):
        return torch.nn.functional.grouped_mm(a.t(), d, offs=offs)
    return _weight_grad_loop(a, d, offs, weight.shape[0])


_bwd_kernel = kernel(kernels._experts_bwd_kernel)
_rows_sum_kernel = kernel(kernels._rows_sum_kernel)


def _one_pass(device) -> bool:
    """Whether the backward takes its one-pass kernels: run, not traced (eager, or the backward op of a
    compiled graph), on Triton's path."""
    return not _tracing() and rt.uses_triton(device)


def _fused_grads(pre, G, w_g, approximate, need_dw: bool, need_dpre: bool, out, dw_dtype):
    """``(dpre [S, 2I] or None, dw [S] or None)`` in one pass over pre and G (kernels._experts_bwd_kernel):
    what ``G * post`` summed, ``G * w`` and gate_grads take in six passes; dpre written into ``out`` if given."""
    S, I2 = pre.shape
    G = G if G.stride(-1) == 1 else G.contiguous()
    if pre.stride(-1) != 1:  # the kernel reads unit columns (a saved-tensor hook may hand back another layout)
        pre, out = pre.contiguous(), None
    dpre = (out if out is not None else torch.empty_like(pre, memory_format=torch.contiguous_format)) \
        if need_dpre else None
    dw = torch.empty(S, dtype=dw_dtype, device=pre.device) if need_dw else None
    if S:
        t = P.tile(rt.hint(S), I2 // 2, pre.element_size(), P.table())
        act = activation(approximate)
        _bwd_kernel[(rt.cdiv(S, t.BLOCK_N),)](
            pre, G, w_g, dpre if need_dpre else pre, dw if need_dw else w_g, S, I2 // 2, pre.stride(0), G.stride(0),
            (dpre if need_dpre else pre).stride(0), BLOCK_N=t.BLOCK_N, BLOCK_D=t.BLOCK_D, HAS_DPRE=need_dpre,
            HAS_DW=need_dw, ACT=act, ACC=rt.tl_acc_dtype(rt.acc_of(pre, G, w_g)), num_warps=t.num_warps)
    return dpre, dw


def _rows_sum(src: torch.Tensor, idx: torch.Tensor, K: int, dtype: torch.dtype) -> torch.Tensor:
    """``src[idx].view(-1, K, D).sum(1)`` in float32 (float64 for float64), k in order, rounded once to dtype,
    without the gathered copy (kernels._rows_sum_kernel)."""
    src = src if src.stride(-1) == 1 else src.contiguous()  # the kernel reads unit columns
    SK, D = src.shape
    N = SK // K
    out = torch.empty((N, D), dtype=dtype, device=src.device)
    if out.numel():
        t = P.tile(rt.hint(N), D, src.element_size(), P.table())
        _rows_sum_kernel[(rt.cdiv(N, t.BLOCK_N), rt.cdiv(D, t.BLOCK_D))](
            src, idx, out, N, D, src.stride(0), K=K, BLOCK_N=t.BLOCK_N, BLOCK_D=t.BLOCK_D,
            ACC=rt.tl_acc_dtype(rt.acc_of(src, out)), num_warps=t.num_warps)
    return out


def _down_grad(d, w_g, post, pre, approximate, offs, down_proj, is_transposed, ydtype):
    """B_d's gradient, ``post^T (w d)`` per expert, in the weight's own layout ([E, I, H] where transposed, else
    [E, H, I]); ``w d`` is written over d (the caller's own gather), post made again from pre if None."""
    post = _gated(pre, approximate) if post is None else post
    dy = d.mul_(w_g.unsqueeze(-1)).to(ydtype)  # d's dtype is promote(y, w): the product's rounding, in place
    return _weight_grad(post, dy, offs, down_proj) if is_transposed else _weight_grad(dy, post, offs, down_proj)


def _grads(dout, x, gate_up_proj, down_proj, pre, perm, inv_perm, tokens, w_g, offs, approximate, is_transposed,
           K, wdtype, ydtype, w_dtype, needs, reuse):
    """``(dx, dw, dgu, dd)``, None where ``needs`` (x, weights, gate_up_proj, down_proj) says no; pre's gradient
    written over pre where ``reuse``."""
    need_x, need_w, need_gu, need_d = needs
    need_dpre = need_x or need_gu
    moe = _moe()
    T, H = x.shape
    # On Triton's path, one kernel takes dw, dpost and dpre in a pass over pre and G; off it, PyTorch ops and
    # gate_grads.
    fused = _one_pass(pre.device)
    post = None if fused else _gated(pre, approximate)
    d = dout.to(wdtype)[tokens]  # [S, H]: the pairs' rows, sorted by expert
    b_d = _weights(down_proj, is_transposed)  # [E, I, H]
    # G = d B_d^T feeds dw and dpost; then the down weight's gradient, its w d written over d, so that d, w d, G
    # and post are never alive together (docs/swiglu-rope.md#moe-experts).
    G = moe._grouped_mm(d.to(b_d.dtype), b_d.transpose(-2, -1), offs) if need_w or need_dpre else None
    dx = dw = dgu = dd = dpre = dw_g = None
    if need_d:
        dd = _down_grad(d, w_g, post, pre, approximate, offs, down_proj, is_transposed, ydtype)
    del d  # not read below
    if fused and (need_w or need_dpre):
        dpre, dw_g = _fused_grads(pre, G, w_g, approximate, need_w, need_dpre, out=pre if reuse else None,
                                  dw_dtype=w_dtype)
    else:
        if need_w:
            acc = torch.promote_types(wdtype, torch.float32)
            dw_g = (G.to(acc) * post.to(acc)).sum(-1).to(w_dtype)
        if need_dpre:
            dpost = (G * w_g.unsqueeze(-1)).to(post.dtype)
            dpre = gate_grads(*pre.chunk(2, dim=-1), dpost, approximate, out=pre if reuse else None)  # [S, 2I]
            del dpost
    del G, post  # [S, I] each: not read below
    if need_w:
        dw = torch.empty_like(dw_g)
        dw[perm] = dw_g
        dw = dw.view(T, K)
    if dpre is not None:
        if reuse:  # any other use of pre saved for backward raises rather than reading the gradient
            torch.autograd.graph.increment_version(pre)
        b_gu = _weights(gate_up_proj, is_transposed)  # [E, H, 2I]
        if need_gu:
            x_g = x[tokens]
            dgu = (_weight_grad(x_g, dpre, offs, gate_up_proj) if is_transposed
                   else _weight_grad(dpre, x_g, offs, gate_up_proj))
            del x_g  # [S, H]: not read by dx's product
        if need_x:
            dx_g = moe._grouped_mm(dpre, b_gu.transpose(-2, -1), offs)  # [S, H]
            if fused:
                dx = _rows_sum(dx_g, inv_perm, K, x.dtype)
            else:
                acc = torch.promote_types(x.dtype, torch.float32)
                dx = dx_g[inv_perm].view(T, K, H).sum(dim=1, dtype=acc).to(x.dtype)
    return dx, dw, dgu, dd


@torch.library.custom_op("tritongrad::grouped_experts_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                 pre: torch.Tensor, perm: torch.Tensor, inv_perm: torch.Tensor, tokens: torch.Tensor,
                 w_g: torch.Tensor, offs: torch.Tensor, approximate: str | None, is_transposed: bool, K: int,
                 wdtype: torch.dtype, ydtype: torch.dtype, w_dtype: torch.dtype,
                 needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward traced: :func:`_grads` (pre not overwritten), an empty tensor for a gradient not needed."""
    grads = _grads(dout, x, gate_up_proj, down_proj, pre, perm, inv_perm, tokens, w_g, offs, approximate,
                   is_transposed, K, wdtype, ydtype, w_dtype, needs, False)
    return tuple(g.contiguous() if g is not None else x.new_empty(0) for g in grads)


@_backward_op.register_fake
def _(dout, x, gate_up_proj, down_proj, pre, perm, inv_perm, tokens, w_g, offs, approximate, is_transposed, K,
      wdtype, ydtype, w_dtype, needs):
    shapes = ((x.shape, x.dtype), ((x.shape[0], K), w_dtype), (gate_up_proj.shape, gate_up_proj.dtype),
              (down_proj.shape, down_proj.dtype))
    return tuple(x.new_empty(shape, dtype=dtype) if n else x.new_empty(0) for (shape, dtype), n in zip(shapes, needs))


def _forward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, approximate, is_transposed):
    """``(out, what the backward keeps)``: transformers' grouped_mm experts forward, step for step."""
    moe = _moe()
    T, H = x.shape
    K = top_k_index.shape[-1]
    E = gate_up_proj.shape[0]
    sample_weights = top_k_weights.reshape(-1)
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    tokens = perm // K
    x_g = x[tokens]
    w_g = sample_weights[perm]
    histc_input = expert_ids_g.float() if x.device.type in ("cpu", "mps") else expert_ids_g.int()
    offs = torch.cumsum(torch.histc(histc_input, bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
    pre = moe._grouped_linear(x_g, gate_up_proj, offs, is_transposed=is_transposed)
    post = _gated(pre, approximate)
    y = moe._grouped_linear(post, down_proj, offs, is_transposed=is_transposed)
    weighted = y * w_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=x.device)
    out = weighted[inv_perm].view(T, K, H).sum(dim=1)
    # No .to that returns its input: Dynamo (2.11) hands the function's intermediates back beside its output,
    # and an output that aliases one of them gets no gradient (docs/swiglu-rope.md#moe-experts).
    out = out if out.dtype == x.dtype else out.to(x.dtype)
    return out, (pre, perm, inv_perm, tokens, w_g, offs, weighted.dtype, y.dtype)


class _GroupedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, gate_up_proj, down_proj, approximate, is_transposed):
        out, (pre, perm, inv_perm, tokens, w_g, offs, wdtype, ydtype) = _forward(
            x, top_k_index, top_k_weights, gate_up_proj, down_proj, approximate, is_transposed)
        K = top_k_index.shape[-1]
        ctx.save_for_backward(x, gate_up_proj, down_proj, pre, perm, inv_perm, tokens, w_g, offs)
        # Eager, the backward may write pre's gradient over pre, its own buffer, when it gets that very tensor.
        ctx.pre = None if torch.compiler.is_compiling() else weakref.ref(pre)
        ctx.meta = (approximate, is_transposed, K, wdtype, ydtype, top_k_weights.dtype)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, gate_up_proj, down_proj, pre, perm, inv_perm, tokens, w_g, offs = ctx.saved_tensors
        approximate, is_transposed, K, wdtype, ydtype, w_dtype = ctx.meta
        need_x, _, need_w, need_gu, need_d = ctx.needs_input_grad[:5]
        needs = [need_x, need_w, need_gu, need_d]
        args = (dout, x, gate_up_proj, down_proj, pre, perm, inv_perm, tokens, w_g, offs, approximate, is_transposed,
                K, wdtype, ydtype, w_dtype, needs)
        if _tracing():
            # One op, opaque to the partitioner: the gathered rows and the gated product it makes again would
            # otherwise be saved from the forward, being inputs of products (docs/swiglu-rope.md#moe-experts).
            grads = _backward_op(*args)
            dx, dw, dgu, dd = (g if n else None for g, n in zip(grads, needs))
        else:
            # Over pre where nothing reads it again: the graph not kept, pre handed back as it was saved.
            reuse = ctx.pre is not None and ctx.pre() is pre and not _graph_kept()
            dx, dw, dgu, dd = _grads(*args, reuse)
        return dx, None, dw, dgu, dd, None, None


def grouped_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *, approximate: str | None = None,
                    is_transposed: bool = False) -> torch.Tensor:
    """The gated-MLP experts of a MoE layer, ``out_t = sum_k w_{t,k} down(act(gate) * up)`` over each token's
    experts, as transformers' ``grouped_mm`` experts implementation computes it, keeping for the backward only
    the gate-and-up product (module docstring).

    Args:
        x: ``[T, H]`` hidden states.
        top_k_index: ``[T, K]`` integer expert ids, each in ``[0, E)``.
        top_k_weights: ``[T, K]`` routing weights (differentiable).
        gate_up_proj: ``[E, 2I, H]`` ([gate; up] concatenated), or ``[E, H, 2I]`` with ``is_transposed``.
        down_proj: ``[E, H, I]``, or ``[E, I, H]`` with ``is_transposed``.
        approximate: None for SiLU (swiglu), ``"none"`` or ``"tanh"`` for GELU (geglu's ``approximate``).

    Returns:
        ``[T, H]`` in x's dtype.
    """
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"grouped_experts: approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if x.dim() != 2 or top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape \
            or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"grouped_experts: x [T, H], top_k_index and top_k_weights [T, K]; got x "
                         f"{tuple(x.shape)}, top_k_index {tuple(top_k_index.shape)}, top_k_weights "
                         f"{tuple(top_k_weights.shape)}")
    tensors = {"x": x, "top_k_index": top_k_index, "top_k_weights": top_k_weights, "gate_up_proj": gate_up_proj,
               "down_proj": down_proj}
    if top_k_index.is_floating_point() or top_k_index.is_complex() or top_k_index.dtype == torch.bool \
            or not all(t.is_floating_point() for n, t in tensors.items() if n != "top_k_index") \
            or len({t.device for t in tensors.values()}) != 1:
        raise ValueError("grouped_experts: integer top_k_index, floating x, weights and projections, all on one "
                         "device; got " + ", ".join(f"{n} {t.dtype} on {t.device}" for n, t in tensors.items()))
    E = gate_up_proj.shape[0]
    gu = _weights(gate_up_proj, is_transposed)
    dn = _weights(down_proj, is_transposed)
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3 or down_proj.shape[0] != E or gu.shape[-2] != x.shape[1] \
            or gu.shape[-1] % 2 or dn.shape[-2] != gu.shape[-1] // 2 or dn.shape[-1] != x.shape[1]:
        raise ValueError(f"grouped_experts: for x {tuple(x.shape)}, gate_up_proj {tuple(gate_up_proj.shape)} and "
                         f"down_proj {tuple(down_proj.shape)} do not make [E, 2I, H] and [E, H, I] "
                         f"(is_transposed={is_transposed}: [E, H, 2I] and [E, I, H])")
    if not torch.compiler.is_compiling():
        _require_moe()
        if under_transform(x, top_k_weights, gate_up_proj, down_proj):
            # The Function gives no tangents and no batching rule: the same forward in PyTorch's ops (the gated
            # op on its reference), which the transform differentiates or batches, as transformers' own.
            return _forward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, approximate, is_transposed)[0]
    return _GroupedExperts.apply(x, top_k_index, top_k_weights, gate_up_proj, down_proj, approximate,
                                 is_transposed)

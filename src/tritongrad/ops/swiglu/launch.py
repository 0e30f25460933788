"""swiglu and geglu: the forward and backward launchers and the ops' declarations.

Both are ``act(gate) * up`` through the same two kernels (kernels.py, the activation a constexpr), so they
move the same bytes. The bandwidth floor, gate and up [N, D] of element sizes sg, su, out of so:
  forward : read gate + read up + write out                          = N*D*(sg + su + so)
  backward: read gate + read up + read dout + write dgate + write dup = N*D*(sg + su + so + sg + su)
            (dup alone reads gate and dout and writes dup: N*D*(sg + so + su))
At Llama-8B's MLP, 16384 tokens x 14336 in bfloat16: 1.41 GB forward, 2.35 GB backward, 3.76 GB in all.
Nothing else is read or written: no copies of strided inputs (the halves of
a fused projection are read in place), no intermediate activation, no residuals. docs/swiglu-rope.md.

gated_linear is the gated product and the down projection after it, out = h W^T with h = act(gate) * up,
keeping gate, up and W for the backward but not h [N, D], which the backward makes again (one forward pass
of the kernel):
    dW = dout^T h        dh = dout W        dgate, dup = the gated product's backward of dh
The same function and rounding as ``F.linear(swiglu(gate, up), W)``; 2 N D bytes (16-bit) less kept per
layer, for N D (sg + su + so) bytes more moved in the backward. docs/swiglu-rope.md#the-down-projection.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch

from ... import _runtime as rt
from ..._dtypes import acc_of
from ..._pattern import _tracing, kernel, op
from . import kernels
from . import plans as P
from .reference import gated_linear_reference, geglu_reference, swiglu_reference

_fwd_kernel = kernel(kernels._gated_fwd_kernel)
_bwd_kernel = kernel(kernels._gated_bwd_kernel)

# geglu's ``approximate`` (F.gelu's) -> the kernels' activation.
GELU_APPROXIMATIONS = {"none": kernels.GELU, "tanh": kernels.GELU_TANH}


def activation(approximate: str | None) -> int:
    """The kernels' activation for ``approximate``: None is SiLU (swiglu's), else GELU's (geglu's)."""
    return kernels.SILU if approximate is None else GELU_APPROXIMATIONS[approximate]

# Inside a backward: whether the running graph task keeps the graph (retain_graph=True, or
# torch.autograd.grad's default with create_graph). Outside one it answers True.
_graph_kept = torch._C._autograd._get_current_graph_task_keep_graph


def _validate_shapes(name, gate, up) -> None:
    if gate.shape != up.shape:
        raise ValueError(
            f"tritongrad.{name}: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape "
            f"(got dtypes {gate.dtype} and {up.dtype}); {name} does not broadcast"
        )


def _validate(gate, up, inplace_backward) -> None:
    _validate_shapes("swiglu", gate, up)


def _validate_geglu(gate, up, approximate, inplace_backward) -> None:
    if not isinstance(approximate, str) or approximate not in GELU_APPROXIMATIONS:
        raise ValueError(
            f"tritongrad.geglu: approximate must be 'none' (erf GELU) or 'tanh' (its tanh approximation), as "
            f"F.gelu's, got {approximate!r} (gate {tuple(gate.shape)} {gate.dtype} on {gate.device})"
        )
    _validate_shapes("geglu", gate, up)


def _plan(N, D: int, *tensors: torch.Tensor) -> P.Tile:
    # The narrowest element sets the tile, so that each of its loads is still a 16-byte vector.
    return P.tile(rt.hint(N), D, min(t.element_size() for t in tensors), P.table())


_LAUNCHES = rt.Memo()  # plain tensors' launches by shapes, strides, dtypes and flags (docs/host-path.md)


def _launch(key: tuple | None, bind, tensors: tuple) -> None:
    """``bind(*rows)`` of the tensors as [N, D] rows, kept under ``key`` for plain tensors: later calls launch
    it on the tensors themselves where their rows are views (the kernel reads their data alone)."""
    if key is None:  # traced: the [N, D] views the graph records
        rows = [rt.as_rows(t) if t is not None else None for t in tensors]
        bound = bind(*rows)
        if bound is not None:
            bound(*rows)
        return
    kept = _LAUNCHES.get(key)
    if kept is None:
        rows = [rt.as_rows(t) if t is not None else None for t in tensors]
        in_place = all(rt.same_data(zip(rows, tensors)))
        kept = _LAUNCHES.put(key, (bind(*rows), in_place))
    bound, in_place = kept
    if bound is not None:
        bound(*(tensors if in_place else [rt.as_rows(t) if t is not None else None for t in tensors]))


def _forward(gate, up, act: int, inplace_backward: bool) -> torch.Tensor:
    # read gate + read up + write out: N*D*(sg + su + so) bytes.
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if inplace_backward:
        _received(gate, up)
    key = None if type(gate) not in rt.PLAIN_TENSORS else (
        "fwd", gate.shape, gate.stride(), gate.dtype, up.stride(), up.dtype, gate.device, act, P.table())
    _launch(key, functools.partial(_bind_forward, act), (gate, up, out))
    return out


def _bind_forward(act: int, g2, u2, out) -> rt.Bound | None:
    N, D = g2.shape
    if N == 0 or D == 0:
        return None
    D = int(D)
    t = _plan(N, D, g2, u2)
    d_blocks = rt.cdiv(D, t.BLOCK_D)
    return _fwd_kernel.bind(
        (rt.cdiv(N, t.BLOCK_N) * d_blocks,),
        g2, u_ptr=u2, out_ptr=out, N=N, D=D, stride_g_row=g2.stride(0), stride_g_col=g2.stride(1),
        stride_u_row=u2.stride(0), stride_u_col=u2.stride(1), D_BLOCKS=d_blocks, BLOCK_N=t.BLOCK_N, BLOCK_D=t.BLOCK_D, ACT=act, ACC=rt.tl_acc_dtype(out.dtype),
        ALIGN=rt.align(D, int(g2.stride(0)), int(u2.stride(0))), num_warps=t.num_warps,
    )


def _backward(ctx, grad_out: torch.Tensor, act: int):
    # read gate + read up + read dout + write dgate + write dup: N*D*(sg + su + so + sg + su) bytes; dup
    # alone skips up and dgate.
    gate, up = ctx.gate, ctx.up
    need_g, need_u = ctx.needs_input_grad[:2]
    # In place only where nothing can read gate or up again (_reusable); the graph check once per backward.
    reuse = ctx.inplace_backward and (need_g or need_u) and ctx.eager and not _graph_kept()
    halves = reuse and _halves_reusable(gate, up, grad_out)
    reuse_g = reuse and need_g and (halves or _reusable(gate, up, grad_out))
    reuse_u = reuse and need_u and (halves or _reusable(up, gate, grad_out))
    dg = (gate.detach() if reuse_g else torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)) if need_g else None
    du = (up.detach() if reuse_u else torch.empty(up.shape, dtype=up.dtype, device=up.device)) if need_u else None
    if gate.numel() == 0 or not (need_g or need_u):
        return dg, du
    key = None if type(gate) not in rt.PLAIN_TENSORS else (
        "bwd", gate.shape, gate.stride(), gate.dtype, up.stride(), up.dtype, grad_out.stride(), grad_out.dtype,
        gate.device, dg is not None and dg.stride(), du is not None and du.stride(), act, P.table())
    _launch(key, functools.partial(_bind_backward, act), (gate, up, grad_out, dg, du))
    for t_, reused in ((gate, reuse_g), (up, reuse_u)):
        if reused:  # a later unpack of it elsewhere raises rather than reading the gradient
            torch.autograd.graph.increment_version(t_)
    return dg, du


def _traced_backward(ctx, grad_out: torch.Tensor, approximate: str | None):
    """The backward in PyTorch ops, the kernel's arithmetic (float32, or float64, then one rounding), for
    torch.compile and torch.export to trace: Inductor fuses it into one pass and writes dg over the saved up,
    whose buffer the backward donates, and du over grad_out (docs/writing-an-op.md#a-backward-for-tracing).
    ``approximate`` None is SiLU."""
    return _traced_grads(ctx.gate, ctx.up, grad_out, approximate, *ctx.needs_input_grad[:2])


def _traced_grads(gate, up, grad_out, approximate: str | None, need_g: bool, need_u: bool, layout: bool = True):
    acc = acc_of(gate, up)
    g, d = gate.to(acc), grad_out.to(acc)
    dg = du = None
    # Inductor writes an output over an input that no other pass of the fused kernel still reads: up, read by
    # dg alone.
    if need_g:
        d_u = d * up.to(acc)
        dg = (torch.ops.aten.silu_backward(d_u, g) if approximate is None
              else torch.ops.aten.gelu_backward(d_u, g, approximate=approximate)).to(gate.dtype)
    if need_u:
        a = torch.nn.functional.silu(g) if approximate is None else torch.nn.functional.gelu(g, approximate=approximate)
        du = d * a
        force_layout = _force_layout() if need_g and layout else None
        if force_layout is not None:
            # dg realized, and read by du as an exact zero: dg's pass is then an ancestor of du's, so Inductor
            # also writes du over grad_out, which only they read (docs/writing-an-op.md#a-backward-for-tracing).
            dg = force_layout(dg, dg.stride())
            du = du - torch.where(dg == dg, 0.0, 0.0)
        du = du.to(up.dtype)
    return dg, du


def gate_grads(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor, approximate: str | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Both gradients of ``act(gate) * up`` (``approximate`` None: SiLU, else GELU's) side by side, ``[N, 2D]``
    in ``[dgate, dup]`` order: the layout of a fused ``[gate; up]`` projection's output, whose gradient this is;
    written into ``out`` where given (the product itself, gate and up its halves, when the caller owns it and
    nothing reads it again: each element is read before it is written). For callers that own their autograd
    (the MoE experts); traced, or off Triton, the PyTorch ops of the traced backward (``out`` unused)."""
    if _tracing() or not rt.uses_triton(gate.device):
        return torch.cat(_traced_grads(gate, up, grad_out, approximate, True, True, layout=False), dim=-1)
    N, D = gate.shape
    if out is None:
        out = torch.empty((N, 2 * D), dtype=gate.dtype, device=gate.device)
    if out.numel():
        act = activation(approximate)
        key = None if type(gate) not in rt.PLAIN_TENSORS else (
            "grads", gate.shape, gate.stride(), gate.dtype, up.stride(), up.dtype, grad_out.stride(), grad_out.dtype,
            gate.device, act, P.table())
        _launch(key, functools.partial(_bind_backward, act), (gate, up, grad_out, out[:, :D], out[:, D:]))
    return out


@functools.cache
def _force_layout():
    """Inductor's ``prims.inductor_force_stride_order`` (the identity on a tensor of that stride: it realizes
    its input in Inductor's graph), or None where this torch does not have it. Imported when first traced:
    torch._inductor takes a second to import."""
    try:
        import torch._inductor.inductor_prims  # noqa: F401  (registers the prims)

        return torch.ops.prims.inductor_force_stride_order
    except (ImportError, AttributeError):
        return None


def _bind_backward(act: int, g2, u2, do2, dg, du) -> rt.Bound:
    N, D = g2.shape
    D = int(D)
    t = _plan(N, D, g2, u2, do2)
    d_blocks = rt.cdiv(D, t.BLOCK_D)
    return _bwd_kernel.bind(
        (rt.cdiv(N, t.BLOCK_N) * d_blocks,),
        g2, u_ptr=u2, dout_ptr=do2, dg_ptr=dg, du_ptr=du, N=N, D=D, stride_g_row=g2.stride(0),
        stride_g_col=g2.stride(1), stride_u_row=u2.stride(0), stride_u_col=u2.stride(1),
        stride_dout_row=do2.stride(0), stride_dout_col=do2.stride(1),
        stride_dg_row=D if dg is None else dg.stride(0), stride_du_row=D if du is None else du.stride(0), D_BLOCKS=d_blocks, BLOCK_N=t.BLOCK_N, BLOCK_D=t.BLOCK_D, HAS_DG=dg is not None, HAS_DU=du is not None, ACT=act,
        ACC=rt.tl_acc_dtype(torch.promote_types(g2.dtype, u2.dtype)),
        ALIGN=rt.align(D, *(int(t_.stride(0)) for t_ in (g2, u2, do2, dg, du) if t_ is not None)),
        num_warps=t.num_warps,
    )


# inplace_backward: the tensors a forward received, by id. The backward writes over a saved tensor only if
# it is that very tensor: saved-tensor hooks (checkpoint recomputation, offloading, a hook that keeps what
# it packs) hand back another one, and version counters no longer guard what they hold.
_RECEIVED: dict[int, weakref.ref] = {}


def _received(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.grad_fn is not None:  # leaves are never reused: no entry
            k = id(t)
            _RECEIVED[k] = weakref.ref(t, lambda r, k=k: _RECEIVED.get(k) is r and _RECEIVED.pop(k, None))


def _reusable(t: torch.Tensor, *others: torch.Tensor) -> bool:
    """t's storage may take its own gradient (``inplace_backward``; eager autograd and a graph that is not
    kept, checked by the caller): t is the tensor the forward received (not handed back by saved-tensor
    hooks), an intermediate result (not a leaf, not a view), contiguous, without tensor hooks or
    retain_grad (they would see the gradient, not t), sharing no storage with ``others``."""
    r = _RECEIVED.get(id(t))
    if r is None or r() is not t:
        return False
    if t.grad_fn is None or t._base is not None or not t.is_contiguous() or t._backward_hooks or t.retains_grad:
        return False
    mine = t.untyped_storage().data_ptr()
    return all(o.untyped_storage().data_ptr() != mine for o in others)


def _halves_reusable(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """gate and up are the two halves of one projection's output (``proj(x).chunk(2, -1)``) and that output
    may take their gradients (``inplace_backward``; the caller checks the graph): each half is the tensor the
    forward received, without tensor hooks or retain_grad; their base is an intermediate result, contiguous,
    without hooks or retain_grad, that they cover exactly and grad_out does not share. They share
    its version counter, so any other use of it saved for backward raises instead of reading the gradient."""
    base = gate._base
    if base is None or up._base is not base or base.grad_fn is None or base._base is not None:
        return False
    for t in (gate, up):
        r = _RECEIVED.get(id(t))
        if r is None or r() is not t or t._backward_hooks or t.retains_grad:
            return False
    D = gate.shape[-1]
    if not base.is_contiguous() or base._backward_hooks or base.retains_grad or base.shape[:-1] != gate.shape[:-1] \
            or base.shape[-1] != 2 * D or gate.stride() != base.stride() or up.stride() != base.stride():
        return False
    if sorted((gate.storage_offset(), up.storage_offset())) != [base.storage_offset(), base.storage_offset() + D]:
        return False
    return grad_out.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


@op("tritongrad::swiglu", reference=swiglu_reference, validate=_validate,
    traced_backward=lambda ctx, grad_out: _traced_backward(ctx, grad_out, None))
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
            alone: the backward then allocates nothing (2 N D elements less at its peak). Taken only where
            nothing can read the input again: in eager autograd, in a backward that does not keep the graph
            (not ``retain_graph=True``), for an input that is the very tensor the forward received (not one
            handed back by saved-tensor hooks, as non-reentrant checkpointing and offloading do), an
            intermediate result (not a leaf, not a view), contiguous, without tensor hooks or
            ``retain_grad``, sharing no storage with the other input or the incoming gradient; or gate and up
            are the two halves of one such result (``proj(x).chunk(2, -1)``), which then takes both
            gradients. Otherwise the backward allocates, as without the option. Its version counter is
            bumped, so any other use of it saved for backward raises instead of reading the gradient.
            Compiled, the backward is traced in PyTorch ops instead, whose fused kernel Inductor lets write
            dgate over up where up's buffer is its own (a saved activation), with or without the option.

    Returns:
        out: gate's shape, contiguous, in ``torch.promote_types(gate.dtype, up.dtype)``. Computed in
        float32 (float64 when an input is float64) and rounded once. Differentiable in gate and up; each
        gradient comes back in its input's dtype, contiguous, or in its input's layout where written over
        it. Inputs are never written unless ``inplace_backward``.
    """
    return _forward(gate, up, kernels.SILU, inplace_backward)


@swiglu.backward
def _swiglu_backward(ctx, grad_out: torch.Tensor):
    return _backward(ctx, grad_out, kernels.SILU)


@op("tritongrad::geglu", reference=geglu_reference, validate=_validate_geglu,
    traced_backward=lambda ctx, grad_out: _traced_backward(ctx, grad_out, ctx.approximate))
def geglu(gate: torch.Tensor, up: torch.Tensor, *, approximate: str = "none",
          inplace_backward: bool = False) -> torch.Tensor:
    """GeGLU's gated product ``gelu(gate) * up`` (``F.gelu(gate, approximate=approximate) * up``) with
    Triton kernels for forward and backward; Gemma's MLPs are ``approximate="tanh"``.

    Args:
        gate: ``[..., D]``, float16/bfloat16/float32/float64, any strides (read in place, as swiglu's).
        up: the same shape as gate (no broadcasting), any floating dtype and strides, on gate's device.
        approximate: ``"none"``, the exact GELU ``gate * Phi(gate)`` (erf), or ``"tanh"``, its tanh
            approximation ``0.5 gate (1 + tanh(sqrt(2/pi) (gate + 0.044715 gate^3)))``, as ``F.gelu``'s.
        inplace_backward: as swiglu's, with the same conditions: opt in to the backward writing each
            gradient over its input, where nothing can read that input again.

    Returns:
        out: gate's shape, contiguous, in ``torch.promote_types(gate.dtype, up.dtype)``. Computed in
        float32 (float64 when an input is float64) and rounded once. Differentiable in gate and up; each
        gradient comes back contiguous in its input's dtype. Inputs are never written unless
        ``inplace_backward``.
    """
    return _forward(gate, up, GELU_APPROXIMATIONS[approximate], inplace_backward)


@geglu.backward
def _geglu_backward(ctx, grad_out: torch.Tensor):
    return _backward(ctx, grad_out, GELU_APPROXIMATIONS[ctx.approximate])


def _validate_gated_linear(gate, up, weight, approximate, inplace_backward) -> None:
    if approximate is not None and approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"tritongrad.gated_linear: approximate must be None (SiLU, swiglu's), 'none' or 'tanh' "
                         f"(GELU, geglu's), got {approximate!r}")
    _validate_shapes("gated_linear", gate, up)
    h_dtype = torch.promote_types(gate.dtype, up.dtype)
    if weight.dim() != 2 or weight.shape[1] != gate.shape[-1] or weight.dtype != h_dtype:
        raise ValueError(
            f"tritongrad.gated_linear: weight must be [out_features, {gate.shape[-1]}] in the gated product's dtype "
            f"{h_dtype} (F.linear's rule), for gate {tuple(gate.shape)} {gate.dtype} and up {up.dtype}; got weight "
            f"{tuple(weight.shape)} {weight.dtype}")


def _no_autocast(device_type: str):
    """Autocast off for the products where it is on; else nothing (what patch's traced calls see)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) \
        else contextlib.nullcontext()


@op("tritongrad::gated_linear", reference=gated_linear_reference, validate=_validate_gated_linear,
    save=("gate", "up", "weight"))
def gated_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, *, approximate: str | None = None,
                 inplace_backward: bool = False) -> torch.Tensor:
    """An MLP's gated product and its down projection, ``F.linear(act(gate) * up, weight)``, act SiLU
    (``approximate`` None: swiglu's) or GELU (``"none"``, ``"tanh"``: geglu's), keeping for the backward
    gate, up and weight but not the product, which the backward makes again (module docstring).

    Args:
        gate, up: ``[..., D]`` as swiglu's (any strides; the halves of one projection are read in place).
        weight: ``[out_features, D]`` in ``torch.promote_types(gate.dtype, up.dtype)``, as ``F.linear`` takes it
            (no bias).
        approximate: None for SiLU, ``"none"`` or ``"tanh"`` for GELU.
        inplace_backward: as swiglu's: gate and up may take their own gradients where nothing reads them again.

    Returns:
        ``[..., out_features]``, what ``F.linear(swiglu(gate, up), weight)`` returns, rounding for rounding.
        Autocast does not apply: the inputs' dtypes are used as given.
    """
    h = _forward(gate, up, activation(approximate), inplace_backward)
    with _no_autocast(gate.device.type):  # the dtypes as given, forward and backward alike
        return torch.nn.functional.linear(h, weight)


@gated_linear.backward
def _gated_linear_backward(ctx, grad_out: torch.Tensor):
    gate, up, weight = ctx.gate, ctx.up, ctx.weight
    need_g, need_u, need_w = ctx.needs_input_grad[:3]
    act = activation(ctx.approximate)
    d2 = grad_out.reshape(-1, grad_out.shape[-1])
    dw = h2 = dh = dg = du = None
    with _no_autocast(grad_out.device.type):  # a backward run inside an autocast region
        if need_w:
            h2 = _forward(gate, up, act, False).view(-1, gate.shape[-1])  # made again, not kept
            dw = torch.mm(d2.t(), h2)
        if need_g or need_u:
            # Eager, dh takes h's buffer, whose last reader was dW's product.
            dh = torch.mm(d2, weight, out=h2) if h2 is not None and ctx.eager else torch.mm(d2, weight)
    if dh is not None:
        dg, du = _backward(ctx, dh.view(gate.shape), act)
    return dg, du, dw

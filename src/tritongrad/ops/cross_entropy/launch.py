"""The cross-entropy family's launchers, op declarations and public functions: cross_entropy and
linear_cross_entropy. Design, floors and predictions: docs/cross-entropy.md.

Bytes each call must move (logits [N, C] of s bytes an element; the floor of fwd+bwd is one read of the
logits and one write of their gradient):
  cross_entropy, mean/sum with a gradient:  forward  read x + write dx (the gradient for an upstream 1)
                                            backward nothing when the upstream gradient is 1 (one tiny launch);
                                                     read dx + write dx otherwise
                                            = 2 N C s, the floor (pass 2 re-reads each row, from L2
                                              where it is still there)
  cross_entropy, reduction="none", or the lse's gradient asked for:
                                            forward read x; backward read x + write dx = 3 N C s
  no gradient:                              read x = N C s
  linear_cross_entropy: three matrix products (logits, grad_input, grad_weight: 6 N H V flops) in chunks of
  rows, the chunk's logits read and written once more by the loss kernel (in place); no [N, V] tensor.
"""

from __future__ import annotations

import enum
import math
import numbers
from typing import Optional

import torch

from ... import _runtime as rt
from ..._pattern import kernel, op
from . import kernels
from . import plans as P
from .reference import REDUCTIONS, check_targets, cross_entropy_reference, linear_cross_entropy_reference

_fwd_kernel = kernel(kernels._cross_entropy_fwd_kernel)
_stats_kernel = kernel(kernels._cross_entropy_stats_kernel)
_sum_kernel = kernel(kernels._cross_entropy_sum_kernel)
_bwd_kernel = kernel(kernels._cross_entropy_bwd_kernel)
_scale_kernel = kernel(kernels._scale_kernel)


# ---------------------------------------------------------------- shared pieces
def _check_options(name: str, ignore_index, reduction, label_smoothing, logit_softcap, z_loss, logit_scale) -> None:
    if type(reduction) is not str or reduction not in REDUCTIONS:
        raise ValueError(f"tritongrad.{name}: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"tritongrad.{name}: ignore_index must be an int, got {ignore_index!r}")
    if not isinstance(label_smoothing, numbers.Real) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"tritongrad.{name}: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if logit_softcap is not None and (not isinstance(logit_softcap, numbers.Real) or not logit_softcap > 0):
        raise ValueError(f"tritongrad.{name}: logit_softcap must be None or a float > 0, got {logit_softcap!r}")
    if not isinstance(z_loss, numbers.Real) or not z_loss >= 0:
        raise ValueError(f"tritongrad.{name}: z_loss must be a float >= 0, got {z_loss!r}")
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) a float may be symbolic
    if (isinstance(logit_scale, bool) or not isinstance(logit_scale, numbers.Real)
            or not -math.inf < logit_scale < math.inf or logit_scale == 0):
        raise ValueError(f"tritongrad.{name}: logit_scale must be a finite, nonzero float, got {logit_scale!r}")


def _as_float(v):
    """A real number as a Python float (the registered ops' schema); anything else as is, for validate to refuse."""
    return float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else v


# Whether the host reads CPU targets to raise on an out-of-range index; tests turn it off (``with
# host_checks.using(False):``) to run the GPU's way on CPU: the kernels poison the loss with NaN instead.
host_checks = rt.Scoped("cross-entropy's host checks of CPU targets", True)


def _host_checkable(t: torch.Tensor) -> bool:
    """Targets whose values the host can read without a device sync (CPU tensors outside tracing): there an
    out-of-range index raises. On a GPU the kernels poison the loss with NaN instead (kernels.py)."""
    return (host_checks.value and t.device.type == "cpu" and not torch.compiler.is_compiling()
            and not rt.is_fake(t))


class Buffers(enum.Enum):
    """How a backward may use the gradient buffers its forward saved (``_take_buffer``)."""

    TAKE = "take"  # scale them in place and hand them over: they become the caller's gradients
    READ = "read"  # read them, return fresh tensors, leave them as they are
    GONE = "gone"  # handed over already (or never written): recompute, do not read them

    def __bool__(self) -> bool:  # ``bool(b)``: whether the backward may write into the buffers
        return self is Buffers.TAKE


def _take_buffer(ctx) -> Buffers:
    """How the backward may use the gradient buffers its forward saved. TAKE: it runs in the op's own eager
    autograd node, in a backward that frees the graph (no ``retain_graph``, no ``create_graph``), so no later
    backward can read the buffers: it may scale them in place and hand them over. READ: it must return fresh
    tensors and leave the buffers as they are, which it may read: the graph is retained (a later backward
    reads them again, and the caller may mutate what it gets), or this is the registered backward op
    (torch.compile, torch.export, opcheck). GONE: the buffers were handed over already and must not be read
    (not reachable through PyTorch's engine, which refuses a backward through a freed graph; kept as a
    guard). The pattern does not say which path called: the running autograd node and its graph task tell
    (docs/cross-entropy.md, 'who owns the gradient buffer')."""
    node = torch._C._current_autograd_node()
    if node is None or type(node) is not ctx.op._function._backward_cls:
        return Buffers.READ
    if getattr(node, "_tritongrad_buffers_taken", False):
        return Buffers.GONE
    if torch._C._autograd._get_current_graph_task_keep_graph():
        return Buffers.READ
    node._tritongrad_buffers_taken = True
    return Buffers.TAKE


# The main kernel's upstream gradient of the loss (its DLOSS constexpr): none (the forward's gradient, for an
# upstream 1), one scalar (reduction mean/sum), or one per row (reduction="none").
DLOSS_ONE, DLOSS_SCALAR, DLOSS_ROWS = 0, 1, 2


def _split(name: str, v: float) -> dict:
    """A float argument as the kernels take it: ``<name>_hi`` (float32) and ``<name>_lo`` (rt.split_float)."""
    hi, lo = rt.split_float(float(v))
    return {f"{name}_hi": hi, f"{name}_lo": lo}


def _splits(label_smoothing: float, z_loss: float, logit_softcap: float | None, logit_scale: float) -> dict:
    return {**_split("eps", label_smoothing), **_split("z", z_loss),
            **_split("cap", logit_softcap if logit_softcap is not None else 1.0), **_split("scale", logit_scale)}


def _stats(target: torch.Tensor, weight: torch.Tensor | None, C: int, ignore_index: int, acc: torch.dtype):
    """[D, W] on the device (kernels.py): the mean's denominator and the class weights' sum."""
    stats = torch.empty(2, dtype=acc, device=target.device)
    t = P.table()
    _stats_kernel[(1,)](
        target, weight_ptr=weight, stats_ptr=stats, N=target.shape[0], C=C, stride_t=target.stride(0),
        stride_w=weight.stride(0) if weight is not None else 0, ignore_index=ignore_index, BLOCK=t.STATS_BLOCK,
        HAS_WEIGHT=weight is not None, ACC=rt.tl_acc_dtype(acc), num_warps=t.STATS_WARPS,
    )
    return stats


def _rows_launch(x, target, weight, stats, loss, lse, parts, grad, dloss, dlse, ignore_index, splits, *, mean: bool,
                 store_lse: bool, lse_all: bool, lse_known: bool, dloss_mode: int, softcap: bool, scaled: bool,
                 smoothing: bool, acc) -> rt.Bound:
    """The main kernel's launch over the rows of ``x`` [N, C] (unit column stride), bound to everything but its
    ten tensors (x, target, weight, stats, loss, lse, parts, grad, dloss, dlse, in that order; None where
    absent): the linear loss's chunks, equal in shape and strides, launch it once each without rebuilding its
    arguments. ``splits``: the float arguments (``_splits``)."""
    N, C = x.shape
    stride_g = grad.stride(0) if grad is not None else 0
    align = rt.align(int(x.stride(0)), stride_g)
    narrow = int(weight is not None and smoothing) + int(align * x.element_size() < 16) + int(softcap)
    plan = P.row_plan(rt.hint(N), int(C), x.element_size(), rt.device_props(x.device), narrow, P.table())
    return _fwd_kernel.bind(
        (plan.programs,), x, target_ptr=target, weight_ptr=weight, stats_ptr=stats, loss_ptr=loss, lse_ptr=lse,
        parts_ptr=parts, grad_ptr=grad, dloss_ptr=dloss, dlse_ptr=dlse, N=N, C=C, stride_x_row=x.stride(0),
        stride_g_row=stride_g, stride_t=target.stride(0), stride_w=weight.stride(0) if weight is not None else 0,
        stride_dloss=dloss.stride(0) if dloss is not None and dloss.dim() == 1 else 0,
        stride_dlse=dlse.stride(0) if dlse is not None else 0, ignore_index=ignore_index, **splits,
        BLOCK_C=plan.BLOCK_C, STAGES=plan.stages, HAS_WEIGHT=weight is not None, HAS_SCALE=scaled, HAS_SOFTCAP=softcap,
        HAS_SMOOTHING=smoothing, MEAN=mean, STORE_LOSS=loss is not None, STORE_LSE=store_lse, LSE_ALL=lse_all,
        STORE_GRAD=grad is not None, LSE_KNOWN=lse_known, DLOSS=dloss_mode, HAS_DLSE=dlse is not None,
        ACC=rt.tl_acc_dtype(acc), ALIGN=align, num_warps=plan.num_warps,
    )


def _rows_kernel(x, target, weight, stats, loss, lse, parts, grad, dloss, dlse, ignore_index, splits, **flags):
    """One launch of the main kernel over the rows of ``x`` (``_rows_launch``'s arguments)."""
    _rows_launch(x, target, weight, stats, loss, lse, parts, grad, dloss, dlse, ignore_index, splits, **flags)(
        x, target, weight, stats, loss, lse, parts, grad, dloss, dlse)


def _finish(rows: torch.Tensor, stats, out: torch.Tensor, mean: bool) -> torch.Tensor:
    """``out`` (0-d) = the fixed-order sum of the per-row losses (over D for the mean)."""
    t = P.table()
    _sum_kernel[(1,)](rows, stats_ptr=stats, out_ptr=out, N=rows.shape[0], BLOCK=t.STATS_BLOCK, MEAN=mean,
                      ACC=rt.tl_acc_dtype(rows.dtype), num_warps=t.STATS_WARPS)
    return out


def _scale(src: torch.Tensor, s: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``s * src`` (s a 0-d tensor): in place (skipped on the device when s == 1), or into a fresh tensor."""
    dst = src if in_place else torch.empty_like(src)
    n = src.numel()
    if n:
        t = P.table()
        _scale_kernel[(P.scale_programs(n, rt.device_props(src.device), t),)](
            src, dst_ptr=dst, s_ptr=s, numel=n, BLOCK=t.SCALE_BLOCK, IN_PLACE=in_place,
            ACC=rt.tl_acc_dtype(rt.acc_of(src, s)), num_warps=t.SCALE_WARPS)
    return dst


# ---------------------------------------------------------------- cross_entropy
def _ce_validate(input, target, weight, ignore_index, reduction, label_smoothing, logit_softcap, z_loss,
                 compute_grad, return_lse, logit_scale) -> None:
    _check_options("cross_entropy", ignore_index, reduction, label_smoothing, logit_softcap, z_loss, logit_scale)
    if input.dim() != 2:
        raise ValueError(f"tritongrad.cross_entropy: the registered op takes input [N, C], got shape "
                         f"{tuple(input.shape)}; tritongrad.cross_entropy takes [C] and [N, C, d1, ...] too")
    N, C = input.shape
    if target.dim() != 1 or target.shape[0] != N:
        raise ValueError(f"tritongrad.cross_entropy: target of shape {tuple(target.shape)} does not match input "
                         f"{tuple(input.shape)}: expected [{N}] (one class index per row)")
    if C == 0 and N > 0:
        raise ValueError(f"tritongrad.cross_entropy: input {tuple(input.shape)} has no classes")
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != C):
        raise ValueError(f"tritongrad.cross_entropy: weight of shape {tuple(weight.shape)} must hold one weight per "
                         f"class: [{C}] for input {tuple(input.shape)}")
    if _host_checkable(target):
        check_targets(target, C, ignore_index)


@op("tritongrad::cross_entropy", reference=cross_entropy_reference, validate=_ce_validate, index=("target",),
    nondiff=("weight",), outputs=("loss", "lse"), residuals=("grad", "parts"),
    save=("input", "target", "weight", "parts", "grad"))
def cross_entropy_op(input: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None,
                     ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                     logit_softcap: Optional[float] = None, z_loss: float = 0.0, compute_grad: bool = True,
                     return_lse: bool = True, logit_scale: float = 1.0,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered cross_entropy over ``input [N, C]``: ``(loss, lse, grad, parts)``; :func:`cross_entropy` is
    the public function. With ``compute_grad`` and reduction mean/sum the forward also writes ``grad``, the
    gradient for an upstream gradient of 1, except for float16 logits (else ``grad`` is empty and the backward
    computes it, with the upstream gradient). ``parts``
    [2, N]: each row's max and the log of its shifted sum (lse = their sum), which the backward's softmax
    needs apart. Without ``return_lse``, ignored rows are not read: their lse is 0, without gradient."""
    N, C = input.shape
    acc = rt.acc_of(input, weight)
    x = input if input.stride(1) == 1 else input.contiguous()  # the kernels take rows of unit column stride
    # float16: the backward makes the gradient, where the upstream gradient (AMP's loss scale) multiplies it
    # before its one float16 rounding, as F's does; made here for 1 and scaled later, it would underflow.
    mean, fused = reduction == "mean", compute_grad and reduction != "none" and input.dtype != torch.float16
    loss = torch.empty((N,) if reduction == "none" else (), dtype=input.dtype, device=input.device)
    lse = torch.empty(N, dtype=acc, device=input.device)
    grad = torch.empty((N, C) if fused else (0,), dtype=input.dtype, device=input.device)
    parts = torch.empty((2, N), dtype=acc, device=input.device)
    if N == 0:  # F: the mean of nothing is NaN, the sum 0
        return loss.fill_(float("nan") if mean else 0.0), lse, grad, parts
    smoothing = label_smoothing > 0
    stats = _stats(target, weight, C, ignore_index, acc) if mean or (weight is not None and smoothing) else None
    rows = loss if reduction == "none" else torch.empty(N, dtype=acc, device=input.device)
    _rows_kernel(x, target, weight, stats, rows, lse, parts, grad if fused else None, None, None, ignore_index,
                 _splits(label_smoothing, z_loss, logit_softcap, logit_scale), mean=mean and fused, store_lse=True,
                 lse_all=return_lse, lse_known=False, dloss_mode=DLOSS_ONE, softcap=logit_softcap is not None,
                 scaled=logit_scale != 1.0, smoothing=smoothing, acc=acc)
    if reduction != "none":
        _finish(rows, stats, loss, mean)
    return loss, lse, grad, parts


@cross_entropy_op.backward
def _cross_entropy_backward(ctx, grad_loss: torch.Tensor, grad_lse: torch.Tensor):
    input, grad, parts = ctx.input, ctx.grad, ctx.parts
    N, C = input.shape
    if N == 0 or C == 0:
        return torch.zeros_like(input), None, None
    x = input if input.stride(1) == 1 else input.contiguous()
    acc = parts.dtype
    softcap = ctx.logit_softcap is not None
    buffers = _take_buffer(ctx) if grad.numel() else Buffers.GONE
    if buffers is not Buffers.GONE:  # the forward wrote the gradient for an upstream 1: scale it, add the lse's term
        dx = grad if buffers is Buffers.TAKE else torch.empty_like(grad)
        t = P.table()
        rows = P.bwd_rows(rt.hint(N), rt.device_props(x.device), t)
        _bwd_kernel[(rt.cdiv(N, rows),)](
            grad, dx_ptr=dx, x_ptr=x, parts_ptr=parts, dloss_ptr=grad_loss, dlse_ptr=grad_lse, target_ptr=ctx.target,
            N=N, C=C, stride_x_row=x.stride(0), stride_g_row=grad.stride(0), stride_dlse=grad_lse.stride(0),
            stride_t=ctx.target.stride(0), ignore_index=ctx.ignore_index,
            **_split("cap", ctx.logit_softcap if softcap else 1.0), **_split("scale", ctx.logit_scale),
            ROWS=rows, BLOCK_C=t.BWD_BLOCK_C[x.element_size()], IN_PLACE=buffers is Buffers.TAKE,
            LSE_ALL=ctx.return_lse, HAS_SCALE=ctx.logit_scale != 1.0, HAS_SOFTCAP=softcap, ACC=rt.tl_acc_dtype(acc),
            ALIGN=rt.align(int(x.stride(0)), int(grad.stride(0))), num_warps=t.BWD_WARPS,
        )
        return dx, None, None
    # The gradient from the logits and the saved row maxima and sums (reduction="none", compute_grad off):
    # one read of the logits, one write.
    weight, target, reduction = ctx.weight, ctx.target, ctx.reduction
    mean, smoothing = reduction == "mean", ctx.label_smoothing > 0
    stats = _stats(target, weight, C, ctx.ignore_index, acc) if mean or (weight is not None and smoothing) else None
    dx = torch.empty((N, C), dtype=input.dtype, device=input.device)
    _rows_kernel(x, target, weight, stats, None, None, parts, dx, grad_loss, grad_lse, ctx.ignore_index,
                 _splits(ctx.label_smoothing, ctx.z_loss, ctx.logit_softcap, ctx.logit_scale), mean=mean,
                 store_lse=False, lse_all=ctx.return_lse, lse_known=True,
                 dloss_mode=DLOSS_ROWS if reduction == "none" else DLOSS_SCALAR, softcap=softcap, scaled=ctx.logit_scale != 1.0, smoothing=smoothing, acc=acc)
    return dx, None, None


def cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    logit_softcap: float | None = None,
    z_loss: float = 0.0,
    return_lse: bool = False,
    logit_scale: float = 1.0,
):
    """``torch.nn.functional.cross_entropy`` for class-index targets, with Triton kernels for forward and
    backward; optionally with Gemma 2's logit soft cap and PaLM's z-loss.

    Args:
        input: logits ``[N, C]``, ``[C]``, or ``[N, C, d1, ...]`` (F's layout: moved to ``[N * d1 * ..., C]``, a
            copy); float16/bfloat16/float32/float64. Rows may be strided (a slice of a padded vocabulary);
            the column stride must be 1 or the rows are copied.
        target: class indices ``[N]`` (``[]``, ``[N, d1, ...]``), int64 or int32, in ``[0, C)`` or
            ``ignore_index``. An index out of range raises IndexError on the CPU; on a GPU it is not read
            and makes its row's loss and gradient NaN (so the reduced loss is NaN), and a device-side assert
            fires with ``TRITON_DEBUG=1``.
        weight: optional class weights ``[C]`` (any floating dtype, no gradient), as in F: each row's loss is
            scaled by its target's weight, the smoothing term by each class's weight, and the mean divides by
            the sum of the non-ignored targets' weights.
        ignore_index: rows with this target add nothing (and count nothing in the mean).
        reduction: ``"mean"`` (the default), ``"sum"`` or ``"none"`` (one loss per row, in input's shape less C).
        label_smoothing: in ``[0, 1]``, as in F.
        logit_softcap: if given, ``cap * tanh(input / cap)`` replaces the logits before the softmax (Gemma 2).
        logit_scale: a finite, nonzero float k: the logits are ``k * input``, scaled before the soft cap
            (``cap * tanh(k * input / cap)``) and the loss; the gradient of input carries k. Default 1.0.
        z_loss: each non-ignored row's loss gains ``z_loss * lse**2`` (PaLM), lse the row's log-sum-exp; the
            reduction applies to the total (so "mean" divides it by F's denominator too).
        return_lse: also return lse, float32 (float64 for float64 input) of shape ``[N]``, differentiable.

    Returns:
        The loss in input's dtype, accumulated in float32 (float64 for float64) and rounded once, as F returns
        it; with ``return_lse``, ``(loss, lse)``. The gradient of input comes back in its dtype and is bitwise
        reproducible. For reduction mean/sum the forward computes it (one read of the logits, one write of the
        gradient) and ``loss.backward()`` only scales it by the upstream gradient, on the device, skipping
        even that when it is 1. The logits are never written. The caller owns every gradient it receives: the
        forward's buffer is handed over only by a backward that frees the graph; with ``retain_graph=True``
        each backward returns a fresh copy scaled the same way, so every backward through one graph gives the
        same bits. Large common offsets of the logits cost no precision (the row's max is taken out first).
        Under CUDA autocast the loss is float32, as F's; the logits are read in their own dtype (not copied).
    """
    if not isinstance(input, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"tritongrad.cross_entropy: input and target must be Tensors, got "
                        f"{type(input).__name__} and {type(target).__name__}")
    if target.is_floating_point():
        raise TypeError(f"tritongrad.cross_entropy: target must hold class indices (int64 or int32), got "
                        f"{target.dtype} of shape {tuple(target.shape)}; class-probability targets are not supported")
    shape = tuple(input.shape)
    if input.dim() == 0:
        raise ValueError("tritongrad.cross_entropy: input must be [C], [N, C] or [N, C, d1, ...], got a 0-d tensor")
    if input.dim() == 1:
        if target.dim() != 0:
            raise ValueError(f"tritongrad.cross_entropy: input of shape {shape} (one row of classes) takes a 0-d "
                             f"target, got shape {tuple(target.shape)}")
        x, t = input.unsqueeze(0), target.reshape(1)
    elif input.dim() == 2:
        x, t = input, target
    else:
        want = (shape[0], *shape[2:])
        if tuple(target.shape) != want:
            raise ValueError(f"tritongrad.cross_entropy: input of shape {shape} ([N, C, d1, ...]) takes target "
                             f"{want}, got {tuple(target.shape)}")
        x, t = input.movedim(1, -1).reshape(-1, shape[1]), target.reshape(-1)
    compute_grad = reduction != "none" and torch.is_grad_enabled() and input.requires_grad
    loss, lse = cross_entropy_op(x, t, weight, ignore_index, reduction, label_smoothing, logit_softcap, z_loss,
                                 compute_grad, return_lse, _as_float(logit_scale))
    if input.is_cuda and torch.is_autocast_enabled():
        loss = loss.float()  # autocast runs F.cross_entropy in float32 (here: the logits stay as they are)
    if reduction == "none" and input.dim() != 2:
        loss = loss.reshape(target.shape)
    if not return_lse:
        return loss
    if input.dim() == 1:
        lse = lse.reshape(())
    elif input.dim() > 2:
        lse = lse.reshape(target.shape)
    return loss, lse


# ---------------------------------------------------------------- linear_cross_entropy
def _lce_validate(input, weight, target, bias, ignore_index, reduction, label_smoothing, logit_softcap, z_loss,
                  grads, out_dtype, logit_scale, grad_weight_f32=False) -> None:
    if type(grad_weight_f32) is not bool:
        raise TypeError(f"tritongrad.linear_cross_entropy: grad_weight_f32 must be a bool, got {grad_weight_f32!r}")
    _check_options("linear_cross_entropy", ignore_index, reduction, label_smoothing, logit_softcap, z_loss,
                   logit_scale)
    if out_dtype is not None and out_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"tritongrad.linear_cross_entropy: out_dtype must be a floating dtype or None, got {out_dtype}")
    if input.dim() != 2 or weight.dim() != 2 or input.shape[1] != weight.shape[1]:
        raise ValueError(f"tritongrad.linear_cross_entropy: input [N, H] and weight [V, H] must share H, got "
                         f"{tuple(input.shape)} and {tuple(weight.shape)}")
    N, V = input.shape[0], weight.shape[0]
    if target.dim() != 1 or target.shape[0] != N:
        raise ValueError(f"tritongrad.linear_cross_entropy: target of shape {tuple(target.shape)} does not match "
                         f"input {tuple(input.shape)}: expected [{N}]")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != V):
        raise ValueError(f"tritongrad.linear_cross_entropy: bias of shape {tuple(bias.shape)} must be [{V}] for "
                         f"weight {tuple(weight.shape)}")
    if V == 0 and N > 0:
        raise ValueError(f"tritongrad.linear_cross_entropy: weight {tuple(weight.shape)} has no classes")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != input.dtype:
            raise TypeError(f"tritongrad.linear_cross_entropy: {name} is {t.dtype}, input is {input.dtype}; "
                            "F.linear takes one dtype (cast them, or use torch.autocast)")
    if grads is not None and len(grads) != 3:
        raise ValueError(f"tritongrad.linear_cross_entropy: grads must be 3 bools (input, weight, bias), got {grads}")
    if _host_checkable(target):
        check_targets(target, V, ignore_index, "linear_cross_entropy")


def _addmm_f32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into a float32 ``acc`` without rounding the product to a's 16-bit dtype first."""
    if acc.is_cuda and _MM_OUT_DTYPE and a.dtype != acc.dtype:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


_MM_OUT_DTYPE = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


def _lce_pass(input, weight, target, bias, ignore_index, reduction, label_smoothing, logit_softcap, z_loss,
              logit_scale, rows, need: tuple[bool, bool, bool], dloss=None, f32: bool = False):
    """Chunks of rows: logits (one product; the loss kernel applies ``logit_scale``), the loss kernel writing the
    chunk's gradient (with respect to the product, so the scale's factor included) over its logits,
    then that chunk's share of the gradients asked for (``need``: input, weight, bias). ``rows``: the per-row
    loss buffer, or None. ``dloss``: the upstream gradient (None: 1, the forward's case). ``f32``: a 16-bit
    weight's gradient accumulates over the chunks in float32 and rounds once. Returns the gradients (None
    where not asked).

    Per chunk the host issues four launches and nothing else: the views come from one ``split`` each, and the
    loss kernel's launch is bound once per chunk shape (docs/cross-entropy.md, chunk size)."""
    N, H = input.shape
    V = weight.shape[0]
    acc = rt.acc_of(input)
    mean, smoothing = reduction == "mean", label_smoothing > 0
    want_grad = any(need)
    stats = _stats(target, None, V, ignore_index, acc) if mean and want_grad else None
    gi = torch.empty_like(input) if need[0] else None
    f32 = f32 and weight.element_size() == 2
    gw = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if f32 else torch.empty_like(weight)
          ) if need[1] else None
    gb = torch.zeros(V, dtype=rt.acc_of(bias), device=input.device) if need[2] else None  # float sums, one rounding
    chunk = P.lce_chunk_rows(rt.hint(N), int(V), int(input.shape[1]), input.element_size(), P.table())
    buf = torch.empty((min(chunk, N), V), dtype=input.dtype, device=input.device)
    splits = _splits(label_smoothing, z_loss, logit_softcap, logit_scale)
    dloss_mode = DLOSS_ONE if dloss is None else DLOSS_ROWS if dloss.dim() == 1 else DLOSS_SCALAR
    wt = weight.t()
    flags = dict(mean=mean and want_grad, store_lse=False, lse_all=False, lse_known=False, dloss_mode=dloss_mode,
                 softcap=logit_softcap is not None, scaled=logit_scale != 1.0, smoothing=smoothing, acc=acc)
    hs, ts = input.split(chunk), target.split(chunk)
    n = len(hs) if N else 0  # split gives one empty piece of no rows
    ls = rows.split(chunk) if rows is not None else (None,) * n
    ds = dloss.split(chunk) if dloss_mode == DLOSS_ROWS else (dloss,) * n
    gis = gi.split(chunk) if gi is not None else (None,) * n
    launches, views = {}, {}  # by chunk rows: the bound loss kernel; the logits and their transpose
    for i in range(n):
        h = hs[i]
        m = h.shape[0]
        if m not in views:
            logits = buf if m == buf.shape[0] else buf[:m]
            views[m] = logits, logits.t()
            launches[m] = _rows_launch(logits, ts[i], None, stats, ls[i], None, None, logits if want_grad else None,
                                       ds[i], None, ignore_index, splits, **flags)
        logits, logits_t = views[m]
        if bias is None:
            torch.mm(h, wt, out=logits)
        else:
            torch.addmm(bias, h, wt, out=logits)
        launches[m](logits, ts[i], None, stats, ls[i], None, None, logits if want_grad else None, ds[i], None)
        if gis[i] is not None:
            torch.mm(logits, weight, out=gis[i])
        if gw is not None:
            # Chunks add into grad_weight in order: each product accumulates in float32 and rounds once to
            # weight's dtype, or, with f32, into a float32 buffer the size of the weight (docs/cross-entropy.md).
            if f32:
                _addmm_f32(gw, logits_t, h)
            elif i == 0:
                torch.mm(logits_t, h, out=gw)
            else:
                gw.addmm_(logits_t, h)
        if gb is not None:
            gb += logits.sum(0, dtype=gb.dtype)
    return gi, (gw.to(weight.dtype) if f32 and need[1] else gw), (gb.to(bias.dtype) if need[2] else None)


def _forward_grads(grads, reduction: str, input: torch.Tensor) -> bool:
    """Whether the linear op's forward makes the gradients asked for in ``grads``: not for reduction="none"
    (per-row upstream gradients), nor for float16 products, whose backward makes them with the upstream
    gradient (AMP's loss scale) before their float16 rounding (four products)."""
    return grads is not None and reduction != "none" and input.dtype != torch.float16


def _lce_unsaved(input, weight, target, bias, ignore_index, reduction, label_smoothing, logit_softcap, z_loss,
                 grads, out_dtype, logit_scale, grad_weight_f32) -> tuple:
    """The hidden states are read again only to recompute; not when the forward computes the gradient of
    every input that requires one (their buffers serve every backward): autograd then does not keep them."""
    if not _forward_grads(grads, reduction, input) or input.shape[0] == 0:
        return ()
    wants = (input.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    return ("input",) if all(g or not w for g, w in zip(grads, wants)) else ()


# Opaque under torch.compile: traced, the chunk loop's slice writes become chains of copies (docs/cross-entropy.md).
@op("tritongrad::linear_cross_entropy", reference=linear_cross_entropy_reference, validate=_lce_validate,
    index=("target",), outputs=("loss",), residuals=("grad_input", "grad_weight", "grad_bias"),
    save=("input", "weight", "target", "bias", "grad_input", "grad_weight", "grad_bias"), unsaved=_lce_unsaved,
    opaque=True, scaled_grads={"input": "grad_input", "weight": "grad_weight", "bias": "grad_bias"})
def linear_cross_entropy_op(input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                            bias: Optional[torch.Tensor] = None, ignore_index: int = -100, reduction: str = "mean",
                            label_smoothing: float = 0.0, logit_softcap: Optional[float] = None, z_loss: float = 0.0,
                            grads: Optional[list[bool]] = None, out_dtype: Optional[torch.dtype] = None,
                            logit_scale: float = 1.0, grad_weight_f32: bool = False,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered linear_cross_entropy over ``input [N, H]``, ``weight [V, H]``: ``(loss, grad_input,
    grad_weight, grad_bias)``; :func:`linear_cross_entropy` is the public function. ``grads`` (input, weight,
    bias): the gradients the forward computes for an upstream gradient of 1 (reduction mean/sum); the others
    are empty, and the backward computes what is asked for and missing. ``out_dtype``: the loss's (None:
    input's)."""
    N = input.shape[0]

    def empty():  # a fresh one per residual: a registered op's returns may not alias each other
        return torch.empty(0, dtype=input.dtype, device=input.device)

    loss = torch.empty((N,) if reduction == "none" else (), dtype=out_dtype or input.dtype, device=input.device)
    need = tuple(bool(g) for g in grads) if _forward_grads(grads, reduction, input) else (False,) * 3
    need = (need[0], need[1], need[2] and bias is not None)
    if N == 0:
        zero = [torch.zeros_like(t) if n else empty() for t, n in ((input, need[0]), (weight, need[1]), (bias, need[2]))]
        return (loss.fill_(float("nan") if reduction == "mean" else 0.0), *zero)
    mean = reduction == "mean"
    acc = rt.acc_of(input)
    rows = loss if reduction == "none" else torch.empty(N, dtype=acc, device=input.device)
    gi, gw, gb = _lce_pass(input, weight, target, bias, ignore_index, reduction, label_smoothing, logit_softcap,
                           z_loss, logit_scale, rows, need, f32=grad_weight_f32)
    if reduction != "none":
        stats = _stats(target, None, weight.shape[0], ignore_index, acc) if mean else None
        _finish(rows, stats, loss, mean)
    return loss, *(g if g is not None else empty() for g in (gi, gw, gb))


@linear_cross_entropy_op.backward
def _linear_cross_entropy_backward(ctx, grad_loss: torch.Tensor):
    need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
    need = (need_x, need_w, need_b and ctx.bias is not None)
    have = (ctx.grad_input.numel() > 0 or ctx.input is not None and ctx.input.numel() == 0,
            ctx.grad_weight.numel() > 0 or ctx.weight.numel() == 0,
            ctx.grad_bias.numel() > 0 or (ctx.bias is not None and ctx.bias.numel() == 0))
    usable = ctx.reduction != "none" and all(h or not n for n, h in zip(need, have))
    buffers = _take_buffer(ctx) if usable else Buffers.GONE
    if buffers is not Buffers.GONE:
        # The forward computed them for an upstream gradient of 1: scale (on the device; nothing when it is 1).
        out = [_scale(g, grad_loss, buffers is Buffers.TAKE) if n else None
               for n, g in zip(need, (ctx.grad_input, ctx.grad_weight, ctx.grad_bias))]
        return out[0], out[1], None, out[2]
    # Not computed in the forward (reduction="none": per-row upstream gradients, or a gradient the forward was
    # not asked for): recompute, in chunks.
    if ctx.input is None:  # _lce_unsaved: the forward computed every gradient; unreachable through the engine
        raise RuntimeError("tritongrad.linear_cross_entropy: the backward needs the hidden states again, which the "
                           "forward did not keep (it computed every gradient then); run the forward again")
    gi, gw, gb = _lce_pass(ctx.input, ctx.weight, ctx.target, ctx.bias, ctx.ignore_index, ctx.reduction,
                           ctx.label_smoothing, ctx.logit_softcap, ctx.z_loss, ctx.logit_scale, None, need,
                           dloss=grad_loss, f32=ctx.grad_weight_f32)
    return gi, gw, None, gb


def linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    logit_softcap: float | None = None,
    z_loss: float = 0.0,
    out_dtype: torch.dtype | None = None,
    logit_scale: float = 1.0,
    grad_weight_f32: bool = False,
):
    """``cross_entropy(logit_scale * F.linear(input, weight, bias), target, ...)`` without the ``[N, V]`` logits
    in memory.

    Args:
        input: hidden states ``[..., H]``, float16/bfloat16/float32/float64.
        weight: the classifier (LM head) ``[V, H]``, input's dtype.
        target: class indices of input's leading shape (``[...]``), int64 or int32; see
            :func:`cross_entropy` for ``ignore_index`` and out-of-range indices.
        bias: optional ``[V]``, input's dtype.
        ignore_index, reduction, label_smoothing, logit_softcap, z_loss: as in :func:`cross_entropy`.
        logit_scale: a finite, nonzero float k: the logits are ``k * (input @ weight.T + bias)``, scaled before
            the soft cap and the loss (Granite's ``logits / logits_scaling`` is ``k = 1 / logits_scaling``;
            Cohere's ``logits * logit_scale``). The product is rounded as F.linear rounds it, then scaled in
            float32 (float64 for float64), not rounded again; the gradients of input, weight and bias carry k.
            Default 1.0.
        out_dtype: the loss's dtype; None (F's semantics) is input's. ``torch.float32`` returns the float32
            accumulation unrounded, as Hugging Face's causal-LM loss (which upcasts the logits) does.
        grad_weight_f32: a 16-bit weight's gradient accumulates over the chunks in a float32 buffer of the
            weight's shape and rounds once at the end, instead of once a chunk (more memory: 4 bytes a weight
            element during the loss).

    Returns:
        The loss in ``out_dtype`` (``[...]`` for reduction="none", else 0-d). The logits are made in chunks of
        rows (plans.py: at most 192 MiB at once) by the same products F.linear runs, so they round as F.linear
        rounds them; the loss accumulates in float32. For reduction mean/sum with gradients enabled, the
        forward also computes the gradients of input, weight and bias (those that require grad) chunk by chunk
        and the backward only scales them by the upstream gradient (nothing when it is 1): three matrix
        products in all. grad_weight adds one product per chunk in a fixed order (deterministic), each
        accumulated in float32 and rounded to weight's dtype; grad_bias accumulates in float32. For
        reduction="none", and for float16 products (whose gradient, made for an upstream gradient of 1 and
        scaled later, would underflow where AMP's loss scale is to prevent it), the backward recomputes the
        logits with the upstream gradient (four products in all). Under CUDA autocast, input,
        weight and bias are cast to the autocast dtype first and the loss is float32, as F.linear and
        F.cross_entropy behave there.
    """
    if not isinstance(input, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"tritongrad.linear_cross_entropy: input and target must be Tensors, got "
                        f"{type(input).__name__} and {type(target).__name__}")
    if target.is_floating_point():
        raise TypeError(f"tritongrad.linear_cross_entropy: target must hold class indices (int64 or int32), got "
                        f"{target.dtype} of shape {tuple(target.shape)}")
    if input.dim() == 0 or tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"tritongrad.linear_cross_entropy: target of shape {tuple(target.shape)} must be input's "
                         f"leading shape: input {tuple(input.shape)} ([..., H]) takes target {tuple(input.shape[:-1])}")
    autocast = input.is_cuda and torch.is_autocast_enabled()
    if autocast:  # as F.linear under autocast: the products in the autocast dtype
        dtype = torch.get_autocast_dtype("cuda")
        input, weight = input.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    x, t = input.reshape(-1, input.shape[-1]), target.reshape(-1)
    grads = None
    if reduction != "none" and torch.is_grad_enabled():
        grads = [input.requires_grad, isinstance(weight, torch.Tensor) and weight.requires_grad,
                 isinstance(bias, torch.Tensor) and bias.requires_grad]
    if autocast and out_dtype is None:
        out_dtype = torch.float32  # the loss in float32, as F.cross_entropy under autocast
    loss = linear_cross_entropy_op(x, weight, t, bias, ignore_index, reduction, label_smoothing, logit_softcap, z_loss,
                                   grads, out_dtype, _as_float(logit_scale), grad_weight_f32)
    return loss.reshape(target.shape) if reduction == "none" else loss

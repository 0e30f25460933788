"""The norm family's launchers and op declarations: rms_norm, llama_rms_norm, layer_norm.

Bytes each pass must move (the bandwidth floor), x: [N, D] with element sizes sx, sy, sdy, sdx, sw, sb:
  forward : read x + read w (+ b) + write y + write the row statistics
                                                     = N*D*(sx + sy) + D*(sw + sb) + 4*N (layer_norm: 8*N)
  backward: read x + read dy + read w + read the statistics + write dx + write dw (+ db)
                                                     = N*D*(sx + sdy + sdx) + D*(2*sw + sb) + 4*N (8*N)
            plus the float dw (and db) partial rows, written and read once: P*D*4 each, P <= 2 x SMs.
            (only the gradients asked for are written; dw or db alone still read x and dy)
Rows longer than one register tile read x (and dy) twice: plans.py. Design and measurements: docs/norms.md.
"""

from __future__ import annotations

import collections.abc
import math
import numbers
from typing import NamedTuple, Optional, Sequence

import torch

from ... import _runtime as rt
from ..._pattern import kernel, op
from ..column_sum import column_sum
from . import kernels
from . import plans as P
from .reference import default_eps, layer_norm_reference, llama_rms_norm_reference, rms_norm_reference

_fwd_kernel = kernel(kernels._norm_fwd_kernel)
_parts_kernel = kernel(kernels._norm_fwd_parts_kernel)
_rowsum_kernel = kernel(kernels._norm_bwd_rowsum_kernel)
_bwd_kernel = kernel(kernels._norm_bwd_kernel)
_long_kernel = kernel(kernels._norm_bwd_long_kernel)


# ---------------------------------------------------------------- arguments
def shape_list(normalized_shape, op: str = "rms_norm") -> list:
    """``normalized_shape`` as torch.nn.functional accepts it (an int, a list/tuple, a torch.Size), as a list.
    Exact type checks first: the ABC check behind isinstance(s, numbers.Integral) is slow on the hot path.
    Anything else that is not a sequence (None, a float) is a TypeError naming ``op``."""
    kind = type(normalized_shape)
    if kind is tuple or kind is list or kind is torch.Size:
        return list(normalized_shape)
    if kind is int or isinstance(normalized_shape, (numbers.Integral, torch.SymInt)) and kind is not bool:
        return [normalized_shape]
    if isinstance(normalized_shape, (str, bytes)) or not isinstance(normalized_shape, collections.abc.Iterable):
        raise TypeError(f"tritongrad.{op}: normalized_shape must be an int or a sequence of ints, got "
                        f"{normalized_shape!r}")
    return list(normalized_shape)


def _is_dim(s) -> bool:
    return type(s) is int or (isinstance(s, (numbers.Integral, torch.SymInt)) and not isinstance(s, bool))


def _check(op: str, x: torch.Tensor, normalized_shape, eps, eps_optional: bool = False, **params) -> None:
    """Shape checks of a norm over the trailing ``normalized_shape`` dims of x; ``params`` are the optional
    per-element tensors (weight, bias), each None or of shape ``normalized_shape``. ``eps`` a real number (not
    a bool), or None where ``eps_optional`` (rms_norm: PyTorch's default)."""
    if not isinstance(normalized_shape, (list, tuple, torch.Size)) or not all(map(_is_dim, normalized_shape)):
        raise TypeError(f"tritongrad.{op}: normalized_shape must be a list of ints, got {normalized_shape!r}")
    ns = tuple(normalized_shape)
    if len(ns) == 0:
        raise ValueError(f"tritongrad.{op}: normalized_shape must have at least one dim, got {ns}")
    if x.dim() < len(ns) or tuple(x.shape[x.dim() - len(ns):]) != ns:
        raise ValueError(
            f"tritongrad.{op}: input of shape {tuple(x.shape)} must end with normalized_shape {ns} "
            f"(its last {len(ns)} dims are normalised)"
        )
    for name, t in params.items():
        if t is not None and tuple(t.shape) != ns:
            raise ValueError(f"tritongrad.{op}: {name} has shape {tuple(t.shape)}, expected normalized_shape {ns}")
    if type(eps) is not float and (eps is not None or not eps_optional) and (
            eps is None or isinstance(eps, bool) or not isinstance(eps, numbers.Real)):
        raise TypeError(f"tritongrad.{op}: eps must be a float{' or None' if eps_optional else ''}, got {eps!r}")


def _native_fits(normalized_shape, eps) -> bool:
    """Whether PyTorch's own norm may serve these unchecked arguments: a non-empty list of ints (PyTorch
    checks the shapes against it), rows short enough for it (``rt.NATIVE_MAX_D``), a float or None eps.
    Anything else takes the checked path (``_pattern``'s ``native`` contract)."""
    if type(normalized_shape) is not list or not normalized_shape or not (eps is None or type(eps) is float):
        return False
    d = 1
    for s in normalized_shape:
        if type(s) is not int:
            return False
        d *= s
    return d <= rt.NATIVE_MAX_D


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    """A weight/bias of shape normalized_shape as [D]: a view (any stride) when possible, else a copy."""
    return t if t is None or t.dim() == 1 else t.reshape(-1)


def _stride(t) -> int:
    return t.stride(0) if t is not None else 0


# ---------------------------------------------------------------- launchers
def _dtype(t: torch.Tensor | None):
    return None if t is None else t.dtype


# Plain tensors' launches by shapes, strides, dtypes and flags: a call's Python goes to its key, its
# allocations and its launches (docs/host-path.md).
_LAUNCHES = rt.Memo()


class _Kept(NamedTuple):
    plan: object  # P.FwdPlan or P.BwdPlan
    bounds: tuple  # the launches, in order (rt.Bound)
    views: tuple  # per input (x, weight, bias; backward: x, dy, weight): rt.same_data (False when traced)


def _sig(t: torch.Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype)


def _forward(x, k: int, weight, bias, eps: float, layer_norm: bool, llama: bool, w_offset: float = 0.0):
    """Normalise x over its last ``k`` dims: ``(y, rstd)``, or ``(y, mean, rstd)`` for layer_norm. y and the
    statistics come in x's layout where x's leading dims are a transposed dense layout (rt.row_order).
    ``w_offset``: the weight is ``w_offset + weight``, added in the kernels (Gemma's 1 + w)."""
    order = None if x.is_contiguous() else rt.row_order(x, k)
    if order is not None:  # rows in memory order, read in place; outputs permuted back
        lead = x.dim() - k
        outs = _forward(x.permute(*order, *range(lead, x.dim())), k, weight, bias, eps, layer_norm, llama, w_offset)
        inv = rt.inverse(order)
        return (outs[0].permute(*inv, *range(lead, x.dim())), *[s.permute(*inv) for s in outs[1:]])
    key = None if type(x) not in rt.PLAIN_TENSORS else (
        "fwd", x.shape, x.stride(), x.dtype, k, _sig(weight), _sig(bias), eps, layer_norm, llama, w_offset, x.device,
        P.table(), rt.assumed_device())
    kept = _LAUNCHES.get(key) if key is not None else None
    if kept is None:
        x2, w, b = rt.as_rows(x, k), _flat(weight), _flat(bias)
        N, D = x2.shape
        r = P.forward(N=rt.hint(N), D=int(D), stride_row=int(x2.stride(0)), x_dtype=x.dtype, w_dtype=_dtype(weight),
                      b_dtype=_dtype(bias), layer_norm=layer_norm, llama=llama, props=rt.device_props(x.device),
                      t=P.table(), w_offset=w_offset)
    else:
        r = kept.plan
        x2 = x if kept.views[0] else rt.as_rows(x, k)
        w = weight if kept.views[1] else _flat(weight)
        b = bias if kept.views[2] else _flat(bias)
    y = torch.empty(x.shape, dtype=r.out_dtype, device=x.device)
    rstd = torch.empty(x.shape[: x.dim() - k], dtype=r.acc, device=x.device)
    mean = torch.empty_like(rstd) if layer_norm else None
    stats = (mean, rstd) if layer_norm else (rstd,)
    if x.numel() == 0:
        return (y, *[s.fill_(0.0) for s in stats])
    # Column-split rows: each split's statistics first (PHASE 1), then the merge and normalisation (PHASE 2).
    part = None if r.parts else rstd if r.splits == 1 else torch.empty((len(stats), r.splits, rstd.numel()),
                                                                        dtype=r.acc, device=x.device)
    tensors = (x2, w, b, y, mean, rstd) + (() if r.parts else (part,))
    if kept is None:
        kept = _Kept(r, _bind_forward(r, eps, *tensors), (False,) * 3 if key is None else
                     rt.same_data(((x2, x), (w, weight), (b, bias))))
        if key is not None:
            _LAUNCHES.put(key, kept)
    for bound in kept.bounds:
        bound(*tensors)
    return (y, *stats)


def _bind_forward(r: P.FwdPlan, eps: float, x2, w, b, y, mean, rstd, part=None) -> tuple:
    N, D = x2.shape
    D = int(D)
    eps_hi, eps_lo = rt.split_float(eps)
    rows = dict(x_ptr=x2, w_ptr=w, b_ptr=b, y_ptr=y, mean_ptr=mean, rstd_ptr=rstd)
    strides = dict(stride_x_row=x2.stride(0), stride_x_col=x2.stride(1), stride_w=_stride(w), stride_b=_stride(b),
                   stride_y_row=D, eps=eps_hi, eps_lo=eps_lo)
    if r.parts:
        return (_parts_kernel.bind((N,), **rows, **strides, **r.consts),)
    grid = (rt.cdiv(N, r.BLOCK_N), r.splits)
    return tuple(_fwd_kernel.bind(grid, **rows, part_ptr=part, N=N, D=D, **strides, D_SPLIT=r.d_split,
                                  NUM_SPLITS=r.splits, PHASE=phase, **r.consts)
                 for phase in ((0,) if r.splits == 1 else (1, 2)))


def _empty_like(t: torch.Tensor | None, need: bool) -> torch.Tensor | None:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device) if need else None


def _backward(dy, x, k: int, weight, bias, mean, rstd, needs, layer_norm: bool, llama: bool, w_offset: float = 0.0):
    """``(dx, dw, db)`` of a norm over x's last ``k`` dims; ``needs`` = (x, weight, bias) gradients wanted.

    One of three launch shapes (plans.py): rows that fit one tile, ``_norm_bwd_kernel`` alone; rows of a few
    chunks with a row group per SM, ``_norm_bwd_long_kernel``; other long rows, the row-sum pass, then
    ``_norm_bwd_kernel`` over column blocks. Then, with more than one row chunk, ``column_sum`` reduces the dw
    (and db) partial rows, side by side in one float buffer, in one launch.
    """
    need_x, need_w, need_b = needs
    order = None if x.is_contiguous() else rt.row_order(x, k)
    if order is not None:  # as the forward: rows in x's memory order, dx in x's layout
        lead = x.dim() - k
        p = (*order, *range(lead, x.dim()))
        dx, dw, db = _backward(dy.permute(*p), x.permute(*p), k, weight, bias,
                               None if mean is None else mean.permute(*order), rstd.permute(*order), needs,
                               layer_norm, llama, w_offset)
        return (None if dx is None else dx.permute(*rt.inverse(order), *range(lead, x.dim()))), dw, db
    dx, dw, db = _empty_like(x, need_x), _empty_like(weight, need_w), _empty_like(bias, need_b)
    if not (need_x or need_w or need_b):
        return dx, dw, db
    if x.numel() == 0:
        return dx, (dw.zero_() if need_w else None), (db.zero_() if need_b else None)
    acc = rstd.dtype
    key = None if type(x) not in rt.PLAIN_TENSORS else (
        "bwd", dy.shape, dy.stride(), dy.dtype, x.stride(), x.dtype, k, _sig(weight), acc, needs, layer_norm, llama,
        w_offset, x.device, P.table(), rt.assumed_device())
    kept = _LAUNCHES.get(key) if key is not None else None
    if kept is None:
        x2, dy2, w = rt.as_rows(x, k), rt.as_rows(dy, k), _flat(weight)  # dy2: a view for contiguous or expanded dy
        N, D = x2.shape
        r = P.backward(N=rt.hint(N), D=int(D), stride_x=int(x2.stride(0)), stride_dy=int(dy2.stride(0)),
                       x_dtype=x.dtype, dy_dtype=dy.dtype, w_dtype=_dtype(w), acc=acc, needs=needs,
                       layer_norm=layer_norm, llama=llama, props=rt.device_props(x.device), t=P.table(),
                       w_offset=w_offset)
    else:
        r = kept.plan
        x2 = x if kept.views[0] else rt.as_rows(x, k)
        dy2 = dy if kept.views[1] else rt.as_rows(dy, k)
        w = weight if kept.views[2] else _flat(weight)
    N = rstd.numel()
    D = int(x.numel() // N)
    chunks = rt.cdiv(N, r.rows_per_prog)
    part, grads = _partials(dx, dw, db, chunks, D, acc)
    if r.rowsum:  # long rows, a launch sequence of their own: not kept
        rows = dict(x_ptr=x2, w_ptr=w, dy_ptr=dy2, mean_ptr=mean, rstd_ptr=rstd)
        strides = _bwd_strides(x2, dy2, w)
        c = _row_sums(r, rows, strides, N, layer_norm, acc)
        _bwd_kernel[(chunks, r.d_blocks)](**rows, c_ptr=c, **strides, stride_c=N, **grads,
                                           ROWS_PER_PROG=r.rows_per_prog, **r.consts)
    else:
        tensors = (x2, w, dy2, mean, rstd) + (() if r.long is not None else (None,)) + (
            grads["dx_ptr"], grads["dw_ptr"], grads["db_ptr"])
        if kept is None:
            kept = _Kept(r, (_bind_backward(r, chunks, grads, *tensors),), (False,) * 3 if key is None else
                         rt.same_data(((x2, x), (dy2, dy), (w, weight))))
            if key is not None:
                _LAUNCHES.put(key, kept)
        kept.bounds[0](*tensors)
    if part is not None:
        column_sum(part, *[g.view(-1) for g in (dw, db) if g is not None])
    return dx, dw, db


def _bwd_strides(x2, dy2, w) -> dict:
    return dict(N=x2.shape[0], D=int(x2.shape[1]), stride_x_row=x2.stride(0), stride_x_col=x2.stride(1),
                stride_w=_stride(w), stride_dy_row=dy2.stride(0), stride_dy_col=dy2.stride(1))


def _bind_backward(r: P.BwdPlan, chunks: int, grads: dict, x2, w, dy2, mean, rstd, *rest) -> rt.Bound:
    """The main backward launch of rows that need no row-sum pass (one tile, or the long-row kernel)."""
    rows = dict(x_ptr=x2, w_ptr=w, dy_ptr=dy2, mean_ptr=mean, rstd_ptr=rstd)
    strides = _bwd_strides(x2, dy2, w)
    if r.long is not None:
        return _long_kernel.bind((chunks * r.long.SPLIT,), **rows, **strides, **grads, ROWS_PER_PROG=r.rows_per_prog,
                                 COLS=r.long.COLS, **r.consts)
    return _bwd_kernel.bind((chunks, r.d_blocks), **rows, c_ptr=None, **strides, stride_c=x2.shape[0], **grads,
                            ROWS_PER_PROG=r.rows_per_prog, **r.consts)


def _partials(dx, dw, db, chunks: int, D: int, acc: torch.dtype) -> tuple[torch.Tensor | None, dict]:
    """Where the backward kernels write dx and the dw/db partial rows: ``(buffer or None, kernel arguments)``.
    One row chunk writes dw and db themselves; more write the partials side by side in one float buffer, so
    that one column_sum launch reduces both. The kernel gets the buffer once, and db's half as an offset into
    it (kernels._db_base)."""
    need_w, need_b = dw is not None, db is not None
    part_w, part_b = (dw.view(-1) if need_w else None), (db.view(-1) if need_b else None)  # one chunk
    part = None
    stride_part = db_off = 0
    if chunks != 1 and (need_w or need_b):
        stride_part = D * (need_w + need_b)
        part = torch.empty((chunks, stride_part), dtype=acc, device=(dw if need_w else db).device)
        part_w, part_b = (part, None) if need_w else (None, part)
        db_off = D if need_w and need_b else 0
    return part, dict(dx_ptr=dx, dw_ptr=part_w, db_ptr=part_b, stride_dx_row=D,
                      stride_dw_part=stride_part if need_w else 0, stride_db_part=stride_part if need_b else 0,
                      db_off=db_off, DB_IN_DW=db_off != 0)


def _row_sums(r: P.BwdPlan, rows: dict, strides: dict, N: int, layer_norm: bool, acc: torch.dtype) -> torch.Tensor:
    """The row-sum pass of long rows: c1 (and c2 for layer_norm), one row each; with column splits, a block
    of partial row sums per split, added by column_sum. c is 1-D, as column_sum writes it (no view to write
    through)."""
    device = rows["x_ptr"].device
    c = torch.empty((1 + layer_norm) * N, dtype=acc, device=device)
    c_part = c if r.splits == 1 else torch.empty((r.splits, (1 + layer_norm) * N), dtype=acc, device=device)
    _rowsum_kernel[(rt.cdiv(N, r.BLOCK_N), r.splits)](
        **rows, c_ptr=c_part, **strides, stride_c=N, D_SPLIT=r.d_split,
        stride_c_split=c_part.stride(0) if r.splits > 1 else 0, **r.rowsum_consts,
    )
    if r.splits > 1:
        column_sum(c_part, c)
    return c


# ---------------------------------------------------------------- rms_norm (torch.nn.functional semantics)
def _rms_validate(input, normalized_shape, weight, eps, weight_offset) -> None:
    _check("rms_norm", input, normalized_shape, eps, eps_optional=True, weight=weight)
    if (isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float))
            or not -math.inf < weight_offset < math.inf):
        raise TypeError(f"tritongrad.rms_norm: weight_offset must be a finite float, got {weight_offset!r} (input "
                        f"{tuple(input.shape)} {input.dtype})")
    if weight_offset and weight is None:
        raise ValueError(f"tritongrad.rms_norm: weight_offset={weight_offset} needs a weight (input "
                         f"{tuple(input.shape)} {input.dtype})")


def _rms_native(input, normalized_shape, weight, eps, weight_offset=0.0):
    if weight_offset or not _native_fits(normalized_shape, eps):
        return NotImplemented
    if not input.is_cuda and torch.is_grad_enabled() and (
            input.requires_grad or weight is not None and weight.requires_grad):
        return NotImplemented  # off CUDA torch.rms_norm is composite and keeps float32 copies for its backward
    # torch.rms_norm: F.rms_norm minus its Python checks. Its eps=None is default_eps(x.dtype).
    return torch.rms_norm(input, normalized_shape, weight, eps)


# Under CUDA autocast, as torch.rms_norm: float32 where autocast lists it (newer torch), else untouched (2.11).
_RMS_AUTOCAST = torch.float32 if torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA") else None


# On CUDA torch.rms_norm's fused backward keeps x and rstd, as the kernels do (the kit's native-memory case).
@op("tritongrad::rms_norm", reference=rms_norm_reference, validate=_rms_validate, native=_rms_native,
    native_grad=True, residuals=("rstd",), autocast=_RMS_AUTOCAST)
def rms_norm_op(input: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor] = None,
                eps: Optional[float] = None, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered rms_norm: ``(y, rstd)``; :func:`rms_norm` is the public function."""
    eps = default_eps(input.dtype) if eps is None else eps
    return _forward(input, len(normalized_shape), weight, None, eps, layer_norm=False, llama=False,
                    w_offset=float(weight_offset))


@rms_norm_op.backward
def _rms_norm_backward(ctx, grad_y):
    need_x, _, need_w = ctx.needs_input_grad[:3]
    dx, dw, _ = _backward(grad_y, ctx.input, len(ctx.normalized_shape), ctx.weight, None, None, ctx.rstd,
                          (need_x, need_w, False), layer_norm=False, llama=False, w_offset=float(ctx.weight_offset))
    return dx, dw


def rms_norm(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
             eps: float | None = None, *, weight_offset: float = 0.0) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` with Triton kernels for forward and backward.

    ``y = x / sqrt(mean(x**2) + eps) * (weight_offset + weight)``, the mean over the trailing
    ``normalized_shape`` dims.

    Args:
        input: ``[..., *normalized_shape]``, float16/bfloat16/float32/float64, any strides.
        normalized_shape: the trailing dims to normalise over (an int or a sequence of ints).
        weight: ``normalized_shape`` or None; any floating dtype (e.g. float32 with bfloat16 x).
        eps: None means PyTorch's default, ``torch.finfo(torch.float32).eps`` for float16/bfloat16/float32
            input and ``torch.finfo(torch.float64).eps`` for float64.
        weight_offset: added to the weight in float32 (float64) inside the kernels: 1.0 is Gemma's RMSNorm,
            ``(xhat * (1 + weight.float())).to(x.dtype)``, with the weight's gradient in its own dtype. Needs a
            weight.

    Returns:
        y: input's shape and dtype, whatever the weight's dtype (as ``torch.nn.functional.rms_norm``);
        contiguous, or in input's layout where its leading dims are a transposed dense layout (docs/norms.md).
        Statistics and products in float32 (float64 when the input or the weight is float64), rounded once.
        Differentiable in input and weight; each gradient comes back in its input's dtype, and the weight
        gradient is bitwise reproducible. Under CUDA autocast it computes in float32 and returns
        float32, as PyTorch's rms_norm does there.
    """
    return rms_norm_op(input, shape_list(normalized_shape, "rms_norm"), weight, eps, weight_offset)


# ---------------------------------------------------------------- Hugging Face's LlamaRMSNorm
def _llama_validate(hidden_states, weight, eps) -> None:
    _check("llama_rms_norm", hidden_states, [hidden_states.shape[-1]] if hidden_states.dim() else [1], eps,
           weight=weight)


def _llama_native(hidden_states, weight, eps):
    # Hugging Face's own sequence of ops; x and the weight share a dtype here (``_pattern``). Its product
    # would broadcast a weight of another shape, so the shape is checked here.
    x = hidden_states
    if (weight is None or x.dim() == 0 or weight.dim() != 1 or weight.numel() != x.size(-1)
            or x.size(-1) > rt.NATIVE_MAX_D or type(eps) is not float):
        return NotImplemented
    xf = x.to(rt.acc_dtype(x.dtype))
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@op("tritongrad::llama_rms_norm", reference=llama_rms_norm_reference, validate=_llama_validate,
    native=_llama_native, residuals=("rstd",))
def llama_rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``LlamaRMSNorm.forward`` (and the many model classes that copy it) in Triton.

    ``y = weight * (x / sqrt(mean(x**2, -1) + eps)).to(x.dtype)``: the normalised value is computed in
    float32 (float64 for float64 x), rounded to x's dtype, then multiplied by the weight.

    Args:
        hidden_states: ``[..., D]``, float16/bfloat16/float32/float64, any strides.
        weight: ``[D]``, any floating dtype.
        eps: added to the mean square.

    Returns:
        y: x's shape in ``torch.promote_types(x.dtype, weight.dtype)`` (so a float32 weight with bfloat16 x
        gives float32, as in Hugging Face's code), contiguous or in x's layout where its leading dims are a
        transposed dense layout (docs/norms.md). Gradients come back in each input's dtype; they are computed
        in float32 without the intermediate roundings eager autograd would apply.
    """
    return _forward(hidden_states, 1, weight, None, eps, layer_norm=False, llama=True)


@llama_rms_norm.backward
def _llama_rms_norm_backward(ctx, grad_y):
    need_x, need_w, _ = ctx.needs_input_grad
    dx, dw, _ = _backward(grad_y, ctx.hidden_states, 1, ctx.weight, None, None, ctx.rstd, (need_x, need_w, False),
                          layer_norm=False, llama=True)
    return dx, dw


# ---------------------------------------------------------------- layer_norm
def _ln_validate(input, normalized_shape, weight, bias, eps) -> None:
    _check("layer_norm", input, normalized_shape, eps, weight=weight, bias=bias)


def _ln_native(input, normalized_shape, weight, bias, eps):
    if eps is None or not _native_fits(normalized_shape, eps):
        return NotImplemented
    return torch.layer_norm(input, normalized_shape, weight, bias, eps)  # F.layer_norm minus its Python checks


@op("tritongrad::layer_norm", reference=layer_norm_reference, validate=_ln_validate, native=_ln_native,
    native_grad=True, residuals=("mean", "rstd"), autocast=torch.float32)
def layer_norm_op(input: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor] = None,
                  bias: Optional[torch.Tensor] = None, eps: float = 1e-5
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered layer_norm: ``(y, mean, rstd)``; :func:`layer_norm` is the public function."""
    return _forward(input, len(normalized_shape), weight, bias, eps, layer_norm=True, llama=False)


@layer_norm_op.backward
def _layer_norm_backward(ctx, grad_y):
    need_x, _, need_w, need_b, _ = ctx.needs_input_grad
    return _backward(grad_y, ctx.input, len(ctx.normalized_shape), ctx.weight, ctx.bias, ctx.mean, ctx.rstd,
                     (need_x, need_w, need_b), layer_norm=True, llama=False)


def layer_norm(
    input: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` with Triton kernels for forward and backward.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias``, mean and biased variance over the trailing
    ``normalized_shape`` dims.

    Args:
        input: ``[..., *normalized_shape]``, float16/bfloat16/float32/float64, any strides.
        normalized_shape: the trailing dims to normalise over (an int or a sequence of ints).
        weight, bias: ``normalized_shape`` or None; any floating dtype (e.g. float32 with bfloat16 x).
        eps: added to the variance.

    Returns:
        y: input's shape and dtype, whatever the dtypes of weight and bias (as
        ``torch.nn.functional.layer_norm``); contiguous, or in input's layout where its leading dims are a
        transposed dense layout (docs/norms.md). Statistics and products in float32 (float64 when any input is
        float64), rounded once. Differentiable in input, weight and bias; each gradient comes back in
        its input's dtype, and the weight and bias gradients are bitwise reproducible. Under CUDA autocast
        its floating inputs are cast to float32 first and it returns float32, as PyTorch's layer_norm does
        there (autocast lists layer_norm among its float32 ops).
    """
    return layer_norm_op(input, shape_list(normalized_shape, "layer_norm"), weight, bias, eps)

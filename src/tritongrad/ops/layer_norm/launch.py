"""Host side of layer_norm: launchers, registration.

Bytes each pass must move (the bandwidth floor), x: [N, D] with element sizes sx, sy, sdy, sdx, sw, sb:
  forward : read x + read w + read b + write y + write mean + write rstd
                                                            = N*D*(sx + sy) + D*(sw + sb) + 8*N
  backward: read x + read dy + read w + read mean, rstd + write dx + write dw + write db
                                                            = N*D*(sx + sdy + sdx) + D*(2*sw + sb) + 8*N
            plus the float32 dw and db partial rows, written and read once: 2 * 2*P*D*4,
            P <= BWD_PROGS_PER_SM * SMs, side by side in one [P, 2D] buffer that one launch reduces.
            (only the gradients asked for are written; dw or db alone still read x and dy)
  Rows longer than one register tile read x (and dy) twice: see ops/_norm_common.py.
Measured on an H200 (torch 2.11, triton 3.6, 2026-11-30, run I) at 32768x4096 bf16, GPU time (`tritongrad
bench`'s device time): forward 131 us, 97% of the device-to-device copy bandwidth; backward 211 us, 91%.
Launch plans (tiles, warps, programs per SM) are shared with rms_norm: see ops/_norm_common.py.
"""

from __future__ import annotations

import torch

from ... import _pattern
from ... import _runtime as rt
from .. import _norm_common as nc
from .._norm_backward import norm_backward
from .._norm_forward import forward_parts
from . import kernels
from .reference import layer_norm_reference

_fwd_kernel = rt.Kernel(kernels._layer_norm_fwd_kernel)
# The backward is shared with rms_norm (ops/_norm_backward.py); centered adds the mean terms.


def _stride(t) -> int:
    return t.stride(0) if t is not None else 0


def _forward(x, normalized_shape, weight, bias, eps):
    k = len(normalized_shape)
    acc = nc.acc_dtype(x, weight, bias)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean = torch.empty(x.shape[: x.dim() - k], dtype=acc, device=x.device)
    rstd = torch.empty_like(mean)
    if rt.is_fake(x):
        return y, mean, rstd
    x2 = _pattern.as_rows(x, k)
    N, D = x2.shape
    if N == 0 or D == 0:
        return y, mean.fill_(0.0), rstd.fill_(0.0)
    w, b = nc.flat(weight), nc.flat(bias)
    parts = nc.fwd_parts(D, x.element_size())
    if parts is not None:  # rows of an odd number (3 to 13) of power-of-two chunks
        forward_parts(x2, w, b, y, mean, rstd, eps, parts, centered=True, round_xhat=False, acc=acc)
        return y, mean, rstd
    t = nc.fwd_plan(N, D, x.element_size(), x.dtype if acc == torch.float32 else None)
    splits, d_split = nc.column_split(N, D, t, rt.sm_count(x.device))
    # Column-split rows: each split's (mean, M2) first (PHASE 1), then the merge and normalisation (PHASE 2).
    part = rstd if splits == 1 else torch.empty((2, splits, N), dtype=acc, device=x.device)
    align = rt.align(D, x2.stride(0), d_split)  # y is contiguous: its row stride is D
    for phase in (0,) if splits == 1 else (1, 2):
        _fwd_kernel[(rt.cdiv(N, t.BLOCK_N), splits)](
            x2, w, b, y, mean, rstd, part, N, D, x2.stride(0), x2.stride(1), _stride(w), _stride(b), D,
            *rt.split_float(eps), d_split, splits, BLOCK_N=t.BLOCK_N, BLOCK_D=t.BLOCK_D, ONE_TILE=t.ONE_TILE,
            HAS_W=w is not None, HAS_B=b is not None, PHASE=phase, ACC=rt.tl_acc_dtype(acc), ALIGN=align,
            num_warps=t.num_warps,
        )
    return y, mean, rstd


def _backward(dy, args, residuals, needs):
    x, normalized_shape, weight, bias, _eps = args
    mean, rstd = residuals
    # layer_norm's backward with 32- and 64-bit x steps over fewer elements (LN_BWD_TILE_32BIT).
    tile = nc.LN_BWD_TILE_32BIT if x.element_size() >= 4 else nc.BWD_TILE
    return norm_backward(dy, x, len(normalized_shape), weight, bias, mean, rstd, needs, centered=True,
                         round_xhat=False, tile=tile)


def _validate(x, normalized_shape, weight, bias, eps) -> None:
    if eps is None:
        raise TypeError("tritongrad.layer_norm: eps must be a float, got None")
    nc.validate("layer_norm", x, normalized_shape, eps, weight=weight, bias=bias)


def _native(x, normalized_shape, weight, bias, eps):
    if eps is None or not nc.native_args_fit(normalized_shape, eps):
        return NotImplemented
    return torch.layer_norm(x, normalized_shape, weight, bias, eps)  # F.layer_norm minus its Python checks


_OP = _pattern.Op(
    "layer_norm",
    "Tensor x, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps",
    forward=_forward,
    backward=_backward,
    reference=layer_norm_reference,
    validate=_validate,
    n_residuals=2,
    native=_native,
)


def layer_norm(
    x: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` with Triton kernels for forward and backward.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias``, mean and biased variance over the trailing
    ``normalized_shape`` dims.

    Args:
        x: ``[..., *normalized_shape]``, float16/bfloat16/float32/float64, any strides.
        normalized_shape: the trailing dims to normalise over (an int or a sequence of ints).
        weight, bias: ``normalized_shape`` or None; any floating dtype (e.g. float32 with bfloat16 x).
        eps: added to the variance.

    Returns:
        y: x's shape and x's dtype, whatever the dtypes of weight and bias (as
        ``torch.nn.functional.layer_norm``); contiguous. Statistics and products are computed in float32
        (float64 when any input is float64) and rounded once. Differentiable in x, weight and bias; each
        gradient comes back in its input's dtype, and the weight and bias gradients are bitwise
        reproducible.
    """
    return _OP(x, nc.shape_list(normalized_shape), weight, bias, eps)

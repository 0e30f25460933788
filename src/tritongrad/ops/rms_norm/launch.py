"""Host side of rms_norm: launch heuristics, launchers, registration.

Bytes each pass must move (the bandwidth floor), x: [N, D] with element sizes sx, sy, sdy, sdx, sw:
  forward : read x + read w + write y + write rstd          = N*D*(sx + sy) + D*sw + 4*N
  backward: read x + read dy + read w + read rstd + write dx + write dw
                                                            = N*D*(sx + sdy + sdx) + 2*D*sw + 4*N
            plus the float32 dw partial rows, written and read once: 2*P*D*4, P <= BWD_PROGS_PER_SM * SMs.
            (only the gradients asked for are written; dw alone still reads x and dy)
  Rows longer than one register tile read x (and dy) twice: see ops/_norm_common.py.
Measured on an H200 (torch 2.11, triton 3.6, 2026-11-30, run I) at 32768x4096 bf16, GPU time (`tritongrad
bench`'s device time): forward 133 us, 95% of the device-to-device copy bandwidth; backward 209 us, 91%.
Launch plans (tiles, warps, programs per SM) are shared with layer_norm: see ops/_norm_common.py.
"""

from __future__ import annotations

import torch

from ... import _pattern
from ... import _runtime as rt
from .. import _norm_common as nc
from .._norm_backward import norm_backward
from .._norm_forward import forward_parts
from . import kernels
from .reference import default_eps, llama_rms_norm_reference, rms_norm_reference

_fwd_kernel = rt.Kernel(kernels._rms_norm_fwd_kernel)
# The backward is layer_norm's without the mean terms (ops/_norm_backward.py, centered=False).


def _launch_forward(x, k: int, weight, eps: float, llama: bool):
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if llama else x.dtype
    acc = nc.acc_dtype(x, weight)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty(x.shape[: x.dim() - k], dtype=acc, device=x.device)
    if rt.is_fake(x):
        return y, rstd
    x2 = _pattern.as_rows(x, k)
    N, D = x2.shape
    if N == 0 or D == 0:
        return y, rstd.fill_(0.0)
    w = nc.flat(weight)
    parts = nc.fwd_parts(D, x.element_size())
    if parts is not None:  # rows of an odd number (3 to 13) of power-of-two chunks
        forward_parts(x2, w, None, y, None, rstd, eps, parts, centered=False, round_xhat=llama, acc=acc)
        return y, rstd
    t = nc.fwd_plan(N, D, x.element_size())
    splits, d_split = nc.column_split(N, D, t, rt.sm_count(x.device))
    # Column-split rows: partial sums of squares first (PHASE 1), then normalisation (PHASE 2).
    part = rstd if splits == 1 else torch.empty((splits, N), dtype=acc, device=x.device)
    align = rt.align(D, x2.stride(0), d_split)  # y is contiguous: its row stride is D
    for phase in (0,) if splits == 1 else (1, 2):
        _fwd_kernel[(rt.cdiv(N, t.BLOCK_N), splits)](
            x2, w, y, rstd, part, N, D, x2.stride(0), x2.stride(1), w.stride(0) if w is not None else 0, D,
            *rt.split_float(eps), d_split, splits, BLOCK_N=t.BLOCK_N, BLOCK_D=t.BLOCK_D, ONE_TILE=t.ONE_TILE,
            HAS_W=w is not None, ROUND_XHAT=llama, PHASE=phase, ACC=rt.tl_acc_dtype(acc), ALIGN=align,
            num_warps=t.num_warps,
        )
    return y, rstd


def _launch_backward(dy, x, k: int, weight, rstd, need_x: bool, need_w: bool, llama: bool):
    dx, dw, _ = norm_backward(dy, x, k, weight, None, None, rstd, (need_x, need_w, False), centered=False,
                              round_xhat=llama, tile=nc.BWD_TILE)
    return dx, dw


# ---------------------------------------------------------------- rms_norm (torch.nn.functional semantics)
def _forward(x, normalized_shape, weight, eps):
    return _launch_forward(x, len(normalized_shape), weight, default_eps(x.dtype) if eps is None else eps, False)


def _backward(dy, args, residuals, needs):
    x, normalized_shape, weight, _eps = args
    return _launch_backward(dy, x, len(normalized_shape), weight, residuals[0], needs[0], needs[1], False)


def _validate(x, normalized_shape, weight, eps) -> None:
    nc.validate("rms_norm", x, normalized_shape, eps, weight=weight)


def _native(x, normalized_shape, weight, eps):
    if not nc.native_args_fit(normalized_shape, eps):
        return NotImplemented
    # torch.rms_norm: F.rms_norm minus its Python checks (the plain tensors here need none). Its eps=None is
    # default_eps(x.dtype), the float32 epsilon for 16-bit x.
    return torch.rms_norm(x, normalized_shape, weight, eps)


_OP = _pattern.Op(
    "rms_norm",
    "Tensor x, SymInt[] normalized_shape, Tensor? weight, float? eps",
    forward=_forward,
    backward=_backward,
    reference=rms_norm_reference,
    validate=_validate,
    n_residuals=1,
    native=_native,
)


def rms_norm(
    x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None, eps: float | None = None
) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` with Triton kernels for forward and backward.

    ``y = x / sqrt(mean(x**2) + eps) * weight``, the mean over the trailing ``normalized_shape`` dims.

    Args:
        x: ``[..., *normalized_shape]``, float16/bfloat16/float32/float64, any strides.
        normalized_shape: the trailing dims to normalise over (an int or a sequence of ints).
        weight: ``normalized_shape`` or None; any floating dtype (e.g. float32 with bfloat16 x).
        eps: None means PyTorch's default, ``torch.finfo(torch.float32).eps`` for float16/bfloat16/float32 x
            and ``torch.finfo(torch.float64).eps`` for float64 x.

    Returns:
        y: x's shape and x's dtype, whatever the weight's dtype (as ``torch.nn.functional.rms_norm``);
        contiguous. Statistics and products are computed in float32 (float64 when x or the weight is
        float64) and rounded once. Differentiable in x and weight; each gradient comes back in its input's
        dtype, and the weight gradient is bitwise reproducible.
    """
    return _OP(x, nc.shape_list(normalized_shape), weight, eps)


# ---------------------------------------------------------------- Hugging Face's LlamaRMSNorm
def _llama_forward(x, weight, eps):
    return _launch_forward(x, 1, weight, eps, True)


def _llama_backward(dy, args, residuals, needs):
    x, weight, _eps = args
    return _launch_backward(dy, x, 1, weight, residuals[0], needs[0], needs[1], True)


def _llama_validate(x, weight, eps) -> None:
    nc.validate("llama_rms_norm", x, [x.shape[-1]] if x.dim() else [1], eps, weight=weight)


def _llama_native(x, weight, eps):
    # Hugging Face's own sequence of ops; x and the weight share a dtype here (``_pattern``). Its product
    # would broadcast a weight of another shape, so the shape is checked here.
    if (weight is None or x.dim() == 0 or weight.dim() != 1 or weight.numel() != x.size(-1)
            or x.size(-1) > rt.NATIVE_MAX_D or type(eps) is not float):
        return NotImplemented
    xf = x.to(rt.acc_dtype(x.dtype))
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


_LLAMA_OP = _pattern.Op(
    "llama_rms_norm",
    "Tensor x, Tensor weight, float eps",
    forward=_llama_forward,
    backward=_llama_backward,
    reference=llama_rms_norm_reference,
    validate=_llama_validate,
    n_residuals=1,
    native=_llama_native,
)


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face's ``LlamaRMSNorm.forward`` (and the many model classes that copy it) in Triton.

    ``y = weight * (x / sqrt(mean(x**2, -1) + eps)).to(x.dtype)``: the normalised value is computed in
    float32 (float64 for float64 x), rounded to x's dtype, then multiplied by the weight.

    Args:
        x: ``[..., D]``, float16/bfloat16/float32/float64, any strides.
        weight: ``[D]``, any floating dtype.

    Returns:
        y: x's shape in ``torch.promote_types(x.dtype, weight.dtype)`` (so a float32 weight with bfloat16 x
        gives float32, as in Hugging Face's code). Gradients come back in each input's dtype; they are
        computed in float32 without the intermediate roundings eager autograd would apply.
    """
    return _LLAMA_OP(x, weight, eps)

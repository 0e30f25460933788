"""The norm family in plain PyTorch: the float64 references of the tests and the CPU path without Triton.
Imports torch only."""

from __future__ import annotations

import torch

from ..._dtypes import acc_of as _acc


def default_eps(dtype: torch.dtype) -> float:
    """PyTorch's eps for ``rms_norm(..., eps=None)``: the machine epsilon of the computation dtype, so
    float16/bfloat16/float32 inputs get float32's (not their own) and float64 inputs get float64's. It
    depends on x alone, not on the weight's dtype."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def rms_norm_reference(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
                       eps: float | None = None, weight_offset: float = 0.0) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` with the weight ``weight_offset + weight`` (Gemma's 1 + w), accumulated
    in float32 (float64 when x or the weight is float64), rounded once to x's dtype. Differentiable; gradients
    come back in each input's dtype."""
    x = input
    dims = tuple(range(-len(normalized_shape), 0))
    eps = default_eps(x.dtype) if eps is None else eps
    xf = x.to(_acc(x, weight))
    y = xf * torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.to(y.dtype) + weight_offset if weight_offset else weight.to(y.dtype))
    return y.to(x.dtype)


def llama_rms_norm_reference(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm.forward: normalise in float32 (float64 for float64 x; Llama's own code
    drops float64 to float32), round the normalised value to x's dtype, then ``weight * that``, returned
    in the promoted dtype of x and the weight."""
    x = hidden_states
    xf = x.to(_acc(x))
    xhat = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    return (weight.to(acc) * xhat.to(acc)).to(out_dtype)


def layer_norm_reference(
    input: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm``, accumulated in float32 (float64 when any input is float64),
    rounded once to x's dtype. The variance is the mean of squared deviations (never E[x^2] - mean^2).
    Differentiable; gradients come back in each input's dtype."""
    x = input
    dims = tuple(range(-len(normalized_shape), 0))
    acc = _acc(x, weight, bias)
    xf = x.to(acc)
    xc = xf - xf.mean(dims, keepdim=True)
    y = xc * torch.rsqrt(xc.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)

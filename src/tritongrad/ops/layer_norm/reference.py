"""Plain PyTorch LayerNorm: the float64 reference of the tests and the CPU path without Triton."""

from __future__ import annotations

import torch

from .._norm_common import acc_dtype


def layer_norm_reference(
    x: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm``, accumulated in float32 (float64 when any input is float64),
    rounded once to x's dtype. The variance is the mean of squared deviations (never E[x^2] - mean^2).
    Differentiable; gradients come back in each input's dtype."""
    dims = tuple(range(-len(normalized_shape), 0))
    acc = acc_dtype(x, weight, bias)
    xf = x.to(acc)
    xc = xf - xf.mean(dims, keepdim=True)
    y = xc * torch.rsqrt(xc.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)

"""Plain PyTorch weighted sum: the float64 reference of the tests and the CPU path without Triton."""

import torch

from ... import _runtime as rt


def weighted_sum_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``(x * w).sum(-1)``, accumulated in float32 (float64 for float64) and returned in the promoted
    dtype of x and w. Differentiable; gradients come back in each input's dtype."""
    out_dtype = torch.promote_types(x.dtype, w.dtype)
    acc = rt.acc_dtype(out_dtype)
    return (x.to(acc) * w.to(acc)).sum(-1).to(out_dtype)

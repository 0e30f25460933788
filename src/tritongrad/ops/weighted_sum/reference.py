"""Plain PyTorch weighted sum: the float64 reference of the tests and the CPU path without Triton. Imports
torch only."""

import torch


def weighted_sum_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``(x * w).sum(-1)``, accumulated in float32 (float64 for float64) and returned in the promoted
    dtype of x and w. Differentiable; gradients come back in each input's dtype."""
    out_dtype = torch.promote_types(x.dtype, w.dtype)
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    return (x.to(acc) * w.to(acc)).sum(-1).to(out_dtype)

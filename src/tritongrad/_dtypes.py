"""The accumulation dtype rule every op follows, in torch alone (the references import it without Triton)."""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def acc_of(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32, or float64 when any present tensor is float64."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32

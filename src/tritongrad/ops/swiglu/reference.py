"""Plain PyTorch SwiGLU and GeGLU: the float64 references of the tests and the CPU path without Triton.
Imports torch only."""

import torch

from ..._dtypes import acc_dtype


def _acc(gate: torch.Tensor, up: torch.Tensor):
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    return out_dtype, acc_dtype(out_dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` computed in float32 (float64 when either input is float64) and rounded once to
    ``torch.promote_types(gate.dtype, up.dtype)``. Differentiable; gradients come back in each input's
    dtype. ``inplace_backward`` (a memory option of the kernels) changes nothing here."""
    out_dtype, acc = _acc(gate, up)
    return (torch.nn.functional.silu(gate.to(acc)) * up.to(acc)).to(out_dtype)


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, *, approximate: str = "none",
                    inplace_backward: bool = False) -> torch.Tensor:
    """``F.gelu(gate, approximate=approximate) * up`` computed in float32 (float64 when either input is
    float64) and rounded once to ``torch.promote_types(gate.dtype, up.dtype)``. Differentiable; gradients
    come back in each input's dtype. ``inplace_backward`` changes nothing here."""
    out_dtype, acc = _acc(gate, up)
    return (torch.nn.functional.gelu(gate.to(acc), approximate=approximate) * up.to(acc)).to(out_dtype)

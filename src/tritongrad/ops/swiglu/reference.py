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


def gated_linear_reference(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, *,
                           approximate: str | None = None, inplace_backward: bool = False) -> torch.Tensor:
    """``F.linear(act(gate) * up, weight)``: an MLP's gated product and its down projection, the product as
    :func:`swiglu_reference` (``approximate`` None) or :func:`geglu_reference` rounds it."""
    h = swiglu_reference(gate, up) if approximate is None else geglu_reference(gate, up, approximate=approximate)
    return torch.nn.functional.linear(h, weight)


def grouped_experts_reference(x, top_k_index, top_k_weights, gate_up_proj, down_proj, *, approximate=None,
                              is_transposed: bool = False) -> torch.Tensor:
    """A MoE layer's gated experts by definition, token by token: ``out_t = sum_k w_{t,k} down_e(act(gate) *
    up)`` with ``[gate; up] = up_e(x_t)``, e = top_k_index[t, k], in x's dtype (float64 for the tests).
    Differentiable in x, the weights and both projections."""
    gu = gate_up_proj if is_transposed else gate_up_proj.transpose(-2, -1)  # [E, H, 2I]
    dn = down_proj if is_transposed else down_proj.transpose(-2, -1)  # [E, I, H]
    pre = torch.einsum("th,tkhj->tkj", x, gu[top_k_index])
    gate, up = pre.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) if approximate is None else torch.nn.functional.gelu(gate, approximate=approximate)
    y = torch.einsum("tki,tkih->tkh", act * up, dn[top_k_index])
    return (y * top_k_weights.unsqueeze(-1).to(y.dtype)).sum(dim=1).to(x.dtype)

"""Modules built on the functional ops."""

from __future__ import annotations

import math

import torch

from .ops.norm import layer_norm, llama_rms_norm, rms_norm
from .ops.weighted_sum import weighted_sum


class WeightedSum(torch.nn.Module):
    """``y = (x * weight).sum(-1)`` with a learnable ``weight: [in_features]``.

    Input ``[..., in_features]``, output ``[...]``. The weight is initialised uniformly in
    ``[-1/sqrt(in_features), 1/sqrt(in_features)]``, as for ``torch.nn.Linear`` with one output.
    """

    def __init__(self, in_features: int, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.weight = torch.nn.Parameter(torch.empty(in_features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        torch.nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return weighted_sum(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}"


class RMSNorm(torch.nn.RMSNorm):
    """Drop-in ``torch.nn.RMSNorm`` whose forward and backward run tritongrad's Triton kernels.

    A subclass: same constructor (``normalized_shape, eps=None, elementwise_affine=True, device, dtype``),
    parameter ``weight``, state_dict keys, ``reset_parameters`` and repr, and ``isinstance(m,
    torch.nn.RMSNorm)`` still holds. Output in the input's dtype (see :func:`tritongrad.rms_norm`).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in ``torch.nn.LayerNorm`` whose forward and backward run tritongrad's Triton kernels.

    A subclass: same constructor (``normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
    device, dtype``), parameters ``weight`` and ``bias``, state_dict keys, ``reset_parameters`` and repr,
    and ``isinstance(m, torch.nn.LayerNorm)`` still holds. Output in the input's dtype (see
    :func:`tritongrad.layer_norm`).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


# ---------------------------------------------------------------- losses (ops/cross_entropy)
from .ops.cross_entropy import cross_entropy, linear_cross_entropy  # noqa: E402


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """Drop-in ``torch.nn.CrossEntropyLoss`` whose forward and backward run tritongrad's Triton kernels.

    A subclass: same constructor (``weight, size_average, ignore_index, reduce, reduction,
    label_smoothing``), the ``weight`` buffer, state_dict keys and repr, and ``isinstance(m,
    torch.nn.CrossEntropyLoss)`` still holds; plus keyword-only ``logit_softcap`` and ``z_loss`` (see
    :func:`tritongrad.cross_entropy`). Targets are class indices; class-probability targets raise.
    """

    def __init__(self, weight: torch.Tensor | None = None, size_average=None, ignore_index: int = -100,
                 reduce=None, reduction: str = "mean", label_smoothing: float = 0.0, *,
                 logit_softcap: float | None = None, z_loss: float = 0.0) -> None:
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.logit_softcap = logit_softcap
        self.z_loss = z_loss

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(input, target, self.weight, self.ignore_index, self.reduction, self.label_smoothing,
                             logit_softcap=self.logit_softcap, z_loss=self.z_loss)

    def extra_repr(self) -> str:
        extra = [f"logit_softcap={self.logit_softcap}"] if self.logit_softcap is not None else []
        extra += [f"z_loss={self.z_loss}"] if self.z_loss else []
        return ", ".join(extra)


class LinearCrossEntropyLoss(torch.nn.Module):
    """The cross-entropy of a linear layer's logits, which never exist in memory at once:
    ``loss_fn(hidden, lm_head.weight, target)`` equals ``F.cross_entropy(lm_head(hidden), target)``.

    Args (constructor): ``ignore_index``, ``reduction``, ``label_smoothing``, ``logit_softcap``, ``z_loss`` as
    in :func:`tritongrad.linear_cross_entropy`. No parameters of its own: it takes the LM head's weight (and
    bias) at call time, so that the head stays where the model keeps it (tied embeddings included).

    Forward: ``hidden [..., H]``, ``weight [V, H]``, ``target [...]`` (class indices), optional ``bias [V]``.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0, *,
                 logit_softcap: float | None = None, z_loss: float = 0.0) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.logit_softcap = logit_softcap
        self.z_loss = z_loss

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, target, bias, self.ignore_index, self.reduction,
                                    self.label_smoothing, logit_softcap=self.logit_softcap, z_loss=self.z_loss)

    def extra_repr(self) -> str:
        out = f"ignore_index={self.ignore_index}, reduction={self.reduction!r}"
        if self.label_smoothing:
            out += f", label_smoothing={self.label_smoothing}"
        if self.logit_softcap is not None:
            out += f", logit_softcap={self.logit_softcap}"
        if self.z_loss:
            out += f", z_loss={self.z_loss}"
        return out


# ---------------------------------------------------------------- MLP (ops/swiglu)
from .ops.swiglu import geglu, swiglu  # noqa: E402  (kept with its modules, below the marker)


class SwiGLUMLP(torch.nn.Module):
    """Hugging Face's ``LlamaMLP`` with tritongrad's SwiGLU: ``down_proj(swiglu(gate_proj(x), up_proj(x)))``,
    where ``swiglu(g, u) = silu(g) * u`` (:func:`tritongrad.swiglu`).

    Same parameters, names and state_dict as ``LlamaMLP`` (``gate_proj``, ``up_proj``: ``hidden_size ->
    intermediate_size``, ``down_proj``: ``intermediate_size -> hidden_size``, biases when ``bias``, as
    ``config.mlp_bias``), so ``SwiGLUMLP(h, i).load_state_dict(llama_mlp.state_dict())`` takes a model's
    weights. Input ``[..., hidden_size]``, output the same shape, in the parameters' dtype.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"


class GeGLUMLP(torch.nn.Module):
    """Hugging Face's ``GemmaMLP`` with tritongrad's GeGLU: ``down_proj(geglu(gate_proj(x), up_proj(x),
    approximate=approximate))``, where ``geglu(g, u) = gelu(g) * u`` (:func:`tritongrad.geglu`).

    ``approximate="tanh"`` (the default) is Gemma's ``gelu_pytorch_tanh``; ``"none"`` the exact GELU. Same
    parameters, names and state_dict as ``GemmaMLP`` (``gate_proj``, ``up_proj``: ``hidden_size ->
    intermediate_size``, ``down_proj``: ``intermediate_size -> hidden_size``; biases only when ``bias``), so
    ``GeGLUMLP(h, i).load_state_dict(gemma_mlp.state_dict())`` takes a model's weights. Input
    ``[..., hidden_size]``, output the same shape, in the parameters' dtype.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, approximate: str = "tanh",
                 device=None, dtype=None):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"tritongrad.nn.GeGLUMLP: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.approximate = approximate
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x), approximate=self.approximate))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"approximate={self.approximate!r}")

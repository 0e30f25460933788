"""Gated MLP activations ``act(gate) * up``: SwiGLU's ``silu(gate) * up`` (Llama-style MLPs) and GeGLU's
``gelu(gate) * up`` (Gemma's, with GELU's tanh approximation); and a MoE layer's gated experts through them."""

from .experts import grouped_experts
from .launch import geglu, swiglu
from .reference import geglu_reference, grouped_experts_reference, swiglu_reference

__all__ = ["geglu", "geglu_reference", "grouped_experts", "grouped_experts_reference", "swiglu", "swiglu_reference"]

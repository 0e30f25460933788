"""Gated MLP activations ``act(gate) * up``: SwiGLU's ``silu(gate) * up`` (Llama-style MLPs) and GeGLU's
``gelu(gate) * up`` (Gemma's, with GELU's tanh approximation); either with the down projection after it
(gated_linear); and a MoE layer's gated experts through them."""

from .experts import grouped_experts
from .launch import gated_linear, geglu, swiglu
from .reference import gated_linear_reference, geglu_reference, grouped_experts_reference, swiglu_reference

__all__ = ["gated_linear", "gated_linear_reference", "geglu", "geglu_reference", "grouped_experts",
           "grouped_experts_reference", "swiglu", "swiglu_reference"]

"""Gated MLP activations ``act(gate) * up``: SwiGLU's ``silu(gate) * up`` (Llama-style MLPs) and GeGLU's
``gelu(gate) * up`` (Gemma's, with GELU's tanh approximation)."""

from .launch import geglu, swiglu
from .reference import geglu_reference, swiglu_reference

__all__ = ["geglu", "geglu_reference", "swiglu", "swiglu_reference"]

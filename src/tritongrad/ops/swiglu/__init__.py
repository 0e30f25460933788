"""SwiGLU's gated product, ``silu(gate) * up`` (the activation of Llama-style MLPs)."""

from .launch import swiglu
from .reference import swiglu_reference

__all__ = ["swiglu", "swiglu_reference"]

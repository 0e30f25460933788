"""The norm family: RMSNorm (torch.nn.functional's and Hugging Face's Llama variant) and LayerNorm."""

from .launch import layer_norm, layer_norm_op, llama_rms_norm, rms_norm, rms_norm_op
from .reference import layer_norm_reference, llama_rms_norm_reference, rms_norm_reference

__all__ = [
    "fused_add_rms_norm", "fused_add_rms_norm_reference", "layer_norm", "layer_norm_op", "layer_norm_reference", "llama_rms_norm", "llama_rms_norm_reference",
    "rms_norm", "rms_norm_op", "rms_norm_reference",
]
from .residual import fused_add_rms_norm, fused_add_rms_norm_reference  # noqa: E402

from .launch import llama_rms_norm, rms_norm
from .reference import llama_rms_norm_reference, rms_norm_reference

__all__ = ["llama_rms_norm", "llama_rms_norm_reference", "rms_norm", "rms_norm_reference"]

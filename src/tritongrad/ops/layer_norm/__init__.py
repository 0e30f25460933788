from .launch import layer_norm
from .reference import layer_norm_reference

__all__ = ["layer_norm", "layer_norm_reference"]

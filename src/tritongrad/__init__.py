"""tritongrad: differentiable Triton operators for PyTorch."""

from . import nn
from ._pattern import set_small_input_threshold
from .ops.layer_norm import layer_norm
from .ops.rms_norm import rms_norm
from .ops.weighted_sum import weighted_sum
from .patch import patch

__version__ = "0.1.0"
__all__ = ["layer_norm", "nn", "patch", "rms_norm", "set_small_input_threshold", "weighted_sum"]

"""tritongrad: differentiable Triton operators for PyTorch."""

from . import nn
from .ops.weighted_sum import weighted_sum

__version__ = "0.1.0"
__all__ = ["nn", "weighted_sum"]

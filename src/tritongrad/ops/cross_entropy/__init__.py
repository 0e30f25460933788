"""The cross-entropy family: cross_entropy (torch.nn.functional's, plus soft cap and z-loss) and
linear_cross_entropy (the loss of a linear layer's logits, which never exist in memory at once)."""

from .launch import cross_entropy, cross_entropy_op, linear_cross_entropy, linear_cross_entropy_op
from .reference import cross_entropy_reference, linear_cross_entropy_reference

__all__ = [
    "cross_entropy", "cross_entropy_op", "cross_entropy_reference", "linear_cross_entropy",
    "linear_cross_entropy_op", "linear_cross_entropy_reference",
]

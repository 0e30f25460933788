"""The deterministic second stage of every column reduction (weight and bias gradients, split rows)."""

from .launch import column_sum

__all__ = ["column_sum"]

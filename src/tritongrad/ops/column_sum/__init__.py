"""The deterministic second stage of every column reduction (weight and bias gradients, split rows), and its
public launchers ``reduce_partials`` and ``partial_rows``."""

from .launch import column_sum, partial_rows, reduce_partials

__all__ = ["column_sum", "partial_rows", "reduce_partials"]

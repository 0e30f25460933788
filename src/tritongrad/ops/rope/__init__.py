"""Rotary position embedding for q and k together: rotate_half and interleaved pairs, partial rotary."""

from .launch import apply_rotary_pos_emb
from .reference import apply_rotary_pos_emb_reference, rotate_half, rotate_pairs

__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_reference", "rotate_half", "rotate_pairs"]

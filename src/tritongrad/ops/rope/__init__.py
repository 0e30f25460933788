"""Rotary position embedding with Hugging Face's ``rotate_half`` convention, for q and k together."""

from .launch import apply_rotary_pos_emb
from .reference import apply_rotary_pos_emb_reference, rotate_half

__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_reference", "rotate_half"]

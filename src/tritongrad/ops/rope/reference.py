"""Plain PyTorch rotary position embedding with Hugging Face's ``rotate_half`` convention: the float64
reference of the tests and the CPU path without Triton. Imports torch only."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim, split in halves (Hugging Face's ``rotate_half``)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                   unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin`` for x = q and k, cos and
    sin unsqueezed at ``unsqueeze_dim`` to broadcast over the heads. Computed in float32 (float64 when any
    input is float64) and rounded once to each output's promoted dtype, ``torch.promote_types(x.dtype,
    cos.dtype, sin.dtype)``. Differentiable."""
    acc = torch.float64 if torch.float64 in (q.dtype, k.dtype, cos.dtype, sin.dtype) else torch.float32
    c = cos.unsqueeze(unsqueeze_dim).to(acc)
    s = sin.unsqueeze(unsqueeze_dim).to(acc)
    cs = torch.promote_types(cos.dtype, sin.dtype)

    def embed(x):
        xf = x.to(acc)
        return (xf * c + rotate_half(xf) * s).to(torch.promote_types(x.dtype, cs))

    return embed(q), embed(k)

"""Plain PyTorch rotary position embedding, both conventions and partial rotary: the float64 reference of
the tests and the CPU path without Triton. Imports torch only."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim, split in halves (Hugging Face's ``rotate_half`` of Llama,
    GPT-NeoX, Phi-3)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """``rot(x)[2i] = -x[2i + 1], rot(x)[2i + 1] = x[2i]`` over the last dim (GPT-J's ``rotate_every_two``,
    GLM's ``rotate_half``)."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_rotary_pos_emb_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                   unsqueeze_dim: int = 1, *, interleaved: bool = False,
                                   out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., :R] * cos + rot(x[..., :R]) * sin`` for x = q and k, ``x[..., R:]`` passed through, with
    ``R = cos.shape[-1]`` and cos and sin unsqueezed at ``unsqueeze_dim`` to broadcast over the heads; rot is
    :func:`rotate_half`, or :func:`rotate_pairs` when ``interleaved``. Computed in float32 (float64 when any
    input or ``out_dtype`` is float64) and rounded once to ``out_dtype``, or where it is None to each output's
    promoted dtype, ``torch.promote_types(x.dtype, cos.dtype, sin.dtype)``. Differentiable."""
    acc = torch.float64 if torch.float64 in (q.dtype, k.dtype, cos.dtype, sin.dtype, out_dtype) else torch.float32
    c = cos.unsqueeze(unsqueeze_dim).to(acc)
    s = sin.unsqueeze(unsqueeze_dim).to(acc)
    cs = torch.promote_types(cos.dtype, sin.dtype)
    r = cos.shape[-1]
    rot = rotate_pairs if interleaved else rotate_half

    def embed(x):
        xf = x.to(acc)
        out = out_dtype or torch.promote_types(x.dtype, cs)
        if r == x.shape[-1]:  # no cat: elementwise ops keep x's layout, as Hugging Face's expression does
            return (xf * c + rot(xf) * s).to(out)
        turned, passed = xf[..., :r], xf[..., r:]
        return torch.cat((turned * c + rot(turned) * s, passed), dim=-1).to(out)

    return embed(q), embed(k)

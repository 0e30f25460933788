"""The ops ``tritongrad bench`` knows: how to make their inputs, what they compute in plain PyTorch, and the
fewest bytes each pass must move through device memory (the bandwidth floor GB/s is computed from).

Every built-in op has an entry in :data:`OPS`; a user's op declares its inputs and bytes with
``@op.inputs(...)`` (:meth:`tritongrad.Op.inputs`), which :func:`from_op` turns into an entry for
``tritongrad bench --op MODULE:NAME``. An op that declares none is refused, never timed on guessed inputs.

Each op reads a size ``N x D`` its own way (the entry's docstring line says how). Bytes are counted with every
floating tensor in one dtype of ``s`` bytes per element (targets: int64):

- forward : read the inputs + write the output;
- backward: read the saved inputs + read the output's gradient ``g`` + write every input's gradient;
- fwdbwd  : the sum of the two.

Row statistics a kernel may save for its backward (rstd, mean: ``N`` floats) are not counted: they are a
choice of the implementation, not something the op must move.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..ops.swiglu.experts import _moe
from ..testing import make_rows

EPS = 1e-6

# Latency regime; medium; bandwidth regime (x >= 256 MB in bf16, several times any L2) with D from 128 to
# 16384; skinny rows both ways; last, a hidden size between powers of two (5120: a row leaves 3/8 of its
# power-of-two tile masked, the norms' weakest common case).
ROW_SWEEP = (
    (4, 64),
    (4096, 4096),
    (1048576, 128),
    (131072, 1024),
    (32768, 4096),
    (16384, 16384),
    (16, 1048576),
    (4194304, 32),
    (26214, 5120),
)
QUICK_SHAPES = ((4, 64), (4096, 4096), (32768, 4096))
# Without a GPU the kernels run in Triton's interpreter (milliseconds per launch): enough to exercise the
# harness, nothing to read speed from.
SMOKE_SHAPES = ((4, 64), (16, 256))


def _x_and_vectors(count: int):
    """``x: [N, D]`` and ``count`` vectors ``[D]`` (weight, bias), fresh normal values, all requiring grad."""

    def make(N: int, D: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        x = make_rows((N, D), dtype, device)
        vectors = [torch.randn(D, dtype=dtype, device=device) for _ in range(count)]
        return tuple(t.requires_grad_() for t in (x, *vectors))

    return make


def _rows(count: int):
    """``count`` tensors ``[N, D]`` requiring grad."""

    def make(N: int, D: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        return tuple(make_rows((N, D), dtype, device).requires_grad_() for _ in range(count))

    return make


def _logits_and_targets(N: int, D: int, dtype: torch.dtype, device):
    return make_rows((N, D), dtype, device).requires_grad_(), torch.randint(0, D, (N,), device=device)


def lce_vocab(D: int) -> int:
    """linear_cross_entropy's vocabulary at hidden size D: Llama 3's 128256 from D = 1024 up, else 8 D (the
    interpreter's smoke sweep)."""
    return 128256 if D >= 1024 else 8 * D


def _hidden_weight_targets(N: int, D: int, dtype: torch.dtype, device):
    V = lce_vocab(D)
    h = (torch.randn(N, D, device=device) / 4).to(dtype).requires_grad_()
    W = (torch.randn(V, D, device=device) / D**0.5).to(dtype).requires_grad_()
    return h, W, torch.randint(0, V, (N,), device=device)


ROPE_HEADS = (32, 8)  # query and key/value heads (Llama 3 8B's)


def _rope_inputs(N: int, D: int, dtype: torch.dtype, device):
    """q [1, 32, N, D], k [1, 8, N, D] (N positions of heads of D), cos and sin [1, N, D] (no gradient)."""
    hq, hk = ROPE_HEADS
    q = torch.randn(1, hq, N, D, dtype=dtype, device=device).requires_grad_()
    k = torch.randn(1, hk, N, D, dtype=dtype, device=device).requires_grad_()
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
    emb = torch.arange(N, device=device, dtype=torch.float32)[:, None] * inv
    emb = torch.cat([emb, emb], dim=-1)[None]
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def _weighted_sum_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum(-1)


def _swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def down_width(D: int) -> int:
    """The down projection's outputs for an MLP of intermediate width D: 3D/8 (1536 at 4096, the ~350M
    training benchmark's MLP)."""
    return 3 * D // 8


def _gated_linear_inputs(N: int, D: int, dtype: torch.dtype, device):
    """gate, up [N, D] and the down projection's weight [3D/8, D], scaled as a trained layer's, all requiring
    grad."""
    gate, up = _rows(2)(N, D, dtype, device)
    w = (torch.randn(down_width(D), D, device=device) / D**0.5).to(dtype).requires_grad_()
    return gate, up, w


def _gated_linear_torch(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(gate) * up, weight)


def _add_norm_inputs(N: int, D: int, dtype: torch.dtype, device):
    """x and residual [N, D], the norm's weight [D]: a decoder layer's stream, all requiring grad."""
    x, residual = _rows(2)(N, D, dtype, device)
    return x, residual, _x_and_vectors(1)(1, D, dtype, device)[1]


def _add_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = EPS):
    """What a Llama decoder layer writes: the stream's add, then LlamaRMSNorm of it."""
    s = residual + x
    h = s.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype), s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary_torch(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Hugging Face's ``apply_rotary_pos_emb`` (Llama's)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _linear_cross_entropy_torch(input, weight, target):
    return F.cross_entropy(F.linear(input, weight), target)


def _token_logprobs_torch(input, weight, target):
    """Per-token log-probabilities as TRL's trainers took them from materialised logits (float32)."""
    return torch.log_softmax(F.linear(input, weight).float(), -1).gather(-1, target[..., None])[..., 0]


GRPO_SEQ = 1024  # completion tokens a sequence: the N tokens are N / gcd(N, GRPO_SEQ) sequences
GRPO_BETA = 0.04  # the KL coefficient of the bench's GRPO (TRL's former default), for every provider


def grpo_layout(N: int) -> tuple[int, int]:
    """(sequences, tokens each) of the bench's GRPO batch of N completion tokens."""
    T = math.gcd(N, GRPO_SEQ)
    return N // T, T


def _grpo_inputs(N: int, D: int, dtype: torch.dtype, device):
    """N completion tokens in sequences of up to GRPO_SEQ: hidden, head, ids (flat), one advantage a sequence
    and the reference's log-probs."""
    h, W, t = _hidden_weight_targets(N, D, dtype, device)
    return h, W, t, torch.randn(grpo_layout(N)[0], device=device), -10 * torch.rand(N, device=device)


def _grpo_bind(f):
    """The flat bench inputs as [sequences, tokens, ...] for a GRPO loss with the public signature."""
    def run(h, W, t, a, ref):
        B, T = grpo_layout(h.shape[0])
        return f(h.view(B, T, -1), W, t.view(B, T), a, ref_logprobs=ref.view(B, T), beta=GRPO_BETA)
    return run


def _grpo_torch(input, weight, completion_ids, advantages, completion_mask=None, bias=None, *, ref_logprobs=None,
                beta=0.0):
    """TRL's GRPO loss (dapo, on-policy) on materialised logits."""
    from ..ops.post_training.reference import grpo_from_logprobs

    lp = _token_logprobs_torch(input, weight, completion_ids)
    mask = torch.ones_like(lp) if completion_mask is None else completion_mask
    return grpo_from_logprobs(lp, advantages, mask, None, ref_logprobs, beta=beta)


DPO_BETA = 0.1  # TRL's default, for every provider


def dpo_layout(N: int) -> tuple[int, int]:
    """(sequences, tokens each) of the bench's DPO batch of N tokens (a multiple of 4): at least two pairs of
    sequences of up to GRPO_SEQ, the chosen ones first."""
    T = math.gcd(N // 4, GRPO_SEQ)
    return N // T, T


def _dpo_inputs(N: int, D: int, dtype: torch.dtype, device):
    """The policy's hidden states, head and ids (as linear_token_logprobs), and the reference model's hidden
    states and head (no gradient): the policy's, perturbed, so that the log-ratios are not all zero."""
    h, W, t = _hidden_weight_targets(N, D, dtype, device)
    ref_h = (h.detach().float() + torch.randn(N, D, device=device) / 16).to(dtype)
    ref_W = (W.detach().float() + torch.randn(W.shape, device=device) / (4 * D**0.5)).to(dtype)
    return h, W, t, ref_h, ref_W


def _dpo_bind(f):
    """The flat bench inputs as TRL's concatenated [2B, T, ...] batch for a DPO loss with the public signature."""
    def run(h, W, t, ref_h, ref_W):
        S, T = dpo_layout(h.shape[0])
        return f(h.view(S, T, -1), W, t.view(S, T), ref_input=ref_h.view(S, T, -1), ref_weight=ref_W, beta=DPO_BETA)
    return run


def _dpo_torch(input, weight, target, bias=None, *, ref_input, ref_weight, beta=0.1):
    """TRL's DPO loss (sigmoid) on materialised logits, the reference's under no_grad."""
    from ..ops.post_training.reference import dpo_from_logprobs

    logps = _token_logprobs_torch(input, weight, target).sum(-1)
    with torch.no_grad():
        ref = _token_logprobs_torch(ref_input, ref_weight, target).sum(-1)
    return dpo_from_logprobs(*logps.chunk(2), *ref.chunk(2), beta=beta)


JSD_BETA = 0.5  # TRL's and Liger's default


def _jsd_inputs(N: int, D: int, dtype: torch.dtype, device):
    """A student's hidden states and head (with gradient) and a teacher's of the same width (none): the student's,
    perturbed, so that the two distributions differ."""
    h, W, _ = _hidden_weight_targets(N, D, dtype, device)
    t_h = (h.detach().float() + torch.randn(N, D, device=device) / 8).to(dtype)
    t_W = (W.detach().float() + torch.randn(W.shape, device=device) / (2 * D**0.5)).to(dtype)
    return h, W, t_h, t_W


def _jsd_torch(student_input, student_weight, teacher_input, teacher_weight, temperature=1.0, beta=0.5):
    """TRL's generalized JSD on materialised logits (the teacher's under no_grad), the mean over tokens."""
    from ..ops.post_training.reference import _divergence_rows

    zs = F.linear(student_input, student_weight).float() / temperature
    with torch.no_grad():
        zt = F.linear(teacher_input, teacher_weight).float() / temperature
    return _divergence_rows(zs, zt, beta).mean()


MOE_EXPERTS, MOE_TOP_K = 8, 2  # experts, and experts a token: the ~350M Qwen3-MoE of the training benchmark


def moe_intermediate(D: int) -> int:
    """The experts' width at hidden size D: 2 D / 3 to a multiple of 16 (1024 at D = 1536, the training
    benchmark's MoE), so that grouped_mm takes every operand."""
    return max(16, (2 * D // 3) // 16 * 16)


def _experts_inputs(N: int, D: int, dtype: torch.dtype, device):
    """x [N, D]; each token's top-2 of 8 experts by random scores, their softmax weights; gate_up_proj
    [E, 2I, D], down_proj [E, D, I] (transformers' layout); all but the expert ids requiring grad."""
    _moe()  # transformers' module resolved here, not while torch.compile traces the baseline
    E, K, I = MOE_EXPERTS, MOE_TOP_K, moe_intermediate(D)
    x = torch.randn(N, D, device=device).to(dtype).requires_grad_()
    w, idx = torch.rand(N, E, device=device).softmax(-1).topk(K, dim=-1)
    gate_up = (torch.randn(E, 2 * I, D, device=device) / D**0.5).to(dtype).requires_grad_()
    down = (torch.randn(E, D, I, device=device) / I**0.5).to(dtype).requires_grad_()
    return x, idx, w.to(dtype).requires_grad_(), gate_up, down


class _Experts:
    """What transformers' grouped_mm experts function reads of its module: the weights, the layout flags and
    the default gate, ``F.silu(gate) * up``."""

    def __init__(self, gate_up_proj, down_proj):
        self.gate_up_proj, self.down_proj, self.num_experts = gate_up_proj, down_proj, gate_up_proj.shape[0]
        self.has_gate, self.has_bias, self.is_transposed, self.is_concatenated = True, False, False, True
        self._is_expert_parallel, self.has_post_expert_norm = False, False

    def _apply_gate(self, gate_up_out):
        gate, up = gate_up_out.chunk(2, dim=-1)
        return F.silu(gate) * up


def _experts_torch(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """transformers' ``grouped_mm`` experts implementation (Hugging Face's default for MoE layers)."""
    return _moe().grouped_mm_experts_forward(_Experts(gate_up_proj, down_proj), x, top_k_index, top_k_weights)


@dataclass(frozen=True)
class OpSpec:
    """One op. ``torch_fn`` has the op's public signature (that of ``tritongrad.<name>``) and is the eager
    baseline and what torch.compile compiles; ``bind`` turns a function of that signature into one taking
    exactly the arguments ``inputs`` makes (tensors, and for a declared op its other arguments too)."""

    name: str
    inputs: Callable[[int, int, torch.dtype, object], tuple]
    torch_fn: Callable
    bind: Callable[[Callable], Callable]
    fwd_bytes: Callable[[int, int, int], int]
    bwd_bytes: Callable[[int, int, int], int]
    shapes: tuple[tuple[int, int], ...] = ROW_SWEEP
    fn: Callable | str | None = None  # tritongrad's callable, or its name in tritongrad; None: ``name``
    size: str = "x: [N, D]"  # what N x D means for this op

    def bytes(self, mode: str, N: int, D: int, s: int) -> int:
        fwd, bwd = self.fwd_bytes(N, D, s), self.bwd_bytes(N, D, s)
        return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode]


def _identity(f):
    return f


OPS: dict[str, OpSpec] = {
    op.name: op
    for op in (
        OpSpec(
            "weighted_sum",
            _x_and_vectors(1),
            _weighted_sum_torch,
            bind=_identity,
            # read x + read w + write y
            fwd_bytes=lambda N, D, s: N * D * s + D * s + N * s,
            # read x + read w + read g + write gx + write gw
            bwd_bytes=lambda N, D, s: N * D * s + D * s + N * s + N * D * s + D * s,
        ),
        OpSpec(
            "rms_norm",
            _x_and_vectors(1),
            F.rms_norm,
            bind=lambda f: lambda x, w: f(x, (x.shape[-1],), w, EPS),
            # read x + read w + write y
            fwd_bytes=lambda N, D, s: N * D * s + D * s + N * D * s,
            # read x + read w + read g + write gx + write gw
            bwd_bytes=lambda N, D, s: N * D * s + D * s + N * D * s + N * D * s + D * s,
        ),
        OpSpec(
            "layer_norm",
            _x_and_vectors(2),
            F.layer_norm,
            bind=lambda f: lambda x, w, b: f(x, (x.shape[-1],), w, b, EPS),
            # read x + read w + read b + write y
            fwd_bytes=lambda N, D, s: N * D * s + 2 * D * s + N * D * s,
            # read x + read w + read g + write gx + write gw + write gb (b itself is not needed)
            bwd_bytes=lambda N, D, s: N * D * s + D * s + N * D * s + N * D * s + 2 * D * s,
        ),
        OpSpec(
            "cross_entropy",
            _logits_and_targets,
            F.cross_entropy,
            bind=_identity,
            # read logits + read targets (the loss, one element, not counted)
            fwd_bytes=lambda N, D, s: N * D * s + 8 * N,
            # read logits + read targets + write their gradient (an implementation that writes the gradient
            # in the forward moves these bytes there: fwdbwd is the figure to compare)
            bwd_bytes=lambda N, D, s: 2 * N * D * s + 8 * N,
            shapes=((4096, 32000), (16384, 32000), (8192, 128256)),
            size="logits [N, D] (D classes), targets [N]",
        ),
        OpSpec(
            "linear_cross_entropy",
            _hidden_weight_targets,
            _linear_cross_entropy_torch,
            bind=lambda f: lambda h, W, t: f(h, W, t),
            # read hidden + read weight + read targets (the logits are never materialised)
            fwd_bytes=lambda N, D, s: N * D * s + lce_vocab(D) * D * s + 8 * N,
            # read hidden + weight + targets + write their gradients
            bwd_bytes=lambda N, D, s: 2 * (N * D * s + lce_vocab(D) * D * s) + 8 * N,
            shapes=((4096, 4096), (16384, 4096)),
            size="hidden [N, D], weight [V, D] (V = 128256 from D = 1024, else 8 D), targets [N]",
        ),
        OpSpec(
            "linear_token_logprobs",
            _hidden_weight_targets,
            _token_logprobs_torch,
            bind=lambda f: lambda h, W, t: f(h, W, t),
            # as linear_cross_entropy: read hidden + weight + targets (no logits materialised) ...
            fwd_bytes=lambda N, D, s: N * D * s + lce_vocab(D) * D * s + 8 * N,
            # ... and write their gradients (the backward makes the logits again: compute, not bytes)
            bwd_bytes=lambda N, D, s: 2 * (N * D * s + lce_vocab(D) * D * s) + 8 * N,
            shapes=((4096, 4096), (8192, 4096)),
            size="hidden [N, D], weight [V, D] (V = 128256 from D = 1024, else 8 D), targets [N]",
        ),
        OpSpec(
            "linear_grpo_loss",
            _grpo_inputs,
            _grpo_torch,
            bind=_grpo_bind,
            # linear_token_logprobs' bytes, plus the reference's log-probabilities (float32); tritongrad's op
            # writes the gradients in the forward, moving those bytes there: fwdbwd is the figure to compare
            fwd_bytes=lambda N, D, s: N * D * s + lce_vocab(D) * D * s + 12 * N,
            bwd_bytes=lambda N, D, s: 2 * (N * D * s + lce_vocab(D) * D * s) + 12 * N,
            shapes=((4096, 4096), (8192, 4096)),
            size="N completion tokens in sequences of gcd(N, 1024): hidden [N, D], weight [V, D] (as "
                 "linear_token_logprobs), dapo loss, beta 0.04",
        ),
        OpSpec(
            "linear_dpo_loss",
            _dpo_inputs,
            _dpo_torch,
            bind=_dpo_bind,
            # read both models' hidden states and heads + targets (the reference's products take no gradient)
            fwd_bytes=lambda N, D, s: 2 * (N * D * s + lce_vocab(D) * D * s) + 8 * N,
            # write the policy's gradients (and read what makes its logits again)
            bwd_bytes=lambda N, D, s: 2 * (N * D * s + lce_vocab(D) * D * s) + 8 * N,
            shapes=((4096, 4096), (8192, 4096)),
            size="N tokens as pairs of sequences of gcd(N / 4, 1024), policy and reference: hidden [N, D], "
                 "weight [V, D] each (as linear_token_logprobs), sigmoid loss, beta 0.1",
        ),
        OpSpec(
            "linear_jsd",
            _jsd_inputs,
            _jsd_torch,
            bind=lambda f: lambda hs, Ws, ht, Wt: f(hs, Ws, ht, Wt, 1.0, JSD_BETA),
            # read both models' hidden states and heads (tritongrad's op writes the student's gradients in the
            # forward, moving those bytes there: fwdbwd is the figure to compare) ...
            fwd_bytes=lambda N, D, s: 2 * (N * D * s + lce_vocab(D) * D * s),
            # ... and write the student's gradients
            bwd_bytes=lambda N, D, s: N * D * s + lce_vocab(D) * D * s,
            shapes=((4096, 4096), (8192, 4096)),
            size="N tokens: student and teacher hidden [N, D], weight [V, D] each (V as linear_token_logprobs), "
                 "beta 0.5, temperature 1",
        ),
        OpSpec(
            "fused_add_rms_norm",
            _add_norm_inputs,
            _add_norm_torch,
            bind=lambda f: lambda x, r, w: f(x, r, w, EPS),
            # read x + read residual + read w + write y + write the stream s
            fwd_bytes=lambda N, D, s: 4 * N * D * s + D * s,
            # read s + read w + read both upstream gradients + write dx + write dresidual + write dw
            bwd_bytes=lambda N, D, s: 5 * N * D * s + 2 * D * s,
            shapes=((4096, 4096), (16384, 4096), (8192, 8192)),
            size="x, residual [N, D], weight [D]",
        ),
        OpSpec(
            "swiglu",
            _rows(2),
            _swiglu_torch,
            bind=_identity,
            # read gate + read up + write y
            fwd_bytes=lambda N, D, s: 3 * N * D * s,
            # read gate + read up + read g + write d_gate + write d_up
            bwd_bytes=lambda N, D, s: 5 * N * D * s,
            shapes=((4096, 4096), (16384, 14336), (4096, 14336)),
            size="gate, up [N, D]",
        ),
        OpSpec(
            "gated_linear",
            _gated_linear_inputs,
            _gated_linear_torch,
            bind=_identity,
            # read gate + read up + read W + write y: the product decides the time, these are its bytes
            fwd_bytes=lambda N, D, s: 2 * N * D * s + down_width(D) * D * s + N * down_width(D) * s,
            # read gate + up + W + g, write d_gate + d_up + dW (the product made again is the op's choice)
            bwd_bytes=lambda N, D, s: 4 * N * D * s + 2 * down_width(D) * D * s + N * down_width(D) * s,
            shapes=((8192, 4096), (16384, 14336)),
            size="gate, up [N, D], weight [3D/8, D]: an MLP's gated product and down projection",
        ),
        OpSpec(
            "grouped_experts",
            _experts_inputs,
            _experts_torch,
            bind=_identity,
            # read x + the experts' weights (3 E I D) + the routing (ids and weights) + write y: the products
            # decide the time, these are the bytes no implementation avoids
            fwd_bytes=lambda N, D, s: 2 * N * D * s + 3 * MOE_EXPERTS * moe_intermediate(D) * D * s
            + MOE_TOP_K * N * (8 + s),
            # read g + x + the weights + the routing + write gx + the weights' gradients + the routing weights'
            bwd_bytes=lambda N, D, s: 3 * N * D * s + 6 * MOE_EXPERTS * moe_intermediate(D) * D * s
            + MOE_TOP_K * N * (8 + 2 * s),
            shapes=((8192, 1536), (16384, 2048)),
            size="x [N, D], each token's top-2 of 8 experts: gate_up_proj [8, 2I, D], down_proj [8, D, I], "
                 "I = 2D/3 (1024 at D = 1536)",
        ),
        OpSpec(
            "rotary",
            _rope_inputs,
            _rotary_torch,
            bind=_identity,
            # read q + k + cos + sin, write q and k rotated
            fwd_bytes=lambda N, D, s: 2 * sum(ROPE_HEADS) * N * D * s + 2 * N * D * s,
            # read their gradients + cos + sin, write q's and k's
            bwd_bytes=lambda N, D, s: 2 * sum(ROPE_HEADS) * N * D * s + 2 * N * D * s,
            shapes=((4096, 128), (16384, 128)),
            fn="apply_rotary_pos_emb",
            size="q [1, 32, N, D], k [1, 8, N, D] (N positions, heads of D), cos, sin [1, N, D]",
        ),
    )
}

# Other names an op is known by (the README's, the function's).
ALIASES = {"apply_rotary_pos_emb": "rotary", "rope": "rotary", "rotary_embedding": "rotary"}


def from_op(op) -> OpSpec:
    """An :class:`OpSpec` for an op declared with :func:`tritongrad.op` whose inputs are declared
    (:meth:`tritongrad.Op.inputs`): its reference is the eager baseline and what torch.compile compiles.
    Raises ValueError, saying what to declare, for an op that declares none."""
    declared = op.declared_inputs
    if declared is None:
        op.make_inputs(1, 1, torch.float32, "meta")  # raises the message that says what to declare
    return OpSpec(op.label, op.make_inputs, op.reference, _identity, declared.fwd_bytes, declared.bwd_bytes,
                  declared.shapes or ROW_SWEEP, fn=op)


def load(path: str) -> OpSpec:
    """``"package.module:attr"``: an :class:`OpSpec`, or an op declared with :func:`tritongrad.op` that declares
    its inputs (:func:`from_op`). Raises ValueError with what to do otherwise."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"expected MODULE:NAME such as mypkg.ops:softcap, got {path!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does: MODULE may be a file under the current folder
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{path}: {type(e).__name__}: {e}") from e
    if isinstance(obj, OpSpec):
        return obj
    from .._pattern import Op

    if isinstance(obj, Op):
        return from_op(obj)
    raise ValueError(f"{path} is a {type(obj).__name__}, neither a tritongrad op nor a tritongrad.bench OpSpec")


def outputs(result) -> tuple:
    """An op's result as a tuple of its floating outputs (the tensors a backward starts from)."""
    outs = result if isinstance(result, (tuple, list)) else (result,)
    return tuple(o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point())


def verify(spec: OpSpec, device: str) -> None:
    """Before timing a user's op: at the smallest smoke shape, tritongrad's op and the baseline (its reference)
    give outputs of the same shapes and dtypes for the declared inputs, so that the rows of every provider time
    one computation. Raises ValueError saying what differs."""
    N, D = SMOKE_SHAPES[0]
    args = spec.inputs(N, D, torch.float32, device)
    with torch.no_grad():
        ours = outputs(spec.bind(spec.fn)(*args))
        base = outputs(spec.bind(spec.torch_fn)(*args))
    shown = [[(tuple(o.shape), o.dtype) for o in outs] for outs in (ours, base)]
    if shown[0] != shown[1]:
        raise ValueError(f"{spec.name} at {N}x{D}: the op returns {shown[0]}, its reference {shown[1]}; the "
                         "declared inputs must be arguments both compute one result from")

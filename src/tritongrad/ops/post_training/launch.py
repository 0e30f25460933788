"""The post-training family's launchers, op declarations and public functions: per-token log-probabilities
(and entropy) from hidden states and an LM head, the GRPO and DPO losses on them, and distillation between two
heads. No ``[N, V]`` logits tensor is ever made: rows are taken in chunks (plans.py), each chunk's logits made by
one product into a reused buffer. Design and math: docs/post-training.md, kernels.py.

Work each call does (N rows, H hidden, V vocabulary; a "product" is one N x H x V matrix product in chunks):
  linear_token_logprobs: forward 1 product (the logits) + one read of each chunk's logits;
                         backward 3 products (the logits again, grad_input, grad_weight) + one read and one write
                         of each chunk's logits. Under torch.no_grad (a reference model), the forward alone.
  linear_grpo_loss (token level): 3 products, all in the forward (the logits, grad_input, grad_weight: each
                         token's loss depends only on its own log-probability, so its derivative is known in the
                         chunk) + two reads and one write of each chunk's logits; backward: a scale.
  linear_dpo_loss:       3 products, all in the forward, when one pair's logits fit the budget (plans.py): chunks
                         of whole pairs, each pair's loss and its derivative known in its chunk; else
                         linear_token_logprobs (4 products). The reference model's scores: 1 more.
  linear_grpo_loss (sequence level): linear_token_logprobs, then O(N) elementwise work.
  linear_jsd, linear_kl_div: forward 4 products (student and teacher logits, grad_input, grad_weight: the
                         gradients are made in the forward, for an upstream gradient of 1) + 3 reads of each
                         student chunk, 2 of each teacher chunk; backward: a scale of the gradients (nothing when
                         the upstream gradient is 1).
float16 products: no gradient is made in a forward for an upstream gradient of 1 (scaled after its float16
rounding, AMP's loss scale would not keep it from underflowing): GRPO and DPO take linear_token_logprobs' path,
the distillation losses make theirs in the backward, the upstream gradient folded into the rows' weights.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
import torch.nn.functional as F

from ... import _runtime as rt
from ..._pattern import kernel, op
from ..cross_entropy.launch import _addmm_f32, _as_float, _host_checkable, _scale, _take_buffer
from . import kernels
from . import plans as P
from .reference import (
    DPO_BATCH_COUPLED,
    DPO_LOSS_TYPES,
    DPO_SCORED,
    GRPO_FORMS,
    GRPO_LOSS_TYPES,
    GRPO_SEQUENCE_COUPLED,
    acc_dtype,
    check_dpo_formula,
    check_targets,
    dpo_from_logprobs,
    dpo_losses,
    dpo_metrics,
    dpo_pair_loss,
    dpo_score,
    dpo_score_slope,
    grpo_from_logprobs,
    grpo_metrics,
    k3_kl,
    ld_token_weights,
    linear_distill_reference,
    linear_dpo_reference,
    linear_grpo_reference,
    linear_token_logprobs_reference,
    wpo_weights,
)

_fwd_kernel = kernel(kernels._token_logprobs_fwd_kernel)
_bwd_kernel = kernel(kernels._token_logprobs_bwd_kernel)
_distill_kernel = kernel(kernels._distill_fwd_kernel)


def _logits_into(buf: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``h @ weight.T (+ bias)`` into ``buf`` (a chunk's rows): the product F.linear runs, rounded as it rounds."""
    if bias is None:
        return torch.mm(h, weight.t(), out=buf)
    return torch.addmm(bias, h, weight.t(), out=buf)


def _check_scale(name: str, logit_scale) -> None:
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) a float may be symbolic
    if (isinstance(logit_scale, bool) or not isinstance(logit_scale, numbers.Real)
            or not -math.inf < logit_scale < math.inf or logit_scale == 0):
        raise ValueError(f"tritongrad.{name}: the logit scale (1 / temperature) must be finite and nonzero, got "
                         f"{logit_scale!r}")


def _check_head(name: str, input, weight, bias, mixed: bool = False) -> None:
    if input.dim() != 2 or weight.dim() != 2 or input.shape[1] != weight.shape[1]:
        raise ValueError(f"tritongrad.{name}: input [N, H] and weight [V, H] must share H, got {tuple(input.shape)} "
                         f"and {tuple(weight.shape)}")
    V = weight.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != V):
        raise ValueError(f"tritongrad.{name}: bias of shape {tuple(bias.shape)} must be [{V}] for weight "
                         f"{tuple(weight.shape)}")
    if V == 0 and input.shape[0] > 0:
        raise ValueError(f"tritongrad.{name}: weight {tuple(weight.shape)} has no classes")
    for what, t in (("weight", weight), ("bias", bias)):
        if t is None or t.dtype == input.dtype:
            continue
        if mixed and t.dtype == torch.float32 and input.dtype in (torch.float16, torch.bfloat16):
            continue  # float32 parameters with 16-bit hidden states: the product in the 16-bit dtype
        raise TypeError(f"tritongrad.{name}: {what} is {t.dtype}, input is {input.dtype}; F.linear takes one "
                        "dtype (cast them, or use torch.autocast)"
                        + ("; float32 parameters with 16-bit input are also taken" if mixed else ""))


def _low(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A parameter in the product's dtype (float32 parameters with 16-bit hidden states: one cast per call, as
    autocast makes it)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


# ---------------------------------------------------------------- linear_token_logprobs
def _head_args(logit_scale, logit_softcap=None, post_scale=1.0) -> dict:
    """The row kernels' head transform by name: the scale, the cap and the scale after it as split floats
    (``rt.split_float``), and HAS_CAP; without a cap (None), one scale (the product of both)."""
    if logit_softcap is not None and not logit_softcap > 0:  # each op's validation names its own argument first
        raise ValueError(f"tritongrad: a soft cap must be > 0 or None, got {logit_softcap!r}")
    if logit_softcap is None:
        pre, cap, post = float(logit_scale) * float(post_scale), 0.0, 1.0
    else:
        pre, cap, post = float(logit_scale), float(logit_softcap), float(post_scale)
    (s_hi, s_lo), (c_hi, c_lo), (p_hi, p_lo) = rt.split_float(pre), rt.split_float(cap), rt.split_float(post)
    return dict(scale_hi=s_hi, scale_lo=s_lo, cap_hi=c_hi, cap_lo=c_lo, post_hi=p_hi, post_lo=p_lo,
                HAS_CAP=logit_softcap is not None)


def _check_cap(name: str, what: str, cap) -> None:
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not 0 < cap < math.inf):
        raise ValueError(f"tritongrad.{name}: {what} must be a finite float > 0 or None, got {cap!r}")


def _check_rows(name, input, weight, target, bias, ignore_index, logit_scale, logit_softcap, post_scale) -> None:
    """The checks every op over rows of one head's logits makes, its errors named ``tritongrad.<name>``."""
    _check_scale(name, logit_scale)
    _check_scale(name, post_scale)
    _check_cap(name, "logit_softcap", logit_softcap)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"tritongrad.{name}: ignore_index must be an int, got {ignore_index!r}")
    _check_head(name, input, weight, bias, mixed=True)
    if target.dim() != 1 or target.shape[0] != input.shape[0]:
        raise ValueError(f"tritongrad.{name}: target of shape {tuple(target.shape)} does not match input "
                         f"{tuple(input.shape)}: expected [{input.shape[0]}]")
    if _host_checkable(target):
        check_targets(target, weight.shape[0], ignore_index, name)


def _tlp_validate(input, weight, target, bias, ignore_index, logit_scale, return_entropy, return_stats,
                  grad_weight_f32, logit_softcap=None, post_scale=1.0) -> None:
    _check_rows("linear_token_logprobs", input, weight, target, bias, ignore_index, logit_scale, logit_softcap,
                post_scale)


# Opaque under torch.compile: the chunk loop writes slices of buffers, which traced code would turn into copies
# (docs/writing-an-op.md#opaque-ops).
@op("tritongrad::linear_token_logprobs", reference=linear_token_logprobs_reference, validate=_tlp_validate,
    index=("target",), outputs=("logprobs", "entropy", "stats"), residuals=("parts",),
    save=("input", "weight", "target", "bias", "parts"), opaque=True)
def linear_token_logprobs_op(input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                             bias: Optional[torch.Tensor] = None, ignore_index: int = -100, logit_scale: float = 1.0,
                             return_entropy: bool = False, return_stats: bool = False,
                             grad_weight_f32: bool = False, logit_softcap: Optional[float] = None,
                             post_scale: float = 1.0,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered op over ``input [N, H]``, ``weight [V, H]``, ``target [N]``: ``(logprobs [N], entropy [N]
    (``[0]`` without ``return_entropy``), stats [3, N] (``[0]`` without ``return_stats``), parts)`` in float32
    (float64 for float64). stats, without gradient: each row's mean logit and whether its target is the first
    argmax (1.0 or 0.0), which TRL's DPO trainer logs, and its ``log sum_j p_j^2`` (WPO's weights). parts
    [2 or 3, N]: each row's max, the log of its shifted sum (and its entropy), for the backward. float32
    ``weight`` and ``bias`` with 16-bit ``input`` are cast to input's dtype for the products, and their gradients
    accumulate in float32; ``grad_weight_f32`` accumulates a 16-bit weight's gradient in float32 too (rounded
    once, at the end: a float32 buffer of the weight's shape, as TRL's fused head keeps). The logits:
    ``post_scale * c tanh(logit_scale * x / c)`` with ``c = logit_softcap`` (Gemma 2's final soft cap, TRL's
    order), or ``post_scale * logit_scale * x`` without one (None). :func:`linear_token_logprobs` is the public
    function."""
    N, V = input.shape[0], weight.shape[0]
    acc = acc_dtype(input)
    lp = torch.empty(N, dtype=acc, device=input.device)
    ent = torch.empty(N if return_entropy else 0, dtype=acc, device=input.device)
    stats = torch.empty((3, N) if return_stats else (0,), dtype=acc, device=input.device)
    parts = torch.empty((3 if return_entropy else 2, N), dtype=acc, device=input.device)
    if N == 0:
        return lp, ent, stats, parts
    plan = P.ChunkPlan.for_shape(rt.hint(N), int(V), input.element_size())
    buf = torch.empty((min(plan.rows, N), V), dtype=input.dtype, device=input.device)
    head = _head_args(logit_scale, logit_softcap, post_scale)
    w, b = _low(weight, input.dtype), _low(bias, input.dtype)
    for r0 in range(0, N, plan.rows):
        r1 = min(N, r0 + plan.rows)
        logits = _logits_into(buf[: r1 - r0], input[r0:r1], w, b)
        _fwd_kernel[(r1 - r0,)](
            logits, target_ptr=target, logp_ptr=lp, ent_ptr=ent if return_entropy else None, parts_ptr=parts,
            stats_ptr=stats if return_stats else None, sq_ptr=stats[2] if return_stats else None, V=V, N=N, row0=r0,
            stride_x_row=logits.stride(0), stride_t=target.stride(0), ignore_index=ignore_index, **head,
            BLOCK_V=plan.BLOCK_V, HAS_ENTROPY=return_entropy, HAS_STATS=return_stats, ACC=rt.tl_acc_dtype(acc),
            HAS_SQ=return_stats, num_warps=plan.num_warps,
        )
    return lp, ent, stats, parts


class _HeadGrads:
    """The gradients of the hidden states, the head's weight and its bias, accumulated chunk by chunk from each
    chunk's gradient with respect to its logits, G: ``grad_input[chunk] = G W``, ``grad_weight += G^T h``,
    ``grad_bias += sum G``, chunks in order (deterministic). ``need``: (input, weight, bias).

    grad_weight accumulates in a float32 buffer, rounded once, for a float32 weight with 16-bit input and, with
    ``f32``, for a 16-bit weight; else in the weight's dtype, each chunk's product accumulated in float32 and
    rounded once a chunk (docs/post-training.md, as the linear cross-entropy does)."""

    def __init__(self, input, weight, bias, need, f32: bool = False):
        self.need = (need[0], need[1], need[2] and bias is not None)
        self.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        N = input.shape[0]
        self.gi = torch.empty_like(input) if self.need[0] else None
        self.gw = None
        if self.need[1]:
            if weight.dtype != input.dtype or f32 and weight.element_size() == 2:
                self.gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            else:
                self.gw = torch.empty_like(weight) if N else torch.zeros_like(weight)
        self.gb = torch.zeros(weight.shape[0], dtype=acc_dtype(bias), device=input.device) if self.need[2] else None
        self.first = True

    def add(self, g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, r0: int, r1: int, *more: int) -> None:
        """g, h: the chunk's rows, which are input's rows ``[r0, r1)`` and then, in ``more``, further
        ``(start, end)`` spans (a DPO chunk's chosen and rejected rows)."""
        if self.need[0]:
            spans, o = (r0, r1, *more), 0
            for a, b in zip(spans[::2], spans[1::2]):
                torch.mm(g[o:o + b - a], w, out=self.gi[a:b])
                o += b - a
        if self.need[1]:
            if self.gw.dtype != g.dtype:
                _addmm_f32(self.gw, g.t(), h)
            elif self.first:
                torch.mm(g.t(), h, out=self.gw)
            else:
                self.gw.addmm_(g.t(), h)
        if self.need[2]:
            self.gb += g.sum(0, dtype=self.gb.dtype)
        self.first = False

    def result(self) -> tuple:
        gw = self.gw.to(self.dtypes[0]) if self.gw is not None and self.gw.dtype != self.dtypes[0] else self.gw
        return self.gi, gw, (self.gb.to(self.dtypes[1]) if self.gb is not None else None)


def _forward_made(ctx, need, grad_loss, inputs, recompute, folds: bool = False) -> list:
    """The gradients ``(input, weight, bias)`` asked for in ``need``, of an op whose forward made them for an
    upstream gradient of 1 (``ctx.grad_input``, ``ctx.grad_weight``, ``ctx.grad_bias``; ``inputs``: the tensors
    they are the gradients of): scaled by ``grad_loss`` (on the device; in place where the buffers may be taken,
    ``_take_buffer``). Where one asked for was not made (float16, or the registered op called directly),
    ``recompute()`` makes all of ``need`` again, for 1, then scaled; with ``folds``, ``recompute(grad_loss)``
    makes them with the upstream gradient inside, before their rounding."""
    made = (ctx.grad_input, ctx.grad_weight, ctx.grad_bias)
    have = (made[0].numel() > 0 or inputs[0].numel() == 0, made[1].numel() > 0 or inputs[1].numel() == 0,
            inputs[2] is None or made[2].numel() > 0 or inputs[2].numel() == 0)
    if all(h or not n for n, h in zip(need, have)):
        take = _take_buffer(ctx)
        return [_scale(g, grad_loss, bool(take)) if n else None for n, g in zip(need, made)]
    if folds:
        return list(recompute(grad_loss))
    return [_scale(g, grad_loss, True) if g is not None else None for g in recompute()]


def _logprobs_backward(input, weight, target, bias, parts, grad_logprobs, grad_entropy, ignore_index, logit_scale,
                       need, f32: bool, logit_softcap: float | None = None, post_scale: float = 1.0):
    """The gradients (input, weight, bias; None where not in ``need``) for upstream gradients of the
    log-probabilities ``[N]`` and, where not None, of the entropy ``[N]``: each chunk's logits made again and
    turned into their gradient in place (kernels.py), then its products."""
    N, V = input.shape[0], weight.shape[0]
    grads = _HeadGrads(input, weight, bias, need, f32)
    if N:
        plan = P.ChunkPlan.for_shape(rt.hint(N), int(V), input.element_size())
        buf = torch.empty((min(plan.rows, N), V), dtype=input.dtype, device=input.device)
        head = _head_args(logit_scale, logit_softcap, post_scale)
        has_dent = grad_entropy is not None
        w, b = _low(weight, input.dtype), _low(bias, input.dtype)
        for r0 in range(0, N, plan.rows):
            r1 = min(N, r0 + plan.rows)
            h = input[r0:r1]
            g = _logits_into(buf[: r1 - r0], h, w, b)
            _bwd_kernel[(r1 - r0,)](
                g, target_ptr=target, parts_ptr=parts, dlogp_ptr=grad_logprobs, dent_ptr=grad_entropy, V=V, N=N,
                row0=r0, stride_x_row=g.stride(0), stride_t=target.stride(0), stride_dlogp=grad_logprobs.stride(0),
                stride_dent=grad_entropy.stride(0) if has_dent else 0, ignore_index=ignore_index, **head,
                BLOCK_V=plan.BLOCK_V, HAS_DENT=has_dent, ACC=rt.tl_acc_dtype(parts.dtype), num_warps=plan.num_warps,
            )
            grads.add(g, h, w, r0, r1)
    return grads.result()


@linear_token_logprobs_op.backward
def _linear_token_logprobs_backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor, grad_stats):
    # stats have no gradient (the reference detaches them): grad_stats is not read
    need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
    dent = grad_entropy if ctx.return_entropy and grad_entropy.numel() == ctx.input.shape[0] else None
    gi, gw, gb = _logprobs_backward(ctx.input, ctx.weight, ctx.target, ctx.bias, ctx.parts, grad_logprobs, dent,
                                    ctx.ignore_index, ctx.logit_scale, (need_x, need_w, need_b),
                                    bool(ctx.grad_weight_f32), ctx.logit_softcap, ctx.post_scale)
    return gi, gw, None, gb


def _products_dtype(input: torch.Tensor) -> torch.dtype:
    """The dtype the head's products run in: autocast's (CUDA) where it is on, else input's."""
    return torch.get_autocast_dtype("cuda") if input.is_cuda and torch.is_autocast_enabled() else input.dtype


def _autocast_head(input, weight, bias):
    """Under CUDA autocast, the product in the autocast dtype, as F.linear runs it there."""
    if input.is_cuda and torch.is_autocast_enabled():
        dtype = torch.get_autocast_dtype("cuda")
        input, weight = input.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    return input, weight, bias


def _scale_of(temperature, name: str) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature > 0:
        raise ValueError(f"tritongrad.{name}: temperature must be a float > 0, got {temperature!r}")
    return 1.0 / float(temperature)


def linear_token_logprobs(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    ignore_index: int = -100,
    logit_softcap: float | None = None,
):
    """Per-token log-probabilities ``log_softmax(F.linear(input, weight, bias) / temperature)[..., target]``
    without the ``[..., V]`` logits in memory (and, with ``return_entropy``, each token's entropy).

    Args:
        input: hidden states ``[..., H]``, float16/bfloat16/float32/float64.
        weight: the LM head ``[V, H]``, input's dtype.
        target: token ids of input's leading shape, int64 or int32. Tokens equal to ``ignore_index`` get
            logprob 0 (no gradient); an id outside [0, V) raises on CPU and gives NaN on a GPU.
        bias: optional ``[V]``, input's dtype.
        temperature: the logits are divided by it (TRL's GRPO ``temperature``), > 0.
        return_entropy: also return the entropy of each token's distribution (every token, ignored ones too),
            differentiable.
        logit_softcap: Gemma 2's final soft cap ``c``: the logits are ``c * tanh(logits / c)`` before the
            temperature divides them (``final_logit_softcapping``; None: no cap).

    Returns:
        ``logprobs`` of target's shape in float32 (float64 for float64 inputs); with ``return_entropy``,
        ``(logprobs, entropy)``. The logits are made in chunks of rows by the product F.linear runs (rounded
        as F.linear rounds them), then scaled and reduced in float32. The backward makes each chunk's logits
        again and gives exact gradients of input, weight and bias (through the entropy too); grad_weight
        adds one product per chunk in a fixed order (deterministic).
    """
    if not isinstance(input, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"tritongrad.linear_token_logprobs: input and target must be Tensors, got "
                        f"{type(input).__name__} and {type(target).__name__}")
    if input.dim() == 0 or tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"tritongrad.linear_token_logprobs: target of shape {tuple(target.shape)} must be input's "
                         f"leading shape: input {tuple(input.shape)} ([..., H]) takes target {tuple(input.shape[:-1])}")
    lp, ent, _ = _token_logprobs(input, weight, target, bias, temperature, bool(return_entropy), ignore_index,
                                 logit_softcap)
    return (lp, ent) if return_entropy else lp


def _token_logprobs(input, weight, target, bias, temperature, return_entropy, ignore_index, logit_softcap,
                    return_stats=False) -> tuple:
    """:func:`linear_token_logprobs`' ``(logprobs, entropy or None, stats [3, ...] or None)``, target's shape; the
    stats (the registered op's, without gradient) include WPO's ``log sum_j p_j^2``."""
    scale = _scale_of(temperature, "linear_token_logprobs")
    input, weight, bias = _autocast_head(input, weight, bias)
    real = isinstance(logit_softcap, numbers.Real) and not isinstance(logit_softcap, bool)
    cap = float(logit_softcap) if real else logit_softcap  # anything else: the op's validation names it
    lp, ent, st = linear_token_logprobs_op(input.reshape(-1, input.shape[-1]), weight, target.reshape(-1), bias,
                                           ignore_index, scale if cap is None else 1.0, return_entropy,
                                           return_stats, False, cap, 1.0 if cap is None else scale)
    return (lp.reshape(target.shape), ent.reshape(target.shape) if return_entropy else None,
            st.reshape(3, *target.shape) if return_stats else None)


# ---------------------------------------------------------------- GRPO, DPO
def _check_like(name: str, what_target: str, target: torch.Tensor, **tensors) -> None:
    """Each tensor given (None: not given) of ``target``'s shape exactly: a flattened, transposed or broadcast one
    would be read against other tokens."""
    for what, t in tensors.items():
        if t is not None and tuple(t.shape) != tuple(target.shape):
            raise ValueError(f"tritongrad.{name}: {what} of shape {tuple(t.shape)} must have {what_target}'s shape "
                             f"{tuple(target.shape)}, one per token")


_INDEX_ARGS = ("completion_ids", "target")


def _check_dtypes(name: str, **tensors) -> None:
    """Token ids (``_INDEX_ARGS``) int64 or int32, the others floating point; None: not given."""
    for what, t in tensors.items():
        if t is None:
            continue
        ids = what in _INDEX_ARGS
        if ids and t.dtype not in (torch.int64, torch.int32) or not ids and not t.dtype.is_floating_point:
            want = "int64 or int32 token ids" if ids else "a floating-point dtype"
            raise TypeError(f"tritongrad.{name}: {what} of shape {tuple(t.shape)} is {t.dtype}; it takes {want}")


def _mask_of(target: torch.Tensor, mask: torch.Tensor | None, ignore_index: int, dtype: torch.dtype) -> torch.Tensor:
    valid = (target != ignore_index).to(dtype)
    return valid if mask is None else valid * mask.to(dtype)


def _grpo_terms(lp, adv, old, ref, c, beta, eps_low, eps_high, delta, form="clip", tau_pos=1.0, tau_neg=1.05):
    """``(c loss_tok, c dloss_tok/dl)`` per token of TRL's token-level GRPO loss (docs/post-training.md), the
    derivative with PyTorch's subgradients, as autograd takes them through TRL's formula: ``torch.min`` splits
    a tie in halves, ``torch.clamp`` passes the gradient at its bounds. Without ``old`` the ratio is 1 (old is
    the current log-probability, detached). ``form``: the surrogate (reference.py's ``_clipped_loss``)."""
    r = torch.exp(lp - old) if old is not None else torch.ones_like(lp)
    if form == "cispo":  # -min(r, eps_high) A l, the clamped ratio a constant
        k = torch.clamp(r, max=eps_high) * adv
        loss, dl = -k * lp, -k
    elif form == "sapo":  # -A 4 s(u) / tau, u = tau (r - 1): dl = -A 4 r s(u) s(-u)
        tau = torch.where(adv > 0, tau_pos, tau_neg)
        u = tau * (r - 1)
        loss = -torch.sigmoid(u) * 4 / tau * adv
        dl = -adv * 4 * r * torch.sigmoid(u) * torch.sigmoid(-u)
    else:
        c1 = r if delta is None else torch.clamp(r, max=delta)
        dc1 = 1.0 if delta is None else (r <= delta).to(lp.dtype)
        c2 = torch.clamp(r, 1 - eps_low, 1 + eps_high)
        dc2 = ((r >= 1 - eps_low) & (r <= 1 + eps_high)).to(lp.dtype)
        t1, t2 = c1 * adv, c2 * adv
        w1 = torch.where(t1 < t2, 1.0, torch.where(t1 == t2, 0.5, 0.0))
        loss = -torch.minimum(t1, t2)
        dl = -(w1 * dc1 + (1 - w1) * dc2) * adv * r
    if beta != 0.0:
        d = ref - lp
        e = torch.exp(d)
        loss = loss + beta * (e - d - 1)
        dl = dl + beta * (1 - e)
    return c * loss, c * dl


def _grpo_validate(input, weight, target, advantages, token_weight, bias, old_logprobs, ref_logprobs, ignore_index,
                   logit_scale, beta, epsilon_low, epsilon_high, delta, return_entropy, grads,
                   differentiable_logprobs, form, sapo_temperature_pos, sapo_temperature_neg, logit_softcap=None,
                   post_scale=1.0) -> None:
    if form not in ("clip", "cispo", "sapo"):
        raise ValueError(f"tritongrad.linear_grpo_loss: the surrogate form must be clip, cispo or sapo, got {form!r}")
    if form == "sapo" and not (sapo_temperature_pos > 0 and sapo_temperature_neg > 0):
        raise ValueError("tritongrad.linear_grpo_loss: sapo's temperatures must be > 0, got "
                         f"{sapo_temperature_pos} and {sapo_temperature_neg}")
    _check_rows("linear_grpo_loss", input, weight, target, bias, ignore_index, logit_scale, logit_softcap, post_scale)
    N = input.shape[0]
    for name, t in (("advantages", advantages), ("token_weight", token_weight), ("old_logprobs", old_logprobs),
                    ("ref_logprobs", ref_logprobs)):
        if t is not None and (t.dim() != 1 or t.shape[0] != N):
            raise ValueError(f"tritongrad.linear_grpo_loss: {name} of shape {tuple(t.shape)} must be [{N}], one per "
                             "token")
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError("tritongrad.linear_grpo_loss: beta != 0 needs ref_logprobs (the reference model's)")
    if grads is not None and len(grads) != 3:
        raise ValueError(f"tritongrad.linear_grpo_loss: grads must be 3 bools (input, weight, bias), got {grads}")


def _grpo_pass(input, weight, target, advantages, token_weight, bias, old, ref, ignore_index, head, beta,
               eps_low, eps_high, delta, form, lp, ent, parts, need):
    """Chunks of rows: the logits, the log-probabilities (and entropy) into ``lp`` (``ent``; the rows' max and
    log-sum into ``parts``), each token's loss and its derivative (PyTorch, O(rows)), then, where a gradient is
    asked for, the logits' gradient in place and that chunk's share of the gradients. Returns
    ``(loss, (grad_input, grad_weight, grad_bias))``. ``head``: ``(logit_scale, logit_softcap, post_scale)``."""
    N, V = input.shape[0], weight.shape[0]
    acc = lp.dtype
    rows = torch.empty(N, dtype=acc, device=input.device)
    dl = torch.empty(N, dtype=acc, device=input.device)
    grads = _HeadGrads(input, weight, bias, need)
    plan = P.ChunkPlan.for_shape(rt.hint(N), int(V), input.element_size())
    buf = torch.empty((min(plan.rows, N), V), dtype=input.dtype, device=input.device)
    head = _head_args(*head)
    w, b = _low(weight, input.dtype), _low(bias, input.dtype)
    cast = (lambda t, sl: t[sl].to(acc) if t is not None else None)
    for r0 in range(0, N, plan.rows):
        r1 = min(N, r0 + plan.rows)
        sl = slice(r0, r1)
        h = input[r0:r1]
        g = _logits_into(buf[: r1 - r0], h, w, b)
        _fwd_kernel[(r1 - r0,)](
            g, target_ptr=target, logp_ptr=lp, ent_ptr=ent, parts_ptr=parts, stats_ptr=None, sq_ptr=None, V=V, N=N,
            row0=r0, stride_x_row=g.stride(0), stride_t=target.stride(0), ignore_index=ignore_index, **head,
            BLOCK_V=plan.BLOCK_V, HAS_ENTROPY=ent is not None, HAS_STATS=False, ACC=rt.tl_acc_dtype(acc),
            HAS_SQ=False, num_warps=plan.num_warps,
        )
        rows[sl], dl[sl] = _grpo_terms(lp[sl], cast(advantages, sl), cast(old, sl), cast(ref, sl),
                                       cast(token_weight, sl), beta, eps_low, eps_high, delta, *form)
        if any(grads.need):
            _bwd_kernel[(r1 - r0,)](
                g, target_ptr=target, parts_ptr=parts, dlogp_ptr=dl, dent_ptr=None, V=V, N=N, row0=r0,
                stride_x_row=g.stride(0), stride_t=target.stride(0), stride_dlogp=dl.stride(0), stride_dent=0,
                ignore_index=ignore_index, **head, BLOCK_V=plan.BLOCK_V, HAS_DENT=False, ACC=rt.tl_acc_dtype(acc),
                num_warps=plan.num_warps,
            )
            grads.add(g, h, w, r0, r1)
    return rows.sum(), grads.result()


# Opaque, as linear_token_logprobs. The per-token GRPO loss depends only on the token's own log-probability and on
# normalisers known before the call, so the forward makes the gradients too: three products, not four.
@op("tritongrad::linear_grpo", reference=linear_grpo_reference, validate=_grpo_validate, index=("target",),
    nondiff=("advantages", "token_weight", "old_logprobs", "ref_logprobs"), outputs=("loss", "logprobs", "entropy"),
    residuals=("parts", "grad_input", "grad_weight", "grad_bias"),
    save=("input", "weight", "target", "advantages", "token_weight", "bias", "old_logprobs", "ref_logprobs",
          "logprobs", "parts", "grad_input", "grad_weight", "grad_bias"), opaque=True)
def linear_grpo_op(input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
                   token_weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   old_logprobs: Optional[torch.Tensor] = None, ref_logprobs: Optional[torch.Tensor] = None,
                   ignore_index: int = -100, logit_scale: float = 1.0, beta: float = 0.0, epsilon_low: float = 0.2,
                   epsilon_high: float = 0.2, delta: Optional[float] = None, return_entropy: bool = False,
                   grads: Optional[list[bool]] = None, differentiable_logprobs: bool = False, form: str = "clip",
                   sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                   logit_softcap: Optional[float] = None, post_scale: float = 1.0,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor]:
    """The fused token-level GRPO loss over rows ``[N]``: ``(loss, logprobs, entropy, parts, grad_input,
    grad_weight, grad_bias)``, the loss ``sum_n token_weight[n] loss_tok[n]`` (0-d, float32; float64 for
    float64), ``token_weight`` the mask times the loss type's normaliser; logprobs and entropy (``[0]`` without
    ``return_entropy``) for the metrics. ``grads`` (input, weight, bias): the gradients the forward computes
    for an upstream gradient of 1 of the loss. Without ``differentiable_logprobs`` (the public function's
    case) logprobs and entropy have no gradient and the backward scales what the forward made; with it they
    are differentiable, the forward makes no gradient and the backward takes every upstream gradient (three
    products). The logits: :func:`linear_token_logprobs_op`'s (a soft cap between ``logit_scale`` and
    ``post_scale``). :func:`linear_grpo_loss` is the public function."""
    N = input.shape[0]
    acc = acc_dtype(input)

    def empty():  # a fresh one per residual: a registered op's returns may not alias each other
        return torch.empty(0, dtype=input.dtype, device=input.device)

    need = tuple(bool(g) for g in grads) if grads is not None and not differentiable_logprobs else (False,) * 3
    lp = torch.empty(N, dtype=acc, device=input.device)
    ent = torch.empty(N if return_entropy else 0, dtype=acc, device=input.device)
    parts = torch.empty((3 if return_entropy else 2, N), dtype=acc, device=input.device)
    if N == 0:
        zero = [torch.zeros_like(t) if n and t is not None else empty()
                for t, n in ((input, need[0]), (weight, need[1]), (bias, need[2]))]
        return (torch.zeros((), dtype=acc, device=input.device), lp, ent, parts, *zero)
    loss, got = _grpo_pass(input, weight, target, advantages, token_weight, bias, old_logprobs, ref_logprobs,
                           ignore_index, (logit_scale, logit_softcap, post_scale), beta, epsilon_low, epsilon_high,
                           delta, (form, sapo_temperature_pos, sapo_temperature_neg), lp,
                           ent if return_entropy else None, parts, need)
    return loss, lp, ent, parts, *(g if g is not None else empty() for g in got)


@linear_grpo_op.backward
def _linear_grpo_backward(ctx, grad_loss: torch.Tensor, grad_logprobs, grad_entropy):
    need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[5] and ctx.bias is not None)
    if ctx.differentiable_logprobs:
        # every upstream gradient: the loss's through each token's derivative, plus the log-probabilities' own
        acc = ctx.logprobs.dtype
        f = (lambda t: t.to(acc) if t is not None else None)
        _, dl = _grpo_terms(ctx.logprobs, f(ctx.advantages), f(ctx.old_logprobs), f(ctx.ref_logprobs),
                            f(ctx.token_weight), ctx.beta, ctx.epsilon_low, ctx.epsilon_high, ctx.delta, ctx.form,
                            ctx.sapo_temperature_pos, ctx.sapo_temperature_neg)
        dent = grad_entropy if ctx.return_entropy and grad_entropy.numel() == ctx.input.shape[0] else None
        gi, gw, gb = _logprobs_backward(ctx.input, ctx.weight, ctx.target, ctx.bias, ctx.parts,
                                        grad_loss * dl + grad_logprobs, dent, ctx.ignore_index, ctx.logit_scale,
                                        need, False, ctx.logit_softcap, ctx.post_scale)
        return gi, gw, None, None, None, gb, None, None
    # logprobs and entropy are the metrics' (the reference detaches them): their gradients are not read
    def recompute():
        N = ctx.input.shape[0]
        lp = torch.empty(N, dtype=acc_dtype(ctx.input), device=ctx.input.device)
        parts = torch.empty((2, N), dtype=lp.dtype, device=ctx.input.device)
        return _grpo_pass(ctx.input, ctx.weight, ctx.target, ctx.advantages, ctx.token_weight, ctx.bias,
                          ctx.old_logprobs, ctx.ref_logprobs, ctx.ignore_index,
                          (ctx.logit_scale, ctx.logit_softcap, ctx.post_scale), ctx.beta,
                          ctx.epsilon_low, ctx.epsilon_high, ctx.delta,
                          (ctx.form, ctx.sapo_temperature_pos, ctx.sapo_temperature_neg), lp, None, parts, need)[1]

    out = _forward_made(ctx, need, grad_loss, (ctx.input, ctx.weight, ctx.bias), recompute)
    return out[0], out[1], None, None, None, out[2], None, None


def linear_grpo_loss(
    input: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    temperature: float = 1.0,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch=None,
    num_sequences_in_batch=None,
    ignore_index: int = -100,
    logit_softcap: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
):
    """TRL's GRPO loss (``GRPOTrainer._compute_loss``, TRL 1.16) from the policy's hidden states and LM head,
    without the logits in memory.

    Args:
        input: the completion tokens' hidden states ``[B, T, H]`` (the positions that predict them).
        weight, bias: the LM head ``[V, H]`` (and ``[V]``), input's dtype.
        completion_ids: ``[B, T]`` the sampled tokens; ``ignore_index`` entries count as masked.
        advantages: ``[B]`` (or ``[B, T]``).
        completion_mask: ``[B, T]``, 1 for tokens in the loss (None: every token not ``ignore_index``).
        old_logprobs: ``[B, T]`` the sampling policy's log-probabilities; None: the current ones, detached
            (TRL's on-policy case: the ratio is 1 and its gradient the policy gradient).
        ref_logprobs: ``[B, T]`` the reference model's, for the KL term (``beta != 0``).
        temperature: the logits are divided by it, as TRL's fused head does.
        beta, epsilon_low, epsilon_high, delta, loss_type (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``,
        ``luspo``, ``cispo``, ``sapo``, ``vespo``), importance_sampling_level (``token``, ``sequence``),
        max_completion_length (``dr_grpo``'s constant; None: T), sapo_temperature_pos, sapo_temperature_neg,
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg:
            as TRL's GRPOConfig (``epsilon_low`` is its ``epsilon``; ``epsilon_high`` None is ``epsilon_low``;
            for ``cispo`` ``epsilon_high`` is the ratio's cap, as in TRL). ``vespo`` weighs each sequence by
            its whole ratio, so it takes the log-probabilities first (four products).
        num_items_in_batch: for ``bnpo``, ``dapo``, ``cispo`` and ``vespo``, the completion tokens of the whole
            optimizer step (every micro-batch; under DDP, divided by the world size); None: this call's.
            Accumulating micro-batches with it gives the gradient of one big step.
        num_sequences_in_batch: for ``grpo``, ``sapo``, ``dr_grpo`` and ``luspo``, the sequences of the whole
            optimizer step; None: B.
        logit_softcap: Gemma 2's final soft cap, before the temperature (:func:`linear_token_logprobs`).

    Returns:
        ``(loss, metrics)``: the 0-d loss (float32; float64 for float64 inputs) and a dict of 0-d detached
        tensors: ``kl`` (with beta), ``entropy``, and for the clipped surrogate ``clip_ratio/low_mean``,
        ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_max``
        (for ``cispo``: ``cispo_clip_ratio``; for ``vespo``: ``vespo/phi_seq_mean``), as TRL logs them (one
        process: TRL's means over processes are left to the caller).
    """
    if completion_ids.dim() != 2 or tuple(input.shape[:-1]) != tuple(completion_ids.shape):
        raise ValueError(f"tritongrad.linear_grpo_loss: input [B, T, H] and completion_ids [B, T] must agree, got "
                         f"{tuple(input.shape)} and {tuple(completion_ids.shape)}")
    _check_like("linear_grpo_loss", "completion_ids", completion_ids, completion_mask=completion_mask,
                old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
    if tuple(advantages.shape) not in (tuple(completion_ids.shape[:1]), tuple(completion_ids.shape)):
        raise ValueError(f"tritongrad.linear_grpo_loss: advantages of shape {tuple(advantages.shape)} must be [B] or "
                         f"[B, T] for completion_ids {tuple(completion_ids.shape)}")
    _check_dtypes("linear_grpo_loss", completion_ids=completion_ids, advantages=advantages,
                  old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
    formula = dict(beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, loss_type=loss_type,
                   importance_sampling_level=importance_sampling_level, max_completion_length=max_completion_length,
                   num_items_in_batch=num_items_in_batch, num_sequences_in_batch=num_sequences_in_batch,
                   sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                   vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                   vespo_lambda_neg=vespo_lambda_neg)
    if (importance_sampling_level != "token" or loss_type in GRPO_SEQUENCE_COUPLED
            or _products_dtype(input) == torch.float16):
        # one importance weight per sequence (or VESPO's weight): each token's loss depends on its whole
        # sequence, so the log-probabilities first, then the formula, whose gradient flows back through them (nor
        # does the fused op take float16 products, whose gradients the backward must make with the upstream
        # gradient, AMP's loss scale, before their float16 rounding)
        logprobs, entropy = linear_token_logprobs(input, weight, completion_ids, bias, temperature,
                                                  return_entropy=True, ignore_index=ignore_index,
                                                  logit_softcap=logit_softcap)
        mask = _mask_of(completion_ids, completion_mask, ignore_index, logprobs.dtype)
        return grpo_from_logprobs(logprobs, advantages, mask, old_logprobs, ref_logprobs, entropy=entropy.detach(),
                                  **formula)
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"tritongrad.linear_grpo_loss: loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    scale = _scale_of(temperature, "linear_grpo_loss")
    input, weight, bias = _autocast_head(input, weight, bias)
    B, T = completion_ids.shape
    acc = acc_dtype(input)
    mask = _mask_of(completion_ids, completion_mask, ignore_index, acc)
    # each token's weight: the mask and the loss type's normaliser (grpo_from_logprobs, docs/post-training.md)
    seqs = B if num_sequences_in_batch is None else num_sequences_in_batch
    if loss_type in ("grpo", "sapo"):
        c = mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / seqs
    elif loss_type == "dr_grpo":
        c = mask / (seqs * (T if max_completion_length is None else max_completion_length))
    elif loss_type == "luspo":
        c = mask / seqs
    else:
        items = mask.sum() if num_items_in_batch is None else num_items_in_batch
        c = mask / (items.clamp(min=1.0) if isinstance(items, torch.Tensor) else max(items, 1.0))
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).expand(B, T)
    flat = (lambda t: None if t is None else t.detach().reshape(-1))
    grads = None
    if torch.is_grad_enabled():
        grads = [input.requires_grad, weight.requires_grad, isinstance(bias, torch.Tensor) and bias.requires_grad]
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    real = isinstance(logit_softcap, numbers.Real) and not isinstance(logit_softcap, bool)
    cap = float(logit_softcap) if real else logit_softcap  # anything else: the op's validation names it
    loss, lp, ent = linear_grpo_op(
        input.reshape(-1, input.shape[-1]), weight, completion_ids.reshape(-1), flat(adv), flat(c), bias,
        flat(old_logprobs), flat(ref_logprobs), ignore_index, scale if cap is None else 1.0, _as_float(beta),
        _as_float(epsilon_low), _as_float(eps_high), _as_float(delta) if delta is not None else None, True, grads,
        False, GRPO_FORMS[loss_type], _as_float(sapo_temperature_pos), _as_float(sapo_temperature_neg), cap,
        1.0 if cap is None else scale,  # TRL's order: the cap, then the temperature
    )
    with torch.no_grad():  # the metrics, from the same log-probabilities (O(tokens))
        lp = lp.reshape(B, T)
        coef_1 = torch.ones_like(lp) if old_logprobs is None else torch.exp(lp - old_logprobs.to(lp.dtype))
        kl = k3_kl(lp, ref_logprobs) if beta != 0.0 else None
        metrics = grpo_metrics(coef_1, kl, adv.to(lp.dtype), mask, ent.reshape(B, T), GRPO_FORMS[loss_type],
                               _as_float(epsilon_low), _as_float(eps_high))
    return loss, metrics



# ---------------------------------------------------------------- DPO, fused
def _dpo_terms(chosen, rejected, ref_c, ref_r, tokens_c, tokens_r, beta, loss_type, eps, tau, fdiv="reverse_kl",
               alpha=1.0, loss_weights=None, sft_slope=None):
    """``(derivative by chosen, by rejected, by the chosen sum of sft)`` per pair of TRL's DPO loss (reference.py's
    ``dpo_pair_loss``), as autograd takes them through it (relu's at 0 is 0): those by the log-ratios (or their
    scores, under an f-divergence: times the score's slope), each loss type's times its weight. ``sft_slope``:
    sft's derivative by a pair's chosen sum of unweighted log-probabilities, ``-B / sum_pairs n_c`` over the
    call's B pairs; the third derivative is None without sft."""
    lc, lr = chosen - ref_c, rejected - ref_r
    dc = dr = ds = None
    for name, w in dpo_losses(loss_type, loss_weights):
        if name == "sft":
            ds = torch.zeros_like(lc) + sft_slope * w
            continue
        if name in DPO_SCORED and fdiv != "reverse_kl":
            c, r = _dpo_slopes(dpo_score(lc, fdiv, alpha), dpo_score(lr, fdiv, alpha), tokens_c, tokens_r, beta,
                               name, eps, tau)
            c, r = c * dpo_score_slope(lc, fdiv, alpha), r * dpo_score_slope(lr, fdiv, alpha)
        else:
            c, r = _dpo_slopes(lc, lr, tokens_c, tokens_r, beta, name, eps, tau)
        c, r = (c, r) if w == 1.0 else (c * w, r * w)
        dc, dr = (c, r) if dc is None else (dc + c, dr + r)
    if dc is None:  # sft alone
        dc, dr = torch.zeros_like(lc), torch.zeros_like(lr)
    return dc, dr, ds


def _dpo_slopes(lc, lr, tokens_c, tokens_r, beta, loss_type, eps, tau):
    """Each pair's loss's derivatives by its two log-ratios (or scores) ``lc``, ``lr``: with ``d = lc - lr``,
    b = beta, s = sigmoid; a derivative by d gives ``(dd, -dd)``."""
    d = lc - lr
    x, bc, br = beta * d, beta * lc, beta * lr
    sig = torch.sigmoid
    if loss_type in ("ipo", "sigmoid_norm"):
        tc, tr = tokens_c.to(d.dtype).clamp(min=1.0), tokens_r.to(d.dtype).clamp(min=1.0)
        delta = lc / tc - lr / tr
        du = 2 * (delta - 1 / (2 * beta)) if loss_type == "ipo" else -beta * sig(-beta * delta)
        return du / tc, -du / tr
    if loss_type == "hinge":
        dd = -beta * (1 - x > 0).to(d.dtype)
    elif loss_type in ("sigmoid", "robust"):  # -(1-e) log s(x) -/+ e log s(-x), over 1 - 2e for robust
        if loss_type == "sigmoid":
            dd = -beta * sig(-x) if not eps else (1 - eps) * -beta * sig(-x) + eps * beta * sig(x)
        else:
            dd = ((1 - eps) * -beta * sig(-x) - eps * beta * sig(x)) / (1 - 2 * eps)
    elif loss_type == "exo_pair":  # s(x) s(-x) (x - log(1-e) + log e)
        dd = beta * sig(x) * sig(-x) * (x - math.log1p(-eps) + math.log(eps))
    elif loss_type == "discopop":  # -s(-x)(1 - m) + log s(x) m' - exp(-x) m + exp(-x) m',  m' = s(x/t) s(-x/t) / t
        m = sig(x / tau)
        dm = m * sig(-x / tau) / tau
        dd = beta * (-sig(-x) * (1 - m) + F.logsigmoid(x) * dm - torch.exp(-x) * m + torch.exp(-x) * dm)
    elif loss_type == "nca_pair":
        return beta * (-sig(-bc) + 0.5 * sig(bc)), beta * 0.5 * sig(br)
    elif loss_type == "bco_pair":
        return -beta * sig(-bc), beta * sig(br)
    elif loss_type == "sppo_hard":
        return 2 * (lc - 0.5 / beta), 2 * (lr + 0.5 / beta)
    elif loss_type == "apo_zero":
        return -beta * sig(bc) * sig(-bc), beta * sig(br) * sig(-br)
    elif loss_type == "apo_down":
        dx = beta * sig(x) * sig(-x)
        return beta * sig(bc) * sig(-bc) - dx, dx
    else:
        raise ValueError(f"tritongrad.linear_dpo_loss: loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    return dd, -dd


def _dpo_validate(input, weight, target, token_weight, ref_chosen_logps, ref_rejected_logps, bias, ignore_index,
                  logit_scale, logit_softcap, post_scale, beta, loss_type, label_smoothing, grads,
                  differentiable_logps, discopop_tau, f_divergence_type, f_alpha_divergence_coef,
                  ld_alpha, loss_weights=None, use_weighting=False) -> None:
    _check_rows("linear_dpo_loss", input, weight, target, bias, ignore_index, logit_scale, logit_softcap, post_scale)
    if token_weight.dim() != 2 or token_weight.shape[0] % 2 or token_weight.numel() != input.shape[0]:
        raise ValueError(f"tritongrad.linear_dpo_loss: token_weight of shape {tuple(token_weight.shape)} must be "
                         f"[2B, T], one per row of input {tuple(input.shape)} (B chosen sequences, then B rejected)")
    B = token_weight.shape[0] // 2
    for name, t in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
        if t.dim() != 1 or t.shape[0] != B:
            raise ValueError(f"tritongrad.linear_dpo_loss: {name} of shape {tuple(t.shape)} must be [{B}], one per "
                             "pair")
    check_dpo_formula(loss_type, label_smoothing, discopop_tau, f_divergence_type, ld_alpha, loss_weights,
                      use_weighting)
    names = [n for n, _ in dpo_losses(loss_type, loss_weights)]
    coupled = [n for n in names if n in DPO_BATCH_COUPLED]
    if coupled:
        raise ValueError(f"tritongrad.linear_dpo: {coupled} sort the batch's pairs, so no chunk of pairs knows its "
                         "gradient; linear_dpo_loss computes them from the log-probabilities (four products)")
    if use_weighting and "sft" in names:
        raise ValueError("tritongrad.linear_dpo: sft with use_weighting (WPO) takes the mean of every pair's weight, "
                         "so no chunk of pairs knows its gradient; linear_dpo_loss computes it from the "
                         "log-probabilities (four products)")
    if grads is not None and len(grads) != 3:
        raise ValueError(f"tritongrad.linear_dpo_loss: grads must be 3 bools (input, weight, bias), got {grads}")


def _dpo_pass(input, weight, target, token_weight, ref_c, ref_r, bias, ignore_index, logit_scale, logit_softcap,
              post_scale, beta, loss_type, eps, tau, fdiv, alpha, ld_alpha, need, upstream=None, loss_weights=None,
              use_weighting=False):
    """Chunks of whole pairs (pair i: input's sequences i and B + i, T rows each): the logits of the chunk's
    chosen and rejected rows (one product), the log-probabilities, each sequence's sum, each pair's loss and its
    derivative (PyTorch, O(pairs)), then, where a gradient is asked for, the logits' gradient in place and the
    chunk's share of the gradients, for the upstream gradients ``(of the loss, of the B chosen and the B rejected
    log-probabilities [2B])`` (None: 1 for the loss, 0 for the others). Returns ``(loss, chosen_logps,
    rejected_logps, (grad_input, grad_weight, grad_bias))``."""
    N, V = input.shape[0], weight.shape[0]
    B, T = token_weight.shape[0] // 2, token_weight.shape[1]
    acc = acc_dtype(input)
    mask = token_weight.to(acc)
    tokens = mask.sum(-1)  # the completions' lengths; the sums weigh tokens by LD-DPO's weights
    tw = ld_token_weights(mask, ld_alpha)
    sft_slope = -B / tokens[:B].sum() if B else None  # sft's derivative by each chosen sum (on the device)
    ref_c, ref_r = ref_c.to(acc), ref_r.to(acc)
    logps = torch.zeros(2 * B, dtype=acc, device=input.device)
    # sft's chosen sums weigh every token 1, LD-DPO's sums do not: kept apart where they differ
    plain = torch.zeros(B, dtype=acc, device=input.device) if ld_alpha is not None else None
    # WPO: each row's log sum_j p_j^2 from the forward kernel, each pair's weight once its chunk is scored
    sq = torch.empty(N, dtype=acc, device=input.device) if use_weighting else None
    pair_w = torch.ones(B, dtype=acc, device=input.device) if use_weighting else None
    lp = torch.empty(N, dtype=acc, device=input.device)
    parts = torch.empty((2, N), dtype=acc, device=input.device)
    dl = torch.empty(N, dtype=acc, device=input.device)
    grads = _HeadGrads(input, weight, bias, need)
    if N:
        plan = P.PairPlan.for_shape(rt.hint(B), rt.hint(T), int(V), input.element_size())
        buf = torch.empty((2 * min(plan.pairs, B) * T, V), dtype=input.dtype, device=input.device)
        w, b = _low(weight, input.dtype), _low(bias, input.dtype)
        launch = dict(target_ptr=target, parts_ptr=parts, V=V, N=N, stride_t=target.stride(0),
                      ignore_index=ignore_index, **_head_args(logit_scale, logit_softcap, post_scale),
                      BLOCK_V=plan.BLOCK_V, ACC=rt.tl_acc_dtype(acc), num_warps=plan.num_warps)
        for p0 in range(0, B, plan.pairs):
            p1 = min(B, p0 + plan.pairs)
            n = (p1 - p0) * T
            spans = ((p0 * T, p1 * T), ((B + p0) * T, (B + p1) * T))
            h = torch.cat([input[a:e] for a, e in spans])
            g = _logits_into(buf[: 2 * n], h, w, b)
            for (a, e), rows in zip(spans, (g[:n], g[n:])):
                _fwd_kernel[(n,)](
                    rows, logp_ptr=lp, ent_ptr=None, stats_ptr=None, sq_ptr=sq, row0=a, stride_x_row=rows.stride(0),
                    HAS_ENTROPY=False, HAS_STATS=False, HAS_SQ=sq is not None, **launch,
                )
            pair = slice(p0, p1), slice(B + p0, B + p1)
            for sl in pair:
                logps[sl] = (lp.view(2 * B, T)[sl] * tw[sl]).sum(-1)
            if plain is not None:
                plain[p0:p1] = (lp.view(2 * B, T)[pair[0]] * mask[pair[0]]).sum(-1)
            if sq is not None:
                def both(t):  # the chunk's chosen sequences, then its rejected ones
                    return torch.cat([t[pair[0]], t[pair[1]]])
                pair_w[p0:p1] = wpo_weights(both(lp.view(2 * B, T)), both(sq.view(2 * B, T)), both(mask))
            if any(grads.need):
                dc, dr, ds = _dpo_terms(logps[pair[0]], logps[pair[1]], ref_c[p0:p1], ref_r[p0:p1],
                                        tokens[pair[0]], tokens[pair[1]], beta, loss_type, eps, tau, fdiv, alpha,
                                        loss_weights, sft_slope)
                if pair_w is not None:  # WPO: the pair's loss times its weight, a constant
                    dc, dr = dc * pair_w[p0:p1], dr * pair_w[p0:p1]
                for sl, (a, e), d in zip(pair, spans, (dc, dr)):
                    d = d / B if upstream is None else upstream[0] * d / B + upstream[1][sl]
                    rows_d = d[:, None] * tw[sl]
                    if ds is not None and sl is pair[0]:  # sft's share, over the chosen tokens unweighted
                        rows_d = rows_d + (ds / B if upstream is None else upstream[0] * ds / B)[:, None] * mask[sl]
                    dl[a:e] = rows_d.reshape(-1)
                for (a, e), rows in zip(spans, (g[:n], g[n:])):
                    _bwd_kernel[(n,)](
                        rows, dlogp_ptr=dl, dent_ptr=None, row0=a, stride_x_row=rows.stride(0),
                        stride_dlogp=dl.stride(0), stride_dent=0, HAS_DENT=False, **launch,
                    )
                grads.add(g, h, w, *spans[0], *spans[1])
    chosen, rejected = logps[:B].clone(), logps[B:].clone()  # outputs of a registered op: no views of each other
    total = dpo_pair_loss(chosen - ref_c, rejected - ref_r, tokens[:B], tokens[B:], beta=beta, loss_type=loss_type,
                          label_smoothing=eps, discopop_tau=tau, f_divergence_type=fdiv,
                          f_alpha_divergence_coef=alpha, loss_weights=loss_weights,
                          chosen_logps=chosen if plain is None else plain, pair_weights=pair_w).sum()
    return total / B, chosen, rejected, grads.result()


# Opaque, as linear_token_logprobs. A pair's loss depends only on its two sequences, so a chunk of whole pairs knows
# its derivative and the forward makes the gradients too: three products, not four (docs/post-training.md).
@op("tritongrad::linear_dpo", reference=linear_dpo_reference, validate=_dpo_validate, index=("target",),
    nondiff=("token_weight", "ref_chosen_logps", "ref_rejected_logps"),
    outputs=("loss", "chosen_logps", "rejected_logps"), residuals=("grad_input", "grad_weight", "grad_bias"),
    save=("input", "weight", "target", "token_weight", "ref_chosen_logps", "ref_rejected_logps", "bias",
          "grad_input", "grad_weight", "grad_bias"), opaque=True)
def linear_dpo_op(input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, token_weight: torch.Tensor,
                  ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
                  bias: Optional[torch.Tensor] = None, ignore_index: int = -100, logit_scale: float = 1.0,
                  logit_softcap: Optional[float] = None, post_scale: float = 1.0, beta: float = 0.1,
                  loss_type: str = "sigmoid", label_smoothing: float = 0.0, grads: Optional[list[bool]] = None,
                  differentiable_logps: bool = False, discopop_tau: float = 0.05,
                  f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 1.0,
                  ld_alpha: Optional[float] = None, loss_weights: Optional[list[float]] = None,
                  use_weighting: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused DPO loss over rows ``[2B T]`` of ``input [2B T, H]`` (B chosen sequences of T rows, then their B
    rejected ones): ``(loss, chosen_logps [B], rejected_logps [B], grad_input, grad_weight, grad_bias)``, the
    sequence log-probabilities ``sum_t token_weight[s, t] logprob[s, t]`` (``token_weight [2B, T]``, the mask)
    (without gradient unless ``differentiable_logps``), the loss TRL's mean over the B pairs (0-d, float32;
    float64 for float64). The logits as linear_token_logprobs makes them (``logit_scale``, ``logit_softcap``,
    ``post_scale``). ``grads`` (input, weight, bias): the gradients the forward computes for an upstream
    gradient of 1; the backward scales them (or, for one it did not make, runs the pass again). With
    ``differentiable_logps`` the forward makes none and the backward runs the pass for every upstream gradient.
    :func:`linear_dpo_loss` is the public function."""
    def empty():  # a fresh one per residual: a registered op's returns may not alias each other
        return torch.empty(0, dtype=input.dtype, device=input.device)

    need = tuple(bool(g) for g in grads) if grads is not None and not differentiable_logps else (False,) * 3
    loss, chosen, rejected, got = _dpo_pass(input, weight, target, token_weight, ref_chosen_logps,
                                            ref_rejected_logps, bias, ignore_index, logit_scale, logit_softcap,
                                            post_scale, beta, loss_type, label_smoothing, discopop_tau,
                                            f_divergence_type, f_alpha_divergence_coef, ld_alpha, need,
                                            loss_weights=loss_weights, use_weighting=use_weighting)
    return loss, chosen, rejected, *(g if g is not None else empty() for g in got)


@linear_dpo_op.backward
def _linear_dpo_backward(ctx, grad_loss: torch.Tensor, grad_chosen, grad_rejected):
    need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[6] and ctx.bias is not None)
    if ctx.differentiable_logps:  # every upstream gradient, through the pairs' derivatives and the sums
        *_, got = _dpo_pass(ctx.input, ctx.weight, ctx.target, ctx.token_weight, ctx.ref_chosen_logps,
                            ctx.ref_rejected_logps, ctx.bias, ctx.ignore_index, ctx.logit_scale, ctx.logit_softcap,
                            ctx.post_scale, ctx.beta, ctx.loss_type, ctx.label_smoothing, ctx.discopop_tau,
                            ctx.f_divergence_type, ctx.f_alpha_divergence_coef, ctx.ld_alpha, need,
                            (grad_loss, torch.cat([grad_chosen, grad_rejected])), loss_weights=ctx.loss_weights,
                            use_weighting=ctx.use_weighting)
        return got[0], got[1], None, None, None, None, got[2]
    # the sequence log-probabilities are the metrics' (the reference detaches them): their gradients are not read
    out = _forward_made(ctx, need, grad_loss, (ctx.input, ctx.weight, ctx.bias), lambda: _dpo_pass(
        ctx.input, ctx.weight, ctx.target, ctx.token_weight, ctx.ref_chosen_logps, ctx.ref_rejected_logps, ctx.bias,
        ctx.ignore_index, ctx.logit_scale, ctx.logit_softcap, ctx.post_scale, ctx.beta, ctx.loss_type,
        ctx.label_smoothing, ctx.discopop_tau, ctx.f_divergence_type, ctx.f_alpha_divergence_coef, ctx.ld_alpha,
        need, loss_weights=ctx.loss_weights, use_weighting=ctx.use_weighting)[3])
    return out[0], out[1], None, None, None, None, out[2]


def linear_dpo_loss(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
    ref_input: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: str | list[str] = "sigmoid",
    label_smoothing: float = 0.0,
    num_pairs_in_batch=None,
    ignore_index: int = -100,
    logit_softcap: float | None = None,
    discopop_tau: float = 0.05,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 1.0,
    ld_alpha: float | None = None,
    loss_weights: list[float] | None = None,
    use_weighting: bool = False,
):
    """TRL's DPO loss (``DPOTrainer._compute_loss``) from the policy's hidden states and LM head, without the
    logits in memory.

    Args:
        input: ``[2B, T, H]``, the chosen completions' hidden states first, then the rejected ones' (TRL's
            concatenated batch); each position predicts ``target`` at that position.
        weight, bias: the policy's LM head.
        target: ``[2B, T]`` token ids; ``ignore_index`` (prompt, padding) is out of the sums.
        ref_chosen_logps, ref_rejected_logps: ``[B]`` the reference model's sequence log-probabilities
            (TRL's precomputed ones), constants of the loss (detached); or, instead, ``ref_input``
            ``[2B, T, H']`` with ``ref_weight`` (and ``ref_bias``): the reference model's hidden states and head,
            scored here without gradient.
        completion_mask: ``[2B, T]``, optional, multiplied into the target's mask.
        beta, loss_type, label_smoothing, discopop_tau: as TRL 1.16's DPOConfig, for the loss types that are a
            function of one pair: ``sigmoid``, ``hinge``, ``ipo``, ``robust``, ``exo_pair``, ``nca_pair``,
            ``bco_pair``, ``sppo_hard``, ``apo_zero``, ``apo_down``, ``discopop``, ``sigmoid_norm`` (the formulas:
            ``reference.dpo_pair_loss``). ``robust`` takes label smoothing in [0, 0.5), ``exo_pair`` in (0, 1);
            ``sigmoid`` with label smoothing is conservative DPO, as TRL before 1.0 defined it (TRL 1.16's
            sigmoid ignores label smoothing: the two agree at 0). ``sft``: the chosen tokens' mean negative
            log-probability. ``aot`` and ``aot_unpaired`` sort the batch's pairs: they take the
            log-probabilities first, then the formula (four products, not three).
        loss_weights: with a list of loss types (TRL's ``loss_type=[...]``, e.g. MPO's ``["sigmoid", "bco_pair",
            "sft"]``), one weight each (None: 1 each); the loss is their weighted sum, as TRL's.
        use_weighting: WPO, as TRL's DPOConfig: each pair's loss times ``w_c w_r``, with ``w_s = exp(mean over
            the sequence's tokens of (logprob - log sum_j p_j^2))`` under the policy, constants
            (``reference.wpo_weights``); sft's term, a batch-wide mean, times the pairs' mean weight (TRL's
            arithmetic, on which TRL 1.16 itself raises). With sft, float16 inputs or pairs over
            ``pair_bytes``, from the log-probabilities (four products).
        f_divergence_type (``reverse_kl``, ``forward_kl``, ``js_divergence``, ``alpha_divergence``),
            f_alpha_divergence_coef: as TRL's DPOConfig (``reference.dpo_score``).
        ld_alpha: LD-DPO, as TRL's DPOConfig: each sequence's log-probability sums its pair's shared length of
            completion tokens at weight 1 and the rest at ``ld_alpha`` (``reference.ld_token_weights``), the
            policy's and the reference's alike; None: plain sums.
        num_pairs_in_batch: the pairs of the whole optimizer step (None: B); the loss is the sum over pairs
            divided by it, so accumulated micro-batches give one big step's gradient.
        logit_softcap: Gemma 2's final soft cap, for the policy and the reference head alike
            (:func:`linear_token_logprobs`).

    The policy's logits are made in chunks of whole pairs, as many as ``plans.LIMITS.pair_bytes`` (1 GiB)
    holds, and each pair's gradients in the same pass: three products. A pair over that budget takes chunks of
    rows and four products (docs/post-training.md#dpo).

    Returns:
        ``(loss, metrics)``: the 0-d loss and a dict with ``chosen_rewards`` and ``rejected_rewards`` (``[B]``,
        ``beta * (logp - ref_logp)``, detached) and TRL's logged means ``rewards/chosen``,
        ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
        ``logps/rejected``.
    """
    if target.dim() != 2 or target.shape[0] % 2 or tuple(input.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"tritongrad.linear_dpo_loss: input [2B, T, H] and target [2B, T] must agree (chosen rows "
                         f"first, then rejected), got {tuple(input.shape)} and {tuple(target.shape)}")
    _check_like("linear_dpo_loss", "target", target, completion_mask=completion_mask)
    _check_dtypes("linear_dpo_loss", target=target, ref_chosen_logps=ref_chosen_logps,
                  ref_rejected_logps=ref_rejected_logps)
    check_dpo_formula(loss_type, label_smoothing, discopop_tau, f_divergence_type, ld_alpha, loss_weights,
                      use_weighting)
    terms = dpo_losses(loss_type, loss_weights)
    loss_type = ",".join(n for n, _ in terms)  # the registered op takes the names joined, and a weight each
    loss_weights = None if all(w == 1.0 for _, w in terms) else [w for _, w in terms]
    mask = _mask_of(target, completion_mask, ignore_index, acc_dtype(input))
    tgt = torch.where(mask > 0, target, ignore_index)
    weights = ld_token_weights(mask, ld_alpha)
    if ref_chosen_logps is None or ref_rejected_logps is None:
        if ref_input is None or ref_weight is None:
            raise ValueError("tritongrad.linear_dpo_loss: give ref_chosen_logps and ref_rejected_logps, or ref_input "
                             "and ref_weight")
        with torch.no_grad():
            ref = linear_token_logprobs(ref_input, ref_weight, tgt, ref_bias, ignore_index=ignore_index,
                                        logit_softcap=logit_softcap)
            ref = (ref * weights).sum(-1)
        ref_chosen_logps, ref_rejected_logps = ref.chunk(2)
    ref_chosen_logps, ref_rejected_logps = ref_chosen_logps.detach(), ref_rejected_logps.detach()
    tokens = mask.sum(-1)
    formula = dict(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, chosen_tokens=tokens.chunk(2)[0],
                   rejected_tokens=tokens.chunk(2)[1], discopop_tau=discopop_tau, f_divergence_type=f_divergence_type,
                   f_alpha_divergence_coef=f_alpha_divergence_coef, loss_weights=loss_weights)
    x, w, b = _autocast_head(input, weight, bias)
    B, T = target.shape[0] // 2, target.shape[1]
    coupled = any(n in DPO_BATCH_COUPLED or n == "sft" and use_weighting for n, _ in terms)
    if not P.pairs_fit(rt.hint(T), rt.hint(w.shape[0]), x.element_size()) or x.dtype == torch.float16 or coupled:
        # a pair's logits over the budget: its loss needs all its tokens first, so the log-probabilities in chunks
        # of rows, then the formula, whose gradient flows back through them (the logits made twice); float16
        # products too, whose gradients the backward must make with the upstream gradient (AMP's loss scale);
        # and what needs every pair first: aot's sort over the batch's pairs, sft's mean WPO weight
        token_lp, _, st = _token_logprobs(input, weight, tgt, bias, 1.0, False, ignore_index, logit_softcap,
                                          return_stats=use_weighting)
        chosen, rejected = (token_lp * weights).sum(-1).chunk(2)
        plain = (token_lp * mask).sum(-1).chunk(2)[0] if ld_alpha is not None else None  # sft's: every token 1
        pair_w = wpo_weights(token_lp, st[2], mask) if use_weighting else None
        return dpo_from_logprobs(chosen, rejected, ref_chosen_logps, ref_rejected_logps,
                                 num_pairs_in_batch=num_pairs_in_batch, sft_chosen_logps=plain, pair_weights=pair_w,
                                 **formula)
    grads = None
    if torch.is_grad_enabled():
        grads = [x.requires_grad, w.requires_grad, isinstance(b, torch.Tensor) and b.requires_grad]
    real = isinstance(logit_softcap, numbers.Real) and not isinstance(logit_softcap, bool)
    loss, chosen, rejected = linear_dpo_op(
        x.reshape(-1, x.shape[-1]), w, tgt.reshape(-1), mask, ref_chosen_logps, ref_rejected_logps, b, ignore_index,
        1.0, float(logit_softcap) if real else logit_softcap, 1.0, _as_float(beta), loss_type,
        _as_float(label_smoothing), grads, False, _as_float(discopop_tau), f_divergence_type,
        _as_float(f_alpha_divergence_coef), _as_float(ld_alpha) if ld_alpha is not None else None, loss_weights,
        use_weighting,
    )
    if num_pairs_in_batch is not None:  # the op's mean over this call's B pairs, as a share of the whole step's
        loss = loss * B / num_pairs_in_batch
    return loss, dpo_metrics(chosen, rejected, ref_chosen_logps, ref_rejected_logps, beta)  # O(pairs)


# ---------------------------------------------------------------- distillation
def _distill_validate(student_input, student_weight, teacher_input, teacher_weight, row_weight, student_bias,
                      teacher_bias, beta, logit_scale, grads, student_logit_softcap=None, teacher_logit_softcap=None,
                      post_scale=1.0) -> None:
    _check_scale("linear_jsd", logit_scale)
    _check_scale("linear_jsd", post_scale)
    _check_cap("linear_jsd", "student_logit_softcap", student_logit_softcap)
    _check_cap("linear_jsd", "teacher_logit_softcap", teacher_logit_softcap)
    if not isinstance(beta, numbers.Real) or isinstance(beta, bool) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"tritongrad.linear_jsd: beta must be a float in [0, 1], got {beta!r}")
    _check_head("linear_jsd (student)", student_input, student_weight, student_bias)
    _check_head("linear_jsd (teacher)", teacher_input, teacher_weight, teacher_bias)
    N = student_input.shape[0]
    if teacher_input.shape[0] != N or teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(f"tritongrad.linear_jsd: student {tuple(student_input.shape)} x "
                         f"{tuple(student_weight.shape)} and teacher {tuple(teacher_input.shape)} x "
                         f"{tuple(teacher_weight.shape)} must share the rows and the vocabulary")
    if row_weight.dim() != 1 or row_weight.shape[0] != N:
        raise ValueError(f"tritongrad.linear_jsd: row_weight of shape {tuple(row_weight.shape)} must be [{N}]")
    if grads is not None and len(grads) != 3:
        raise ValueError(f"tritongrad.linear_jsd: grads must be 3 bools (input, weight, bias), got {grads}")


def _distill_pass(s_in, s_w, t_in, t_w, row_weight, s_b, t_b, beta, head, need, rows_out):
    """Chunks of rows: both heads' logits, the divergence kernel (the student's gradient over its logits where
    any is asked for), then that chunk's share of the gradients asked for. Returns them (None where not).
    ``head``: ``(logit_scale, student_logit_softcap, teacher_logit_softcap, post_scale)``."""
    N, V = s_in.shape[0], s_w.shape[0]
    acc = acc_dtype(s_in)
    want = any(need)
    grads = _HeadGrads(s_in, s_w, s_b, need)
    plan = P.ChunkPlan.for_shape(rt.hint(N), int(V), max(s_in.element_size(), t_in.element_size()))
    rows = min(plan.rows, N)
    sbuf = torch.empty((rows, V), dtype=s_in.dtype, device=s_in.device)
    tbuf = torch.empty((rows, V), dtype=t_in.dtype, device=s_in.device)
    mode = 0 if beta == 0.0 else 1 if beta == 1.0 else 2
    scale, s_cap, t_cap, post = head
    heads = {f"{who}_{k}": v for who, cap in (("s", s_cap), ("t", t_cap))
             for k, v in _head_args(scale, cap, post).items()}  # s_scale_hi, ..., s_HAS_CAP, t_...
    caps = dict(HAS_CAP_S=heads.pop("s_HAS_CAP"), HAS_CAP_T=heads.pop("t_HAS_CAP"))
    beta_split = rt.split_float(float(beta))
    for r0 in range(0, N, plan.rows):
        r1 = min(N, r0 + plan.rows)
        h = s_in[r0:r1]
        zs = _logits_into(sbuf[: r1 - r0], h, s_w, s_b)
        zt = _logits_into(tbuf[: r1 - r0], t_in[r0:r1], t_w, t_b)
        _distill_kernel[(r1 - r0,)](
            zs, t_ptr=zt, w_ptr=row_weight, loss_ptr=rows_out, V=V, row0=r0, stride_s_row=zs.stride(0),
            stride_t_row=zt.stride(0), stride_w=row_weight.stride(0), **heads, beta_hi=beta_split[0],
            beta_lo=beta_split[1], MODE=mode, STORE_GRAD=want, BLOCK_V=plan.BLOCK_V, ACC=rt.tl_acc_dtype(acc),
            **caps, num_warps=plan.num_warps,
        )
        if want:
            grads.add(zs, h, s_w, r0, r1)
    return grads.result()


@op("tritongrad::linear_distill", reference=linear_distill_reference, validate=_distill_validate,
    nondiff=("teacher_input", "teacher_weight", "row_weight", "teacher_bias"), outputs=("loss",),
    residuals=("grad_input", "grad_weight", "grad_bias"),
    save=("student_input", "student_weight", "teacher_input", "teacher_weight", "row_weight", "student_bias",
          "teacher_bias", "grad_input", "grad_weight", "grad_bias"), opaque=True,
    scaled_grads={"student_input": "grad_input", "student_weight": "grad_weight", "student_bias": "grad_bias"})
def linear_distill_op(student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
                      teacher_weight: torch.Tensor, row_weight: torch.Tensor,
                      student_bias: Optional[torch.Tensor] = None, teacher_bias: Optional[torch.Tensor] = None,
                      beta: float = 0.5, logit_scale: float = 1.0, grads: Optional[list[bool]] = None,
                      student_logit_softcap: Optional[float] = None, teacher_logit_softcap: Optional[float] = None,
                      post_scale: float = 1.0,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered distillation op: ``(loss, grad_input, grad_weight, grad_bias)``, the loss
    ``sum_n row_weight[n] D_n`` (0-d, float32; float64 for float64) of the student's distribution against the
    teacher's (kernels.py). ``grads`` (student input, weight, bias): the gradients the forward computes for an
    upstream gradient of 1 (none for float16 products); the others are empty, and the backward computes what is
    asked for and missing. Each head's logits: ``post_scale * c tanh(logit_scale * x / c)`` with its soft cap
    ``c`` (``student_logit_softcap``, ``teacher_logit_softcap``), or ``post_scale * logit_scale * x`` without
    one (None).
    :func:`linear_jsd` and :func:`linear_kl_div` are the public functions."""
    N = student_input.shape[0]
    acc = acc_dtype(student_input)

    def empty():  # a fresh one per residual: a registered op's returns may not alias each other
        return torch.empty(0, dtype=student_input.dtype, device=student_input.device)

    # float16 products: the backward makes the gradients, the upstream gradient (AMP's loss scale) folded into the
    # rows' weights before the float16 rounding; made here for 1 and scaled later, they would underflow.
    made = grads is not None and student_input.dtype != torch.float16
    need = tuple(bool(g) for g in grads) if made else (False,) * 3
    need = (need[0], need[1], need[2] and student_bias is not None)
    if N == 0:
        zero = [torch.zeros_like(t) if n else empty()
                for t, n in ((student_input, need[0]), (student_weight, need[1]), (student_bias, need[2]))]
        return (torch.zeros((), dtype=acc, device=student_input.device), *zero)
    rows = torch.empty(N, dtype=acc, device=student_input.device)
    gi, gw, gb = _distill_pass(student_input, student_weight, teacher_input, teacher_weight, row_weight, student_bias,
                               teacher_bias, beta,
                               (logit_scale, student_logit_softcap, teacher_logit_softcap, post_scale), need, rows)
    return rows.sum(), *(g if g is not None else empty() for g in (gi, gw, gb))


@linear_distill_op.backward
def _linear_distill_backward(ctx, grad_loss: torch.Tensor):
    need_x, need_w = ctx.needs_input_grad[:2]
    need_b = ctx.needs_input_grad[5] and ctx.student_bias is not None
    need = (need_x, need_w, need_b)

    def recompute(scale):
        # the upstream gradient folded into the rows' weights: it multiplies each row's gradient before rounding
        rows = torch.empty(ctx.student_input.shape[0], dtype=acc_dtype(ctx.student_input),
                           device=ctx.student_input.device)
        return _distill_pass(ctx.student_input, ctx.student_weight, ctx.teacher_input, ctx.teacher_weight,
                             ctx.row_weight * scale.to(ctx.row_weight.dtype), ctx.student_bias, ctx.teacher_bias,
                             ctx.beta,
                             (ctx.logit_scale, ctx.student_logit_softcap, ctx.teacher_logit_softcap, ctx.post_scale),
                             need, rows)

    out = _forward_made(ctx, need, grad_loss, (ctx.student_input, ctx.student_weight, ctx.student_bias), recompute,
                        folds=True)
    return out[0], out[1], None, None, None, out[2], None


def linear_jsd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    temperature: float = 1.0,
    beta: float = 0.5,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    num_items_in_batch=None,
    student_logit_softcap: float | None = None,
    teacher_logit_softcap: float | None = None,
):
    """TRL's generalized Jensen-Shannon divergence between a student's and a teacher's next-token
    distributions, from both models' hidden states and LM heads; neither model's ``[N, V]`` logits exist at
    once. ``beta`` = 0 is KL(teacher || student), 1 is KL(student || teacher), between them the JSD with the
    mixture ``(1 - beta) student + beta teacher`` (TRL's distillation trainer, Liger's fused linear JSD).

    Args:
        student_input: ``[..., H_s]``; student_weight ``[V, H_s]`` (and ``student_bias`` ``[V]``).
        teacher_input: ``[..., H_t]`` with the student's leading shape; teacher_weight ``[V, H_t]`` (and
            ``teacher_bias``). The teacher takes no gradient (its tensors are detached here).
        temperature: both models' logits are divided by it.
        mask: input's leading shape, 1 for tokens in the loss (None: every token).
        num_items_in_batch: the loss is the sum over tokens divided by it (the tokens of the whole optimizer
            step, for gradient accumulation); None: this call's count of tokens in the mask (at least 1).
        student_logit_softcap, teacher_logit_softcap: each model's final soft cap ``c`` (Gemma 2's
            ``final_logit_softcapping``): its logits are ``c tanh(logits / c)`` before the temperature divides
            them, as the model's forward returns them (None: no cap).

    Returns:
        The 0-d loss in float32 (float64 for float64 inputs). The forward computes the student's gradients
        (chunk by chunk), so the backward only scales them.
    """
    lead = tuple(student_input.shape[:-1])
    if tuple(teacher_input.shape[:-1]) != lead:
        raise ValueError(f"tritongrad.linear_jsd: student_input {tuple(student_input.shape)} and teacher_input "
                         f"{tuple(teacher_input.shape)} must share the leading shape")
    if mask is not None and tuple(mask.shape) != lead:
        raise ValueError(f"tritongrad.linear_jsd: mask of shape {tuple(mask.shape)} must be the inputs' leading shape "
                         f"{lead}, one per token")
    scale = _scale_of(temperature, "linear_jsd")
    caps = []
    for cap in (student_logit_softcap, teacher_logit_softcap):
        real = isinstance(cap, numbers.Real) and not isinstance(cap, bool)
        caps.append(float(cap) if real else cap)  # anything else: the op's validation names it
    capped = caps != [None, None]
    student_input, student_weight, student_bias = _autocast_head(student_input, student_weight, student_bias)
    teacher_input, teacher_weight, teacher_bias = _autocast_head(teacher_input, teacher_weight, teacher_bias)
    acc = acc_dtype(student_input)
    w = (torch.ones(lead, dtype=acc, device=student_input.device) if mask is None else mask.to(acc)).reshape(-1)
    items = w.sum().clamp(min=1.0) if num_items_in_batch is None else num_items_in_batch
    w = w / items
    grads = None
    if torch.is_grad_enabled():  # made in the forward where the op may (not float16: linear_distill_op)
        grads = [student_input.requires_grad, student_weight.requires_grad,
                 isinstance(student_bias, torch.Tensor) and student_bias.requires_grad]
    return linear_distill_op(
        student_input.reshape(-1, student_input.shape[-1]), student_weight,
        teacher_input.detach().reshape(-1, teacher_input.shape[-1]), teacher_weight.detach(), w.detach(),
        student_bias, teacher_bias.detach() if teacher_bias is not None else None, _as_float(beta),
        1.0 if capped else scale, grads, *caps, scale if capped else 1.0,  # the cap, then the temperature
    )


def linear_kl_div(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    temperature: float = 1.0,
    *,
    reverse: bool = False,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    num_items_in_batch=None,
    student_logit_softcap: float | None = None,
    teacher_logit_softcap: float | None = None,
):
    """KL(teacher || student) (``reverse``: KL(student || teacher)) between two heads' next-token
    distributions, per token, summed over the mask and divided by ``num_items_in_batch``: :func:`linear_jsd`
    with beta 0 (1), its arguments otherwise."""
    return linear_jsd(student_input, student_weight, teacher_input, teacher_weight, temperature,
                      1.0 if reverse else 0.0, student_bias=student_bias, teacher_bias=teacher_bias, mask=mask,
                      num_items_in_batch=num_items_in_batch, student_logit_softcap=student_logit_softcap,
                      teacher_logit_softcap=teacher_logit_softcap)

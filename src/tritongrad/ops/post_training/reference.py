"""The post-training family in plain PyTorch: the float64 references of the tests, the CPU path without Triton,
and the scalar formulas (GRPO, DPO) that the public losses apply to per-token log-probabilities. Imports torch
only.

The formulas follow TRL 1.16 (``GRPOTrainer._compute_loss``, ``DPOTrainer._compute_loss``, the distillation
trainer's generalized JSD); kernels.py has the per-row math and its gradients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
# The per-token surrogate of each: TRL's clipped ratio, CISPO's clamped ratio (a constant) times the log-probability,
# SAPO's soft gate; the loss types differ otherwise in their normaliser (_grpo_normalised).
GRPO_FORMS = {"grpo": "clip", "bnpo": "clip", "dr_grpo": "clip", "dapo": "clip", "luspo": "clip", "cispo": "cispo",
              "sapo": "sapo", "vespo": "vespo"}
# VESPO weighs each sequence by a gamma function of its whole importance ratio: not a per-token function, so the
# fused op does not take it (the log-probabilities first, then the formula).
GRPO_SEQUENCE_COUPLED = ("vespo",)


@torch.no_grad()
def vespo_weights(advantages, log_ratio, mask, k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float):
    """TRL 1.16's VESPO weight per sequence ``[B, 1]``, a constant of the loss: ``phi(w) = e^lam w^k e^(-lam w)``
    with ``w = exp(sum_t M clamp(log_ratio, -20, 20))`` (its log clamped to [log 1e-8, 20]), ``(k, lam)`` by the
    advantage's sign (``lam`` at least 1e-4); NaN and infinities become 0."""
    low = math.log(1e-8)
    seq = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
    log_w = torch.clamp(seq, low, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
# TRL 1.16's DPO losses: those that are a function of one pair; "sft" (the chosen tokens' mean negative
# log-probability, a pair's share of it a constant times its chosen sum); and "aot", "aot_unpaired", which sort the
# batch's pairs, so a pair's loss depends on the others (DPO_BATCH_COUPLED: not in chunks of pairs).
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "discopop", "sigmoid_norm", "sft", "aot", "aot_unpaired")
DPO_BATCH_COUPLED = ("aot", "aot_unpaired")
DPO_PER_TOKEN = ("ipo", "sigmoid_norm")  # the log-ratios divided by the completions' lengths
# TRL's f-divergences: the score f'(t) each loss type that takes scores applies to the log-ratio l = log t.
DPO_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# The loss types that take the scores. TRL refuses the others (nca_pair, bco_pair, sppo_hard, apo_zero, apo_down)
# under any divergence but reverse KL: its f-DPO reparameterization leaves a beta log Z(x) term that cancels only
# in the chosen-rejected difference. sft takes neither (the policy's log-probabilities alone).
DPO_SCORED = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "discopop", "sigmoid_norm")
ALPHA_CLAMP = 80.0  # TRL's cap on (alpha - 1) l before exp, for float32 and bfloat16


def dpo_score(l: torch.Tensor, f_divergence_type: str = "reverse_kl", alpha: float = 1.0) -> torch.Tensor:
    """TRL 1.16's score of a log-ratio l under ``f_divergence_type``: l (reverse KL), 1 - exp(-l) (forward KL),
    log 2 + log sigmoid(l) (Jensen-Shannon), (exp(min((alpha - 1) l, ALPHA_CLAMP)) - 1) / (alpha - 1) (alpha;
    l itself within 1e-6 of alpha = 1)."""
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-l)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(l)
    if f_divergence_type == "alpha_divergence" and abs(alpha - 1.0) >= 1e-6:
        return (torch.exp(torch.clamp((alpha - 1.0) * l, max=ALPHA_CLAMP)) - 1.0) * (1.0 / (alpha - 1.0))
    return l


def dpo_score_slope(l: torch.Tensor, f_divergence_type: str = "reverse_kl", alpha: float = 1.0):
    """d score / d l, as autograd takes it through :func:`dpo_score` (the clamp passes the gradient up to and
    at its bound)."""
    if f_divergence_type == "forward_kl":
        return torch.exp(-l)
    if f_divergence_type == "js_divergence":
        return torch.sigmoid(-l)
    if f_divergence_type == "alpha_divergence" and abs(alpha - 1.0) >= 1e-6:
        t = (alpha - 1.0) * l
        return torch.exp(torch.clamp(t, max=ALPHA_CLAMP)) * (t <= ALPHA_CLAMP).to(l.dtype)
    return torch.ones_like(l)


def acc_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32, or float64 when any present tensor is float64."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _readable(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and not torch.compiler.is_compiling()
            and not isinstance(t, torch._subclasses.fake_tensor.FakeTensor))


def check_targets(target: torch.Tensor, V: int, ignore_index: int, op: str = "linear_token_logprobs") -> None:
    """Raise IndexError naming the first target outside [0, V) that is not ``ignore_index`` (CPU tensors)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= V))
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0, 0])
        raise IndexError(f"tritongrad.{op}: target holds class index {int(target.flatten()[i])} at position {i}, "
                         f"outside [0, {V}) and not ignore_index={ignore_index}")


def head_logits(input, weight, bias=None, logit_scale: float = 1.0, logit_softcap: float | None = None,
                post_scale: float = 1.0) -> torch.Tensor:
    """``post_scale * c tanh(logit_scale * F.linear(input, weight, bias) / c)`` (no cap: ``post_scale *
    logit_scale * F.linear(...)``), the product rounded to input's dtype as F.linear returns it (float32
    parameters cast to a 16-bit input's dtype, as under autocast), then in float32 (float64 for float64)."""
    low = (lambda t: t if t is None or t.dtype == input.dtype else t.to(input.dtype))
    z = F.linear(input, low(weight), low(bias)).to(acc_dtype(input))
    if logit_scale != 1.0:
        z = z * logit_scale
    if logit_softcap is not None:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    if post_scale != 1.0:
        z = z * post_scale
    return z


def linear_token_logprobs_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    return_entropy: bool = False,
    return_stats: bool = False,
    grad_weight_f32: bool = False,
    logit_softcap: float | None = None,
    post_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs [N], entropy [N] or [0], stats [3, N] or [0])`` of ``post_scale * c tanh(logit_scale *
    F.linear(input, weight, bias) / c)`` (``c = logit_softcap``; without one, None: ``post_scale * logit_scale *
    F.linear(...)``) for ``input [N, H]``, ``weight [V, H]``, targets ``[N]``: the product rounded to input's dtype as
    F.linear returns it, then everything in float32 (float64 for float64). Rows whose target is
    ``ignore_index`` have logprob 0 (no gradient); the entropy is every row's. ``stats``, without gradient: the
    mean logit, 1.0 where the target is the first argmax (0 for ignored rows), and ``log sum_j p_j^2`` (TRL's
    ``log_sum_sq_probs``, WPO's). float32 parameters with 16-bit input are cast to input's dtype first (the
    product F.linear runs under autocast); ``grad_weight_f32`` is the registered op's hint (kernels only)."""
    if _readable(target):
        check_targets(target, weight.shape[0], ignore_index)
    z = head_logits(input, weight, bias, logit_scale, logit_softcap, post_scale)
    logp = torch.log_softmax(z, -1)
    valid = target != ignore_index
    safe = torch.where(valid, target, 0).long()
    lp = torch.where(valid, logp.gather(-1, safe[:, None])[:, 0], 0.0)
    ent = -(logp.exp() * logp).sum(-1) if return_entropy else z.new_empty(0)
    stats = z.new_empty(0)
    if return_stats:
        zd = z.detach()
        z_t = zd.gather(-1, safe[:, None])[:, 0]
        cols = torch.arange(zd.shape[-1], device=zd.device)
        before = torch.where(cols < target[:, None], zd, float("-inf")).amax(-1)
        top = (z_t >= zd.amax(-1)) & (z_t > before) & valid
        lsq = torch.logsumexp(2 * torch.log_softmax(zd, -1), -1)
        stats = torch.stack([zd.mean(-1), top.to(zd.dtype), lsq])
    return lp, ent, stats


def _divergence_rows(zs: torch.Tensor, zt: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's generalized JSD per row of student logits ``zs`` and teacher logits ``zt`` (already scaled)."""
    lq, lp = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    if beta == 0.0:
        return (lp.exp() * (lp - lq)).sum(-1)
    if beta == 1.0:
        return (lq.exp() * (lq - lp)).sum(-1)
    lm = torch.logaddexp(lq + math.log1p(-beta), lp + math.log(beta))
    return beta * (lp.exp() * (lp - lm)).sum(-1) + (1 - beta) * (lq.exp() * (lq - lm)).sum(-1)


def linear_distill_reference(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    row_weight: torch.Tensor,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    beta: float = 0.5,
    logit_scale: float = 1.0,
    grads: list[bool] | None = None,
    student_logit_softcap: float | None = None,
    teacher_logit_softcap: float | None = None,
    post_scale: float = 1.0,
) -> torch.Tensor:
    """``sum_n row_weight[n] D_n`` (0-d, float32; float64 for float64) with D_n TRL's generalized JSD of the
    student's distribution from the teacher's on row n (kernels.py), each model's logits :func:`head_logits`
    with its own soft cap (None: ``post_scale * logit_scale * F.linear(...)``). The teacher takes no gradient.
    ``grads`` is the registered op's hint."""
    acc = acc_dtype(student_input)
    zs = head_logits(student_input, student_weight, student_bias, logit_scale, student_logit_softcap, post_scale)
    zt = head_logits(teacher_input, teacher_weight, teacher_bias, logit_scale, teacher_logit_softcap, post_scale)
    zs, zt = zs.to(acc), zt.to(acc)
    return (row_weight.to(acc) * _divergence_rows(zs, zt.detach(), beta)).sum()


# ---------------------------------------------------------------- the scalar formulas on log-probabilities
def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 1:  # one value per sequence (sequence-level importance sampling)
        return x.mean()
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _clipped_loss(log_ratio, logprobs, advantages, ref_logprobs, beta: float, epsilon_low: float,
                  epsilon_high: float, delta: float | None, form: str = "clip", sapo_temperature_pos: float = 1.0,
                  sapo_temperature_neg: float = 1.05):
    """TRL's per-token surrogate for importance weights ``r = exp(log_ratio)``, plus beta times the k3 KL
    estimate: ``(loss, coef_1, kl or None)``. With A the advantage and l the log-probability:

        clip   -min(r' A, clip(r, 1 - eps_low, 1 + eps_high) A)    r' = min(r, delta), or r
        cispo  -min(r, eps_high) A l                                 the clamped ratio a constant (detached)
        sapo   -A 4 sigmoid(tau (r - 1)) / tau                       tau: sapo_temperature_pos where A > 0, else _neg
    """
    coef_1 = torch.exp(log_ratio)
    if form == "cispo":
        loss = -torch.clamp(coef_1, max=epsilon_high).detach() * advantages * logprobs
    elif form == "sapo":
        tau = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * advantages
    else:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    loss, kl = _with_kl(loss, logprobs, ref_logprobs, beta)
    return loss, coef_1, kl


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """TRL's k3 estimate of the per-token KL to the reference: ``exp(ref - l) - (ref - l) - 1``."""
    ref = ref_logprobs.to(logprobs.dtype)
    return torch.exp(ref - logprobs) - (ref - logprobs) - 1


def _with_kl(loss, logprobs, ref_logprobs, beta: float):
    """``(loss + beta kl, kl or None)``: TRL's k3 estimate of the KL to the reference, where beta != 0."""
    if beta == 0.0:
        return loss, None
    kl = k3_kl(logprobs, ref_logprobs)
    return loss + beta * kl, kl


def grpo_token_loss(logprobs, advantages, old_logprobs, ref_logprobs, beta: float, epsilon_low: float,
                    epsilon_high: float, delta: float | None, form: str = "clip", sapo_temperature_pos: float = 1.0,
                    sapo_temperature_neg: float = 1.05):
    """TRL's per-token GRPO loss at token level (the surrogate ``form``, plus beta times the k3 KL estimate):
    ``(loss_tok, coef_1, per_token_kl or None)``, all of logprobs' shape (advantages broadcast)."""
    old = logprobs.detach() if old_logprobs is None else old_logprobs.to(logprobs.dtype)
    return _clipped_loss(logprobs - old, logprobs, advantages, ref_logprobs, beta, epsilon_low, epsilon_high, delta,
                         form, sapo_temperature_pos, sapo_temperature_neg)


def linear_grpo_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    advantages: torch.Tensor,
    token_weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    return_entropy: bool = False,
    grads: list[bool] | None = None,
    differentiable_logprobs: bool = False,
    form: str = "clip",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    logit_softcap: float | None = None,
    post_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused GRPO op over rows ``[N]``: ``(sum_n token_weight[n] loss_tok[n], logprobs, entropy)``, the
    last two without gradient unless ``differentiable_logprobs``; ``token_weight`` carries the mask and the
    loss type's normaliser (launch.py), ``form`` its surrogate (``GRPO_FORMS``). ``grads`` is the registered
    op's hint (kernels only)."""
    lp, ent, _ = linear_token_logprobs_reference(input, weight, target, bias, ignore_index, logit_scale, return_entropy,
                                                 logit_softcap=logit_softcap, post_scale=post_scale)
    loss, _, _ = grpo_token_loss(lp, advantages.to(lp.dtype), old_logprobs, ref_logprobs, beta, epsilon_low,
                                 epsilon_high, delta, form, sapo_temperature_pos, sapo_temperature_neg)
    if not differentiable_logprobs:
        lp, ent = lp.detach(), ent.detach()
    return (token_weight.to(lp.dtype) * loss).sum(), lp, ent


def _grpo_sequence_loss(logprobs, advantages, mask, old_logprobs, ref_logprobs, beta, epsilon_low, eps_high, delta,
                        form="clip", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05):
    """GSPO's per-token loss: one importance weight per sequence, the mean log-ratio over its tokens."""
    old = logprobs.detach() if old_logprobs is None else old_logprobs.to(logprobs.dtype)
    log_w = (((logprobs - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return _clipped_loss(log_w, logprobs, advantages, ref_logprobs, beta, epsilon_low, eps_high, delta, form,
                         sapo_temperature_pos, sapo_temperature_neg)


def _grpo_normalised(total, mask, loss_type, max_completion_length, num_items_in_batch, num_sequences_in_batch):
    """The masked per-token losses ``total [B, T]`` reduced as TRL's ``loss_type`` does."""
    B, T = mask.shape
    seqs = B if num_sequences_in_batch is None else num_sequences_in_batch
    if loss_type in ("grpo", "sapo"):
        return (total.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / seqs
    if loss_type == "dr_grpo":
        return total.sum() / (seqs * (T if max_completion_length is None else max_completion_length))
    if loss_type == "luspo":  # each sequence's sum, not its mean
        return total.sum() / seqs
    items = mask.sum() if num_items_in_batch is None else num_items_in_batch  # bnpo, dapo, cispo, vespo: tokens
    items = items.clamp(min=1.0) if isinstance(items, torch.Tensor) else max(items, 1.0)
    return total.sum() / items


def grpo_from_logprobs(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    *,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch=None,
    num_sequences_in_batch=None,
    entropy: torch.Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> tuple[torch.Tensor, dict]:
    """TRL's GRPO loss of per-token ``logprobs [B, T]`` (the policy's, differentiable), ``advantages [B]`` or
    ``[B, T]`` and a float ``mask [B, T]``; ``(loss, metrics)``. The normalisers (``num_items_in_batch``: tokens,
    ``num_sequences_in_batch``: sequences, each over the whole optimizer step) replace TRL's division by the
    gradient-accumulation steps; None is this call's own count. docs/post-training.md has the formulas."""
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"tritongrad.linear_grpo_loss: loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    if loss_type == "sapo" and not (sapo_temperature_pos > 0 and sapo_temperature_neg > 0):
        raise ValueError("tritongrad.linear_grpo_loss: sapo's temperatures must be > 0, got "
                         f"{sapo_temperature_pos} and {sapo_temperature_neg}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError("tritongrad.linear_grpo_loss: importance_sampling_level must be 'token' or 'sequence', got "
                         f"{importance_sampling_level!r}")
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logprobs.dtype)
    mask = mask.to(logprobs.dtype)
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError("tritongrad.linear_grpo_loss: beta != 0 needs ref_logprobs (the reference model's)")
    form = (GRPO_FORMS[loss_type], sapo_temperature_pos, sapo_temperature_neg)
    if loss_type == "vespo":  # -phi A l, phi a constant of each sequence's whole ratio
        old = logprobs.detach() if old_logprobs is None else old_logprobs.to(logprobs.dtype)
        coef_1 = vespo_weights(advantages, logprobs - old, mask, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                               vespo_lambda_neg)
        per_token_loss, per_token_kl = _with_kl(-coef_1 * advantages * logprobs, logprobs, ref_logprobs, beta)
    elif importance_sampling_level == "token":
        per_token_loss, coef_1, per_token_kl = grpo_token_loss(logprobs, advantages, old_logprobs, ref_logprobs, beta,
                                                               epsilon_low, eps_high, delta, *form)
    else:  # one importance weight per sequence (GSPO)
        per_token_loss, coef_1, per_token_kl = _grpo_sequence_loss(logprobs, advantages, mask, old_logprobs,
                                                                   ref_logprobs, beta, epsilon_low, eps_high, delta,
                                                                   *form)
    loss = _grpo_normalised(per_token_loss * mask, mask, loss_type, max_completion_length, num_items_in_batch,
                            num_sequences_in_batch)
    return loss, grpo_metrics(coef_1, per_token_kl, advantages, mask, entropy, form[0], epsilon_low, eps_high)


@torch.no_grad()
def grpo_metrics(coef_1: torch.Tensor, per_token_kl: torch.Tensor | None, advantages: torch.Tensor,
                 mask: torch.Tensor, entropy: torch.Tensor | None, form: str, epsilon_low: float,
                 epsilon_high: float) -> dict:
    """What TRL's GRPOTrainer logs (one process) of the importance weights ``coef_1`` (``[B, T]``, or ``[B, 1]``
    per sequence), the per-token KL (None without beta), the advantages ``[B, 1]`` or ``[B, T]``, the float mask
    and the entropy (or None), for the surrogate ``form`` (``GRPO_FORMS``): 0-d tensors."""
    metrics = {}
    if per_token_kl is not None:
        metrics["kl"] = _masked_mean(per_token_kl, mask)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy, mask)
    c1, dt = coef_1, mask.dtype
    # what TRL logs for each: the clipped ratios of the clipped surrogate, CISPO's own, VESPO's weights
    if form == "cispo":
        metrics["cispo_clip_ratio"] = _masked_mean(((c1 > epsilon_high) & (advantages > 0)).to(dt), mask)
    if form == "vespo":
        metrics["vespo/phi_seq_mean"] = _masked_mean(c1, mask)
    if form != "clip":
        return metrics
    low = ((c1 < 1 - epsilon_low) & (advantages < 0)).to(dt)
    high = ((c1 > 1 + epsilon_high) & (advantages > 0)).to(dt)
    metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
    metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
    metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), mask)
    if low.shape[1] == 1:
        low_seq, high_seq = low[:, 0], high[:, 0]
    else:
        low_seq, high_seq = (low * mask).sum(-1) / mask.sum(-1), (high * mask).sum(-1) / mask.sum(-1)
    metrics["clip_ratio/low_min"] = _nan_reduce(low_seq, torch.amin)
    metrics["clip_ratio/high_max"] = _nan_reduce(high_seq, torch.amax)
    return metrics


def _nan_reduce(x: torch.Tensor, fn) -> torch.Tensor:
    """TRL's nanmin / nanmax: NaN entries (sequences without tokens) left out; NaN when all are."""
    fill = float("inf") if fn is torch.amin else float("-inf")
    out = fn(torch.where(torch.isnan(x), fill, x))
    return torch.where(torch.isnan(x).all(), float("nan"), out)


def ld_token_weights(mask: torch.Tensor, ld_alpha: float | None) -> torch.Tensor:
    """LD-DPO's weight per token of ``mask [2B, T]`` (B chosen sequences, then their B rejected ones), as TRL 1.16
    sums a sequence with ``ld_alpha``: 1 over each pair's first ``min(n_chosen, n_rejected)`` masked tokens,
    ``ld_alpha`` beyond, 0 off the mask. ``ld_alpha`` None: the mask itself."""
    if ld_alpha is None:
        return mask
    pos = mask.cumsum(-1)
    shared = torch.minimum(*mask.sum(-1).chunk(2))
    shared = torch.cat([shared, shared])[:, None]
    return mask * ((pos > 0) & (pos <= shared)).to(mask.dtype) + mask * ld_alpha * (pos > shared).to(mask.dtype)


def dpo_losses(loss_type, loss_weights=None) -> tuple[tuple[str, float], ...]:
    """TRL's ``loss_type`` (a name, a list of names, or names joined by commas, as the registered op takes them)
    with ``loss_weights`` (None: 1 each) as ``(name, weight)`` pairs; the loss is ``sum_k weight_k loss_k``."""
    names = loss_type.split(",") if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(names) if loss_weights is None else list(loss_weights)
    if not names or len(weights) != len(names):
        raise ValueError(f"tritongrad.linear_dpo_loss: loss_weights {loss_weights!r} must give one weight per loss "
                         f"type of {loss_type!r}")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not -math.inf < w < math.inf:  # NaN fails too
            raise ValueError(f"tritongrad.linear_dpo_loss: loss_weights must be finite numbers, got {loss_weights!r}")
    return tuple(zip(names, (float(w) for w in weights)))


def check_dpo_formula(loss_type, label_smoothing: float, discopop_tau: float,
                      f_divergence_type: str = "reverse_kl", ld_alpha: float | None = None, loss_weights=None,
                      use_weighting: bool = False) -> None:
    """The loss types (one, or several with ``loss_weights``) and the values they take, or ValueError."""
    if ld_alpha is not None and not 0.0 <= ld_alpha <= 1.0:
        raise ValueError(f"tritongrad.linear_dpo_loss: ld_alpha must be in [0, 1] (or None), got {ld_alpha}")
    if f_divergence_type not in DPO_DIVERGENCES:
        raise ValueError(f"tritongrad.linear_dpo_loss: f_divergence_type must be one of {DPO_DIVERGENCES}, got "
                         f"{f_divergence_type!r}")
    terms = dpo_losses(loss_type, loss_weights)
    for name, _ in terms:
        if name not in DPO_LOSS_TYPES:
            raise ValueError(f"tritongrad.linear_dpo_loss: loss_type must be one of {DPO_LOSS_TYPES}, got {name!r}")
    names = [n for n, _ in terms]
    if type(use_weighting) is not bool:
        raise TypeError(f"tritongrad.linear_dpo_loss: use_weighting must be a bool, got {use_weighting!r}")
    if use_weighting and any(n in DPO_BATCH_COUPLED for n in names):
        raise ValueError("tritongrad.linear_dpo_loss: use_weighting (WPO) with aot or aot_unpaired is refused, as "
                         "TRL's DPOTrainer refuses it: those losses sort the pairs, which misaligns per-pair weights")
    if len(set(names)) != len(names):
        raise ValueError(f"tritongrad.linear_dpo_loss: loss_type {loss_type!r} names a loss type twice")
    other = [n for n in names if n not in DPO_SCORED and n != "sft"]
    if f_divergence_type != "reverse_kl" and other:
        raise ValueError(f"tritongrad.linear_dpo_loss: f_divergence_type={f_divergence_type!r} takes the loss types "
                         f"{DPO_SCORED} and sft, as TRL's DPOTrainer does (the f-DPO reparameterization's beta log "
                         f"Z(x) cancels only in the chosen-rejected difference), got {other}")
    if "robust" in names and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"tritongrad.linear_dpo_loss: the robust loss takes label_smoothing in [0, 0.5), got "
                         f"{label_smoothing}")
    if "exo_pair" in names and not 0.0 < label_smoothing < 1.0:
        raise ValueError(f"tritongrad.linear_dpo_loss: exo_pair takes label_smoothing in (0, 1) (its log(e) is "
                         f"infinite at 0; the EXO paper uses 1e-3), got {label_smoothing}")
    if "discopop" in names and not discopop_tau > 0:
        raise ValueError(f"tritongrad.linear_dpo_loss: discopop takes discopop_tau > 0, got {discopop_tau}")


def dpo_pair_loss(lc: torch.Tensor, lr: torch.Tensor, chosen_tokens, rejected_tokens, *, beta: float, loss_type,
                  label_smoothing: float, discopop_tau: float = 0.05, f_divergence_type: str = "reverse_kl",
                  f_alpha_divergence_coef: float = 1.0, loss_weights=None,
                  chosen_logps: torch.Tensor | None = None, pair_weights: torch.Tensor | None = None,
                  aot_logps: tuple | None = None) -> torch.Tensor:
    """Each pair's loss ``[B]`` of its log-ratios ``lc = logp_c - ref_c``, ``lr = logp_r - ref_r`` (reverse KL),
    as TRL 1.16's ``DPOTrainer._compute_loss`` defines it per loss type; several loss types (``loss_type`` a list,
    or names joined by commas) add up, each times its weight in ``loss_weights`` (:func:`dpo_losses`). With
    d = lc - lr, s = sigmoid, e the label smoothing:

        sigmoid       -log s(b d);  e > 0: -(1-e) log s(b d) - e log s(-b d) (conservative DPO, TRL before 1.0)
        hinge         relu(1 - b d)
        ipo           (lc/n_c - lr/n_r - 1/(2b))^2            (n: the completions' lengths, at least 1)
        sigmoid_norm  -log s(b (lc/n_c - lr/n_r))
        robust        (-(1-e) log s(b d) + e log s(-b d)) / (1 - 2e)
        exo_pair      s(b d) (log s(b d) - log(1-e)) + s(-b d) (log s(-b d) - log e)
        nca_pair      -log s(b lc) - log s(-b lc)/2 - log s(-b lr)/2
        bco_pair      -log s(b lc) - log s(-b lr)
        sppo_hard     (lc - 1/(2b))^2 + (lr + 1/(2b))^2
        apo_zero      1 - s(b lc) + s(b lr)
        apo_down      s(b lc) + 1 - s(b d)
        discopop      -log s(b d) (1 - m) + exp(-b d) m,      m = s(b d / tau)
        aot           -(1-e) log s(b u) - e log s(-b u),      u = sort(logp_c - logp_r) - sort(ref_c - ref_r)
        aot_unpaired  the same with u = sort(lc) - sort(lr)       (sorted over the batch's pairs: ``aot_logps``
                                                              = (logp_c, logp_r, ref_c, ref_r) for aot; the
                                                              i-th loss is the sorted order's, not pair i's)
        sft           -B logp_c / sum_pairs n_c               (``chosen_logps``: logp_c, unweighted sums; over the
                                                              B pairs' mean, TRL's mean over the chosen tokens)

    Under another ``f_divergence_type``, the loss types of DPO_SCORED take the scores of lc and lr
    (:func:`dpo_score`) in their place, as TRL does (TRL refuses the others there, and so does
    :func:`check_dpo_formula`). ``pair_weights`` ``[B]`` (WPO, :func:`wpo_weights`; constants) multiply each
    pair's loss; sft's, a batch-wide mean, takes their mean over the B pairs (TRL multiplies sft's batch loss,
    broadcast to every pair, by each pair's weight and averages).
    """
    total, sft = None, None
    for name, w in dpo_losses(loss_type, loss_weights):
        if name == "sft":
            if chosen_logps is None:
                raise ValueError("tritongrad.linear_dpo_loss: loss_type 'sft' needs the chosen log-probabilities")
            sft = -chosen_logps * (lc.shape[0] / chosen_tokens.to(lc.dtype).sum())
            sft = sft if w == 1.0 else sft * w
            continue
        elif name in DPO_BATCH_COUPLED:
            if name == "aot":
                if aot_logps is None:
                    raise ValueError("tritongrad.linear_dpo_loss: loss_type 'aot' needs the sequence log-probabilities")
                c, r, ref_c, ref_r = (t.to(lc.dtype) for t in aot_logps)
                u = torch.sort(c - r, dim=0)[0] - torch.sort(ref_c - ref_r, dim=0)[0]
            else:
                u = torch.sort(lc, dim=0)[0] - torch.sort(lr, dim=0)[0]
            one = -F.logsigmoid(beta * u) * (1 - label_smoothing) - F.logsigmoid(-beta * u) * label_smoothing
        else:
            one = _dpo_one_loss(lc, lr, chosen_tokens, rejected_tokens, beta=beta, loss_type=name,
                                label_smoothing=label_smoothing, discopop_tau=discopop_tau,
                                f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef)
        one = one if w == 1.0 else one * w
        total = one if total is None else total + one
    if pair_weights is not None:
        pw = pair_weights.to(lc.dtype)
        total = total * pw if total is not None else None
        sft = sft * pw.mean() if sft is not None else None
    if sft is not None:
        total = sft if total is None else total + sft
    return total


@torch.no_grad()
def wpo_weights(token_logps: torch.Tensor, log_sum_sq_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """WPO's weight of each pair ``[B]`` (TRL's ``use_weighting``; constants of the loss): per sequence ``[2B, T]``,
    ``w_s = exp(sum_t m (logprob_t - log sum_j p_j^2) / max(n_s, 1))``, and a pair's ``w_chosen * w_rejected``."""
    m = mask.to(token_logps.dtype)
    w = torch.exp(((token_logps - log_sum_sq_probs.to(m.dtype)) * m).sum(-1) / m.sum(-1).clamp(min=1.0))
    return w.chunk(2)[0] * w.chunk(2)[1]


def _dpo_one_loss(lc, lr, chosen_tokens, rejected_tokens, *, beta, loss_type, label_smoothing, discopop_tau,
                  f_divergence_type, f_alpha_divergence_coef):
    """One pair loss type of :func:`dpo_pair_loss`."""
    if loss_type in DPO_SCORED and f_divergence_type != "reverse_kl":
        lc = dpo_score(lc, f_divergence_type, f_alpha_divergence_coef)
        lr = dpo_score(lr, f_divergence_type, f_alpha_divergence_coef)
    d = lc - lr
    eps = label_smoothing
    if loss_type in DPO_PER_TOKEN:
        delta = (lc / chosen_tokens.to(d.dtype).clamp(min=1.0) - lr / rejected_tokens.to(d.dtype).clamp(min=1.0))
        return (delta - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * delta)
    if loss_type == "sigmoid":
        per_pair = -F.logsigmoid(beta * d)
        return (1 - eps) * per_pair - eps * F.logsigmoid(-beta * d) if eps else per_pair
    if loss_type == "hinge":
        return torch.relu(1 - beta * d)
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * d) + eps * F.logsigmoid(-beta * d)) / (1 - 2 * eps)
    if loss_type == "exo_pair":
        x = beta * d
        return (torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-eps))
                + torch.sigmoid(-x) * (F.logsigmoid(-x) - math.log(eps)))
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * lc) - 0.5 * F.logsigmoid(-beta * lc) - 0.5 * F.logsigmoid(-beta * lr)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * lc) - F.logsigmoid(-beta * lr)
    if loss_type == "sppo_hard":
        return (lc - 0.5 / beta) ** 2 + (lr + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * lc) + torch.sigmoid(beta * lr)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * lc) + 1 - torch.sigmoid(beta * d)
    if loss_type == "discopop":
        x = beta * d
        m = torch.sigmoid(x / discopop_tau)
        return -F.logsigmoid(x) * (1 - m) + torch.exp(-x) * m
    raise ValueError(f"tritongrad.linear_dpo_loss: loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")


def dpo_from_logprobs(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
    num_pairs_in_batch=None,
    discopop_tau: float = 0.05,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 1.0,
    loss_weights=None,
    sft_chosen_logps: torch.Tensor | None = None,
    pair_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """TRL's DPO loss of sequence log-probabilities ``[B]`` (the policy's differentiable, the reference's not):
    ``(loss, metrics)``. ``chosen_tokens``/``rejected_tokens`` (``[B]``, completion lengths) are the
    normalisation of IPO and sigmoid_norm, and their sum sft's; ``sft_chosen_logps``: the chosen sums sft takes
    where they differ from ``chosen_logps`` (LD-DPO weighs the others' tokens, sft every token 1; None: the
    same). ``pair_weights``: WPO's per-pair weights (:func:`wpo_weights`), constants. ``num_pairs_in_batch``:
    the pairs of the whole optimizer step (None: B). ``loss_type``: one name, or a list with ``loss_weights``;
    ``discopop_tau``: DiscoPOP's temperature; ``f_divergence_type``, ``f_alpha_divergence_coef``: the
    f-divergence (TRL's ``DPOConfig`` fields of those names). The metrics: :func:`dpo_metrics`."""
    check_dpo_formula(loss_type, label_smoothing, discopop_tau, f_divergence_type, loss_weights=loss_weights,
                      use_weighting=pair_weights is not None)
    names = [n for n, _ in dpo_losses(loss_type, loss_weights)]
    if any(n in DPO_PER_TOKEN or n == "sft" for n in names) and (chosen_tokens is None or rejected_tokens is None):
        raise ValueError(f"tritongrad.linear_dpo_loss: loss_type={loss_type!r} needs the completion lengths")
    chosen_logratios = chosen_logps - ref_chosen_logps.to(chosen_logps.dtype)
    rejected_logratios = rejected_logps - ref_rejected_logps.to(rejected_logps.dtype)
    per_pair = dpo_pair_loss(chosen_logratios, rejected_logratios, chosen_tokens, rejected_tokens, beta=beta,
                             loss_type=loss_type, label_smoothing=label_smoothing, discopop_tau=discopop_tau,
                             f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
                             loss_weights=loss_weights,
                             chosen_logps=chosen_logps if sft_chosen_logps is None else sft_chosen_logps,
                             pair_weights=None if pair_weights is None else pair_weights.detach(),
                             aot_logps=(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps))
    pairs = per_pair.shape[0] if num_pairs_in_batch is None else num_pairs_in_batch
    return per_pair.sum() / pairs, dpo_metrics(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                                               beta)


@torch.no_grad()
def dpo_metrics(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float) -> dict:
    """What TRL's DPOTrainer logs of a batch's sequence log-probabilities ``[B]``: the rewards ``beta (logp -
    ref)`` per pair and their means, the accuracy and margin, and the log-probabilities' means (detached)."""
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps.to(chosen_logps.dtype))
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps.to(rejected_logps.dtype))
    return {
        "chosen_rewards": chosen_rewards,
        "rejected_rewards": rejected_rewards,
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.mean(),
        "logps/rejected": rejected_logps.mean(),
    }


def linear_dpo_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    token_weight: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    post_scale: float = 1.0,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    grads: list[bool] | None = None,
    differentiable_logps: bool = False,
    discopop_tau: float = 0.05,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 1.0,
    ld_alpha: float | None = None,
    loss_weights: list[float] | None = None,
    use_weighting: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused DPO op over rows ``[2B T]`` (B chosen sequences of T rows, then their B rejected ones):
    ``(loss, chosen_logps [B], rejected_logps [B])``, the sequence log-probabilities ``sum_t w[s, t]
    logprob[s, t]`` (``w``: the mask ``token_weight [2B, T]``, LD-DPO's weights with ``ld_alpha``) without gradient
    unless ``differentiable_logps``, the loss :func:`dpo_from_logprobs` of them over B pairs (the completions'
    lengths from the mask). ``grads`` is the registered op's hint (kernels only)."""
    lp, _, _ = linear_token_logprobs_reference(input, weight, target, bias, ignore_index, logit_scale,
                                               logit_softcap=logit_softcap, post_scale=post_scale)
    mask = token_weight.to(lp.dtype)
    tw = ld_token_weights(mask, ld_alpha)
    chosen, rejected = (lp.reshape(tw.shape) * tw).sum(-1).chunk(2)
    plain = (lp.reshape(tw.shape) * mask).sum(-1).chunk(2)[0] if ld_alpha is not None else None
    tokens = mask.sum(-1)
    pair_weights = None
    if use_weighting:  # WPO: log sum_j p_j^2 of each row, from the same logits
        with torch.no_grad():
            lsq = torch.logsumexp(2 * torch.log_softmax(
                head_logits(input, weight, bias, logit_scale, logit_softcap, post_scale), -1), -1)
        pair_weights = wpo_weights(lp.reshape(tw.shape), lsq.reshape(tw.shape), mask)
    loss, _ = dpo_from_logprobs(chosen, rejected, ref_chosen_logps, ref_rejected_logps, beta=beta, loss_type=loss_type,
                                label_smoothing=label_smoothing, chosen_tokens=tokens.chunk(2)[0],
                                rejected_tokens=tokens.chunk(2)[1], discopop_tau=discopop_tau,
                                f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
                                loss_weights=loss_weights, sft_chosen_logps=plain, pair_weights=pair_weights)
    if not differentiable_logps:
        chosen, rejected = chosen.detach(), rejected.detach()
    return loss, chosen, rejected

"""The post-training family on small shapes, through Triton's interpreter on CPU.

The OpSuite battery for the per-token log-probabilities; then each loss against a float64 reference built from
TRL's own formulas on materialised logits, within twice the error of the same formulas in eager PyTorch in
the input's dtype (float32, float16, bfloat16); gradient accumulation against one big step; masks and ignored
tokens; torch.compile(fullgraph=True); and, where TRL is installed, the formulas against TRL's own
``_compute_loss`` and the fused-head patch inside TRL's trainers.

Every test runs with chunks of a few rows and vocabulary steps of 16 columns (``small_chunks``), so that the
chunk loops run several times and the last chunk and the last vocabulary step are ragged.
"""

import copy
import dataclasses
import math
import os
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import ATOL, DEVICE, backward_graphs_backend, run_without_interpreter

import tritongrad
from tritongrad.ops.post_training import (
    dpo_from_logprobs,
    grpo_from_logprobs,
    linear_distill_op,
    linear_distill_reference,
    linear_dpo_loss,
    linear_dpo_op,
    linear_dpo_reference,
    linear_grpo_loss,
    linear_grpo_op,
    linear_grpo_reference,
    linear_jsd,
    linear_kl_div,
    linear_token_logprobs,
    linear_token_logprobs_op,
    linear_token_logprobs_reference,
)
from tritongrad.ops.post_training import plans as P
from tritongrad.ops.post_training.reference import ld_token_weights, wpo_weights
from tritongrad.testing import OpSuite, assert_close_earned, ulp_atol

# 600 bytes of logits a chunk: 3 rows of 40 float32 logits, 7 of bfloat16; 16 columns a vocabulary step; DPO
# chunks of 4000 bytes of whole pairs: one pair of two 5-row sequences of 40 float64 logits, two of float32
SMALL = P.Limits(chunk_bytes=600, row_multiple=1, min_rows=1, block_bytes=64, pair_bytes=4000)
DEFAULT_LIMITS = P.LIMITS
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(P, "LIMITS", SMALL)


def _targets(N, V, ignored=(), device=DEVICE):
    t = torch.randint(0, V, (N,), device=device)
    for i in ignored:
        t[i] = -100
    return t


# ---------------------------------------------------------------- OpSuite: linear_token_logprobs
def tlp_entropy_bias(dtype, device):
    # entropy (its gradient too), a bias, a temperature (0.8: its reciprocal exact in float32, see
    # docs/post-training.md on float64), an ignored row; 7 rows in chunks, 40 columns in 3 steps
    return {"input": torch.randn(7, 8, device=device).to(dtype),
            "weight": (torch.randn(40, 8, device=device) / 2).to(dtype), "target": _targets(7, 40, (2,), device),
            "bias": torch.randn(40, device=device).to(dtype), "logit_scale": 1 / 0.8, "return_entropy": True}


def tlp_logprobs_only(dtype, device):
    # the default call: log-probabilities alone, no bias (the reference model's path, and GRPO's policy)
    return (torch.randn(5, 8, device=device).to(dtype), (torch.randn(24, 8, device=device) / 2).to(dtype),
            _targets(5, 24, device=device))


def tlp_softcap(dtype, device):
    # Gemma 2's final soft cap between two scales (TRL's order: the config's scale, the cap, the temperature),
    # logits large enough to saturate it; entropy and its gradient
    return {"input": torch.randn(6, 8, device=device).to(dtype),
            "weight": (torch.randn(40, 8, device=device) * 2).to(dtype), "target": _targets(6, 40, (1,), device),
            "logit_scale": 1.5, "return_entropy": True, "logit_softcap": 3.0, "post_scale": 1 / 0.8}


# mixed: bfloat16 hidden states with a float32 head (autocast's case), grad_weight accumulated in float32
TLP_SUITE = OpSuite(linear_token_logprobs_op, [tlp_entropy_bias, tlp_logprobs_only, tlp_softcap], mixed=True,
                    device=DEVICE)
test_linear_token_logprobs_suite = TLP_SUITE.pytest()


# ---------------------------------------------------------------- OpSuite: the distillation op
def distill_jsd(dtype, device):
    # the generalized JSD (its three passes), a wider student than teacher, a student bias, row weights
    # (mask and normaliser), the gradients made in the forward
    return {"student_input": torch.randn(6, 8, device=device).to(dtype),
            "student_weight": (torch.randn(24, 8, device=device) / 2).to(dtype),
            "teacher_input": torch.randn(6, 4, device=device).to(dtype),
            "teacher_weight": (torch.randn(24, 4, device=device) / 2).to(dtype),
            "row_weight": torch.rand(6, device=device).to(dtype),
            "student_bias": torch.randn(24, device=device).to(dtype), "beta": 0.3, "logit_scale": 1.25,
            "grads": [True, True, True]}


def distill_caps(dtype, device):
    # Gemma 2's final soft cap on the student's head and another on the teacher's, between the logit scale and the
    # scale after it (the temperature)
    case = distill_jsd(dtype, device)
    case.update(student_logit_softcap=3.0, teacher_logit_softcap=5.0, post_scale=0.8)
    return case


def distill_student_cap(dtype, device):
    # a cap on the student's head alone: the teacher's logits take both scales
    case = distill_jsd(dtype, device)
    case.update(student_logit_softcap=3.0, post_scale=0.8, beta=1.0)
    return case


# slow: the second op's battery (12 s through the interpreter); its formulas are also checked below, fast
test_linear_distill_suite = pytest.mark.slow(OpSuite(linear_distill_op, [distill_jsd, distill_caps,
                                                                         distill_student_cap],
                                                     device=DEVICE).pytest())


def grpo_off_policy_kl(dtype, device):
    # the GRPO op: off-policy ratios (some clipped), the KL term, a bias, one ignored token, per-token weights
    # (mask and normaliser); differentiable log-probabilities and entropy, so that every output's gradient is
    # checked (the public function's fused path, gradients made in the forward, is checked by the parity
    # tests below against TRL's formula)
    lp0 = -3 + torch.randn(7, device=device)
    return {"input": torch.randn(7, 8, device=device).to(dtype),
            "weight": (torch.randn(24, 8, device=device) / 2).to(dtype), "target": _targets(7, 24, (4,), device),
            "advantages": torch.randn(7, device=device), "token_weight": torch.rand(7, device=device),
            "bias": torch.randn(24, device=device).to(dtype), "old_logprobs": lp0,
            "ref_logprobs": lp0 + 0.3 * torch.randn(7, device=device), "logit_scale": 1.25, "beta": 0.1,
            "epsilon_low": 0.2, "epsilon_high": 0.28, "return_entropy": True, "differentiable_logprobs": True}


def grpo_softcap(dtype, device):
    # Gemma 2's final soft cap between the logit scale and the scale after it (the temperature)
    case = grpo_off_policy_kl(dtype, device)
    case.update(logit_softcap=4.0, post_scale=0.8)
    return case


test_linear_grpo_suite = pytest.mark.slow(OpSuite(linear_grpo_op, [grpo_off_policy_kl, grpo_softcap],
                                                  device=DEVICE).pytest())


def dpo_ipo_bias(dtype, device):
    # the fused DPO op: two pairs of sequences of 3 rows (one chunk each), IPO (the token counts enter the
    # derivative), a fractional token weight, an ignored token, a bias, a soft cap between two scales; differentiable
    # sequence log-probabilities, so that every output's gradient is checked (the gradients made in the forward
    # are checked by the parity tests below)
    tw = torch.ones(4, 3, device=device)
    tw[1, 0], tw[3, 2] = 0.5, 0.0
    target = _targets(12, 24, (11,), device)
    return {"input": torch.randn(12, 8, device=device).to(dtype),
            "weight": (torch.randn(24, 8, device=device) / 2).to(dtype), "target": target, "token_weight": tw,
            "ref_chosen_logps": -9 + torch.randn(2, device=device),
            "ref_rejected_logps": -9 + torch.randn(2, device=device),
            "bias": torch.randn(24, device=device).to(dtype), "logit_scale": 1.25, "logit_softcap": 4.0,
            "post_scale": 0.8, "beta": 0.5, "loss_type": "ipo", "differentiable_logps": True}


def dpo_list_sft(dtype, device):
    # a list of loss types with weights, sft's chosen-token mean among them: each pair's derivative their weighted
    # sum, sft's through the call's chosen-token count; differentiable sequence log-probabilities as above
    case = dpo_ipo_bias(dtype, device)
    case.update(loss_type="sigmoid,sft,bco_pair", loss_weights=[1.0, 0.5, 0.25], beta=0.1)
    return case


def dpo_wpo(dtype, device):
    # WPO's per-pair weights (the forward kernel's log sum p^2 per row), constants of the loss, over the soft cap
    case = dpo_ipo_bias(dtype, device)
    case.update(loss_type="sigmoid", beta=0.1, use_weighting=True)
    return case


test_linear_dpo_suite = pytest.mark.slow(OpSuite(
    linear_dpo_op, [dpo_ipo_bias, dpo_list_sft, dpo_wpo], mixed=True, device=DEVICE,
    stop_gradient={"dpo_wpo": "WPO's weights are TRL's no-grad constants"}).pytest())


# ---------------------------------------------------------------- parity helpers
def _earned(what, got, ref64, base, dtype):
    assert_close_earned(what, got, ref64, base, factor=2.0, atol=ATOL[dtype] + ulp_atol(torch.float32, ref64, 4))


def _check(ours, ref, make, dtype, diff=("input", "weight")):
    """``ours(**t)`` and ``ref(**t)`` return a 0-d loss (or a tuple of tensors); compare ours in ``dtype``
    against ref in float64 (the same values, upcast), within 2x ref in ``dtype``: values and the gradients of
    ``diff``. The inputs go to the test device (on a GPU machine, the kernels run on it). Returns the largest
    errors against float64, for the record."""
    torch.manual_seed(0)
    base_in = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in make(dtype).items()}
    errs = {}
    runs = {}
    for name, cast in (("got", None), ("ref64", torch.float64), ("base", None)):
        t = {k: (v.detach().to(cast) if cast and isinstance(v, torch.Tensor) and v.is_floating_point() else v.detach()
                 if isinstance(v, torch.Tensor) else v) for k, v in base_in.items()}
        for k in diff:
            if t.get(k) is not None:
                t[k].requires_grad_(True)
        out = (ours if name == "got" else ref)(**t)
        out = out if isinstance(out, tuple) else (out,)
        g = torch.autograd.grad(sum(o.sum() * (i + 1) for i, o in enumerate(out) if o.requires_grad),
                                [t[k] for k in diff if t.get(k) is not None])
        runs[name] = (out, g)
    for i, (a, r, b) in enumerate(zip(*(runs[n][0] for n in ("got", "ref64", "base")))):
        _earned(f"output {i}", a, r, b, dtype)
        errs[f"out{i}"] = (a.double() - r).abs().max().item()
    names = [k for k in diff if base_in.get(k) is not None]
    for k, a, r, b in zip(names, *(runs[n][1] for n in ("got", "ref64", "base"))):
        assert a.dtype == base_in[k].dtype
        _earned(f"grad {k}", a, r, b, dtype)
        errs[k] = (a.double() - r).abs().max().item()
    return errs


def _head(dtype, B=3, T=5, H=16, V=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(B, T, H, generator=g)).to(dtype), (torch.randn(V, H, generator=g) / 3).to(dtype),
            torch.randint(0, V, (B, T), generator=g))


def _ref_logprobs(input, weight, target, bias=None, temperature=1.0, entropy=False):
    """Materialised logits, as TRL's trainers had them: F.linear, then float32 (float64) and the temperature."""
    lp, ent, _ = linear_token_logprobs_reference(input.reshape(-1, input.shape[-1]), weight, target.reshape(-1), bias,
                                                 -100, 1 / temperature, entropy)
    return lp.reshape(target.shape), (ent.reshape(target.shape) if entropy else None)


# ---------------------------------------------------------------- token log-probabilities
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_logprobs_and_entropy_against_float64(dtype):
    # [B, T, H] input, a temperature, ignored tokens: logprobs and entropy, and the gradients through both
    def make(dt):
        h, W, t = _head(dt)
        t[0, :2] = -100
        return {"input": h, "weight": W, "target": t, "temperature": 0.7}

    _check(lambda **k: linear_token_logprobs(**k, return_entropy=True),
           lambda **k: _ref_logprobs(**k, entropy=True), make, dtype)


def test_ignored_tokens_have_no_logprob_gradient():
    # reduction="none" with ignore_index, Liger #968's case: an ignored token contributes 0 and no gradient,
    # the others their exact gradient
    h, W, t = _head(torch.float64)
    t[1, 1:4] = -100
    h.requires_grad_(True)
    lp = linear_token_logprobs(h, W, t)
    assert (lp[1, 1:4] == 0).all()
    g = torch.autograd.grad(lp.sum(), h)[0]
    assert (g[1, 1:4] == 0).all() and (g[1, 0] != 0).all()
    h2 = h.detach().clone().requires_grad_(True)
    want = torch.autograd.grad(_ref_logprobs(h2, W, t)[0].sum(), h2)[0]
    torch.testing.assert_close(g, want)


def test_stats_mean_logit_and_first_argmax():
    # the DPO trainer's statistics: the mean logit, and whether the target is the first argmax (ties go to the
    # earlier token, as argmax breaks them)
    h, W, t = _head(torch.float32, B=1, T=6)
    h, t = h[0], t[0]
    z = F.linear(h, W) * 2.0
    t[:3] = z[:3].argmax(-1)  # three rows whose target is the argmax
    W2 = torch.cat([W, W[:1]])  # a duplicate of class 0 at the end: a tie the target V loses to class 0 ...
    t2 = t.clone()
    t2[3] = 40
    h2 = h.clone()
    h2[3] = W[0] * 10  # ... on a row where class 0 is the argmax
    lp, _, st = linear_token_logprobs_op(h2, W2, t2, None, -100, 2.0, False, True)
    _, _, want = linear_token_logprobs_reference(h2, W2, t2, None, -100, 2.0, False, True)
    torch.testing.assert_close(st, want)
    assert st[1, :3].tolist() == [1.0, 1.0, 1.0] and st[1, 3] == 0.0


# ---------------------------------------------------------------- GRPO
def _trl_grpo(per_token_logps, advantages, completion_mask, old_per_token_logps, ref_per_token_logps, *, beta,
              epsilon_low, epsilon_high, loss_type, importance_sampling_level, max_completion_length, delta=None,
              gradient_accumulation_steps=1, num_items_in_batch=None, sapo_temperature_pos=1.0,
              sapo_temperature_neg=1.05, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
    """TRL 1.16's GRPOTrainer._compute_loss, its arithmetic line by line (one process, training mode), on given
    per-token log-probabilities: (loss, kl, clip ratios low/high/region; for cispo, its clip ratio in place of
    the three)."""
    mask = completion_mask
    advantages = advantages.unsqueeze(1)
    old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if beta != 0.0:
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    elif loss_type == "vespo":
        with torch.no_grad():
            lower_clamp = math.log(1e-8)
            log_ratio_clamped = torch.clamp(log_ratio, -20.0, 20.0)
            seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
            log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
            w_seq = torch.exp(log_w_seq)
            is_nonneg_adv = advantages >= 0
            k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
            lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
            log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
            phi_seq = torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token_loss = -phi_seq * advantages * per_token_logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    ga = gradient_accumulation_steps
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ga
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / ga
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length) / ga
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean() / ga
    else:  # dapo, cispo, vespo: num_items_in_batch spans the generation batch (steps_per_generation = ga here)
        loss = (per_token_loss * mask).sum() / num_items_in_batch.clamp(min=1.0)

    def gmm(x):
        if x.shape[1] == 1:
            return x.sum() / x.shape[0]
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    kl = gmm(per_token_kl) if beta else None
    if loss_type == "cispo":
        return loss, kl, gmm(((coef_1 > epsilon_high) & (advantages > 0)).float())
    if loss_type == "sapo":
        return loss, kl
    if loss_type == "vespo":
        return loss, kl, gmm(phi_seq)
    low = (coef_1 < 1 - epsilon_low) & (advantages < 0)
    high = (coef_1 > 1 + epsilon_high) & (advantages > 0)
    return loss, kl, gmm(low.float()), gmm(high.float()), gmm((low | high).float())


GRPO_CASES = {
    # on-policy (old = current, detached), TRL's default loss
    "dapo-on-policy": dict(loss_type="dapo", beta=0.0, old=False, level="token"),
    # off-policy with clipping on both sides and the KL term
    "grpo-kl-clipped": dict(loss_type="grpo", beta=0.04, old=True, level="token"),
    "bnpo-kl": dict(loss_type="bnpo", beta=0.1, old=True, level="token"),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.0, old=True, level="token", max_len=7),
    # GSPO: one importance weight per sequence
    "grpo-sequence": dict(loss_type="grpo", beta=0.0, old=True, level="sequence"),
    # LUSPO (its sequences' sums), at sequence level as the paper runs it, and at token level (the fused op)
    "luspo-sequence": dict(loss_type="luspo", beta=0.0, old=True, level="sequence"),
    "luspo-kl": dict(loss_type="luspo", beta=0.04, old=True, level="token"),
    # CISPO: the ratio capped at epsilon_high (1.2: some tokens above it) and held constant
    "cispo-kl": dict(loss_type="cispo", beta=0.04, old=True, level="token", eps_high=1.2),
    "cispo-on-policy": dict(loss_type="cispo", beta=0.0, old=False, level="token", eps_high=1.2),
    # SAPO: the soft gate, its two temperatures
    "sapo-kl": dict(loss_type="sapo", beta=0.04, old=True, level="token"),
    "sapo-sequence": dict(loss_type="sapo", beta=0.0, old=True, level="sequence"),
    # VESPO: each sequence weighted by a gamma function of its whole ratio (log-probabilities first)
    "vespo-kl": dict(loss_type="vespo", beta=0.04, old=True, level="token"),
    "vespo-on-policy": dict(loss_type="vespo", beta=0.0, old=False, level="token"),
}
# what TRL logs beside the loss, per loss type
GRPO_LOGGED = {"cispo": ("cispo_clip_ratio",), "sapo": (), "vespo": ("vespo/phi_seq_mean",)}


def _grpo_inputs(dt, case, seed=0):
    h, W, t = _head(dt, B=4, T=5, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    lp0 = _ref_logprobs(h.double(), W.double(), t, None, 0.8)[0].float()
    return {"input": h, "weight": W, "completion_ids": t, "advantages": torch.randn(4, generator=g),
            "completion_mask": mask,
            "old_logprobs": (lp0 + 0.3 * torch.randn(4, 5, generator=g)) if case["old"] else None,
            "ref_logprobs": lp0 + 0.2 * torch.randn(4, 5, generator=g)}


def _grpo_kwargs(case):
    return dict(temperature=0.8, beta=case["beta"], epsilon_low=0.2, epsilon_high=case.get("eps_high", 0.28),
                loss_type=case["loss_type"], importance_sampling_level=case["level"],
                max_completion_length=case.get("max_len"))


def _grid(names, sixteen):
    """Every case in float32; the 16-bit dtypes on the cases named (each case is a path, each dtype a rounding)."""
    return [(n, torch.float32) for n in names] + [(n, d) for n in sixteen for d in DTYPES[1:]]


@pytest.mark.parametrize("name,dtype", _grid(GRPO_CASES, ["dapo-on-policy", "grpo-kl-clipped", "cispo-kl",
                                                          "sapo-kl"]), ids=str)
def test_grpo_against_trl_formula_in_float64(name, dtype):
    case = GRPO_CASES[name]
    kw = _grpo_kwargs(case)
    logged = GRPO_LOGGED.get(case["loss_type"], ("clip_ratio/low_mean", "clip_ratio/high_mean"))

    def ours(input, weight, completion_ids, advantages, completion_mask, old_logprobs, ref_logprobs):
        loss, metrics = linear_grpo_loss(input, weight, completion_ids, advantages, completion_mask,
                                         old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, **kw)
        if case["loss_type"] in GRPO_LOGGED:  # no clip ratios where TRL logs none
            assert "clip_ratio/low_mean" not in metrics, sorted(metrics)
        return (loss, *(metrics[k] for k in logged))

    def ref(input, weight, completion_ids, advantages, completion_mask, old_logprobs, ref_logprobs):
        lp = _ref_logprobs(input, weight, completion_ids, None, kw["temperature"])[0]
        acc = lp.dtype
        cast = (lambda x: None if x is None else x.to(acc))
        loss, kl, *ratios = _trl_grpo(
            lp, advantages.to(acc), completion_mask.to(acc), cast(old_logprobs), cast(ref_logprobs), beta=kw["beta"],
            epsilon_low=0.2, epsilon_high=kw["epsilon_high"], loss_type=kw["loss_type"], importance_sampling_level=kw[
                "importance_sampling_level"], max_completion_length=kw["max_completion_length"] or 5,
            num_items_in_batch=completion_mask.sum().to(acc))
        return (loss, *ratios[:len(logged)])

    _check(ours, ref, lambda dt: _grpo_inputs(dt, case), dtype)


@pytest.mark.parametrize("level", ["token", "sequence"])  # the fused op's check, and the formula's
def test_grpo_refuses_what_it_does_not_compute(level):
    case = dict(GRPO_CASES["sapo-kl"], level=level)
    t = _grpo_inputs(torch.float32, case)
    kw = _grpo_kwargs(case)
    with pytest.raises(ValueError, match=r"sapo's temperatures must be > 0, got 0.0 and 1.05"):
        linear_grpo_loss(**t, **kw, sapo_temperature_pos=0.0)
    with pytest.raises(ValueError, match=r"loss_type must be one of .*'vespo'\), got 'gspo'"):
        linear_grpo_loss(**t, **dict(kw, loss_type="gspo"))


@pytest.mark.parametrize("field,value,match", [
    ("old_logprobs", lambda t: t.t().contiguous(), r"old_logprobs of shape \(5, 4\) must have completion_ids's shape"),
    ("ref_logprobs", lambda t: t.reshape(-1), r"ref_logprobs of shape \(20,\) must have completion_ids's shape"),
    ("completion_mask", lambda t: t[0], r"completion_mask of shape \(5,\) must have completion_ids's shape"),
    ("advantages", lambda t: t[:3], r"advantages of shape \(3,\) must be \[B\] or \[B, T\] for completion_ids"),
    ("logit_softcap", lambda t: -1.0, r"linear_grpo_loss: logit_softcap must be a finite float > 0 or None"),
    ("advantages", lambda t: (t > 0).long(), r"linear_grpo_loss: advantages of shape \(4,\) is torch.int64; it takes a "
                                             r"floating-point dtype"),
    ("completion_ids", lambda t: t.float(), r"completion_ids of shape \(4, 5\) is torch.float32; it takes int64"),
], ids=["old-transposed", "ref-flat", "mask-broadcast", "advantages", "softcap", "advantages-int", "ids-float"])
def test_grpo_refuses_per_token_tensors_of_another_shape(field, value, match):
    # a flattened, transposed or broadcast per-token tensor would be read against other tokens: refused, named;
    # so are token ids and values of the other kind of dtype
    case = GRPO_CASES["grpo-kl-clipped"]
    t = _grpo_inputs(torch.float32, case)
    t[field] = value(t.get(field))
    with pytest.raises((ValueError, TypeError), match=match):
        linear_grpo_loss(**t, **_grpo_kwargs(case))


def test_dpo_refuses_a_completion_mask_of_another_shape():
    t = _dpo_inputs(torch.float32)
    with pytest.raises(ValueError, match=r"linear_dpo_loss: completion_mask of shape \(5,\) must have target's"):
        linear_dpo_loss(t["input"], t["weight"], t["target"], ref_chosen_logps=t["ref_chosen_logps"],
                        ref_rejected_logps=t["ref_rejected_logps"], completion_mask=torch.ones(5))


def test_grpo_metrics_are_trls():
    # every metric TRL logs, in float64: KL mean, clip ratios (means, the per-sequence min and max), entropy
    case = GRPO_CASES["grpo-kl-clipped"]
    t = _grpo_inputs(torch.float64, case)
    t["old_logprobs"], t["ref_logprobs"] = t["old_logprobs"].double(), t["ref_logprobs"].double()
    _, m = linear_grpo_loss(**t, **_grpo_kwargs(case))
    lp, ent = _ref_logprobs(t["input"], t["weight"], t["completion_ids"], None, 0.8, entropy=True)
    _, kl, low, high, region = _trl_grpo(lp, t["advantages"].double(), t["completion_mask"].double(),
                                         t["old_logprobs"], t["ref_logprobs"], beta=0.04, epsilon_low=0.2,
                                         epsilon_high=0.28, loss_type="grpo", importance_sampling_level="token",
                                         max_completion_length=5)
    mask = t["completion_mask"].double()
    for key, want in (("kl", kl), ("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high),
                      ("clip_ratio/region_mean", region), ("entropy", (ent * mask).sum() / mask.sum())):
        torch.testing.assert_close(m[key], want, msg=key)
    assert m["clip_ratio/region_mean"] > 0  # the case clips something
    assert not any(v.requires_grad for v in m.values())


def test_grpo_op_recomputes_a_gradient_the_forward_did_not_make():
    # the fused op called without grads (as a caller of the registered op could): its backward recomputes, and
    # equals the formula's gradient through the reference
    a = grpo_off_policy_kl(torch.float64, DEVICE)
    a.update(differentiable_logprobs=False, grads=None)
    h = a.pop("input").requires_grad_(True)
    got = torch.autograd.grad(linear_grpo_op(h, **a)[0], h)[0]
    h2 = h.detach().clone().requires_grad_(True)
    want = torch.autograd.grad(linear_grpo_reference(h2, **a)[0], h2)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"])
def test_grpo_gradient_accumulation_equals_one_step(loss_type):
    # two micro-batches of unequal token counts, each given the whole step's normaliser, sum to the big step's
    # gradient (TRL #5890, Liger #802: dividing each micro-batch by its own count does not)
    case = dict(GRPO_CASES["grpo-kl-clipped"], loss_type=loss_type)
    t = _grpo_inputs(torch.float64, case)
    t["old_logprobs"], t["ref_logprobs"] = t["old_logprobs"].double(), t["ref_logprobs"].double()
    kw = _grpo_kwargs(case)
    W = t.pop("weight").requires_grad_(True)
    big, _ = linear_grpo_loss(weight=W, **t, **kw)
    want = torch.autograd.grad(big, W)[0]
    items, seqs = t["completion_mask"].sum(), t["completion_mask"].shape[0]
    got = torch.zeros_like(W)
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4)):
        part = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
        loss, _ = linear_grpo_loss(weight=W, **part, **kw, num_items_in_batch=items, num_sequences_in_batch=seqs)
        got += torch.autograd.grad(loss, W)[0]
        total += loss.detach()
    torch.testing.assert_close(total, big.detach())
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- DPO
def _trl_dpo(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, completion_mask, *, beta, loss_type,
             label_smoothing, discopop_tau=0.05, f_divergence_type="reverse_kl", f_alpha_divergence_coef=1.0,
             per_sequence=False):
    """TRL 1.16's DPOTrainer._compute_loss (one loss type, no weighting), its arithmetic line by line; sigmoid
    with label smoothing as TRL 0.x defined it (conservative DPO)."""
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    if f_divergence_type == "reverse_kl":
        chosen_scores, rejected_scores = chosen_logratios, rejected_logratios
    elif f_divergence_type == "forward_kl":
        chosen_scores, rejected_scores = 1 - torch.exp(-chosen_logratios), 1 - torch.exp(-rejected_logratios)
    elif f_divergence_type == "js_divergence":
        chosen_scores = math.log(2) + F.logsigmoid(chosen_logratios)
        rejected_scores = math.log(2) + F.logsigmoid(rejected_logratios)
    else:  # alpha_divergence, away from alpha = 1; the clamp of float32 and bfloat16 (TRL has none for float64)
        coef = 1.0 / (f_alpha_divergence_coef - 1.0)
        t_chosen = (f_alpha_divergence_coef - 1.0) * chosen_logratios
        t_rejected = (f_alpha_divergence_coef - 1.0) * rejected_logratios
        chosen_scores = (torch.exp(torch.clamp(t_chosen, max=80.0)) - 1.0) * coef
        rejected_scores = (torch.exp(torch.clamp(t_rejected, max=80.0)) - 1.0) * coef
    delta_score = chosen_scores - rejected_scores
    chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
    if loss_type in ("aot", "aot_unpaired"):
        if loss_type == "aot":
            logratios_sorted, _ = torch.sort(chosen_logps - rejected_logps, dim=0)
            ref_logratios_sorted, _ = torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0)
            delta = logratios_sorted - ref_logratios_sorted
        else:
            delta = torch.sort(chosen_logratios, dim=0)[0] - torch.sort(rejected_logratios, dim=0)[0]
        per_sequence_loss = (-F.logsigmoid(beta * delta) * (1 - label_smoothing)
                             - F.logsigmoid(-beta * delta) * label_smoothing)
    elif loss_type == "exo_pair":
        eps = torch.tensor(label_smoothing)  # float32, as TRL makes it
        per_sequence_loss = (torch.sigmoid(beta * delta_score) * (F.logsigmoid(beta * delta_score) - torch.log1p(-eps))
                             + torch.sigmoid(-beta * delta_score) * (F.logsigmoid(-beta * delta_score) - torch.log(eps)))
    elif loss_type == "nca_pair":
        per_sequence_loss = (-F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards)
                             - 0.5 * F.logsigmoid(-rejected_rewards))
    elif loss_type == "bco_pair":
        per_sequence_loss = -F.logsigmoid(chosen_rewards) - F.logsigmoid(-rejected_rewards)
    elif loss_type == "sppo_hard":
        per_sequence_loss = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":
        per_sequence_loss = (1 - torch.sigmoid(chosen_rewards)) + torch.sigmoid(rejected_rewards)
    elif loss_type == "apo_down":
        per_sequence_loss = torch.sigmoid(chosen_rewards) + (1 - torch.sigmoid(beta * delta_score))
    elif loss_type == "discopop":
        logits = delta_score * beta
        modulation = torch.sigmoid(logits / discopop_tau)
        per_sequence_loss = -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    elif loss_type == "sigmoid_norm":
        chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
        delta = (chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
                 - rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0))
        per_sequence_loss = -F.logsigmoid(beta * delta)
    elif loss_type == "sigmoid":
        per_sequence_loss = (-F.logsigmoid(beta * delta_score) * (1 - label_smoothing)
                             - F.logsigmoid(-beta * delta_score) * label_smoothing)
    elif loss_type == "hinge":
        per_sequence_loss = torch.relu(1 - beta * delta_score)
    elif loss_type == "ipo":
        chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
        ipo_delta = (chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
                     - rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0))
        per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2
    else:  # robust
        clean_loss_term = -(1 - label_smoothing) * F.logsigmoid(beta * delta_score)
        flipped_loss_term = -label_smoothing * F.logsigmoid(-beta * delta_score)
        per_sequence_loss = (clean_loss_term - flipped_loss_term) / (1 - 2 * label_smoothing)
    if per_sequence:  # before TRL's mean (WPO weighs each pair first)
        return per_sequence_loss
    return per_sequence_loss.mean(), beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


DPO_CASES = {"sigmoid": 0.0, "sigmoid-smoothed": 0.1, "hinge": 0.0, "ipo": 0.0, "robust": 0.1, "exo_pair": 1e-3,
             "nca_pair": 0.0, "bco_pair": 0.0, "sppo_hard": 0.0, "apo_zero": 0.0, "apo_down": 0.0, "discopop": 0.0,
             "sigmoid_norm": 0.0, "aot": 0.0, "aot-smoothed": 0.1, "aot_unpaired": 0.0}
# f-divergences other than reverse KL: (loss type, label smoothing, f_divergence_type, f_alpha_divergence_coef);
# bco_pair takes the log-ratios whatever the divergence
DPO_DIV_CASES = {"sigmoid-forward_kl": ("sigmoid", 0.0, "forward_kl", 1.0),
                 "ipo-js": ("ipo", 0.0, "js_divergence", 1.0),
                 "hinge-alpha": ("hinge", 0.0, "alpha_divergence", 0.5),
                 "exo_pair-alpha": ("exo_pair", 1e-3, "alpha_divergence", 1.5),
                 "sigmoid_norm-forward_kl": ("sigmoid_norm", 0.0, "forward_kl", 1.0),
                 "sigmoid+sft-js": (["sigmoid", "sft"], 0.0, "js_divergence", 1.0)}


def _dpo_inputs(dt):
    h, W, t = _head(dt, B=4, T=5)
    t[:, 0] = -100  # the prompt's last position
    t[3, 3:] = -100  # padding
    g = torch.Generator().manual_seed(3)
    return {"input": h, "weight": W, "target": t, "ref_chosen_logps": -10 + torch.randn(2, generator=g),
            "ref_rejected_logps": -10 + torch.randn(2, generator=g)}


@pytest.mark.parametrize("name,dtype", _grid(DPO_CASES, ["sigmoid-smoothed", "ipo", "discopop"]), ids=str)
def test_dpo_against_trl_formula_in_float64(name, dtype):
    loss_type, eps = name.split("-")[0], DPO_CASES[name]
    # ipo's and sppo_hard's margins 1/(2 beta) near the log-ratios' scale; discopop's tau near beta d's
    beta = {"ipo": 0.5, "sppo_hard": 0.5, "discopop": 1.0}.get(loss_type, 0.1)

    def ours(input, weight, target, ref_chosen_logps, ref_rejected_logps):
        loss, m = linear_dpo_loss(input, weight, target, ref_chosen_logps=ref_chosen_logps,
                                  ref_rejected_logps=ref_rejected_logps, beta=beta, loss_type=loss_type,
                                  label_smoothing=eps)
        return loss, m["chosen_rewards"], m["rejected_rewards"]

    def ref(input, weight, target, ref_chosen_logps, ref_rejected_logps):
        lp = _ref_logprobs(input, weight, target)[0]
        mask = (target != -100).to(lp.dtype)
        c, r = (lp * mask).sum(1).chunk(2)
        return _trl_dpo(c, r, ref_chosen_logps.to(lp.dtype), ref_rejected_logps.to(lp.dtype), mask, beta=beta,
                        loss_type=loss_type, label_smoothing=eps)

    _check(ours, ref, _dpo_inputs, dtype)


@pytest.mark.parametrize("name", list(DPO_DIV_CASES))
def test_dpo_f_divergences_against_trl_formula_in_float64(name):
    loss_type, eps, fdiv, alpha = DPO_DIV_CASES[name]
    names = loss_type if isinstance(loss_type, list) else [loss_type]
    _check_dpo_list(names, None, eps, torch.float32, f_divergence_type=fdiv, f_alpha_divergence_coef=alpha)


def _check_dpo_list(types, weights, eps, dtype, **divergence):
    """linear_dpo_loss with a list of loss types (and a divergence) against TRL's loop over them in float64."""
    beta = 0.5 if "ipo" in types else 0.1

    def ours(input, weight, target, ref_chosen_logps, ref_rejected_logps):
        loss, m = linear_dpo_loss(input, weight, target, ref_chosen_logps=ref_chosen_logps,
                                  ref_rejected_logps=ref_rejected_logps, beta=beta, loss_type=types,
                                  loss_weights=weights, label_smoothing=eps, **divergence)
        return loss, m["chosen_rewards"], m["rejected_rewards"]

    def ref(input, weight, target, ref_chosen_logps, ref_rejected_logps):
        lp = _ref_logprobs(input, weight, target)[0]
        mask = (target != -100).to(lp.dtype)
        c, r = (lp * mask).sum(1).chunk(2)
        return _trl_dpo_multi(c, r, ref_chosen_logps.to(lp.dtype), ref_rejected_logps.to(lp.dtype), mask, lp * mask,
                              beta=beta, types=types, weights=weights, eps=eps, **divergence)

    _check(ours, ref, _dpo_inputs, dtype)


# Lists of loss types with their weights, as TRL's loss_type=[...] and loss_weights: (types, weights, label smoothing)
DPO_MULTI_CASES = {"sft": (["sft"], None, 0.0), "sigmoid+sft": (["sigmoid", "sft"], [1.0, 0.5], 0.0),
                   "mpo": (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], 0.0),
                   "ipo+robust": (["ipo", "robust"], [0.7, 1.3], 0.1)}


def _trl_dpo_multi(c, r, rc, rr, mask, lp, *, beta, types, weights, eps, **divergence):
    """TRL 1.16's loop over loss types: sum_k w_k mean(per-sequence loss_k); sft: the chosen tokens' mean -logp."""
    loss = 0.0
    for name, w in zip(types, weights or [1.0] * len(types)):
        if name == "sft":
            cm, _ = mask.chunk(2)
            one = -lp.chunk(2)[0][cm.bool()].mean()
        else:
            one = _trl_dpo(c, r, rc, rr, mask, beta=beta, loss_type=name, label_smoothing=eps, **divergence)[0]
        loss = loss + one * w
    return loss, beta * (c - rc).detach(), beta * (r - rr).detach()


@pytest.mark.parametrize("name,dtype", _grid(DPO_MULTI_CASES, ["mpo"]), ids=str)
def test_dpo_loss_lists_against_trl_formula_in_float64(name, dtype):
    # the weighted sum of several loss types, sft's chosen-token mean among them, in the fused op (chunks of whole
    # pairs: each pair's derivative the weighted sum of its types') and in float64: loss, rewards, gradients
    types, weights, eps = DPO_MULTI_CASES[name]
    _check_dpo_list(types, weights, eps, dtype)


def test_dpo_loss_list_accumulates_over_micro_batches():
    # sigmoid + sft over two micro-batches with num_pairs_in_batch: the gradients of one call over both (sft's
    # mean over each call's chosen tokens; here both calls hold the same number of them)
    t = _dpo_inputs(torch.float64)
    W = t["weight"].clone().requires_grad_()
    kw = dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
    tg = t["target"]
    assert (tg[0] != -100).sum() == (tg[1] != -100).sum()  # both chosen rows hold as many tokens
    whole, _ = linear_dpo_loss(t["input"], W, tg, ref_chosen_logps=t["ref_chosen_logps"],
                               ref_rejected_logps=t["ref_rejected_logps"], **kw)
    g_whole, = torch.autograd.grad(whole, W)
    total = 0
    for i in range(2):
        rows = [i, 2 + i]
        part, _ = linear_dpo_loss(t["input"][rows], W, tg[rows], ref_chosen_logps=t["ref_chosen_logps"][i:i + 1],
                                  ref_rejected_logps=t["ref_rejected_logps"][i:i + 1], num_pairs_in_batch=2, **kw)
        total = total + part
    g_parts, = torch.autograd.grad(total, W)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(g_parts, g_whole)


def test_dpo_fused_op_refuses_losses_that_couple_the_pairs():
    # aot couples the batch's pairs through a sort, sft under WPO through the mean weight: linear_dpo_loss takes the
    # log-probabilities path for them, and the fused op, called directly, says why it cannot
    t = _dpo_inputs(torch.float32)
    tw = (t["target"] != -100).to(torch.float32)
    args = (t["input"].reshape(-1, t["input"].shape[-1]), t["weight"], t["target"].reshape(-1), tw,
            t["ref_chosen_logps"], t["ref_rejected_logps"])
    with pytest.raises(ValueError, match=r"\['aot'\] sort the batch's pairs, so no chunk of pairs knows its gradient"):
        linear_dpo_op(*args, loss_type="sigmoid,aot")
    with pytest.raises(ValueError, match=r"sft with use_weighting \(WPO\) takes the mean of every pair's weight"):
        linear_dpo_op(*args, loss_type="sigmoid,sft", use_weighting=True)


def _trl_wpo(per_token_logps, log_sum_sq_probs, shift_completion_mask):
    """TRL 1.16's WPO weights (use_weighting), line by line: each pair's w_chosen * w_rejected."""
    completion_lengths = shift_completion_mask.sum(dim=1).clamp_min(1)
    aligned_logps = (per_token_logps - log_sum_sq_probs) * shift_completion_mask
    weights = torch.exp(aligned_logps.sum(dim=1) / completion_lengths)
    chosen_weights, rejected_weights = weights.chunk(2, dim=0)
    return (chosen_weights * rejected_weights).detach()


# WPO: (loss types, weights, label smoothing, softcap, ld_alpha, f-divergence)
DPO_WPO_CASES = {"sigmoid-wpo": (["sigmoid"], None, 0.0, None, None, "reverse_kl"),
                 "ipo+hinge-wpo": (["ipo", "hinge"], [1.0, 0.5], 0.0, None, None, "reverse_kl"),
                 "sigmoid-wpo-softcap": (["sigmoid"], None, 0.0, 3.0, None, "reverse_kl"),
                 "sigmoid+sft-wpo": (["sigmoid", "sft"], [1.0, 0.5], 0.0, None, None, "reverse_kl"),
                 # LD-DPO's sums, WPO's weights over the plain mask (TRL's)
                 "sigmoid-wpo-ld": (["sigmoid"], None, 0.0, None, 0.5, "reverse_kl"),
                 # the scores of an f-divergence, each pair's loss of them times its weight
                 "sigmoid-wpo-js": (["sigmoid"], None, 0.0, None, None, "js_divergence")}


@pytest.mark.parametrize("name,dtype", _grid(DPO_WPO_CASES, ["sigmoid-wpo"]), ids=str)
def test_dpo_wpo_against_trl_formula_in_float64(name, dtype):
    # WPO's weights from each row's log sum_j p_j^2 (the forward kernel's HAS_SQ statistic) and log-probability,
    # each pair's loss times its weight, in chunks of whole pairs (float16, and sft's batch-wide term, from the
    # log-probabilities with the same statistic); against TRL's arithmetic in float64
    types, weights, eps, cap, ld, fdiv = DPO_WPO_CASES[name]
    beta = 0.5 if "ipo" in types else 0.1

    def ours(input, weight, target, ref_chosen_logps, ref_rejected_logps):
        loss, m = linear_dpo_loss(input, weight, target, ref_chosen_logps=ref_chosen_logps,
                                  ref_rejected_logps=ref_rejected_logps, beta=beta, loss_type=types,
                                  loss_weights=weights, label_smoothing=eps, use_weighting=True, logit_softcap=cap,
                                  ld_alpha=ld, f_divergence_type=fdiv)
        return loss, m["chosen_rewards"], m["rejected_rewards"]

    def ref(input, weight, target, ref_chosen_logps, ref_rejected_logps):
        z = input @ weight.t()
        if cap is not None:
            z = cap * torch.tanh(z / cap)
        logp = torch.log_softmax(z, -1)
        mask = (target != -100).to(z.dtype)
        lp = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0] * mask
        lss = torch.logsumexp(2 * logp, -1)
        w = _trl_wpo(lp, lss, mask)
        c, r = (lp * ld_token_weights(mask, ld)).sum(1).chunk(2)
        rc, rr = ref_chosen_logps.to(z.dtype), ref_rejected_logps.to(z.dtype)
        loss = 0.0
        for t_, w_ in zip(types, weights or [1.0] * len(types)):
            if t_ == "sft":  # TRL's batch loss, broadcast to every pair
                per_seq = (-lp.chunk(2)[0][mask.chunk(2)[0].bool()].mean()).expand(c.shape[0])
            else:
                per_seq = _trl_dpo(c, r, rc, rr, mask, beta=beta, loss_type=t_, label_smoothing=eps,
                                   f_divergence_type=fdiv, per_sequence=True)
            loss = loss + (per_seq * w).mean() * w_
        return loss, beta * (c - rc).detach(), beta * (r - rr).detach()

    _check(ours, ref, _dpo_inputs, dtype)


@pytest.mark.parametrize("kw,match", [
    (dict(loss_type="kto_pair"), r"loss_type must be one of .*, got 'kto_pair'"),
    (dict(loss_type="aot", use_weighting=True), r"use_weighting \(WPO\) with aot or aot_unpaired is refused"),
    (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]), r"must give one weight per loss type"),
    (dict(loss_type=["sigmoid", "sigmoid"]), r"names a loss type twice"),
    (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, float("nan")]), r"loss_weights must be finite numbers"),
    (dict(loss_type="exo_pair"), r"exo_pair takes label_smoothing in \(0, 1\).*got 0.0"),
    (dict(loss_type="robust", label_smoothing=0.5), r"robust loss takes label_smoothing in \[0, 0.5\), got 0.5"),
    (dict(loss_type="discopop", discopop_tau=0.0), r"discopop takes discopop_tau > 0, got 0.0"),
    (dict(f_divergence_type="chi2"), r"f_divergence_type must be one of .*, got 'chi2'"),
    (dict(loss_type=["sigmoid", "bco_pair"], f_divergence_type="js_divergence"),
     r"f_divergence_type='js_divergence' takes the loss types .* got \['bco_pair'\]"),
    (dict(ld_alpha=1.5), r"ld_alpha must be in \[0, 1\] \(or None\), got 1.5"),
], ids=["unknown", "aot-wpo", "weights-length", "twice", "weights-nan", "exo_pair-0", "robust-0.5",
        "discopop-tau-0", "f-divergence", "f-divergence-bco_pair", "ld_alpha"])
def test_dpo_refuses_what_it_does_not_compute(kw, match):
    # TRL's batch-coupled and non-pair loss types, and values whose loss TRL would make infinite or undefined
    t = _dpo_inputs(torch.float32)
    with pytest.raises(ValueError, match=match):
        linear_dpo_loss(t["input"], t["weight"], t["target"], ref_chosen_logps=t["ref_chosen_logps"],
                        ref_rejected_logps=t["ref_rejected_logps"], **kw)


def test_dpo_reference_model_from_hidden_states_and_accumulation():
    # the reference scored from its own hidden states and head (no gradient), equal to given sequence logprobs;
    # two micro-batches of one pair each with num_pairs_in_batch=2 sum to the big step
    t = _dpo_inputs(torch.float64)
    ref_h, ref_W = torch.randn(4, 5, 8, dtype=torch.float64), torch.randn(40, 8, dtype=torch.float64)
    ref_lp = _ref_logprobs(ref_h, ref_W, t["target"])[0].sum(1)
    W = t["weight"].requires_grad_(True)
    a, ma = linear_dpo_loss(t["input"], W, t["target"], ref_input=ref_h, ref_weight=ref_W)
    b, mb = linear_dpo_loss(t["input"], W, t["target"], ref_chosen_logps=ref_lp[:2], ref_rejected_logps=ref_lp[2:])
    torch.testing.assert_close(a, b)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        torch.testing.assert_close(ma[k], mb[k])
    want = torch.autograd.grad(a, W)[0]
    got = torch.zeros_like(W)
    for i in range(2):
        rows = [i, 2 + i]  # pair i: its chosen and its rejected row
        loss, _ = linear_dpo_loss(t["input"][rows], W, t["target"][rows], ref_chosen_logps=ref_lp[i:i + 1],
                                  ref_rejected_logps=ref_lp[2 + i:3 + i], num_pairs_in_batch=2)
        got += torch.autograd.grad(loss, W)[0]
    torch.testing.assert_close(got, want)


# ipo and sigmoid_norm (the token counts), robust (both sigmoid terms), nca_pair and apo_down (chosen and rejected
# apart, not through d alone); every loss type's derivative is checked against TRL's formula on the fused path above
@pytest.mark.parametrize("loss_type", ["ipo", "robust", "sigmoid_norm", "nca_pair", "apo_down", "sigmoid-wpo"])
def test_dpo_chunks_of_pairs_and_of_rows_agree(monkeypatch, loss_type):
    # the fused op in chunks of one pair (SMALL), of two (the second ragged: one pair), and the unfused path
    # (a pair over pair_bytes: chunks of rows, the logits made twice): the same loss, gradients and metrics, equal
    # to the op's float64 reference; the registered op called without grads recomputes them in its backward
    h, W, t = _head(torch.float64, B=6, T=5)
    t[:, 0] = -100
    t[5, 2:] = -100
    g = torch.Generator().manual_seed(4)
    ref_c, ref_r = (-10 + torch.randn(3, generator=g, dtype=torch.float64) for _ in range(2))
    h, W, t, ref_c, ref_r = (x.to(DEVICE) for x in (h, W, t, ref_c, ref_r))  # the kernels on a GPU machine
    kw = dict(beta=0.5 if loss_type == "ipo" else 0.1, loss_type=loss_type.split("-")[0],
              label_smoothing=0.2 if loss_type == "robust" else 0.0, use_weighting=loss_type.endswith("-wpo"))
    pair = P.pair_bytes(5, 40, 8)
    results = []
    for limits in (SMALL, dataclasses.replace(SMALL, pair_bytes=2 * pair),
                   dataclasses.replace(SMALL, pair_bytes=pair - 1)):
        monkeypatch.setattr(P, "LIMITS", limits)
        x, w = h.clone().requires_grad_(True), W.clone().requires_grad_(True)
        loss, m = linear_dpo_loss(x, w, t, ref_chosen_logps=ref_c, ref_rejected_logps=ref_r, **kw)
        results.append((loss, *torch.autograd.grad(loss, (x, w)), m["chosen_rewards"], m["rejected_rewards"]))
    x, w = h.clone().requires_grad_(True), W.clone().requires_grad_(True)
    mask = (t != -100).to(torch.float64)
    want = linear_dpo_reference(x.reshape(-1, 16), w, t.reshape(-1), mask, ref_c, ref_r, **kw)
    op = linear_dpo_op(x.reshape(-1, 16), w, t.reshape(-1), mask, ref_c, ref_r, **kw)  # no grads: backward recomputes
    results.append((op[0], *torch.autograd.grad(op[0], (x, w)), kw["beta"] * (op[1] - ref_c),
                    kw["beta"] * (op[2] - ref_r)))
    want = (want[0], *torch.autograd.grad(want[0], (x, w)), kw["beta"] * (want[1] - ref_c),
            kw["beta"] * (want[2] - ref_r))
    for got in results:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- distillation
def _trl_jsd(student_logits, teacher_logits, mask, beta, temperature):
    """TRL's generalized JSD (the distillation trainer's), per token, masked mean."""
    s = F.log_softmax(student_logits / temperature, -1)
    t = F.log_softmax(teacher_logits / temperature, -1)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    else:
        m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)
        jsd = (beta * F.kl_div(m, t, reduction="none", log_target=True)
               + (1 - beta) * F.kl_div(m, s, reduction="none", log_target=True)).sum(-1)
    return (jsd * mask).sum() / mask.sum().clamp(min=1)


def _distill_inputs(dt):
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(2, 7)
    mask[1, 4:] = 0
    return {"student_input": torch.randn(2, 7, 16, generator=g).to(dt),
            "student_weight": (torch.randn(40, 16, generator=g) / 3).to(dt),
            "teacher_input": torch.randn(2, 7, 12, generator=g).to(dt),  # a wider teacher head is fine too
            "teacher_weight": (torch.randn(40, 12, generator=g) / 3).to(dt),
            "student_bias": torch.randn(40, generator=g).to(dt), "mask": mask}


@pytest.mark.parametrize("beta,dtype", _grid([0.0, 1.0, 0.5, 0.1], [0.0, 0.5]), ids=str)
def test_jsd_against_trl_formula_in_float64(beta, dtype):
    def ours(**t):
        return linear_jsd(t.pop("student_input"), t.pop("student_weight"), t.pop("teacher_input"),
                          t.pop("teacher_weight"), 1.3, beta, **t)

    def ref(student_input, student_weight, teacher_input, teacher_weight, student_bias, mask):
        acc = torch.float64 if student_input.dtype == torch.float64 else torch.float32
        zs = F.linear(student_input, student_weight, student_bias).to(acc)
        zt = F.linear(teacher_input, teacher_weight).to(acc)
        return _trl_jsd(zs, zt, mask.to(acc), beta, 1.3)

    _check(ours, ref, _distill_inputs, dtype, diff=("student_input", "student_weight", "student_bias"))


@pytest.mark.parametrize("caps,dtype", [(c, torch.float32) for c in [(3.0, 5.0), (3.0, None), (None, 5.0)]]
                         + [((3.0, 5.0), torch.bfloat16)], ids=str)
def test_jsd_with_gemma2_soft_caps_against_float64(caps, dtype):
    # each model's final soft cap before the temperature, as each model's forward and TRL's loss apply them
    def ours(**t):
        return linear_jsd(t.pop("student_input"), t.pop("student_weight"), t.pop("teacher_input"),
                          t.pop("teacher_weight"), 1.3, 0.5, student_logit_softcap=caps[0],
                          teacher_logit_softcap=caps[1], **t)

    def ref(student_input, student_weight, teacher_input, teacher_weight, student_bias, mask):
        acc = torch.float64 if student_input.dtype == torch.float64 else torch.float32
        zs = F.linear(student_input, student_weight, student_bias).to(acc)
        zt = F.linear(teacher_input, teacher_weight).to(acc)
        zs, zt = (z if c is None else c * torch.tanh(z / c) for z, c in zip((zs, zt), caps))
        return _trl_jsd(zs, zt, mask.to(acc), 0.5, 1.3)

    _check(ours, ref, _distill_inputs, dtype, diff=("student_input", "student_weight", "student_bias"))


@pytest.mark.parametrize("kw,match", [
    (dict(beta=1.5), r"linear_jsd: beta must be a float in \[0, 1\], got 1.5"),
    (dict(student_logit_softcap=0.0), r"linear_jsd: student_logit_softcap must be a finite float > 0 or None, got 0.0"),
    (dict(teacher_logit_softcap=float("inf")), r"teacher_logit_softcap must be a finite float > 0 or None, got inf"),
    (dict(temperature=0.0), r"linear_jsd: temperature must be a float > 0, got 0.0"),
    (dict(mask=torch.ones(7, 2)), r"linear_jsd: mask of shape \(7, 2\) must be the inputs' leading shape \(2, 7\)"),
    (dict(mask=torch.ones(14)), r"linear_jsd: mask of shape \(14,\) must be the inputs' leading shape \(2, 7\)"),
], ids=["beta", "student-cap", "teacher-cap", "temperature", "mask-transposed", "mask-flat"])
def test_jsd_refuses_bad_arguments_by_name(kw, match):
    t = _distill_inputs(torch.float32)
    with pytest.raises(ValueError, match=match):
        linear_jsd(t["student_input"], t["student_weight"], t["teacher_input"], t["teacher_weight"], **kw)


def test_kl_div_is_jsd_at_the_ends_and_teacher_takes_no_gradient():
    t = _distill_inputs(torch.float64)
    Wt = t["teacher_weight"].requires_grad_(True)
    fwd = linear_kl_div(t["student_input"], t["student_weight"], t["teacher_input"], Wt, mask=t["mask"])
    rev = linear_kl_div(t["student_input"], t["student_weight"], t["teacher_input"], Wt, reverse=True, mask=t["mask"])
    torch.testing.assert_close(fwd, linear_jsd(t["student_input"], t["student_weight"], t["teacher_input"], Wt,
                                               beta=0.0, mask=t["mask"]))
    torch.testing.assert_close(rev, linear_jsd(t["student_input"], t["student_weight"], t["teacher_input"], Wt,
                                               beta=1.0, mask=t["mask"]))
    assert not fwd.requires_grad and Wt.grad is None  # nothing else requires grad: the teacher's own is detached


def test_jsd_gradient_accumulation_and_backward_scale():
    # micro-batches with the step's token count sum to one step; a backward of 2 * loss gives twice the gradient
    t = _distill_inputs(torch.float64)
    W = t.pop("student_weight").requires_grad_(True)
    args = (t.pop("student_input"), W, t.pop("teacher_input"), t.pop("teacher_weight"))
    mask = t.pop("mask")
    big = linear_jsd(*args, 1.0, 0.3, mask=mask, **t)
    want = torch.autograd.grad(2 * big, W)[0]
    got = torch.zeros_like(W)
    for rows in (slice(0, 1), slice(1, 2)):
        part = (args[0][rows], W, args[2][rows], args[3])
        got += torch.autograd.grad(2 * linear_jsd(*part, 1.0, 0.3, mask=mask[rows], num_items_in_batch=mask.sum(),
                                                  **t), W)[0]
    torch.testing.assert_close(got, want)


def test_distill_op_recomputes_a_gradient_the_forward_did_not_make():
    # the registered op called without grads (as torch.compile's graph could): its backward recomputes
    t = _distill_inputs(torch.float64)
    hs = t["student_input"].reshape(14, 16).requires_grad_(True)
    w = torch.rand(14, dtype=torch.float64)
    args = (t["student_weight"], t["teacher_input"].reshape(14, 12), t["teacher_weight"], w)
    got = torch.autograd.grad(linear_distill_op(hs, *args, None, None, 0.5, 1.0, None), hs)[0]
    h2 = hs.detach().clone().requires_grad_(True)
    want = torch.autograd.grad(linear_distill_reference(h2, *args, None, None, 0.5, 1.0), h2)[0]
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_traced_distillation_backward_scales_the_forwards_gradients(scale):
    # Traced, the student's gradients the forward computed are scaled in PyTorch ops (scaled_grads), which
    # Inductor may write over the saved buffers: no backward op in the graph, the gradients eager's bit for bit.
    backend, graphs = backward_graphs_backend()
    d = {k: v.to(DEVICE) for k, v in _distill_inputs(torch.float32).items()}
    hs, Ws, bs = (d.pop(k).requires_grad_() for k in ("student_input", "student_weight", "student_bias"))

    def f(hs, Ws, bs):
        return linear_jsd(hs, Ws, d["teacher_input"], d["teacher_weight"], 1.3, 0.3, student_bias=bs,
                          mask=d["mask"]) * scale

    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, backend=backend, fullgraph=True)(hs, Ws, bs), (hs, Ws, bs))
    want = torch.autograd.grad(f(hs, Ws, bs), (hs, Ws, bs))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=0, atol=0)
    (graph,) = graphs
    assert "linear_distill_backward" not in graph, graph


def test_compile_fullgraph_without_graph_breaks():
    # the three losses in one compiled function (aot_eager on CPU: the ops are opaque custom ops), equal to
    # eager, loss and gradients
    torch._dynamo.reset()
    t = _grpo_inputs(torch.float32, GRPO_CASES["grpo-kl-clipped"])
    d = _distill_inputs(torch.float32)

    def step(h, W, Ws):
        grpo, m = linear_grpo_loss(h, W, t["completion_ids"], t["advantages"], t["completion_mask"],
                                   old_logprobs=t["old_logprobs"], ref_logprobs=t["ref_logprobs"], beta=0.04,
                                   loss_type="grpo", temperature=0.8)
        dpo, _ = linear_dpo_loss(h, W, t["completion_ids"], ref_chosen_logps=t["ref_logprobs"][:2].sum(1),
                                 ref_rejected_logps=t["ref_logprobs"][2:].sum(1))
        jsd = linear_jsd(d["student_input"], Ws, d["teacher_input"], d["teacher_weight"], 1.0, 0.5)
        return grpo + dpo + jsd + 0 * m["kl"]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    outs = []
    for fn in (step, compiled):
        h = t["input"].clone().requires_grad_(True)
        W = t["weight"].clone().requires_grad_(True)
        Ws = d["student_weight"].clone().requires_grad_(True)
        loss = fn(h, W, Ws)
        outs.append((loss, *torch.autograd.grad(loss, (h, W, Ws))))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- a plain training loop
def test_plain_training_loop_with_accumulation():
    # GRPO in a plain loop: two micro-batches accumulated with the step's normaliser equal one step, and the
    # head and the hidden states' producer both train (docs/post-training.md's loop)
    torch.manual_seed(0)
    body = torch.nn.Linear(8, 16, dtype=torch.float64)
    head = torch.nn.Linear(16, 40, bias=False, dtype=torch.float64)
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    ids = torch.randint(0, 40, (4, 5))
    adv = torch.randn(4, dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.float64)
    mask[2, 2:] = 0
    grads = []
    for micro in ([slice(0, 4)], [slice(0, 2), slice(2, 4)]):
        body.zero_grad(), head.zero_grad()
        for rows in micro:
            loss, _ = linear_grpo_loss(body(x[rows]), head.weight, ids[rows], adv[rows], mask[rows],
                                       num_items_in_batch=mask.sum())
            loss.backward()
        grads.append([p.grad.clone() for p in (*body.parameters(), head.weight)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- sm_90
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests compile and run the kernels themselves")
def test_kernels_compile_for_sm90_without_spills(sm90_cases):
    out = run_without_interpreter([os.path.join(os.path.dirname(__file__), "post_training_sm90_compile.py"),
                                   *sm90_cases], timeout=600)
    assert out.returncode == 0 and " 0 failures" in out.stdout, (out.stdout + out.stderr)[-4000:]


# ---------------------------------------------------------------- TRL itself
def _trl():
    trl = pytest.importorskip("trl", reason="TRL not installed")
    for dep in ("accelerate", "datasets"):  # TRL's own requirements, which its trainers import (absent on the GPU host)
        pytest.importorskip(dep, reason=f"TRL's trainers need {dep}, not installed")
    return trl


class _Acc:
    """What TRL's _compute_loss reads from its accelerator, for one process."""
    num_processes = 1
    device = torch.device("cpu")
    reduce = staticmethod(lambda x, reduction="sum": x)
    gather = staticmethod(lambda x: x)
    gather_for_metrics = staticmethod(lambda x: x)
    sync_gradients = True


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GRPO_CASES))
def test_grpo_formula_is_trls_own(name):
    # grpo_from_logprobs against GRPOTrainer._compute_loss itself (TRL installed), on float64 log-probabilities:
    # loss and every metric it logs
    _trl()
    from collections import defaultdict

    from trl import GRPOTrainer
    case = GRPO_CASES[name]
    t = _grpo_inputs(torch.float64, case)
    lp, ent = _ref_logprobs(t["input"], t["weight"], t["completion_ids"], None, 0.8, entropy=True)
    B, T = lp.shape
    mask = t["completion_mask"].double()
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": t["completion_ids"], "completion_mask": mask, "advantages": t["advantages"].double(),
              "ref_per_token_logps": t["ref_logprobs"].double(), "num_items_in_batch": mask.sum()}
    if case["old"]:
        inputs["old_per_token_logps"] = t["old_logprobs"].double()
    eps_high = case.get("eps_high", 0.28)
    me = types.SimpleNamespace(
        top_entropy_quantile=1.0, importance_sampling_level=case["level"], beta=case["beta"],
        loss_type=case["loss_type"], epsilon_low=0.2, epsilon_high=eps_high, off_policy_mask_threshold=None,
        use_vllm=False, vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=case.get("max_len") or T, accelerator=_Acc(),
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1,
                                   sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                                   vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0),
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, ent, None))
    want = GRPOTrainer._compute_loss(me, None, inputs)
    loss, m = grpo_from_logprobs(lp, t["advantages"].double(), mask, inputs.get("old_per_token_logps"),
                                 inputs["ref_per_token_logps"], beta=case["beta"], epsilon_low=0.2,
                                 epsilon_high=eps_high, loss_type=case["loss_type"],
                                 importance_sampling_level=case["level"], max_completion_length=case.get("max_len"),
                                 entropy=ent)
    torch.testing.assert_close(loss, want)
    logged = me._metrics["train"]
    assert set(logged) == set(m), (sorted(logged), sorted(m))  # the metrics TRL logs for this loss type, no others
    for key in logged:
        assert abs(m[key].item() - logged[key][0]) < 1e-12, key


def _trl_ld_logps(per_token_logps, shift_completion_mask, ld_alpha):
    """TRL 1.16's LD-DPO sequence sums (DPOTrainer._compute_loss with ld_alpha), line by line."""
    comp_pos = shift_completion_mask.cumsum(dim=1)
    comp_lens = shift_completion_mask.sum(dim=1).long()
    chosen_lens, rejected_lens = comp_lens.chunk(2, dim=0)
    shared_lens = torch.minimum(chosen_lens, rejected_lens)
    shared_lens = torch.cat([shared_lens, shared_lens], dim=0)
    shared_mask = (comp_pos > 0) & (comp_pos <= shared_lens.unsqueeze(1))
    tail_mask = comp_pos > shared_lens.unsqueeze(1)
    return (per_token_logps * shared_mask).sum(dim=1) + ld_alpha * (per_token_logps * tail_mask).sum(dim=1)


# LD-DPO: (loss type, ld_alpha)
DPO_LD_CASES = {"sigmoid-ld": ("sigmoid", 0.5), "ipo-ld": ("ipo", 0.3), "sigmoid-ld0": ("sigmoid", 0.0),
                "sigmoid+sft-ld": (["sigmoid", "sft"], 0.5)}  # sft's chosen tokens unweighted, the sigmoid's not


@pytest.mark.parametrize("name", list(DPO_LD_CASES))
def test_dpo_ld_alpha_against_trl_formula_in_float64(name):
    # the policy's and the reference's sums weighted alike (the reference from its hidden states and head)
    loss_type, ld = DPO_LD_CASES[name]
    names = loss_type if isinstance(loss_type, list) else [loss_type]
    beta = 0.5 if loss_type == "ipo" else 0.1
    t = _dpo_inputs(torch.float32)
    t["target"][1, 2:] = -100  # a chosen completion shorter than its rejected one: a tail to weigh
    t["target"][2, 3:] = -100  # and a rejected one shorter than its chosen one: a chosen tail (sft weighs it 1)
    g = torch.Generator().manual_seed(8)
    ref_h, ref_W = torch.randn(4, 5, 16, generator=g), torch.randn(40, 16, generator=g) / 4

    def ours(input, weight, target, ref_input):
        loss, m = linear_dpo_loss(input, weight, target, ref_input=ref_input, ref_weight=ref_W.to(input),
                                  beta=beta, loss_type=loss_type, ld_alpha=ld)
        return loss, m["chosen_rewards"], m["rejected_rewards"]

    def ref(input, weight, target, ref_input):
        lp = _ref_logprobs(input, weight, target)[0]
        mask = (target != -100).to(lp.dtype)
        c, r = _trl_ld_logps(lp * mask, mask, ld).chunk(2)
        rc, rr = _trl_ld_logps(_ref_logprobs(ref_input, ref_W.to(lp), target)[0] * mask, mask, ld).chunk(2)
        return _trl_dpo_multi(c, r, rc.detach(), rr.detach(), mask, lp * mask, beta=beta, types=names, weights=None,
                              eps=0.0)

    _check(ours, ref, lambda dt: {"input": t["input"].to(dt), "weight": t["weight"].to(dt), "target": t["target"],
                                  "ref_input": ref_h.to(dt)}, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in DPO_CASES if n != "sigmoid-smoothed"]  # TRL 1.16's sigmoid: no smoothing
                         + list(DPO_DIV_CASES) + list(DPO_LD_CASES) + list(DPO_MULTI_CASES)
                         + [n for n in DPO_WPO_CASES if "softcap" not in n])
def test_dpo_formula_is_trls_own(name, monkeypatch):
    # dpo_from_logprobs against DPOTrainer._compute_loss itself (TRL installed), on float64 log-probabilities from a
    # stand-in model (float32 for the alpha divergence, whose clamp TRL has no float64 entry for): the loss and
    # the rewards it logs
    _trl()
    from collections import defaultdict

    from trl import DPOTrainer
    ld, weights, wpo = None, None, False
    if name in DPO_DIV_CASES:
        loss_type, eps, fdiv, alpha = DPO_DIV_CASES[name]
    elif name in DPO_MULTI_CASES:
        (loss_type, weights, eps), fdiv, alpha = DPO_MULTI_CASES[name], "reverse_kl", 1.0
    elif name in DPO_WPO_CASES:
        (loss_type, weights, eps, _, ld, fdiv), alpha, wpo = DPO_WPO_CASES[name], 1.0, True
    elif name in DPO_LD_CASES:
        (loss_type, ld), eps, fdiv, alpha = DPO_LD_CASES[name], 0.0, "reverse_kl", 1.0
    else:
        (loss_type, eps), fdiv, alpha = (name.split("-")[0], DPO_CASES[name]), "reverse_kl", 1.0
    dt = torch.float32 if fdiv == "alpha_divergence" else torch.float64
    names = loss_type if isinstance(loss_type, list) else [loss_type]
    beta = {"ipo": 0.5, "sppo_hard": 0.5, "discopop": 1.0}.get(names[0], 0.1)
    g = torch.Generator().manual_seed(5)
    B, L = 3, 7
    completion_mask = torch.zeros(2 * B, L)
    completion_mask[:, 2:] = 1  # two prompt tokens
    completion_mask[1, 5:] = 0  # completions of different lengths
    completion_mask[4, 4:] = 0
    shifted = completion_mask[:, 1:]
    lp = (-torch.rand(2 * B, L - 1, generator=g, dtype=torch.float64) * 3 * shifted).to(dt)  # each token's logprob
    ref = (-torch.rand(2 * B, generator=g, dtype=torch.float64) * 3 * shifted.sum(1)).to(dt)  # given: any weighting
    zeros = torch.zeros(2 * B, L - 1, dtype=dt)
    lss = (-torch.rand(2 * B, L - 1, generator=g, dtype=torch.float64) * 2).to(dt)  # each token's log sum p^2
    outputs = types.SimpleNamespace(log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(),
                                    log_sum_sq_probs=lss)
    inputs = {"input_ids": torch.zeros(2 * B, L, dtype=torch.long), "attention_mask": torch.ones(2 * B, L),
              "completion_mask": completion_mask, "ref_chosen_logps": ref[:B], "ref_rejected_logps": ref[B:]}
    me = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_Acc(), aux_loss_enabled=False, ld_alpha=ld,
        precompute_ref_logps=True, f_divergence_type=fdiv, f_alpha_divergence_coef=alpha, loss_types=names,
        loss_weights=weights or [1.0] * len(names),
        beta=beta, label_smoothing=eps, use_weighting=wpo, args=types.SimpleNamespace(discopop_tau=0.05),
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    if wpo and "sft" in names:
        # TRL 1.16 raises here: it multiplies sft's batch loss, broadcast to every pair by expand, by each pair's
        # weight in place; its arithmetic is checked with that product made out of place
        with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
            DPOTrainer._compute_loss(me, lambda **kw: outputs, inputs, False)
        me._metrics = {"train": defaultdict(list)}
        expand = torch.Tensor.expand
        monkeypatch.setattr(torch.Tensor, "expand", lambda self, *size: expand(self, *size).clone())
    want = DPOTrainer._compute_loss(me, lambda **kw: outputs, inputs, False)
    chosen, rejected = (lp * ld_token_weights(shifted.to(dt), ld)).sum(1).chunk(2)
    plain = (lp * shifted.to(dt)).sum(1).chunk(2)[0]  # sft's chosen sums: every token 1
    tokens = shifted.sum(1).to(dt)
    loss, m = dpo_from_logprobs(chosen, rejected, ref[:B], ref[B:], beta=beta, loss_type=loss_type,
                                label_smoothing=eps, chosen_tokens=tokens[:B], rejected_tokens=tokens[B:],
                                f_divergence_type=fdiv, f_alpha_divergence_coef=alpha, loss_weights=weights,
                                sft_chosen_logps=plain, pair_weights=wpo_weights(lp, lss, shifted) if wpo else None)
    torch.testing.assert_close(loss, want)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):  # TRL averages the accuracies' booleans in float32
        assert abs(m[key].item() - me._metrics["train"][key][0]) < (1e-7 if key == "rewards/accuracies" else 1e-12), key


def _tiny_llama(seed=0):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                   bos_token_id=None)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("softcap, logit_scale", [(None, None), (2.0, 1.3)])
def test_trl_fused_head_patched_is_exact(softcap, logit_scale, monkeypatch):
    # TRL's fused LM head (every trainer's log-probabilities) served by tritongrad: the same log-probabilities,
    # entropy, statistics (WPO's log sum p^2 too), loss and parameter gradients as TRL's own kernel, float32,
    # with a final-logit soft cap too (Gemma 2's; the config's logit scale before it, the temperature after it);
    # a field tritongrad does not compute is handed back to TRL's
    _trl()
    from trl.trainer.utils import add_fused_lm_head

    from tritongrad.ops.post_training import trl_integration
    from tritongrad.ops.post_training.trl_integration import REPORT, patch_trl, unpatch_trl
    fields = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    models = [_tiny_llama(), None]
    models[0].config.final_logit_softcapping, models[0].config.logit_scale = softcap, logit_scale
    models[1] = copy.deepcopy(models[0])
    for m in models:
        add_fused_lm_head(m, temperature=0.7, outputs=fields)
    ids = torch.randint(2, 96, (2, 9))
    labels = ids.clone()
    labels[:, :3] = -100
    outs = []
    REPORT.clear()
    for i, m in enumerate(models):
        if i == 1:
            patch_trl()
        try:
            o = m(input_ids=ids, labels=labels, fused_lm_head=True)
            (o.loss + 0.1 * (o.entropy * o.label_mask).sum()).backward()
            outs.append(o)
        finally:
            unpatch_trl()
    assert REPORT == {"tritongrad": 1}
    for k in fields + ("loss",):
        torch.testing.assert_close(getattr(outs[1], k), getattr(outs[0], k), msg=k)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name, rtol=1e-5, atol=1e-6)
    handed = []  # a field of a later TRL: TRL's own function (here a stand-in) computes the call
    monkeypatch.setitem(trl_integration._state, "original",
                        types.SimpleNamespace(apply=lambda *args: handed.append(args[-1])))
    trl_integration.TritongradLogProbFunction.apply(torch.randn(3, 32), models[0].lm_head.weight, None,
                                                    torch.tensor([2, 3, 4]), 1.0, 64, None, 1.0,
                                                    ("log_probs", "new_field"))
    assert handed == [("log_probs", "new_field")]
    assert REPORT["trl: fields ['new_field'] not computed by tritongrad"] == 1


def _tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(94)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trl_grpo_trainer_step_patched_equals_unpatched(tmp_path, dtype):
    # one GRPOTrainer step (generation, rewards, the KL to a reference model, dapo) on a tiny random Llama,
    # patched and not: the same logged loss, KL, entropy, grad norm, and the same parameters after an SGD step.
    # float32: a float32 model without autocast; bfloat16: a bfloat16 model under TRL's bf16 autocast
    trl = _trl()
    import datasets

    from tritongrad.ops.post_training.trl_integration import REPORT, patch_trl, unpatch_trl
    path = str(tmp_path / "model")
    _tiny_llama().to(getattr(torch, dtype)).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    ds = datasets.Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5 w6", "w7 w8 w9", "w3 w2 w1"]})

    def reward(completions, **kw):
        return [float(len(c)) for c in completions]

    runs = []
    REPORT.clear()
    for patched in (False, True):
        args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                              max_completion_length=5, max_steps=1, report_to=[], logging_steps=1, learning_rate=0.1,
                              optim="sgd", beta=0.1, use_cpu=True, save_strategy="no", seed=0, temperature=0.7,
                              bf16=dtype == "bfloat16", model_init_kwargs={"dtype": dtype})
        trainer = trl.GRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=ds)
        if patched:
            patch_trl()
        try:
            trainer.train()
        finally:
            unpatch_trl()
        runs.append((trainer.state.log_history[0], [p.detach().clone() for p in trainer.model.parameters()]))
    assert REPORT == {"tritongrad": 2}  # the policy and the reference model
    (a, pa), (b, pb) = runs
    tol = 1e-5 if dtype == "float32" else 2e-2  # bfloat16: the logits and gradients round to bfloat16
    for key in ("loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean"):
        assert abs(a[key] - b[key]) <= tol * max(1.0, abs(a[key])), (key, a[key], b[key])
    for x, y in zip(pa, pb):
        assert x.dtype == getattr(torch, dtype)
        torch.testing.assert_close(y, x, rtol=tol, atol=tol / 10)


@pytest.mark.slow
@pytest.mark.parametrize("use_weighting,models", [(False, False), (True, False), (False, True)],
                         ids=["dpo", "wpo", "models-patched-too"])
def test_trl_dpo_trainer_step_patched_equals_unpatched(tmp_path, use_weighting, models):
    # one DPOTrainer step (policy and reference model, the sigmoid loss, every logged metric: the mean logits and
    # token accuracy come from the same kernel; WPO's log sum p^2 too) on a tiny random Llama, patched and not;
    # with tritongrad.patch on the policy and the reference model as well (norms, rope, swiglu under TRL's head)
    trl = _trl()
    import datasets

    from tritongrad.ops.post_training.trl_integration import REPORT, patch_trl, unpatch_trl
    path = str(tmp_path / "model")
    _tiny_llama().save_pretrained(path)
    _tokenizer().save_pretrained(path)
    ds = datasets.Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5 w6"], "chosen": [" w7 w8", " w9 w10 w11"],
                                     "rejected": [" w12", " w13 w14"]})
    runs = []
    REPORT.clear()
    for patched in (False, True):
        args = trl.DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=1,
                             report_to=[], logging_steps=1, learning_rate=0.1, optim="sgd", use_cpu=True,
                             save_strategy="no", seed=0, bf16=False, use_weighting=use_weighting)
        trainer = trl.DPOTrainer(model=path, args=args, train_dataset=ds)
        if patched and models:
            for m in (trainer.model, trainer.ref_model):
                assert {"rms_norm", "rope", "swiglu"} <= set(tritongrad.patch(m).ops())
        if patched:
            patch_trl()
        try:
            trainer.train()
        finally:
            unpatch_trl()
            if patched and models:  # rope is patched module-wide: the other tests get Hugging Face's back
                for m in (trainer.model, trainer.ref_model):
                    tritongrad.unpatch(m)
        runs.append((trainer.state.log_history[0], [p.detach().clone() for p in trainer.model.parameters()]))
    assert REPORT == {"tritongrad": 2}
    (a, pa), (b, pb) = runs
    for key in ("loss", "grad_norm", "entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy",
                "logps/chosen", "logps/rejected", "rewards/margins"):
        assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])
    for x, y in zip(pa, pb):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_patch_refuses_uncovered_trl(monkeypatch):
    # exact or refused: a TRL version outside COVERED is not patched
    trl_mod = _trl()
    from tritongrad.ops.post_training import trl_integration as ti
    monkeypatch.setattr(trl_mod, "__version__", "0.19.1")
    with pytest.raises(RuntimeError, match="not covered"):
        ti.patch_trl()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_logprobs_with_gemma2_soft_cap(dtype):
    # Gemma 2: logits = c tanh(logits / c), then the temperature divides them (GRPO's order)
    h = torch.randn(6, 16, device=DEVICE, dtype=dtype, requires_grad=True)
    W = (torch.randn(50, 16, device=DEVICE, dtype=dtype) * 2).requires_grad_()
    t = torch.randint(0, 50, (6,), device=DEVICE)
    t[2] = -100
    lp, ent = linear_token_logprobs(h, W, t, temperature=0.7, logit_softcap=3.0, return_entropy=True)
    h64, W64 = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    lsm = (3.0 * torch.tanh(F.linear(h64, W64) / 3.0) / 0.7).log_softmax(-1)
    lp64 = lsm.gather(-1, t.clamp(min=0)[:, None])[:, 0] * (t != -100)
    ent64 = -(lsm.exp() * lsm).sum(-1)
    up = torch.arange(6, device=DEVICE, dtype=dtype)
    got = torch.autograd.grad((lp * up).sum() + ent.sum(), (h, W))
    want = torch.autograd.grad((lp64 * up).sum() + ent64.sum(), (h64, W64))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    for a, b in zip((lp, ent, *got), (lp64, ent64, *want)):
        torch.testing.assert_close(a.double(), b, **tol)
    with pytest.raises(ValueError, match=r"logit_softcap must be a finite float > 0 or None, got 0.0"):
        linear_token_logprobs(h, W, t, logit_softcap=0.0)


def _capped_logprobs(input, weight, target, temperature, cap):
    """The float64 reference's log-probabilities of Gemma 2's capped logits: c tanh(z / c), then 1 / temperature."""
    lp, _, _ = linear_token_logprobs_reference(input.reshape(-1, input.shape[-1]), weight, target.reshape(-1), None,
                                               -100, 1.0, False, False, False, cap, 1 / temperature)
    return lp.reshape(target.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grpo_and_dpo_with_gemma2_soft_cap_against_float64(dtype):
    case = GRPO_CASES["dapo-on-policy"]
    kw = _grpo_kwargs(case)

    def grpo(input, weight, completion_ids, advantages, completion_mask, old_logprobs, ref_logprobs):
        loss, m = linear_grpo_loss(input, weight, completion_ids, advantages, completion_mask,
                                   old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, logit_softcap=2.0, **kw)
        return loss, m["clip_ratio/low_mean"]

    def grpo_ref(input, weight, completion_ids, advantages, completion_mask, old_logprobs, ref_logprobs):
        lp = _capped_logprobs(input, weight, completion_ids, kw["temperature"], 2.0)
        acc = lp.dtype
        loss, _, low, _, _ = _trl_grpo(lp, advantages.to(acc), completion_mask.to(acc), None, ref_logprobs.to(acc),
                                       beta=kw["beta"], epsilon_low=0.2, epsilon_high=0.28, loss_type=kw["loss_type"],
                                       importance_sampling_level="token", max_completion_length=5,
                                       num_items_in_batch=completion_mask.sum().to(acc))
        return loss, low

    _check(grpo, grpo_ref, lambda dt: _grpo_inputs(dt, case), dtype)

    def dpo(input, weight, target, ref_chosen_logps, ref_rejected_logps):
        loss, m = linear_dpo_loss(input, weight, target, ref_chosen_logps=ref_chosen_logps,
                                  ref_rejected_logps=ref_rejected_logps, logit_softcap=2.0)
        return loss, m["chosen_rewards"]

    def dpo_ref(input, weight, target, ref_chosen_logps, ref_rejected_logps):
        lp = _capped_logprobs(input, weight, target, 1.0, 2.0)
        mask = (target != -100).to(lp.dtype)
        c, r = (lp * mask).sum(1).chunk(2)
        loss, chosen, _ = _trl_dpo(c, r, ref_chosen_logps.to(lp.dtype), ref_rejected_logps.to(lp.dtype), mask,
                                   beta=0.1, loss_type="sigmoid", label_smoothing=0.0)
        return loss, chosen

    _check(dpo, dpo_ref, _dpo_inputs, dtype)


@pytest.mark.extended  # a subprocess importing torch, transformers and TRL: 13 CPU-s for a benchmark's claim
@pytest.mark.slow
def test_grpo_step_benchmark_providers_train_the_same_function(tmp_path):
    # benchmarks/grpo_step.py compares tritongrad's GRPO loss with TRL's own paths (its fused log-prob function,
    # and materialised logits) in one training loop: on a tiny Llama in float32 every provider's loss, at every
    # step (the weights moving under AdamW), is the first provider's.
    _trl()
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "grpo_step.py")
    subprocess.run([sys.executable, script, "--size", "tiny", "--batch", "2", "--prompt", "8", "--completion", "16",
                    "--steps", "3", "--warmup", "1", "--providers", "tritongrad,trl-fused,trl-logits",
                    "--out", str(tmp_path)], check=True, capture_output=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    (path,) = tmp_path.glob("grpo-step-*.json")
    runs = json.loads(path.read_text())["runs"]
    assert [r["status"] for r in runs] == ["ok"] * 3, runs
    for r in runs:
        assert len(r["losses"]) == 3 and r["max_rel_loss_diff"] < 1e-5, r


def test_dpo_reference_logps_are_constants_on_either_path(monkeypatch):
    # reference log-probabilities that require grad get none, in chunks of whole pairs and in chunks of rows alike
    t = _dpo_inputs(torch.float64)
    for limits in (SMALL, dataclasses.replace(SMALL, pair_bytes=0)):
        monkeypatch.setattr(P, "LIMITS", limits)
        rc = t["ref_chosen_logps"].double().requires_grad_(True)
        rr = t["ref_rejected_logps"].double().requires_grad_(True)
        W = t["weight"].clone().requires_grad_(True)
        loss, _ = linear_dpo_loss(t["input"], W, t["target"], ref_chosen_logps=rc, ref_rejected_logps=rr)
        loss.backward()
        assert rc.grad is None and rr.grad is None and W.grad is not None


# ---------------------------------------------------------------- float16 under AMP's loss scale
def _amp_grads(fn, tensors, scale):
    """The gradients of ``scale * fn(*tensors)`` (the loss, float32 or float64), divided by the scale, in float64."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    (out[0] if isinstance(out, tuple) else out).mul(scale).backward()
    return [t.grad.double() / scale for t in leaves]


@pytest.mark.parametrize("loss, rows", [("jsd", 512), pytest.param("grpo", 2048, marks=pytest.mark.extended),
                                        pytest.param("dpo", 2048, marks=pytest.mark.extended)])
def test_float16_gradients_take_the_loss_scale_before_rounding(loss, rows, monkeypatch):
    # AMP's GradScaler multiplies the loss by 2^16 so that tiny float16 gradients survive their rounding. These
    # losses made their gradients in the forward for an upstream gradient of 1 and scaled them after rounding,
    # so the scale did nothing: at 2048 rows (V 1024, near-uniform), JSD's gradients were 1.1e-1 off float64
    # with or without it, GRPO's 2.6e-3, DPO's 1.1e-3. float16 products now make them in the backward, the
    # scale inside (3.0e-4, 3.7e-4, 3.8e-4). Here: the scale must at least halve the unscaled error, as for F.
    monkeypatch.setattr(P, "LIMITS", DEFAULT_LIMITS)  # the default chunks: the small ones are for the paths
    g = torch.Generator().manual_seed(0)
    B, H, V = rows // 64, 16, 1024
    h, ht = (torch.randn(B, 64, H, generator=g, dtype=torch.float64) for _ in range(2))
    w, wt = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.05 for _ in range(2))  # near-uniform p
    ids = torch.randint(0, V, (B, 64), generator=g).to(DEVICE)
    adv, ref = torch.randn(B, generator=g), torch.randn(B, generator=g)

    def run(x, m):
        f = torch.float64 if x.dtype == torch.float64 else torch.float32
        if loss == "grpo":
            return linear_grpo_loss(x, m, ids, adv.to(DEVICE, f))
        if loss == "dpo":
            return linear_dpo_loss(x, m, ids, ref_chosen_logps=ref[: B // 2].to(DEVICE, f),
                                   ref_rejected_logps=ref[B // 2:].to(DEVICE, f), beta=0.01)
        return linear_jsd(x, m, ht.to(DEVICE, x.dtype), wt.to(DEVICE, x.dtype), 1.0, 0.5)

    exact = _amp_grads(run, [h.to(DEVICE), w.to(DEVICE)], 1.0)
    half = [h.to(DEVICE, torch.float16), w.to(DEVICE, torch.float16)]
    plain, scaled = _amp_grads(run, half, 1.0), _amp_grads(run, half, 2.0 ** 16)
    for name, a, b, e in zip(("input", "weight"), plain, scaled, exact):
        err_plain, err_scaled = ((a - e).norm() / e.norm()).item(), ((b - e).norm() / e.norm()).item()
        assert err_scaled <= 0.5 * err_plain, (f"{loss}: grad of {name} {err_scaled:.2e} off float64 with the loss "
                                               f"scale, {err_plain:.2e} without")

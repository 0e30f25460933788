"""cross_entropy and linear_cross_entropy on small shapes: through Triton's interpreter on CPU, compiled on a GPU.

The OpSuite battery for both registered ops, then what is special to the family: torch.nn.functional's
semantics for every option in float64, shapes F takes, inputs never written, bitwise determinism, bad inputs
and their messages, out-of-range targets, the modules as drop-ins, and the sm_90 compile of every
specialization the launchers request.
"""

import dataclasses
import itertools
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, backward_graphs_backend, run_without_interpreter

import tritongrad
from tritongrad.ops.cross_entropy import (
    cross_entropy,
    cross_entropy_op,
    launch,
    linear_cross_entropy,
    linear_cross_entropy_op,
    linear_cross_entropy_reference,
)
from tritongrad.ops.cross_entropy import plans as P
from tritongrad.testing import OpSuite


def _targets(N, C, ignored=(1,), device=DEVICE):
    t = torch.randint(0, C, (N,), device=device)
    for i in ignored:
        if i < N:
            t[i] = -100
    return t


# ---------------------------------------------------------------- the error baseline: eager PyTorch
def _eager_ce(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              logit_softcap=None, z_loss=0.0, compute_grad=True, return_lse=True, logit_scale=1.0):
    """What a user writes in plain PyTorch, in the logits' dtype (the scale, cap and z-loss as extra ops);
    lse as a user would take it for logging, in float32 (float64 for float64)."""
    acc = torch.float64 if torch.float64 in (input.dtype, getattr(weight, "dtype", None)) else torch.float32
    u = input if logit_scale == 1.0 else input * logit_scale
    u = u if logit_softcap is None else logit_softcap * torch.tanh(u / logit_softcap)
    w = weight.to(input.dtype) if weight is not None else None
    lse = torch.logsumexp(u.to(acc), -1)
    if not return_lse:
        lse = torch.where(target != ignore_index, lse, 0.0)
    loss = F.cross_entropy(u, target, w, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss:
        valid = target != ignore_index
        z = torch.where(valid, z_loss * lse * lse, 0.0)
        if reduction == "none":
            loss = loss + z.to(loss.dtype)
        else:
            z = z.sum()
            if reduction == "mean":
                wt = w.to(acc)[torch.where(valid, target, 0)] if w is not None else torch.ones_like(lse)
                z = z / torch.where(valid, wt, 0.0).sum()
            loss = loss + z.to(loss.dtype)
    return loss, lse


def _eager_lce(input, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
               logit_softcap=None, z_loss=0.0, grads=None, out_dtype=None, logit_scale=1.0, grad_weight_f32=False):
    loss = _eager_ce(F.linear(input, weight, bias), target, None, ignore_index, reduction, label_smoothing,
                     logit_softcap, z_loss, logit_scale=logit_scale)[0]
    return loss if out_dtype is None else loss.to(out_dtype)


# ---------------------------------------------------------------- OpSuite: cross_entropy
def ce_basic(dtype, device):
    # the default call of the public function: mean over rows, one ignored row, whose logits are not read
    # (return_lse off: its lse is 0, with no gradient)
    return {"input": torch.randn(6, 40, device=device).to(dtype), "target": _targets(6, 40, device=device),
            "return_lse": False}


def ce_strided_rows_sum(dtype, device):
    # rows of a padded vocabulary (row stride 48 for 37 classes), reduction="sum"
    x = torch.randn(5, 48, device=device).to(dtype)[:, :37]
    return {"input": x, "target": _targets(5, 37, device=device), "reduction": "sum"}


def ce_weights_smoothing_none(dtype, device):
    # class weights with label smoothing (weighted smoothing sum), one loss per row; the backward
    # recomputes the gradient from the saved lse (compute_grad is off for reduction="none")
    return {"input": torch.randn(7, 33, device=device).to(dtype), "target": _targets(7, 33, (0, 4), device),
            "weight": (torch.rand(33, device=device) + 0.5).to(dtype), "reduction": "none",
            "label_smoothing": 0.2, "compute_grad": False}


def ce_softcap_zloss_chunks(dtype, device):
    # rows longer than one chunk in every dtype (4500 > 4096 columns): the online lse over chunks, pass 2
    # in reverse order; soft cap and z-loss
    return {"input": (3 * torch.randn(3, 4500, device=device)).to(dtype), "target": _targets(3, 4500, device=device),
            "logit_softcap": 5.0, "z_loss": 1e-2}


def ce_everything_weighted_mean(dtype, device):
    # every option at once, the weighted mean (F's denominator: the non-ignored targets' weights)
    return {"input": torch.randn(9, 20, device=device).to(dtype), "target": _targets(9, 20, (2, 3), device),
            "weight": torch.rand(20, device=device).to(dtype) + 0.1, "label_smoothing": 0.1, "logit_softcap": 4.0,
            "z_loss": 1e-3}


def ce_recompute_mean(dtype, device):
    # reduction="mean" with the gradient left to the backward (compute_grad=False): the recompute path
    return {"input": torch.randn(4, 50, device=device).to(dtype), "target": _targets(4, 50, device=device),
            "compute_grad": False}


CE_SUITE = OpSuite(cross_entropy_op, [ce_basic, ce_strided_rows_sum, ce_weights_smoothing_none,
                                      ce_softcap_zloss_chunks, ce_everything_weighted_mean, ce_recompute_mean],
                   baseline=_eager_ce, device=DEVICE)
test_cross_entropy_suite = CE_SUITE.pytest()


# ---------------------------------------------------------------- OpSuite: linear_cross_entropy
def lce_basic(dtype, device):
    # gradients of input and weight computed in the forward (mean), one ignored row
    return (torch.randn(11, 16, device=device).to(dtype), (torch.randn(30, 16, device=device) / 4).to(dtype),
            _targets(11, 30, device=device), None, -100, "mean", 0.0, None, 0.0, [True, True, True])


def lce_bias_options_sum(dtype, device):
    # a bias, smoothing, cap and z-loss, reduction="sum"
    return {"input": torch.randn(7, 8, device=device).to(dtype),
            "weight": (torch.randn(25, 8, device=device) / 3).to(dtype),
            "target": _targets(7, 25, device=device), "bias": torch.randn(25, device=device).to(dtype),
            "reduction": "sum", "label_smoothing": 0.1, "logit_softcap": 3.0, "z_loss": 1e-3,
            "grads": [True, True, True]}


def lce_none_recompute(dtype, device):
    # reduction="none": the backward recomputes the logits with per-row upstream gradients
    return {"input": torch.randn(6, 8, device=device).to(dtype),
            "weight": (torch.randn(20, 8, device=device) / 3).to(dtype),
            "target": _targets(6, 20, device=device), "bias": torch.randn(20, device=device).to(dtype),
            "reduction": "none"}


LCE_SUITE = OpSuite(linear_cross_entropy_op, [lce_basic, lce_bias_options_sum, lce_none_recompute],
                    baseline=_eager_lce, device=DEVICE)
test_linear_cross_entropy_suite = LCE_SUITE.pytest()


# ---------------------------------------------------------------- logit_scale (Granite, Cohere)
def _lce_scaled(scale, softcap, reduction):
    def lce_scaled(dtype, device):
        # a bias, so that all three gradients carry the scale's factor
        return {"input": torch.randn(9, 16, device=device).to(dtype),
                "weight": (torch.randn(40, 16, device=device) / 2).to(dtype), "target": _targets(9, 40, device=device),
                "bias": torch.randn(40, device=device).to(dtype), "reduction": reduction, "logit_softcap": softcap,
                "logit_scale": scale, "grads": [True, True, True]}
    return lce_scaled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale,softcap,reduction", [(0.125, None, "mean"), (2.5, 3.0, "mean"), (0.125, 4.0, "none")],
                         ids=["granite", "scaled-capped", "capped-none"])
def test_linear_logit_scale_against_float64(dtype, scale, softcap, reduction):
    # loss and the gradients of input, weight and bias against the float64 reference, within the error of eager
    # PyTorch in the same dtype (F.linear, then the scale and cap as ops), the forward's gradients and the recompute
    LCE_SUITE.check_values(_lce_scaled(scale, softcap, reduction), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "capped"])
def test_cross_entropy_logit_scale_against_float64(dtype, softcap):
    def ce_scaled(dtype, device):
        return {"input": torch.randn(7, 40, device=device).to(dtype), "target": _targets(7, 40, device=device),
                "logit_softcap": softcap, "logit_scale": 1 / 8}
    CE_SUITE.check_values(ce_scaled, dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_logit_scale_equals_scaled_logits_float64(reduction):
    # logit_scale k: F on k * logits (before the cap), for both ops; all gradients, the lse's included
    h = torch.randn(7, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    W = torch.randn(30, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    b = torch.randn(30, dtype=torch.float64, device=DEVICE, requires_grad=True)
    t = _targets(7, 30, (2,))
    for k, cap in ((1 / 16, None), (-3.0, None), (2.0, 2.5)):
        def capped(z):
            return z if cap is None else cap * torch.tanh(z / cap)
        got = linear_cross_entropy(h, W, t, b, reduction=reduction, label_smoothing=0.1, logit_softcap=cap,
                                   z_loss=1e-3, logit_scale=k)
        want = _eager_lce(h, W, t, b, reduction=reduction, label_smoothing=0.1, logit_softcap=cap, z_loss=1e-3,
                          logit_scale=k)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        g = torch.randn_like(want)
        for a, r in zip(torch.autograd.grad(got, (h, W, b), g), torch.autograd.grad(want, (h, W, b), g)):
            torch.testing.assert_close(a, r, rtol=1e-11, atol=1e-12)
        x = torch.randn(7, 30, dtype=torch.float64, device=DEVICE, requires_grad=True)
        loss, lse = cross_entropy(x, t, reduction=reduction, logit_softcap=cap, logit_scale=k, return_lse=True)
        want, want_lse = F.cross_entropy(capped(k * x), t, reduction=reduction), torch.logsumexp(capped(k * x), -1)
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
        gs = [torch.randn_like(loss), torch.randn_like(lse)]
        torch.testing.assert_close(torch.autograd.grad((loss, lse), x, gs)[0],
                                   torch.autograd.grad((want, want_lse), x, gs)[0], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan"), "2", True, None])
def test_logit_scale_refused(bad):
    x, t = torch.randn(4, 5), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"cross_entropy: logit_scale must be a finite, nonzero float"):
        cross_entropy(x, t, logit_scale=bad)
    with pytest.raises(ValueError, match=r"linear_cross_entropy: logit_scale must be a finite, nonzero float"):
        linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), t, logit_scale=bad)


# ---------------------------------------------------------------- F's semantics in float64
@pytest.mark.parametrize("reduction,weighted,smoothing,ignore",
                         list(itertools.product(("mean", "sum", "none"), (False, True), (0.0, 0.3), (-100, 3))))
def test_equals_torch_functional(reduction, weighted, smoothing, ignore):
    # every F option, with ignore_index both outside and inside [0, C) (a real class may be ignored)
    N, C = 8, 13
    x = torch.randn(N, C, dtype=torch.float64, device=DEVICE, requires_grad=True)
    t = torch.randint(0, C, (N,), device=DEVICE)
    t[::3] = ignore
    w = torch.rand(C, dtype=torch.float64, device=DEVICE) + 0.2 if weighted else None
    g = torch.randn((N,) if reduction == "none" else (), dtype=torch.float64, device=DEVICE)
    got = cross_entropy(x, t, w, ignore, reduction, smoothing)
    (gx,) = torch.autograd.grad(got, x, g)
    want = F.cross_entropy(x, t, w, ignore_index=ignore, reduction=reduction, label_smoothing=smoothing)
    (wx,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, wx, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_softcap_and_z_loss_equal_composed_ops(reduction):
    # the extras against the same math written with F's ops, float64
    x = torch.randn(6, 21, dtype=torch.float64, device=DEVICE, requires_grad=True)
    t = _targets(6, 21)
    loss, lse = cross_entropy(x, t, reduction=reduction, logit_softcap=2.5, z_loss=0.05, return_lse=True)
    want, want_lse = _eager_ce(x, t, reduction=reduction, logit_softcap=2.5, z_loss=0.05)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    g = [torch.randn_like(loss), torch.randn_like(lse)]  # lse's gradient too
    torch.testing.assert_close(torch.autograd.grad((loss, lse), x, g)[0],
                               torch.autograd.grad((want, want_lse), x, g)[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_extreme_logits_over_many_chunks(dtype):
    # rows of several chunks (the per-lane running max): masked -inf logits, a row all -inf but its target, the
    # most negative finite value, a maximum in the first chunk only, and values whose exp overflows unshifted
    C = 2 * P.TABLE.ONE_CHUNK_MAX[torch.empty((), dtype=dtype).element_size()] + 37
    x = torch.randn(5, C, dtype=torch.float64, device=DEVICE) * 4
    x[0, torch.rand(C, device=DEVICE) < 0.7] = float("-inf")
    x[1] = float("-inf")
    x[2, ::3] = torch.finfo(dtype).min
    x[3, :5] = 60.0
    x[4] += 700.0 if dtype == torch.float64 else 80.0
    t = torch.tensor([0, 7, 2, 3, 4], device=DEVICE)
    x[0, 0] = x[1, 7] = 1.5  # the targets are finite
    x = x.to(dtype).requires_grad_()
    got = cross_entropy(x, t, reduction="none")
    want = F.cross_entropy(x.double(), t, reduction="none")
    torch.testing.assert_close(got.double(), want, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-5)
    g = torch.randn(5, dtype=torch.float64, device=DEVICE)
    (gx,) = torch.autograd.grad(got, x, g.to(dtype))
    (wx,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(gx.double(), wx.double(), rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-6)


def test_all_rows_ignored():
    # F: the mean of no rows is NaN (0/0), the sum 0; the gradient is 0 either way
    x = torch.randn(3, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    t = torch.full((3,), -100, device=DEVICE)
    for reduction in ("mean", "sum"):
        got, want = cross_entropy(x, t, reduction=reduction), F.cross_entropy(x, t, reduction=reduction)
        torch.testing.assert_close(got, want, equal_nan=True)
        (gx,) = torch.autograd.grad(got, x)
        assert torch.equal(gx, torch.zeros_like(x))


@pytest.mark.parametrize("shape", [(7,), (2, 7, 3), (2, 7, 2, 3)], ids=str)
def test_shapes_f_takes(shape):
    # [C] with a 0-d target, and [N, C, d1, ...] with target [N, d1, ...], as F takes them
    x = torch.randn(shape, dtype=torch.float64, device=DEVICE, requires_grad=True)
    t = torch.randint(0, shape[0] if len(shape) == 1 else shape[1], (() if len(shape) == 1 else (shape[0], *shape[2:])),
                      device=DEVICE)
    for reduction in ("mean", "none"):
        got, want = cross_entropy(x, t, reduction=reduction), F.cross_entropy(x, t, reduction=reduction)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
        g = torch.randn_like(want)
        torch.testing.assert_close(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_int32_targets_and_loss_dtype(dtype):
    # int32 class indices; the loss in the logits' dtype, as F returns it
    x = torch.randn(5, 9, device=DEVICE).to(dtype)
    t = torch.randint(0, 9, (5,), device=DEVICE, dtype=torch.int32)
    got = cross_entropy(x, t)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), F.cross_entropy(x.float(), t.long()), atol=2e-2, rtol=2e-2)


def test_linear_equals_functional_float64():
    # F.cross_entropy(F.linear(...)) for every reduction, with and without bias; gradients of all three
    for reduction, bias in itertools.product(("mean", "sum", "none"), (False, True)):
        h = torch.randn(2, 5, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
        W = torch.randn(30, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
        b = torch.randn(30, dtype=torch.float64, device=DEVICE, requires_grad=True) if bias else None
        t = torch.randint(0, 30, (2, 5), device=DEVICE)
        t[0, 1] = -100
        got = linear_cross_entropy(h, W, t, b, reduction=reduction, label_smoothing=0.1)
        want = F.cross_entropy(F.linear(h, W, b).flatten(0, 1), t.flatten(), reduction=reduction,
                               label_smoothing=0.1)
        want = want.reshape(t.shape) if reduction == "none" else want
        torch.testing.assert_close(got, want)
        ins = [h, W] + ([b] if bias else [])
        g = torch.randn_like(want)
        for a, r in zip(torch.autograd.grad(got, ins, g), torch.autograd.grad(want, ins, g)):
            torch.testing.assert_close(a, r)


@pytest.mark.parametrize("wanted", ["all", "weight", "input"])
def test_linear_forward_that_computes_every_gradient_keeps_no_hidden_states(wanted):
    # The backward reads the hidden states only to recompute the logits. When the forward computed the
    # gradient of every input that requires one, autograd does not keep them (neither does Liger-Kernel):
    # N x H bytes less at the loss, where a step's peak can be. reduction="none" recomputes, and keeps them.
    def kept_by(fn):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda s: kept.append(s) or s, lambda s: s):
            out = fn()
        return out, {k.untyped_storage().data_ptr() for k in kept if k is not None}

    h = torch.randn(2, 5, 8, dtype=torch.float64, device=DEVICE, requires_grad=wanted in ("all", "input"))
    W = torch.randn(30, 8, dtype=torch.float64, device=DEVICE, requires_grad=wanted in ("all", "weight"))
    b = torch.randn(30, dtype=torch.float64, device=DEVICE, requires_grad=wanted == "all")
    t = torch.randint(0, 30, (2, 5), device=DEVICE)
    ins = [x for x in (h, W, b) if x.requires_grad]
    for reduction in ("mean", "none"):
        got, kept = kept_by(lambda: linear_cross_entropy(h, W, t, b, reduction=reduction))
        assert (h.untyped_storage().data_ptr() in kept) == (reduction == "none"), reduction
        want = F.cross_entropy(F.linear(h, W, b).flatten(0, 1), t.flatten(), reduction=reduction)
        g = torch.randn_like(want)
        for _ in range(2):  # a retained graph's second backward reads the gradients the forward kept
            for a, r in zip(torch.autograd.grad(got, ins, g.reshape(got.shape), retain_graph=True),
                            torch.autograd.grad(want, ins, g, retain_graph=True)):
                torch.testing.assert_close(a, r)


@pytest.fixture
def small_chunks():
    # linear_cross_entropy in chunks of 4 rows: several chunks on interpreter-sized inputs
    with P.using(dataclasses.replace(P.TABLE, LCE_CHUNK_BYTES=4 * 30 * 8, LCE_ROW_MULTIPLE=1, LCE_MIN_ROWS=1)):
        yield


def test_linear_chunks_hold_no_more_than_the_hidden_states():
    # A chunk's logits take no more memory than the call's hidden states (a training step's peak then stays at
    # Liger-Kernel's), unless that is under LCE_EFFICIENT_ROWS rows; never more than LCE_CHUNK_BYTES; chunks of
    # equal size up to the row multiple.
    t = P.table()
    for N, V, H, elem in itertools.product((1, 300, 8192, 16384, 65536, 1 << 18), (32000, 128256, 262144),
                                           (1536, 2048, 4096), (2, 4)):
        rows = P.lce_chunk_rows(N, V, H, elem, t)
        most = min(t.LCE_CHUNK_BYTES // (V * elem), max(t.LCE_EFFICIENT_ROWS, N * H // V))
        assert rows <= min(N, max(most, t.LCE_MIN_ROWS) + t.LCE_ROW_MULTIPLE - 1), (N, V, H, elem, rows)
        assert rows == N or rows >= min(most, t.LCE_MIN_ROWS), (N, V, H, elem, rows)
    assert P.lce_chunk_rows(16384, 128256, 2048, 2, t) == 512  # the 1.24B Llama's step: Liger's 512 rows
    assert P.lce_chunk_rows(8192, 32000, 1536, 2, t) == 512
    assert P.lce_chunk_rows(65536, 128256, 4096, 2, t) == 784  # the cap: 192 MiB


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_in_chunks(small_chunks, reduction):
    # 13 rows in chunks of 4 (the last ragged; on a GPU the chunks launch one bound kernel, the last its own):
    # the same loss and gradients as one product, per-row upstream gradients (reduction="none") included
    h = torch.randn(13, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    W = torch.randn(30, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    b = torch.randn(30, dtype=torch.float64, device=DEVICE, requires_grad=True)
    t = _targets(13, 30, (0, 5, 12))
    assert P.lce_chunk_rows(13, 30, 8, 8, P.table()) == 4
    got = linear_cross_entropy(h, W, t, b, z_loss=1e-3, reduction=reduction)
    want = linear_cross_entropy_reference(h, W, t, b, z_loss=1e-3, reduction=reduction)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    for a, r in zip(torch.autograd.grad(got, (h, W, b), g), torch.autograd.grad(want, (h, W, b), g)):
        torch.testing.assert_close(a, r)


# ---------------------------------------------------------------- behaviour
def test_inputs_never_written():
    # the logits (and target, weight) are read only, whatever the path; so are the linear op's inputs
    x = torch.randn(6, 40, device=DEVICE, requires_grad=True)
    t, w = _targets(6, 40), torch.rand(40, device=DEVICE)
    before = [a.detach().clone() for a in (x, t, w)]
    for kw in ({}, {"reduction": "none"}, {"return_lse": True}):
        out = cross_entropy(x, t, w, **kw)
        out = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(out, x, [torch.randn_like(o) for o in out])
    assert all(torch.equal(a, b) for a, b in zip((x.detach(), t, w), before))
    h, W = torch.randn(9, 8, device=DEVICE, requires_grad=True), torch.randn(20, 8, device=DEVICE, requires_grad=True)
    t2 = _targets(9, 20)
    before = [a.detach().clone() for a in (h, W, t2)]
    linear_cross_entropy(h, W, t2).backward()
    assert all(torch.equal(a, b) for a, b in zip((h.detach(), W.detach(), t2), before))


def test_deterministic_bitwise(small_chunks):
    # two runs give identical bits: no atomics anywhere, fixed-order sums across rows and chunks
    def run():
        torch.manual_seed(1)
        x = torch.randn(37, 300, device=DEVICE).to(torch.bfloat16).requires_grad_()
        t = _targets(37, 300, (0, 9))
        loss = cross_entropy(x, t, label_smoothing=0.1)
        loss.backward()
        h = torch.randn(13, 8, device=DEVICE, dtype=torch.float64, requires_grad=True)
        W = torch.randn(30, 8, device=DEVICE, dtype=torch.float64, requires_grad=True)
        b = torch.randn(30, device=DEVICE, dtype=torch.float64, requires_grad=True)
        loss2 = linear_cross_entropy(h, W, _targets(13, 30), b)
        loss2.backward()
        return [loss, x.grad, loss2, h.grad, W.grad, b.grad]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_backward_through_one_graph_twice():
    # eager, retain_graph=True: the first backward returns a scaled copy of the gradient the forward wrote and
    # leaves that buffer intact; the second, which frees the graph, scales the buffer in place and hands it over
    x = torch.randn(4, 10, device=DEVICE, requires_grad=True)
    t = _targets(4, 10)
    want = torch.autograd.grad(F.cross_entropy(x, t), x)[0]
    loss = cross_entropy(x, t)
    (g1,) = torch.autograd.grad(loss * 3.0, x, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(g1, 3.0 * want)
    torch.testing.assert_close(g2, want)
    h, W = torch.randn(5, 8, device=DEVICE, requires_grad=True), torch.randn(20, 8, device=DEVICE, requires_grad=True)
    t2 = _targets(5, 20)
    loss = linear_cross_entropy(h, W, t2)
    a = torch.autograd.grad(loss * 2.0, (h, W), retain_graph=True)
    b = torch.autograd.grad(loss, (h, W))
    for u, v in zip(a, b):
        torch.testing.assert_close(u, 2.0 * v)


def test_ignored_rows_are_not_read():
    # without return_lse an ignored row (padding, a masked prompt) is never read: NaN there changes nothing,
    # and its gradient is 0; with return_lse it is read for its lse
    x = torch.randn(5, 30, device=DEVICE)
    t = _targets(5, 30, (2,))
    x[2] = float("nan")
    x.requires_grad_()
    for kw in ({}, {"label_smoothing": 0.1, "z_loss": 1e-3}):
        loss = cross_entropy(x, t, **kw)
        (gx,) = torch.autograd.grad(loss, x)
        assert torch.isfinite(loss) and torch.equal(gx[2], torch.zeros_like(gx[2])) and torch.isfinite(gx).all()
    loss, lse = cross_entropy(x, t, return_lse=True)
    assert torch.isfinite(loss) and torch.isnan(lse[2]) and torch.isfinite(lse[[0, 1, 3, 4]]).all()


def test_no_gradient_work_under_no_grad(launches):
    # under no_grad (or without requires_grad) the forward writes no gradient
    x = torch.randn(4, 10, device=DEVICE, requires_grad=True)
    with torch.no_grad():
        cross_entropy(x, _targets(4, 10))
    cross_entropy(x.detach(), _targets(4, 10))
    cross_entropy(x, _targets(4, 10))
    stores = [seen.kw["STORE_GRAD"] for seen in launches if seen.kernel == "_cross_entropy_fwd_kernel"]
    assert stores == [False, False, True]


def test_torch_export():
    # torch.export traces both ops (the registered ops appear in the graph) and the program matches eager
    class Loss(torch.nn.Module):
        def forward(self, h, W, x, t):
            return linear_cross_entropy(h, W, t, label_smoothing=0.1) + cross_entropy(x, t, z_loss=1e-3)

    h, W = torch.randn(6, 8, device=DEVICE), torch.randn(20, 8, device=DEVICE)
    x, t = torch.randn(6, 20, device=DEVICE), _targets(6, 20)
    program = torch.export.export(Loss(), (h, W, x, t))
    graph = str(program.graph)
    assert "tritongrad.cross_entropy" in graph and "tritongrad.linear_cross_entropy" in graph
    torch.testing.assert_close(program.module()(h, W, x, t), Loss()(h, W, x, t))


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_compile_paths_without_gradient_buffers(reduction):
    # torch.compile(fullgraph) where the forward computes no gradient (no_grad) or leaves it to the backward
    # (reduction="none"): the registered ops' placeholders must not alias each other
    backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    h, W = torch.randn(6, 8, device=DEVICE, requires_grad=True), torch.randn(20, 8, device=DEVICE, requires_grad=True)
    x, t = torch.randn(6, 20, device=DEVICE, requires_grad=True), _targets(6, 20)

    def f(h, W, x, t):
        return linear_cross_entropy(h, W, t, reduction=reduction), cross_entropy(x, t, reduction=reduction)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    with torch.no_grad():
        for a, b in zip(compiled(h, W, x, t), f(h, W, x, t)):
            torch.testing.assert_close(a, b)
    got, want = compiled(h, W, x, t), f(h, W, x, t)
    for a, b in zip(torch.autograd.grad(sum(o.sum() for o in got), (h, W, x)),
                    torch.autograd.grad(sum(o.sum() for o in want), (h, W, x))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("reduction,scale", [("mean", 1.0), ("sum", 0.37), ("none", 1.0)])
def test_traced_backward_scales_the_forwards_gradients(reduction, scale):
    # Traced, the gradients the forward computed are scaled in PyTorch ops (scaled_grads), which Inductor may
    # write over the saved buffers; the backward op serves what the forward did not compute (reduction="none").
    # Either way the gradients are the eager path's, bit for bit.
    backend, graphs = backward_graphs_backend()
    h, W, b = (torch.randn(*s, device=DEVICE, requires_grad=True) for s in ((6, 8), (20, 8), (20,)))
    t = _targets(6, 20)

    def f(h, W, b, t):
        return linear_cross_entropy(h, W, t, b, reduction=reduction).sum() * scale

    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, backend=backend, fullgraph=True)(h, W, b, t), (h, W, b))
    want = torch.autograd.grad(f(h, W, b, t), (h, W, b))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=0, atol=0)
    (graph,) = graphs
    assert ("linear_cross_entropy_backward" in graph) == (reduction == "none"), graph


def test_registered_op_refuses_double_backward_of_the_forwards_gradients():
    # Under create_graph=True the scaled residuals would carry no second derivatives: the backward op serves,
    # and refuses.
    h, W = torch.randn(6, 8, device=DEVICE, requires_grad=True), torch.randn(20, 8, device=DEVICE, requires_grad=True)
    t = _targets(6, 20)
    loss = launch.linear_cross_entropy_op.opoverload(h, W, t, None, -100, "mean", 0.0, None, 0.0, [True, True, False],
                                                     None, 1.0, False)[0]
    with pytest.raises(RuntimeError, match="double backward"):
        gh, _ = torch.autograd.grad(loss, (h, W), create_graph=True)
        gh.square().sum().backward()


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("call,error,match", [
    (lambda: cross_entropy(torch.randn(4, 5), torch.zeros(3, dtype=torch.long)), ValueError, r"target of shape \(3,\)"),
    (lambda: cross_entropy(torch.randint(0, 5, (4, 5)), torch.zeros(4, dtype=torch.long)), TypeError,
     r"input has dtype torch.int64 \(shape \(4, 5\)\)"),
    (lambda: cross_entropy(torch.randn(4, 5), torch.zeros(4)), TypeError, "class-probability targets"),
    (lambda: cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.int16)), TypeError, "int64 or int32"),
    (lambda: cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), torch.ones(6)), ValueError,
     r"weight of shape \(6,\) must hold one weight per class: \[5\]"),
    (lambda: cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), reduction="avg"), ValueError,
     "reduction must be"),
    (lambda: cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), label_smoothing=1.5), ValueError,
     r"label_smoothing must be a float in \[0, 1\]"),
    (lambda: cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), logit_softcap=0.0), ValueError,
     "logit_softcap must be None or a float > 0"),
    (lambda: cross_entropy(torch.randn(2, 5, 3), torch.zeros(2, 5, dtype=torch.long)), ValueError,
     r"takes target \(2, 3\)"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(9, 7), torch.zeros(4, dtype=torch.long)),
     ValueError, r"must share H, got \(4, 8\) and \(9, 7\)"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(9, 8, dtype=torch.float64),
                                  torch.zeros(4, dtype=torch.long)), TypeError, "weight is torch.float64, input is"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(9, 8), torch.zeros(5, dtype=torch.long)),
     ValueError, r"target of shape \(5,\) must be input's leading shape"),
], ids=["batch", "int-logits", "float-target", "int16-target", "weight-length", "reduction", "smoothing", "softcap",
        "nd-target", "lce-hidden", "lce-dtype", "lce-batch"])
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_devices_must_match():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device")
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        cross_entropy(torch.randn(4, 5, device="cuda"), torch.zeros(4, dtype=torch.long))


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors: the host reads the targets")
def test_out_of_range_target_raises_on_cpu():
    x = torch.randn(4, 5, requires_grad=True)
    for bad in (5, -1, -101):
        t = torch.tensor([0, bad, 2, -100])
        with pytest.raises(IndexError, match=rf"class index {bad} at position 1, outside \[0, 5\)"):
            cross_entropy(x, t)
    with pytest.raises(IndexError, match=r"outside \[0, 9\)"):
        linear_cross_entropy(torch.randn(2, 3), torch.randn(9, 3), torch.tensor([9, 0]))


@pytest.fixture
def no_host_checks():
    with launch.host_checks.using(False):
        yield


def test_out_of_range_target_poisons_without_reading(no_host_checks):
    # where the host cannot read the targets (a GPU), a bad index is never read: its row's loss and gradient
    # are NaN, and so is the mean; the other rows are untouched
    x = torch.randn(4, 5, device=DEVICE, requires_grad=True)
    t = torch.tensor([0, 7, 2, -100], device=DEVICE)
    rows = cross_entropy(x, t, reduction="none")
    assert torch.isnan(rows[1]) and torch.isfinite(rows[[0, 2, 3]]).all()
    loss = cross_entropy(x, t)
    assert torch.isnan(loss)
    (gx,) = torch.autograd.grad(cross_entropy(x, t, reduction="sum"), x)
    assert torch.isnan(gx[1]).all() and torch.isfinite(gx[[0, 2, 3]]).all()


# ---------------------------------------------------------------- modules
def test_cross_entropy_loss_module_is_a_drop_in():
    w = torch.rand(12, device=DEVICE) + 0.5
    ours = tritongrad.nn.CrossEntropyLoss(weight=w, ignore_index=3, label_smoothing=0.1)
    theirs = torch.nn.CrossEntropyLoss(weight=w, ignore_index=3, label_smoothing=0.1)
    assert isinstance(ours, torch.nn.CrossEntropyLoss)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(7, 12, dtype=torch.float64, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 12, (7,), device=DEVICE)
    t[0] = 3
    a, b = ours.double()(x, t), theirs.double()(x, t)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(torch.autograd.grad(a, x)[0], torch.autograd.grad(b, x)[0])
    capped = tritongrad.nn.CrossEntropyLoss(logit_softcap=30.0, z_loss=1e-4)
    assert "logit_softcap=30.0" in repr(capped) and "z_loss=0.0001" in repr(capped)


def test_linear_cross_entropy_loss_module():
    head = torch.nn.Linear(8, 25, dtype=torch.float64, device=DEVICE)
    h = torch.randn(3, 4, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 25, (3, 4), device=DEVICE)
    loss_fn = tritongrad.nn.LinearCrossEntropyLoss(reduction="sum", label_smoothing=0.1)
    got = loss_fn(h, head.weight, t, head.bias)
    want = F.cross_entropy(head(h).flatten(0, 1), t.flatten(), reduction="sum", label_smoothing=0.1)
    torch.testing.assert_close(got, want)
    ins = (h, head.weight, head.bias)
    for a, r in zip(torch.autograd.grad(got, ins), torch.autograd.grad(want, ins)):
        torch.testing.assert_close(a, r)


# ---------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture():
    # no host syncs: forward and backward capture in one graph, and replays match eager
    tritongrad.set_small_input_threshold(0)
    x = torch.randn(64, 1000, device="cuda", requires_grad=True)
    t = _targets(64, 1000, device="cuda")
    ref = torch.autograd.grad(cross_entropy(x, t, label_smoothing=0.1), x)[0]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            x.grad = None
            cross_entropy(x, t, label_smoothing=0.1).backward()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    x.grad = None
    with torch.cuda.graph(g):
        cross_entropy(x, t, label_smoothing=0.1).backward()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(x.grad, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast")
def test_autocast_dtypes_match_functional():
    # under autocast F.linear runs in bfloat16 and F.cross_entropy returns float32: the same dtypes here
    h = torch.randn(16, 32, device="cuda", requires_grad=True)
    W = torch.randn(100, 32, device="cuda", requires_grad=True)
    t = torch.randint(0, 100, (16,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours, theirs = linear_cross_entropy(h, W, t), F.cross_entropy(F.linear(h, W), t)
        logits = F.linear(h, W)
        assert cross_entropy(logits, t).dtype == F.cross_entropy(logits, t).dtype == torch.float32
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)
    a, b = torch.autograd.grad(ours, (h, W)), torch.autograd.grad(theirs, (h, W))
    assert [g.dtype for g in a] == [g.dtype for g in b] == [torch.float32, torch.float32]


# ---------------------------------------------------------------- sm_90
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite compiles and runs the kernels itself")
def test_kernels_compile_for_sm90_without_spills(sm90_cases):
    script = os.path.join(os.path.dirname(__file__), "ce_sm90_compile.py")
    out = run_without_interpreter([script, *sm90_cases], timeout=1200)
    assert out.returncode == 0 and " 0 failures" in out.stdout, (out.stdout + out.stderr)[-4000:]


def test_linear_cross_entropy_out_dtype_keeps_the_float32_loss():
    # Hugging Face's causal-LM loss upcasts the logits and returns a float32 loss: out_dtype=float32 gives the
    # same, not a bfloat16 loss cast up afterwards (which would keep only ~3 significant digits).
    h = torch.randn(37, 16, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(50, 16, device=DEVICE).to(torch.bfloat16)
    t = torch.randint(0, 50, (37,), device=DEVICE)
    want = F.cross_entropy(F.linear(h, w).double(), t)
    got = tritongrad.linear_cross_entropy(h, w, t, out_dtype=torch.float32)
    rounded = tritongrad.linear_cross_entropy(h, w, t)
    assert got.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    assert abs(got.double() - want) < 1e-5 * want.abs()
    assert abs(got.double() - want) < abs(rounded.double() - want) or rounded.double() == want
    with pytest.raises(TypeError, match="out_dtype"):
        tritongrad.linear_cross_entropy(h, w, t, out_dtype=torch.int64)


# ---------------------------------------------------------------- shift invariance
def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max error of ``a`` against ``ref``, relative to ref's largest magnitude."""
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-300)).item()


def _outs_and_grads(fn, x, ups):
    """``fn(x)``'s outputs and the gradient of x for upstream gradients ``ups`` (float64, cast to each output)."""
    x = x.detach().requires_grad_()
    outs = fn(x)
    (gx,) = torch.autograd.grad(outs, x, [u.to(o.dtype) for o, u in zip(outs, ups)])
    return [*outs, gx]


@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("case", ["mean", "none", "smoothing", "lse-grad"])
def test_large_common_offset_costs_no_precision(offset, case):
    # randn logits + a large offset, float32: loss, lse and gradient as close to float64 as F.cross_entropy's
    # in float32 (lse - x_t, rounded, would lose the offset's bits). Paths: the forward's gradient (mean,
    # smoothing), the recompute from the saved row maxima (none), the lse's gradient re-reading the logits.
    # Rows of several chunks, so that the online max moves.
    C = 2 * P.TABLE.ONE_CHUNK_MAX[4] + 37
    x64 = (torch.randn(6, C, dtype=torch.float64, device=DEVICE) + offset).float().double()  # float32 values
    t = _targets(6, C, (2,))
    kw = {"mean": {}, "none": {"reduction": "none"}, "smoothing": {"label_smoothing": 0.1},
          "lse-grad": {"reduction": "sum"}}[case]
    ups = [torch.randn(6 if case == "none" else (), dtype=torch.float64, device=DEVICE)]
    if case == "lse-grad":
        ups.append(torch.randn(6, dtype=torch.float64, device=DEVICE))

    def ours(x):
        out = cross_entropy(x, t, return_lse=case == "lse-grad", **kw)
        return out if isinstance(out, tuple) else (out,)

    def theirs(x):
        loss = F.cross_entropy(x, t, **kw)
        return (loss, torch.logsumexp(x, -1)) if case == "lse-grad" else (loss,)

    ref = _outs_and_grads(theirs, x64, ups)
    got = _outs_and_grads(ours, x64.float(), ups)
    base = _outs_and_grads(theirs, x64.float(), ups)
    eps32 = torch.finfo(torch.float32).eps
    for k, (a, b, r) in enumerate(zip(got, base, ref)):
        err, base_err = _rel(a, r), _rel(b, r)
        assert err <= 4 * base_err + 4 * eps32, f"result {k}: error {err:.3e}, F's {base_err:.3e} (offset {offset})"


@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_linear_large_common_offset_costs_no_precision(offset):
    # the same through linear_cross_entropy (the offset in the bias): loss, grad_input and grad_bias against
    # float64 on the same float32 logits, as close as eager F.cross_entropy(F.linear(...)) in float32
    h = torch.randn(9, 16, device=DEVICE)
    W = torch.randn(50, 16, device=DEVICE) / 4
    b = torch.randn(50, device=DEVICE) + offset
    t = _targets(9, 50)
    logits = F.linear(h, W, b).double().requires_grad_()
    want = F.cross_entropy(logits, t, label_smoothing=0.1)
    (G,) = torch.autograd.grad(want, logits)
    ref = [want, G @ W.double(), G.sum(0)]

    def run(fn):
        hh, bb = h.clone().requires_grad_(), b.clone().requires_grad_()
        loss = fn(hh, bb)
        return [loss, *torch.autograd.grad(loss, (hh, bb))]

    got = run(lambda hh, bb: linear_cross_entropy(hh, W, t, bb, label_smoothing=0.1))
    base = run(lambda hh, bb: F.cross_entropy(F.linear(hh, W, bb), t, label_smoothing=0.1))
    eps32 = torch.finfo(torch.float32).eps
    for name, a, bs, r in zip(("loss", "grad_input", "grad_bias"), got, base, ref):
        err, base_err = _rel(a, r), _rel(bs, r)
        assert err <= 4 * base_err + 4 * eps32, f"{name}: error {err:.3e}, F's {base_err:.3e} (offset {offset})"


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bfloat16_logits_near_the_largest_finite(reduction):
    # bfloat16 logits of +-3e38: the loss is the log of the number of maxima (F gives it), not 0 from
    # lse - x_t rounded at 3e38; the gradient is F's (1/k at the maxima, minus 1 at the target)
    x = torch.where(torch.rand(4, 20, device=DEVICE) < 0.45, 3e38, -3e38).to(torch.bfloat16)
    t = torch.tensor([0, 3, 7, 11], device=DEVICE)
    x[torch.arange(4), t] = 3e38  # each target is one of its row's maxima
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = cross_entropy(xa, t, reduction=reduction), F.cross_entropy(xb, t, reduction=reduction)
    assert torch.isfinite(want).all() and (want > 0).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0)
    g = torch.ones_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, xa, g)[0].float(), torch.autograd.grad(want, xb, g)[0].float(),
                               rtol=1e-2, atol=1e-3)
    if reduction == "none":
        for k in range(4):  # the log of the count of maxima, to bfloat16's precision
            count = (x[k] == x[k].max()).sum().double()
            assert count > 1 and abs(got[k].double() - count.log()) <= 2**-7 * count.log()


# ---------------------------------------------------------------- the caller owns every gradient
def _lce_pair(reduction="mean"):
    """(tritongrad loss, F loss, parameters of each): the same linear_cross_entropy on separate leaves."""
    h, W, b = torch.randn(7, 8, device=DEVICE), torch.randn(30, 8, device=DEVICE) / 3, torch.randn(30, device=DEVICE)
    t = _targets(7, 30)
    ours = [a.clone().requires_grad_() for a in (h, W, b)]
    theirs = [a.clone().requires_grad_() for a in (h, W, b)]
    loss = linear_cross_entropy(ours[0], ours[1], t, ours[2], reduction=reduction)
    want = F.cross_entropy(F.linear(*theirs), t, reduction=reduction)
    return loss, want, ours, theirs


def test_linear_backward_three_times_through_a_retained_graph():
    # the first backward hands nothing over while the graph is retained: three backwards accumulate 3x F's
    loss, want, ours, theirs = _lce_pair()
    for _ in range(3):
        loss.backward(retain_graph=True)
        want.backward(retain_graph=True)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


def test_linear_backward_after_zeroing_the_gradient():
    # backward(retain_graph=True), p.grad.zero_(), backward(): the zeroed .grad is the caller's, not the
    # forward's buffer, and the second backward reads that buffer intact
    loss, want, ours, theirs = _lce_pair()
    for lo, params in ((loss, ours), (want, theirs)):
        lo.backward(retain_graph=True)
        for p in params:
            p.grad.zero_()
        lo.backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_mutating_a_returned_gradient_then_backward_again(op):
    # torch.autograd.grad's result belongs to the caller: mutating it changes nothing for the next backward
    if op == "cross_entropy":
        x = torch.randn(5, 40, device=DEVICE)
        t = _targets(5, 40)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        loss, want, ours, theirs = cross_entropy(xa, t, label_smoothing=0.1), F.cross_entropy(
            xb, t, label_smoothing=0.1), [xa], [xb]
    else:
        loss, want, ours, theirs = _lce_pair()
    first = torch.autograd.grad(loss, ours, retain_graph=True)
    wanted = torch.autograd.grad(want, theirs)
    for g in first:
        g.mul_(2)
    second = torch.autograd.grad(loss, ours, retain_graph=True)
    third = torch.autograd.grad(loss, ours)
    for a, b, c, w in zip(first, second, third, wanted):
        torch.testing.assert_close(a, 2 * w)
        torch.testing.assert_close(b, w)
        torch.testing.assert_close(c, w)


# ---------------------------------------------------------------- bitwise equal backwards through one graph
@pytest.mark.parametrize("case", ["ce-mean", "ce-sum-lse", "ce-none", "lce-mean", "lce-none"])
def test_backwards_through_one_graph_are_bitwise_equal(case):
    # three backwards through one retained graph, upstream gradients != 1: every gradient bitwise equal
    # (the last backward, which frees the graph, scales the forward's buffer in place: the same arithmetic)
    torch.manual_seed(3)
    if case.startswith("ce"):
        x = torch.randn(6, 300, device=DEVICE).to(torch.bfloat16).requires_grad_()
        t = _targets(6, 300, (0,))
        red = case.split("-")[1]
        out = cross_entropy(x, t, reduction=red, label_smoothing=0.1, return_lse=case.endswith("lse"))
        outs = out if isinstance(out, tuple) else (out,)
        ins = [x]
    else:
        red = case.split("-")[1]
        loss, _, ins, _ = _lce_pair(red)
        outs = (loss,)
    ups = [torch.full_like(o, 0.37) if o.dim() == 0 else torch.rand_like(o) for o in outs]
    runs = [torch.autograd.grad(outs, ins, ups, retain_graph=k < 2) for k in range(3)]
    for k in (1, 2):
        for a, b in zip(runs[0], runs[k]):
            assert torch.equal(a, b), f"backward {k + 1} differs from the first by {(a - b).abs().max():.3e}"


# ---------------------------------------------------------------- F's NaN for a zero denominator
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_mean_with_every_target_weight_zero_is_nan(smoothing):
    # reduction="mean" where every non-ignored target's class weight is 0: F's denominator is 0 and F gives
    # NaN (with smoothing too, where the sum is not 0), and NaN gradients for the non-ignored rows
    x = torch.randn(4, 5, dtype=torch.float64, device=DEVICE)
    w = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64, device=DEVICE)
    t = torch.tensor([0, -100, 1, 0], device=DEVICE)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = cross_entropy(xa, t, w, label_smoothing=smoothing)
    want = F.cross_entropy(xb, t, w, label_smoothing=smoothing)
    assert torch.isnan(want) and torch.isnan(got)
    torch.testing.assert_close(torch.autograd.grad(got, xa)[0],
                               torch.autograd.grad(want, xb, retain_graph=True)[0], equal_nan=True)
    xr = x.clone().requires_grad_()
    ref = tritongrad.ops.cross_entropy.cross_entropy_reference(xr, t, w, label_smoothing=smoothing)[0]
    assert torch.isnan(ref)
    torch.testing.assert_close(torch.autograd.grad(ref, xr)[0], torch.autograd.grad(want, xb)[0], equal_nan=True)


# the forward's gradients; the backward's recomputation (extended tier: twice the interpreter's launches)
@pytest.mark.parametrize("reduction", ["sum", pytest.param("none", marks=pytest.mark.extended)])
def test_linear_grad_weight_in_float32(reduction):
    # A bfloat16 weight over 20 chunks of 8 rows: grad_weight_f32 rounds once, after every chunk is added, so its
    # error stays near one rounding where the default (one rounding a chunk) drifts; deterministic either way.
    g = torch.Generator().manual_seed(0)
    h = torch.randn(160, 32, generator=g).bfloat16().to(DEVICE).requires_grad_()
    W = torch.randn(64, 32, generator=g).bfloat16().to(DEVICE).requires_grad_()
    t = torch.randint(0, 64, (160,), generator=g).to(DEVICE)
    h64, W64 = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    F.cross_entropy(F.linear(h64, W64), t, reduction="sum").backward()
    err = {}
    with P.using(dataclasses.replace(P.TABLE, LCE_CHUNK_BYTES=64 * 2 * 8, LCE_ROW_MULTIPLE=1, LCE_MIN_ROWS=1)):
        for f32 in (False, True, True):
            W.grad = None
            loss = tritongrad.linear_cross_entropy(h, W, t, reduction=reduction, grad_weight_f32=f32)
            (loss if reduction == "sum" else loss.sum()).backward()
            assert W.grad.dtype == torch.bfloat16
            if f32 in err:
                assert torch.equal(W.grad, err[f32][1])
            err[f32] = ((W.grad.double() - W64.grad).abs().max().item() / W64.grad.abs().max().item(), W.grad.clone())
    assert err[True][0] <= 2.0 ** -7 < err[False][0], (err[True][0], err[False][0])
    with pytest.raises(TypeError, match="grad_weight_f32 must be a bool, got 1"):
        tritongrad.linear_cross_entropy(h, W, t, grad_weight_f32=1)


# ---------------------------------------------------------------- float16 under AMP's loss scale
def _scaled_grads(fn, tensors, scale):
    """Each tensor's gradient of ``scale * fn(*tensors)``, divided by the scale, in float64."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    (fn(*leaves) * scale).backward()
    return [t.grad.double() / scale for t in leaves]


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy", "cross_entropy_op",
                                "linear_cross_entropy_op"])
def test_float16_gradients_take_the_loss_scale_before_rounding(op):
    # AMP's GradScaler multiplies the loss by 2^16 so that float16 gradients of ~1e-7 survive their rounding.
    # Near-uniform logits (an LM early in training) over many tokens make the logits' gradient (p - y) / D such
    # values; made for an upstream gradient of 1 and scaled afterwards, they rounded to a few bits or to zero
    # (linear_cross_entropy's grad_input: 2.5e-2 relative error at 8192 tokens, F's 3.2e-4). The backward now
    # makes them with the scale, as F does. Measured through what the next product sees: the logits' gradient
    # times the LM head (cross_entropy), the hidden states' gradient (linear_cross_entropy).
    g = torch.Generator().manual_seed(0)
    N, H, V = 2048, 16, 1024  # p ~ 1e-3, D ~ 1800: (p - y) / D ~ 5e-7, float16's subnormals
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.05
    t = torch.randint(0, V, (N,), generator=g)
    t[::9] = -100
    # the registered ops asked to make the gradients in the forward (as a direct caller may): float16 declines
    if op.startswith("cross_entropy"):  # a float16 loss (F's dtype): 2^15, the largest power of two it holds
        inputs, scale = [h @ w.t()], 2.0 ** 15
        ours = ((lambda z: tritongrad.cross_entropy(z, t.to(z.device))) if op == "cross_entropy" else
                (lambda z: cross_entropy_op(z, t.to(z.device), compute_grad=True, return_lse=False)[0]))
        f = lambda z: F.cross_entropy(z, t.to(z.device))  # noqa: E731
    else:  # the loss in float32, as the Hugging Face patch asks for it (and HF's upcast logits give)
        inputs, scale = [h, w], 2.0 ** 16
        ours = ((lambda x, m: tritongrad.linear_cross_entropy(x, m, t.to(x.device), out_dtype=torch.float32))
                if op == "linear_cross_entropy" else
                (lambda x, m: linear_cross_entropy_op(x, m, t.to(x.device), grads=[True, True, False],
                                                      out_dtype=torch.float32)))
        f = lambda x, m: F.cross_entropy((x @ m.t()).float(), t.to(x.device))  # noqa: E731
    exact = _scaled_grads(f, [x.to(DEVICE) for x in inputs], 1.0)
    half = [x.to(DEVICE, torch.float16) for x in inputs]
    got, base = _scaled_grads(ours, half, scale), _scaled_grads(f, half, scale)
    seen = (lambda d: d @ w.to(DEVICE)) if op.startswith("cross_entropy") else (lambda d: d)  # noqa: E731
    for k, (a, b, e) in enumerate(zip(got, base, exact)):
        a, b, e = seen(a), seen(b), seen(e)
        err, base_err = ((a - e).norm() / e.norm()).item(), ((b - e).norm() / e.norm()).item()
        assert err <= 2 * base_err + 1e-4, (f"{op} gradient {k}: error {err:.2e}, F's {base_err:.2e} "
                                            f"(float16, x{scale:g})")
        if op.startswith("cross_entropy"):
            break

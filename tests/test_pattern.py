"""The public op API (``tritongrad.op``, ``tritongrad.kernel``, ``tritongrad.testing``) from a user's side: ops
declared here in their own namespace, each for one feature of the pattern, run through the kit and through
what the kit does not cover (re-declaration, error messages, vmap, double backward, export, the CPU path
without Triton's interpreter, the kit's own refusals and its power to catch a wrong kernel)."""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from conftest import DEVICE, ROOT, import_example, run_without_interpreter

import tritongrad
from tritongrad import _runtime as rt
from tritongrad.testing import OpSuite

BLOCK = 128


def blocks(n: int) -> tuple:
    return (triton.cdiv(n, BLOCK),)


def acc_of(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@triton.jit
def _acc(v):
    # float32 math, float64 for float64
    return v.to(tl.float64 if v.dtype == tl.float64 else tl.float32)


# ---------------------------------------------------------------- keyword-only arguments with defaults
@triton.jit
def _affine_kernel(x_ptr, y_ptr, n, scale, shift, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = _acc(tl.load(x_ptr + o, mask=o < n))
    tl.store(y_ptr + o, (x * scale + shift).to(y_ptr.dtype.element_ty), mask=o < n)


affine_kernel = tritongrad.kernel(_affine_kernel)


def affine_reference(x: torch.Tensor, *, scale: float = 2.0, shift: float = 0.0) -> torch.Tensor:
    return (x.to(acc_of(x.dtype)) * scale + shift).to(x.dtype)


@tritongrad.op("mylib::affine", reference=affine_reference, save=())
def affine(x: torch.Tensor, *, scale: float = 2.0, shift: float = 0.0) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    affine_kernel[blocks(x.numel())](x, y, x.numel(), scale, shift, BLOCK=BLOCK)
    return y


@affine.backward
def _(ctx, dy):
    # Nothing saved: the gradient needs the scale alone. dy may come expanded or transposed (the kit's
    # upstream-grads case): made contiguous before dx takes its layout.
    dy = dy.contiguous()
    dx = torch.empty_like(dy)
    affine_kernel[blocks(dx.numel())](dy, dx, dx.numel(), ctx.scale, 0.0, BLOCK=BLOCK)
    return dx


# ---------------------------------------------------------------- several outputs, saved instead of the input
@triton.jit
def _sincos_kernel(x_ptr, s_ptr, c_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = _acc(tl.load(x_ptr + o, mask=o < n))
    tl.store(s_ptr + o, tl.sin(x).to(s_ptr.dtype.element_ty), mask=o < n)
    tl.store(c_ptr + o, tl.cos(x).to(c_ptr.dtype.element_ty), mask=o < n)


@triton.jit
def _sincos_bwd_kernel(s_ptr, c_ptr, ds_ptr, dc_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    # d/dx (sin, cos) = (cos, -sin): dx = ds * c - dc * s, from the saved outputs.
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    s = _acc(tl.load(s_ptr + o, mask=o < n))
    c = _acc(tl.load(c_ptr + o, mask=o < n))
    ds = _acc(tl.load(ds_ptr + o, mask=o < n))
    dc = _acc(tl.load(dc_ptr + o, mask=o < n))
    tl.store(dx_ptr + o, (ds * c - dc * s).to(dx_ptr.dtype.element_ty), mask=o < n)


sincos_kernel, sincos_bwd_kernel = tritongrad.kernel(_sincos_kernel), tritongrad.kernel(_sincos_bwd_kernel)


def sincos_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.to(acc_of(x.dtype))
    return xf.sin().to(x.dtype), xf.cos().to(x.dtype)


@tritongrad.op("mylib::sincos", reference=sincos_reference, outputs=("s", "c"), save=("s", "c"))
def sincos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    s, c = torch.empty_like(x), torch.empty_like(x)
    sincos_kernel[blocks(x.numel())](x, s, c, x.numel(), BLOCK=BLOCK)
    return s, c


@sincos.backward
def _(ctx, ds, dc):
    dx = torch.empty_like(ctx.s)
    sincos_bwd_kernel[blocks(dx.numel())](ctx.s, ctx.c, ds.contiguous(), dc.contiguous(), dx, dx.numel(),
                                          BLOCK=BLOCK)
    return dx


# ---------------------------------------------------------------- a residual: a tensor for the backward only
@triton.jit
def _softplus_kernel(x_ptr, y_ptr, sig_ptr, n, BLOCK: tl.constexpr):
    # y = log(1 + e^x) = max(x, 0) + log(1 + e^-|x|); the residual sigmoid(x) is dy/dx.
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = _acc(tl.load(x_ptr + o, mask=o < n))
    e = tl.exp(-tl.abs(x))
    tl.store(y_ptr + o, (tl.maximum(x, 0.0) + tl.log(1.0 + e)).to(y_ptr.dtype.element_ty), mask=o < n)
    tl.store(sig_ptr + o, tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)), mask=o < n)


@triton.jit
def _mul_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = _acc(tl.load(a_ptr + o, mask=o < n))
    b = tl.load(b_ptr + o, mask=o < n).to(a.dtype)
    tl.store(out_ptr + o, (a * b).to(out_ptr.dtype.element_ty), mask=o < n)


softplus_kernel, mul_kernel = tritongrad.kernel(_softplus_kernel), tritongrad.kernel(_mul_kernel)


def softplus_reference(x: torch.Tensor) -> torch.Tensor:
    # log(1 + e^x) exactly (F.softplus returns x itself above a threshold)
    xf = x.to(acc_of(x.dtype))
    return torch.logaddexp(xf, torch.zeros_like(xf)).to(x.dtype)


@tritongrad.op("mylib::softplus", reference=softplus_reference, residuals=("sig",), save=("sig",))
def softplus(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    y, sig = torch.empty_like(x), torch.empty(x.shape, dtype=acc_of(x.dtype), device=x.device)
    softplus_kernel[blocks(x.numel())](x, y, sig, x.numel(), BLOCK=BLOCK)
    return y, sig


@softplus.backward
def _(ctx, dy):
    dx = torch.empty(ctx.sig.shape, dtype=dy.dtype, device=dy.device)
    mul_kernel[blocks(dx.numel())](dy.contiguous(), ctx.sig, dx, dx.numel(), BLOCK=BLOCK)
    return dx


# ---------------------------------------------------------------- an index argument: class targets
@triton.jit
def _pick_kernel(x_ptr, t_ptr, y_ptr, n, stride_x_row, stride_x_col, BLOCK: tl.constexpr):
    # y[i] = x[i, target[i]]
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    t = tl.load(t_ptr + o, mask=o < n, other=0).to(tl.int64)
    tl.store(y_ptr + o, tl.load(x_ptr + o * stride_x_row + t * stride_x_col, mask=o < n), mask=o < n)


@triton.jit
def _pick_bwd_kernel(dy_ptr, t_ptr, dx_ptr, n, stride_dx_row, BLOCK: tl.constexpr):
    # dx is zeros but for dx[i, target[i]] = dy[i].
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    t = tl.load(t_ptr + o, mask=o < n, other=0).to(tl.int64)
    tl.store(dx_ptr + o * stride_dx_row + t, tl.load(dy_ptr + o, mask=o < n), mask=o < n)


pick_kernel, pick_bwd_kernel = tritongrad.kernel(_pick_kernel), tritongrad.kernel(_pick_bwd_kernel)


def pick_reference(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return x.gather(1, target.long()[:, None])[:, 0]


def pick_validate(x, target) -> None:
    if x.dim() != 2 or tuple(target.shape) != tuple(x.shape[:1]):
        raise ValueError(f"mylib.pick: x must be [N, C] and target [N], got {tuple(x.shape)} and "
                         f"{tuple(target.shape)}")


@tritongrad.op("mylib::pick", reference=pick_reference, validate=pick_validate, index=("target",))
def pick(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    target = target.contiguous()
    y = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    pick_kernel[blocks(x.shape[0])](x, target, y, x.shape[0], x.stride(0), x.stride(1), BLOCK=BLOCK)
    return y


@pick.backward
def pick_backward(ctx, dy):
    dx = torch.zeros(ctx.x.shape, dtype=ctx.x.dtype, device=ctx.x.device)
    pick_bwd_kernel[blocks(dx.shape[0])](dy.contiguous(), ctx.target.contiguous(), dx, dx.shape[0], dx.stride(0),
                                         BLOCK=BLOCK)
    return dx, None


# ---------------------------------------------------------------- a nondiff argument: a table without gradient
def scale_reference(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return (x.to(acc_of(x.dtype)) * table.to(acc_of(x.dtype))).to(x.dtype)


def scale_validate(x, table) -> None:
    if x.shape != table.shape:
        raise ValueError(f"mylib.scale: x {tuple(x.shape)} and table {tuple(table.shape)} differ in shape")


@tritongrad.op("mylib::scale", reference=scale_reference, validate=scale_validate, nondiff=("table",),
               save=("table",))
def scale(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    x, table = x.contiguous(), table.contiguous()
    y = torch.empty_like(x)
    mul_kernel[blocks(x.numel())](x, table, y, x.numel(), BLOCK=BLOCK)
    return y


@scale.backward
def _(ctx, dy):
    dx = torch.empty_like(dy, memory_format=torch.contiguous_format)
    mul_kernel[blocks(dx.numel())](dy.contiguous(), ctx.table.contiguous(), dx, dx.numel(), BLOCK=BLOCK)
    return dx, None


# ---------------------------------------------------------------- the kit on every feature
def randn(*shape, dtype, device, scale=1.0):
    return (scale * torch.randn(shape, device=device)).to(dtype)


def affine_given(dtype, device):
    # keyword-only arguments given (exact in float32, as Triton passes them)
    return {"x": randn(5, 37, dtype=dtype, device=device), "scale": 0.5, "shift": -1.25}


def affine_defaults(dtype, device):
    # the declared defaults
    return {"x": randn(3, 300, dtype=dtype, device=device)}


def sincos_sample(dtype, device):
    # two blocks, the second ragged; values over several periods
    return (randn(3, 50, dtype=dtype, device=device, scale=4.0),)


def softplus_sample(dtype, device):
    # both signs, tails where e^-|x| underflows in float32
    return (randn(4, 40, dtype=dtype, device=device, scale=30.0),)


def pick_int64(dtype, device):
    # int64 targets; more rows than a block
    return randn(150, 10, dtype=dtype, device=device), torch.randint(0, 10, (150,), device=device)


def pick_int32(dtype, device):
    # int32 targets
    return randn(7, 3, dtype=dtype, device=device), torch.randint(0, 3, (7,), device=device, dtype=torch.int32)


def scale_sample(dtype, device):
    # the table in x's dtype, without gradient
    return randn(4, 33, dtype=dtype, device=device), randn(4, 33, dtype=dtype, device=device)


USER_SUITES = {
    "affine": OpSuite(affine, [affine_given, affine_defaults], leading=("x",)),
    "sincos": OpSuite(sincos, [sincos_sample], leading=("x",)),
    "softplus": OpSuite(softplus, [softplus_sample], leading=("x",)),
    "pick": OpSuite(pick, [pick_int64, pick_int32]),
    "scale": OpSuite(scale, [scale_sample], leading=("x", "table")),
}


@pytest.mark.parametrize("check", [pytest.param(check, id=f"{name}-{case}") for name, suite in USER_SUITES.items()
                                   for case, check in suite.cases])
def test_user_ops_pass_the_kit(check):
    check()


# ---------------------------------------------------------------- declaration and registration
def test_ops_live_in_their_own_namespace():
    assert sincos.opoverload is torch.ops.mylib.sincos.default
    assert sincos.backward_opoverload is torch.ops.mylib.sincos_backward.default
    assert str(torch.ops.mylib.sincos.default._schema) == "mylib::sincos(Tensor x) -> (Tensor, Tensor)"
    assert str(affine.opoverload._schema) == "mylib::affine(Tensor x, float scale, float shift) -> Tensor"
    # residuals are returned by the registered op, not by the public call
    assert str(softplus.opoverload._schema) == "mylib::softplus(Tensor x) -> (Tensor, Tensor)"
    assert repr(affine) == "<tritongrad op mylib::affine(x: torch.Tensor, *, scale: float = 2.0, shift: float = 0.0)" \
        " -> torch.Tensor>"


def test_keyword_only_arguments_and_defaults():
    x = torch.randn(4, 10, device=DEVICE, requires_grad=True)
    for kwargs in ({}, {"shift": 1.5}, {"scale": -3.0, "shift": 0.25}):
        y = affine(x, **kwargs)
        torch.testing.assert_close(y, affine_reference(x.detach(), **kwargs))
        (dx,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(dx, torch.full_like(x, kwargs.get("scale", 2.0)))
    with pytest.raises(TypeError, match=r"mylib.affine\(\) got an unexpected keyword argument 'bias'"):
        affine(x, bias=1.0)
    with pytest.raises(TypeError, match=r"mylib.affine\(\) missing required argument\(s\): x"):
        affine(scale=1.0)
    with pytest.raises(TypeError, match=r"mylib.affine\(\) got multiple values for argument 'x'"):
        affine(x, x=x)


def test_several_outputs_one_used():
    # Only one output reaches the loss: the other's gradient is zeros, eager and compiled.
    x = torch.randn(3, 70, device=DEVICE, dtype=torch.float64, requires_grad=True)
    s, c = sincos(x)
    assert s.grad_fn is c.grad_fn and type(s.grad_fn).__name__ == "SincosBackward"
    (dx,) = torch.autograd.grad(c.sum(), x)
    torch.testing.assert_close(dx, -x.detach().sin())
    compiled = torch.compile(lambda x: sincos(x)[0].sum(), fullgraph=True, backend="aot_eager")
    (dx,) = torch.autograd.grad(compiled(x), x)
    torch.testing.assert_close(dx, x.detach().cos())


def saved_by(fn, *args) -> tuple:
    """``fn(*args)``, and the tensors autograd keeps for its backward."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*args)
    return out, saved


def test_saved_outputs_and_residuals():
    x = torch.randn(5, 8, device=DEVICE, requires_grad=True)
    # save=("s", "c"): the two outputs, not x
    (s, c), saved = saved_by(sincos, x)
    assert [t.data_ptr() for t in saved] == [s.data_ptr(), c.data_ptr()]
    # save=("sig",): the residual alone, a float32 tensor the caller never sees
    y, saved = saved_by(softplus, x)
    assert isinstance(y, torch.Tensor) and len(saved) == 1
    torch.testing.assert_close(saved[0], torch.sigmoid(x.detach()))
    # save=(): nothing; the default: every tensor input
    _, saved = saved_by(affine, x)
    assert saved == []
    t = torch.randint(0, 8, (5,), device=DEVICE)
    _, saved = saved_by(pick, x, t)
    assert [a.data_ptr() for a in saved] == [x.data_ptr(), t.data_ptr()]


def test_backward_reading_what_is_not_saved():
    def forward(x: torch.Tensor) -> torch.Tensor:
        return affine(x.detach(), scale=3.0)

    op = tritongrad.op("mylib::unsaved", reference=lambda x: 3.0 * x, save=())(forward)
    op.backward(lambda ctx, dy: 3.0 * dy * ctx.x / ctx.x)
    with pytest.raises(AttributeError, match=r"mylib.unsaved: the backward reads ctx.x, which is not saved; add 'x' "
                                             r"to the op's save=\.\.\. \(saved now: nothing\)"):
        op(torch.randn(3, device=DEVICE, requires_grad=True)).sum().backward()


def test_index_arguments():
    x = torch.randn(6, 5, device=DEVICE, requires_grad=True)
    for t in (torch.randint(0, 5, (6,), device=DEVICE), torch.randint(0, 5, (6,), device=DEVICE, dtype=torch.int32)):
        (dx,) = torch.autograd.grad(pick(x, t).sum(), x)
        assert torch.equal(dx, F.one_hot(t.long(), 5).float())
    for bad in (torch.float32, torch.int16, torch.uint8):
        with pytest.raises(TypeError, match=rf"mylib.pick: target holds class indices and must be int64 or int32, "
                                            rf"got {bad} of shape \(6,\)"):
            pick(x, torch.zeros(6, dtype=bad, device=DEVICE))


def test_nondiff_arguments():
    x = torch.randn(4, 3, device=DEVICE, requires_grad=True)
    table = torch.randn(4, 3, device=DEVICE)
    (dx,) = torch.autograd.grad(scale(x, table).sum(), x)
    torch.testing.assert_close(dx, table)
    table.requires_grad_()
    # A missing gradient would be silent: asking for one is an error that says what to do.
    with pytest.raises(ValueError, match=r"mylib.scale: table \(4, 3\) requires grad, but the op gives no gradient "
                                         r"for it; pass table.detach\(\), or run under torch.no_grad\(\)"):
        scale(x, table)
    with torch.no_grad():
        torch.testing.assert_close(scale(x, table), x * table)
    torch.testing.assert_close(scale(x, table.detach()), x * table)


def test_redeclaring_in_place():
    # A notebook cell run twice: the same name and signature take the new launchers, reference and checks.
    def declare(factor):
        def reference(x: torch.Tensor) -> torch.Tensor:
            return x * factor

        @tritongrad.op("mylib::redeclared", reference=reference, save=())
        def redeclared(x: torch.Tensor) -> torch.Tensor:
            x = x.contiguous()
            y = torch.empty_like(x)
            affine_kernel[blocks(x.numel())](x, y, x.numel(), factor, 0.0, BLOCK=BLOCK)
            return y

        @redeclared.backward
        def _(ctx, dy):
            return dy * factor

        return redeclared

    first = declare(2.0)
    x = torch.randn(9, device=DEVICE, requires_grad=True)
    torch.testing.assert_close(first(x), 2 * x)
    second = declare(3.0)
    assert second is first
    y = first(x)
    torch.testing.assert_close(y, 3 * x)
    torch.testing.assert_close(torch.ops.mylib.redeclared(x.detach()), 3 * x.detach())
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(dx, torch.full_like(x, 3.0))
    # A new signature cannot replace a registered schema: the message says what to do.
    with pytest.raises(RuntimeError, match=r"mylib.redeclared is already declared in this process as \(x: "
                                           r"torch.Tensor\).*Keep the declaration, choose another name, or restart "
                                           r"Python"):
        tritongrad.op("mylib::redeclared", reference=lambda x, k: x)(_two_args)
    # Nor can opaque change: torch.compile would keep tracing (or calling) the registered op.
    with pytest.raises(RuntimeError, match=r"mylib.redeclared is already declared in this process"):
        tritongrad.op("mylib::redeclared", reference=lambda x: x, save=(), opaque=True)(_one_arg)
    assert first.opaque is False


def _one_arg(x: torch.Tensor) -> torch.Tensor:
    return x


def _two_args(x: torch.Tensor, k: float) -> torch.Tensor:
    return x


# ---------------------------------------------------------------- error messages
def _x(*shape, dtype=torch.float32, device=DEVICE):
    return torch.zeros(shape, dtype=dtype, device=device)


CALL_ERRORS = [
    # each names the op, the argument, and its shape, dtype or device
    (lambda: scale(_x(4, 3), _x(4, 3, dtype=torch.int32)), TypeError,
     r"mylib.scale: table has dtype torch.int32 \(shape \(4, 3\)\); supported dtypes are float16, bfloat16, "
     r"float32 and float64"),
    (lambda: sincos(_x(2, dtype=torch.complex64)), TypeError,
     r"mylib.sincos: x has dtype torch.complex64 \(shape \(2,\)\)"),
    (lambda: scale(_x(4, 3), "table"), TypeError, r"mylib.scale: table must be a Tensor, got str"),
    (lambda: pick(None, _x(2, dtype=torch.int64)), TypeError, r"mylib.pick: x must be a Tensor, got NoneType"),
    (lambda: scale(_x(4, 3), _x(4, 3, device="meta")), ValueError,
     rf"mylib.scale: all tensors must be on one device, got x \(4, 3\) on {DEVICE}\S* and table \(4, 3\) on meta"),
    (lambda: pick(_x(4, 3), _x(5, dtype=torch.int64)), ValueError, r"mylib.pick: x must be \[N, C\] and target \[N\], "
                                                                  r"got \(4, 3\) and \(5,\)"),
    (lambda: affine(_x(2), 1.0, 2.0, 3.0), TypeError, r"mylib.affine\(\) takes 3 arguments but 4 were given"),
]


@pytest.mark.parametrize("call,exc,match", CALL_ERRORS)
def test_call_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _declare(name="mylib::bad", **kw):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x

    return tritongrad.op(name, reference=lambda x: x, **kw)(forward)


def _untyped(x: torch.Tensor):
    return x


def _varargs(x: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
    return x


def _no_tensor(n: int) -> torch.Tensor:
    return torch.zeros(n)


DECLARATION_ERRORS = [
    (lambda: _declare("softcap"), ValueError, r"name must be 'namespace::name', e.g. 'mylib::softcap', got 'softcap'"),
    (lambda: tritongrad.op("mylib::bad", reference=None)(_untyped), TypeError,
     r"mylib.bad: annotate the forward launcher's return as Tensor or tuple\[Tensor, \.\.\.\]"),
    (lambda: tritongrad.op("mylib::bad", reference=None)(_varargs), TypeError,
     r"mylib.bad: the forward launcher takes named arguments only"),
    (lambda: tritongrad.op("mylib::bad", reference=None)(_no_tensor), TypeError,
     r"mylib.bad: the forward launcher takes no Tensor argument"),
    (lambda: _declare(index=("y",)), ValueError, r"mylib.bad: index=\('y',\) names \['y'\], which are not tensor"),
    (lambda: _declare(nondiff=("n",)), ValueError, r"mylib.bad: nondiff=\('n',\) names \['n'\], which are not tensor"),
    (lambda: _declare(save=("out", "w")), ValueError, r"mylib.bad: save=\('out', 'w'\) names \['w'\]: neither a tensor "
                                                      r"input \(x\) nor an output or residual \(out\)"),
    (lambda: _declare(residuals=("r",)), ValueError, r"mylib.bad: 1 returned tensors leave no output after residuals"),
    (lambda: _declare(outputs=("a", "b")), ValueError, r"mylib.bad: outputs=\('a', 'b'\) names 2 outputs; the launcher "
                                                       r"returns 1"),
    (lambda: _declare(scaled_grads={"y": "out"}), ValueError, r"mylib.bad: scaled_grads names 'y', which is not a "
                                                              r"differentiable tensor argument"),
    (lambda: _declare(scaled_grads={"x": "out"}), ValueError, r"mylib.bad: scaled_grads maps 'x' to 'out', which is "
                                                              r"not a saved residual"),
]


@pytest.mark.parametrize("declare,exc,match", DECLARATION_ERRORS)
def test_declaration_errors(declare, exc, match):
    with pytest.raises(exc, match=match):
        declare()


@pytest.mark.parametrize(
    "backward,match",
    [
        (None, r"mylib.no_backward has no backward: declare one with @no_backward.backward"),
        (lambda ctx, dy: (dy, dy, dy), r"mylib.wrong_count: the backward returned 3 gradients; expected one per "
                                       r"tensor input \(1: x\) or one per argument \(2\)"),
        (lambda ctx, dy: None, r"mylib.none_grad: the backward returned None for x, whose gradient was asked for"),
    ],
    ids=["missing", "wrong count", "None"],
)
def test_backward_errors(backward, match):
    name = re.match(r"mylib\.(\w+)", match).group(1)

    def forward(x: torch.Tensor, k: float = 1.0) -> torch.Tensor:
        return affine(x.detach(), scale=k)

    op = tritongrad.op(f"mylib::{name}", reference=lambda x, k=1.0: x * k)(forward)
    if backward is not None:
        op.backward(backward)
    with pytest.raises(RuntimeError, match=match):
        op(torch.randn(3, device=DEVICE, requires_grad=True)).sum().backward()


# ---------------------------------------------------------------- transforms, double backward, export
def test_vmap_without_grad():
    # torch.func.vmap runs the registered op once per batch element (no batching rule of the op's own).
    x = torch.randn(3, 4, 9, device=DEVICE)
    table = torch.randn(4, 9, device=DEVICE)
    t = torch.randint(0, 9, (3, 4), device=DEVICE)
    torch.testing.assert_close(torch.func.vmap(scale, in_dims=(0, None))(x, table), x * table)
    s, c = torch.func.vmap(sincos)(x)
    torch.testing.assert_close((s, c), (x.sin(), x.cos()))
    torch.testing.assert_close(torch.func.vmap(pick)(x, t), x.gather(2, t[..., None])[..., 0])
    torch.testing.assert_close(torch.func.vmap(lambda x: affine(x, shift=1.0))(x), 2 * x + 1)


@pytest.mark.parametrize("op,args", [(sincos, lambda x: (x,)), (pick, lambda x: (x, torch.zeros(3, dtype=torch.long, device=DEVICE))),
                                     (affine, lambda x: (x,))], ids=["saved outputs", "saved inputs", "nothing saved"])
def test_double_backward_is_refused(op, args):
    # create_graph=True would differentiate launchers that autograd cannot see through: a gradient penalty
    # would silently lose terms. A loss that is not linear in the output puts a graph on dy, which is refused
    # too, also for an op that saves nothing (its backward is linear in dy).
    x = torch.randn(3, 4, device=DEVICE, requires_grad=True)
    out = op(*args(x))
    out = out[0] if isinstance(out, tuple) else out
    with pytest.raises(RuntimeError, match=f"{op.label}: double backward"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)


def test_export_of_a_module_calling_user_ops():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(6, 6)

        def forward(self, x, target):
            s, c = sincos(self.proj(x))
            return pick(softplus(s + c), target)

    m = Head().to(DEVICE)
    x, t = torch.randn(5, 6, device=DEVICE), torch.randint(0, 6, (5,), device=DEVICE)
    ep = torch.export.export(m, (x, t))
    code = ep.graph_module.code
    assert all(f"torch.ops.mylib.{name}.default" in code for name in ("sincos", "softplus", "pick")), code
    torch.testing.assert_close(ep.module()(x, t), m(x, t))
    x2, t2 = torch.randn(5, 6, device=DEVICE), torch.randint(0, 6, (5,), device=DEVICE)
    torch.testing.assert_close(ep.module()(x2, t2), m(x2, t2))


# ---------------------------------------------------------------- without the interpreter, the kit, the example
# The kit's refusal, first, in the same fresh process (one import of torch for both).
_KIT_REFUSES = """
import torch
from tritongrad.testing import OpSuite, use_interpreter
from softcap import softcap
try:
    OpSuite(softcap, [lambda dtype, device: (torch.randn(3, 5, dtype=dtype, device=device),)]).run_all()
except RuntimeError as e:
    print("kit:", e)
try:
    use_interpreter()
except RuntimeError as e:
    print("use_interpreter:", e)
"""


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors take the PyTorch path only where no GPU kernels serve them")
@pytest.mark.parametrize("first_backend", ["aot_eager", "inductor"])
def test_cpu_path_without_interpreter(first_backend):
    # A fresh process without TRITON_INTERPRET: CPU tensors take each op's reference (PyTorch's autograd, no
    # launch), eager and compiled; the registered ops run the reference too (opcheck); patch() works.
    # Without a GPU or the interpreter the kit would compare the reference with itself: it refuses, and says
    # what to do. The first case compiled with Inductor (its reference lowered) is in the extended tier.
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, "examples")
    """) + _KIT_REFUSES + f"FIRST_BACKEND = {first_backend!r}\n" + textwrap.dedent("""        import torch, tritongrad
        import torch.nn.functional as F
        from tritongrad import _runtime
        from softcap import softcap
        assert not _runtime.INTERPRET
        x = torch.randn(4, 3, 9, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(9, requires_grad=True)
        b = torch.randn(9, requires_grad=True)
        cases = [
            (lambda x, w, b: tritongrad.weighted_sum(x, w), lambda x, w, b: (x.float() * w).sum(-1)),
            (lambda x, w, b: tritongrad.rms_norm(x, (9,), w),
             lambda x, w, b: F.rms_norm(x.float(), (9,), w).bfloat16()),
            (lambda x, w, b: tritongrad.layer_norm(x, (9,), w, b),
             lambda x, w, b: F.layer_norm(x.float(), (9,), w, b).bfloat16()),
            (lambda x, w, b: tritongrad.llama_rms_norm(x, w, 1e-6),
             lambda x, w, b: w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()),
            (lambda x, w, b: softcap(x.float() * w, cap=2.0), lambda x, w, b: 2.0 * torch.tanh(x.float() * w / 2.0)),
        ]
        for i, (f, ref) in enumerate(cases):
            y = f(x, w, b)
            want = ref(x, w, b)
            assert y.dtype == want.dtype
            assert not isinstance(y.grad_fn, torch.autograd.function.BackwardCFunction), type(y.grad_fn)
            g = torch.randn_like(y)
            got = torch.autograd.grad(y, (x, w), g)
            exp = torch.autograd.grad(want, (x, w), g)
            torch.testing.assert_close(y, want, atol=0.05, rtol=0.02)
            for a, e in zip(got, exp):
                assert a.dtype == e.dtype
                torch.testing.assert_close(a, e, atol=0.05, rtol=0.02)
            # Inductor lowers the first case's reference (extended tier); every case is traced alone (aot_eager),
            # which is where a graph break or a fake-tensor failure of the registered op would show.
            backend = FIRST_BACKEND if i == 0 else "aot_eager"
            fc = torch.compile(lambda x, w, b: f(x, w, b).float().sum(), fullgraph=True, backend=backend)
            gc = torch.autograd.grad(fc(x, w, b), (x, w))
            ge = torch.autograd.grad(f(x, w, b).float().sum(), (x, w))
            torch.testing.assert_close(gc, ge, atol=0.01, rtol=0.02)  # bfloat16 x: Inductor may round otherwise
        xf = x.detach().float()
        torch.library.opcheck(torch.ops.tritongrad.weighted_sum.default, (xf.requires_grad_(), w))
        torch.library.opcheck(torch.ops.tritongrad.rms_norm.default, (xf, [9], w, None, 0.0))
        torch.library.opcheck(torch.ops.tritongrad.layer_norm.default, (xf, [9], w, b, 1e-5))
        m = torch.nn.Sequential(torch.nn.LayerNorm(9), torch.nn.RMSNorm(9))
        assert tritongrad.patch(m).count == 2
        m(xf).sum().backward()
        print("ok")
    """)
    out = run_without_interpreter(["-c", code])
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    assert "kit: tritongrad.testing: no GPU and Triton's interpreter is off" in out.stdout
    assert "Call tritongrad.testing.use_interpreter() before triton is imported" in out.stdout
    assert "use_interpreter: tritongrad.testing.use_interpreter(): triton is already imported" in out.stdout


def test_kit_catches_wrong_kernels():
    example = import_example("softcap")

    # softcap whose backward omits the factor 1/cap^2 of (y/cap)^2 (it passes cap = 1 to the kernel)
    @tritongrad.op("kitcheck::softcap_no_factor", reference=example.softcap_reference, save=("out",))
    def softcap_no_factor(x: torch.Tensor, cap: float = 30.0) -> torch.Tensor:
        y = torch.empty_like(x)
        example.fwd[blocks(x.numel())](x.contiguous(), y, x.numel(), cap, BLOCK=BLOCK)
        return y

    @softcap_no_factor.backward
    def _(ctx, dy):
        dx = torch.empty_like(ctx.out)
        example.bwd[blocks(dx.numel())](ctx.out, dy.contiguous(), dx, dx.numel(), 1.0, BLOCK=BLOCK)
        return dx

    def sample(dtype, device):
        return randn(7, 33, dtype=dtype, device=device), 5.0

    suite = OpSuite(softcap_no_factor, [sample])
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(AssertionError, match=r"kitcheck.softcap_no_factor\(torch.\w+\) grad x: error"):
            suite.check_values(sample, dtype)

    # pick that ignores x's column stride: right on a contiguous x, wrong on a transposed one
    @tritongrad.op("kitcheck::pick_unit_stride", reference=pick_reference, index=("target",))
    def pick_unit_stride(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
        pick_kernel[blocks(x.shape[0])](x, target.contiguous(), y, x.shape[0], x.stride(0), 1, BLOCK=BLOCK)
        return y

    pick_unit_stride.backward(pick_backward)
    wrong = OpSuite(pick_unit_stride, [pick_int64])
    wrong.check_values(pick_int64, torch.float32)
    with pytest.raises(AssertionError, match=r"kitcheck.pick_unit_stride\(torch.float32, transposed\) output 0"):
        wrong.check_values(pick_int64, torch.float32, layout="transposed")

    # affine whose backward gives dx dy's layout but writes it in contiguous order: right for a contiguous or
    # expanded dy, wrong for a transposed one
    @tritongrad.op("kitcheck::affine_dy_layout", reference=affine_reference, save=())
    def affine_dy_layout(x: torch.Tensor, *, scale: float = 2.0, shift: float = 0.0) -> torch.Tensor:
        return affine(x, scale=scale, shift=shift)

    @affine_dy_layout.backward
    def _(ctx, dy):
        dx = torch.empty_like(dy)
        affine_kernel[blocks(dx.numel())](dy.contiguous(), dx, dx.numel(), ctx.scale, 0.0, BLOCK=BLOCK)
        return dx

    wrong = OpSuite(affine_dy_layout, [affine_given])
    wrong.check_values(affine_given, torch.float32)
    with pytest.raises(AssertionError, match=r"kitcheck.affine_dy_layout grad x \(transposed upstream gradient\)"):
        wrong.check_upstream_grads(affine_given)


# ---------------------------------------------------------------- torch.func and forward-mode AD
def _builtin(name):
    import tritongrad.ops.cross_entropy as ce
    import tritongrad.ops.norm as norm

    return {"weighted_sum": tritongrad.weighted_sum, "rms_norm": norm.rms_norm_op,
            "llama_rms_norm": norm.llama_rms_norm, "layer_norm": norm.layer_norm_op,
            "cross_entropy": ce.cross_entropy_op, "linear_cross_entropy": ce.linear_cross_entropy_op,
            "swiglu": tritongrad.swiglu, "apply_rotary_pos_emb": tritongrad.apply_rotary_pos_emb}[name]


def _f64(*shape):
    return torch.randn(shape, dtype=torch.float64, device=DEVICE)


def _targets(n, c):
    t = torch.randint(0, c, (n,), device=DEVICE)
    t[1] = -100  # an ignored row
    return t


# Float64 arguments of each op: every differentiable input present (weights, biases), small shapes.
TRANSFORM_ARGS = {
    "weighted_sum": lambda: (_f64(3, 7), _f64(7)),
    "rms_norm": lambda: (_f64(3, 2, 5), [2, 5], _f64(2, 5), 1e-5),
    "llama_rms_norm": lambda: (_f64(3, 6), _f64(6), 1e-6),
    "layer_norm": lambda: (_f64(4, 5) + 1.0, [5], _f64(5), _f64(5), 1e-5),
    "cross_entropy": lambda: (_f64(4, 6), _targets(4, 6), None, -100, "mean", 0.1, 3.0, 1e-2),
    "linear_cross_entropy": lambda: (_f64(4, 3), _f64(6, 3), _targets(4, 6), _f64(6), -100, "sum"),
    "swiglu": lambda: (_f64(3, 5), _f64(3, 5)),
    "apply_rotary_pos_emb": lambda: (_f64(1, 2, 3, 4), _f64(1, 1, 3, 4), _f64(1, 3, 4), _f64(1, 3, 4), 1),
    "mylib.sincos": lambda: (_f64(2, 5),),
    "mylib.affine": lambda: (_f64(2, 5),),
    "mylib.pick": lambda: (_f64(4, 3), torch.randint(0, 3, (4,), device=DEVICE)),
    "mylib.scale": lambda: (_f64(2, 5), _f64(2, 5)),
}
TRANSFORM_OPS = list(TRANSFORM_ARGS)


def _transform_op(name):
    return {"mylib.sincos": sincos, "mylib.affine": affine, "mylib.pick": pick, "mylib.scale": scale}.get(name) or \
        _builtin(name)


def _as_functions(op, args):
    """(f, f_ref, primals): the op and its reference as functions of the differentiable inputs alone,
    returning a tuple of the outputs."""
    args = op.bind(tuple(args), {})
    diff = [i for i in op._diff_positions if isinstance(args[i], torch.Tensor)]

    def of(fn):
        def f(*xs):
            full = list(args)
            for i, x in zip(diff, xs):
                full[i] = x
            out = fn(*full)
            return out if isinstance(out, tuple) else (out,)

        return f

    return of(op), of(op.reference), tuple(args[i] for i in diff)


def _assert_same(got, want, what):
    got, want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: {g.dtype} {tuple(g.shape)} vs {w.dtype} {tuple(w.shape)}"
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")
        if w.abs().max() > 0:
            assert g.abs().max() > 0, f"{what}: zero where the reference's is not"


@pytest.mark.parametrize("name", TRANSFORM_OPS)
def test_forward_mode_ad(name):
    # jvp, jacfwd and torch.autograd.forward_ad: the reference's tangents (never zeros, never None).
    op = _transform_op(name)
    f, ref, primals = _as_functions(op, TRANSFORM_ARGS[name]())
    tangents = tuple(torch.randn_like(p) for p in primals)
    want = torch.func.jvp(ref, primals, tangents)
    _assert_same(torch.func.jvp(f, primals, tangents), want, f"{op.label} jvp")
    _assert_same(torch.func.jacfwd(f, argnums=tuple(range(len(primals))))(*primals),
                 torch.func.jacrev(ref, argnums=tuple(range(len(primals))))(*primals), f"{op.label} jacfwd")
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        outs = f(*[fwAD.make_dual(p, t) for p, t in zip(primals, tangents)])
        got = [fwAD.unpack_dual(o) for o in outs]
    assert all(g.tangent is not None for g in got), f"{op.label}: forward_ad gave no tangent"
    _assert_same(([g.primal for g in got], [g.tangent for g in got]), ([*want[0]], [*want[1]]), f"{op.label} forward_ad")


@pytest.mark.parametrize("name", TRANSFORM_OPS)
def test_reverse_mode_transforms(name):
    # torch.func.grad, vjp and jacrev: the reference's gradients.
    op = _transform_op(name)
    f, ref, primals = _as_functions(op, TRANSFORM_ARGS[name]())
    argnums = tuple(range(len(primals)))
    weights = [torch.randn_like(o) for o in ref(*primals)]

    def loss(fn):
        return lambda *xs: sum((o * w).sum() for o, w in zip(fn(*xs), weights))

    _assert_same(torch.func.grad(loss(f), argnums=argnums)(*primals),
                 torch.func.grad(loss(ref), argnums=argnums)(*primals), f"{op.label} grad")
    (out, pull), (out_ref, pull_ref) = torch.func.vjp(f, *primals), torch.func.vjp(ref, *primals)
    _assert_same((out, pull(tuple(weights))), (out_ref, pull_ref(tuple(weights))), f"{op.label} vjp")
    _assert_same(torch.func.jacrev(f, argnums=argnums)(*primals), torch.func.jacrev(ref, argnums=argnums)(*primals),
                 f"{op.label} jacrev")


@pytest.mark.parametrize("name", TRANSFORM_OPS)
def test_vmap(name):
    # vmap over a batch of the differentiable inputs (list arguments such as normalized_shape are not batched),
    # alone and under grad: the reference's values, equal to the op's per-sample results.
    op = _transform_op(name)
    f, ref, primals = _as_functions(op, TRANSFORM_ARGS[name]())
    batched = tuple(torch.stack([p, torch.randn_like(p)]) for p in primals)
    got = torch.func.vmap(f)(*batched)
    _assert_same(got, torch.func.vmap(ref)(*batched), f"{op.label} vmap")
    with torch.no_grad():
        each = [f(*[b[k] for b in batched]) for k in range(2)]
    for o, *e in zip(got, *each):
        torch.testing.assert_close(o, torch.stack(e), rtol=1e-10, atol=1e-12)
    per = torch.func.vmap(torch.func.grad(lambda *xs: f(*xs)[0].sum()))(*batched)
    _assert_same(per, torch.func.vmap(torch.func.grad(lambda *xs: ref(*xs)[0].sum()))(*batched),
                 f"{op.label} vmap(grad)")


def test_public_norms_under_vmap():
    # The public functions pass normalized_shape as a list: vmap never batches it.
    x, w = _f64(2, 3, 5), _f64(5)
    torch.testing.assert_close(torch.func.vmap(lambda x: tritongrad.rms_norm(x, 5, w))(x), F.rms_norm(x, (5,), w))
    torch.testing.assert_close(torch.func.vmap(lambda x: tritongrad.layer_norm(x, [5], w))(x),
                               F.layer_norm(x, (5,), w))
    # the registered op, called directly under vmap, loops over the batch without slicing the list
    torch.testing.assert_close(torch.func.vmap(lambda x: torch.ops.tritongrad.rms_norm(x, [5], w, None, 0.0)[0])(x),
                               F.rms_norm(x, (5,), w))


@pytest.mark.parametrize("transform", ["vmap", "jvp", "grad", "forward_ad"])
def test_transforms_under_torch_compile(transform):
    # A transform inside a compiled function runs the reference as in eager mode.
    x, w, t = _f64(2, 3, 5), _f64(5), _f64(2, 3, 5)
    import torch.autograd.forward_ad as fwAD

    def run(norm):
        if transform == "vmap":
            return torch.func.vmap(norm)(x)
        if transform == "jvp":
            return torch.func.jvp(norm, (x,), (t,))[1]
        if transform == "grad":
            return torch.func.grad(lambda x: norm(x).square().sum())(x)
        with fwAD.dual_level():
            return fwAD.unpack_dual(norm(fwAD.make_dual(x, t))).tangent

    torch._dynamo.reset()
    got = torch.compile(lambda x: run(lambda x: tritongrad.rms_norm(x, 5, w)), backend="aot_eager")(x)
    torch.testing.assert_close(got, run(lambda x: F.rms_norm(x, (5,), w)))


def test_transform_refused_where_the_reference_cannot_run():
    # A reference that reads a value (data-dependent control flow) cannot run under vmap: a RuntimeError names
    # the op and the transform, instead of torch's message about an internal function.
    def reference(x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 if bool((x > 0).all()) else x

    def forward(x: torch.Tensor) -> torch.Tensor:
        return affine(x.detach())

    op = tritongrad.op("mylib::reads_values", reference=reference, save=())(forward)
    op.backward(lambda ctx, dy: 2.0 * dy)
    with pytest.raises(RuntimeError, match=r"mylib.reads_values does not support torch.func.vmap: under it the op "
                                           r"runs its PyTorch reference"):
        torch.func.vmap(op)(torch.rand(2, 3, device=DEVICE))


# ---------------------------------------------------------------- float arguments: float32 in every mode
FLOAT32_ENTRY = """
import os, sys
sys.path.insert(0, os.path.join({root!r}, "examples"))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tritongrad import _runtime as rt
import softcap

kernel = softcap._softcap_fwd_kernel
entry = rt.float32_entry(kernel, ("cap",))
assert entry is not kernel and rt.float32_entry(kernel, ("cap",)).src == entry.src
assert [(p.name, p.is_constexpr) for p in entry.params] == [(p.name, p.is_constexpr) for p in kernel.params]
print(entry.src)
for cap in ("fp64", "fp32"):  # Inductor's signature of a Python float; Triton's own
    sig = {{"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "cap": cap, "BLOCK": "constexpr"}}
    ttir = triton.compile(ASTSource(entry, signature=sig, constexprs={{"BLOCK": 1024}}),
                          target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4}}).asm["ttir"]
    body = [line for line in ttir.splitlines() if "f64" in line and "tt.func" not in line]
    print(cap, "f64 lines:", body)
# torch's mutation analysis compiles the kernel with its scalars as constants: the entry must compile so too
sig = {{"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "cap": "constexpr", "BLOCK": "constexpr"}}
triton.compile(ASTSource(entry, signature=sig, constexprs={{"cap": 0.5, "BLOCK": 1024}}),
               target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4}})
print("constant cap compiles")
"""


@pytest.mark.slow
def test_float_arguments_reach_compiled_kernels_as_float32():
    """A traced launch (what Inductor compiles) runs a copy of the kernel that converts its float parameters to
    float32 on entry: compiled for sm_90 with the float64 signature Inductor gives a Python float, the only
    float64 in the kernel is that one conversion, so the math is the float32 math of an eager launch."""
    out = run_without_interpreter(["-c", FLOAT32_ENTRY.format(root=str(ROOT))])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cap = tl.cast(cap, tl.float32)" in out.stdout and "constant cap compiles" in out.stdout
    fp64 = next(line for line in out.stdout.splitlines() if line.startswith("fp64 f64 lines:"))
    assert fp64.count("arith.truncf") == 1 and fp64.count("f64") == 2, fp64  # the argument, truncated once
    assert "fp32 f64 lines: []" in out.stdout



# ---------------------------------------------------------------- the interpreter across Triton versions
@triton.jit
def _program_bounded_loop_kernel(o_ptr, N, R: tl.constexpr):
    pid = tl.program_id(0)
    acc = 0
    for r in tl.range(pid * R, tl.minimum(N, pid * R + R)):  # loop bounds from the program id
        acc += r
    tl.store(o_ptr + pid, acc)


@pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter")
def test_interpreter_loops_bounded_by_the_program_id(monkeypatch):
    """Triton 3.6's interpreter converts a loop bound with ``int(array)``, which numpy >= 2.4 refuses for the
    one-element arrays ``tl.program_id`` gives: tritongrad puts the later conversion on top of such an
    interpreter. Here the installed interpreter is given 3.6's conversion, and the shim must undo it."""
    from triton.runtime import interpreter

    from tritongrad import _runtime as rt

    later = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):  # Triton 3.6's conversion of a scalar
        later(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", _patch_lang_tensor)
    rt._interpreter_scalar_index()
    out = torch.zeros(4, dtype=torch.int64)
    _program_bounded_loop_kernel[(4,)](out, 10, R=3)
    assert out.tolist() == [0 + 1 + 2, 3 + 4 + 5, 6 + 7 + 8, 9]


@triton.jit
def _twice(v):
    return v * 2


@triton.jit
def _helper_loop_kernel(o_ptr, n):
    acc = tl.zeros([4], dtype=tl.float32)
    for _ in tl.range(0, n):
        acc = _twice(acc + 1)
    tl.store(o_ptr + tl.arange(0, 4), acc)


@pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter")
def test_interpreter_patches_the_language_once_a_launch(monkeypatch):
    """The interpreter patches ``triton.language`` when a kernel starts and at every call of a jit helper;
    tritongrad skips the helpers' repeats (most of the interpreter's time in kernels written with helpers). The
    language is walked as often for 8 helper calls as for 1, the results are right, and the language is
    restored when the kernel ends, also the module that only its helper names (``tl.zeros`` sees
    ``triton.language.core``)."""
    from triton.runtime import interpreter

    walks = []
    walk = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: (walks.append(1), walk(*a))[1])
    load = tl.load
    members = lambda m: {k: v for k, v in vars(m).items() if not k.startswith("__")}  # noqa: E731
    before = {m: members(m) for m in (tl, tl.core, tl.math, tl.tensor)}
    counts = {}
    _helper_loop_kernel[(1,)](torch.zeros(4), 1)  # the first launch rewrites the functions (their globals too)
    for n in (1, 8):
        walks.clear()
        out = torch.zeros(4)
        _helper_loop_kernel[(1,)](out, n)
        want = 0.0
        for _ in range(n):
            want = 2 * (want + 1)
        assert out.tolist() == [want] * 4
        counts[n] = len(walks)
    assert counts[1] == counts[8] > 0
    assert tl.load is load
    # tl.zeros's helper sees triton.language.core, which the kernel does not name: patched for the kernel too,
    # and restored with it
    assert {m: members(m) for m in before} == before


@pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter")
def test_interpreter_builtin_walk_kept_wraps_what_the_walk_wraps():
    """tritongrad keeps the names of the language's callable members instead of listing every member at each
    launch. On each module and class the interpreter walks, the kept walk wraps the same members as the listing,
    with the same builtins inside, both on the plain language and inside a launch (where they are wrapped
    already, and neither wraps them again), also when its names were first taken inside a launch; and it
    restores the language as the listing does."""
    from triton.runtime import interpreter

    kept, listing = interpreter._patch_builtin, interpreter._patch_builtin.__wrapped__
    pkgs = (tl, tl.core, tl.math, tl.tensor, tl.core.tensor_descriptor_base)

    def wrapped_by(walk, pkg):
        scope = interpreter._LangPatchScope()
        before = {n: getattr(pkg, n) for n in dir(pkg)}
        walk(pkg, interpreter.interpreter_builder, scope)
        changed = {n: getattr(pkg, n).__defaults__ for n in dir(pkg) if getattr(pkg, n) != before[n]}
        scope.restore()
        assert {n: getattr(pkg, n) for n in dir(pkg)} == before
        return changed

    kept._names.clear()  # first walked inside a launch, where some members are wrapped (and others replaced)
    outer = interpreter._LangPatchScope()
    for pkg in pkgs:
        listing(pkg, interpreter.interpreter_builder, outer)
    interpreter._patch_lang_core(tl, outer)
    try:
        for pkg in pkgs:
            kept(pkg, interpreter.interpreter_builder, interpreter._LangPatchScope())
    finally:
        outer.restore()
    for pkg in pkgs:
        want = wrapped_by(listing, pkg)
        assert want, pkg  # the builtins: each wrapper holds its builtin as its default argument
        assert wrapped_by(kept, pkg) == want, pkg  # with the names taken inside the launch above
        outer = interpreter._LangPatchScope()
        listing(pkg, interpreter.interpreter_builder, outer)
        try:  # inside a launch: nothing left to wrap for either
            assert wrapped_by(kept, pkg) == wrapped_by(listing, pkg) == {}, pkg
        finally:
            outer.restore()


def test_a_bound_launch_runs_on_the_tensors_it_is_given_and_keeps_none_alive():
    import gc
    import weakref

    x, y = torch.randn(37, device=DEVICE), torch.empty(37, device=DEVICE)
    bound = affine_kernel.bind((3,), x, y, 37, 2.0, shift=0.5, BLOCK=16)
    held = weakref.ref(x)
    del x, y
    gc.collect()
    assert held() is None  # the bound launch keeps no tensor of its first call
    for dtype in (torch.float32, torch.float64, torch.float32):  # a dtype each call, as Triton would specialize
        x2 = torch.randn(37, device=DEVICE, dtype=dtype)
        y2 = torch.full((37,), float("nan"), device=DEVICE, dtype=dtype)
        bound(x2, y2)
        torch.testing.assert_close(y2, x2 * 2.0 + 0.5)
    with pytest.raises(TypeError, match="takes 2 tensors"):
        bound(x2)


@pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter")
def test_interpreter_types_built_once_equal_those_built_anew():
    """The interpreter builds a block type and a tensor for every operation of every program; tritongrad keeps
    what their constructors derive from the type and copies it onto the next instance of an equal type. Each
    instance is distinct and equal, attribute for attribute, to one the constructors build anew, for scalar,
    pointer and block types; what the constructor refuses is still refused."""
    from triton.language import core
    from triton.runtime import interpreter

    original_block, original_tensor = core.block_type.__init__.__wrapped__, core.tensor.__init__.__wrapped__

    def anew(cls, init, *args):
        obj = cls.__new__(cls)
        init(obj, *args)
        return vars(obj)

    elements = [tl.float32, tl.int1, tl.bfloat16, tl.pointer_type(tl.float16), tl.pointer_type(tl.int64, const=True)]
    for element in elements:
        for shape in ([4], [2, 8], core.tuple([16, 1])):
            for _ in range(2):  # built, then copied
                block = tl.block_type(element, shape)
                want = anew(tl.block_type, original_block, element, shape)
                assert vars(block).keys() == want.keys()
                assert all(str(vars(block)[k]) == str(v) for k, v in want.items()), (element, shape)
                assert block == tl.block_type(element, shape) and block is not tl.block_type(element, shape)
        for ty in (element, tl.block_type(element, [8])):
            for handle in (interpreter.TensorHandle(np.zeros(8, np.float32), tl.float32), None):
                t = tl.tensor(handle, ty)
                want = anew(tl.tensor, original_tensor, handle, ty)
                assert vars(t).keys() == want.keys() and t.handle is handle and t.type is ty
                assert all(str(vars(t)[k]) == str(v) for k, v in want.items()), (ty, vars(t), want)
    for bad in ((2, 8), [3], [4, tl.constexpr(2)]):  # a plain tuple, not a power of two, a constexpr
        try:
            anew(tl.block_type, original_block, tl.float32, bad)
        except Exception as e:
            with pytest.raises(type(e)):
                tl.block_type(tl.float32, bad)
        else:
            assert vars(tl.block_type(tl.float32, bad)).keys() == anew(tl.block_type, original_block, tl.float32,
                                                                     bad).keys()


@triton.jit
def _pair_sum(a, b, c, d):
    return a + c, b + d


@triton.jit
def _first_max(a, ia, b, ib):
    take = (b > a) | ((b == a) & (ib < ia))
    return tl.where(take, b, a), tl.where(take, ib, ia)


@triton.jit
def _sum(a, b):
    return a + b


@triton.jit
def _custom_reduce_kernel(x_ptr, s1_ptr, s2_ptr, m_ptr, im_ptr, t_ptr, k_ptr, R: tl.constexpr, C: tl.constexpr):
    r, c = tl.arange(0, R)[:, None], tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + r * C + c)
    s1, s2 = tl.reduce((x, x * x), 1, _pair_sum)  # two inputs, the last axis (layer_norm's backward)
    tl.store(s1_ptr + tl.arange(0, R), s1)
    tl.store(s2_ptr + tl.arange(0, R), s2)
    m, im = tl.reduce((x, (r * C + c).to(tl.int32)), 0, _first_max)  # a max with its first index, axis 0
    tl.store(m_ptr + tl.arange(0, C), m)
    tl.store(im_ptr + tl.arange(0, C), im)
    tl.store(t_ptr, tl.reduce(x, None, _sum))  # every element
    kept = tl.reduce(x, 1, _sum, keep_dims=True)  # [R, 1]
    tl.store(k_ptr + r, kept)


@pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter")
def test_interpreter_tree_reduce_equals_the_sequential_one(monkeypatch):
    """tritongrad runs a kernel's own ``tl.reduce`` combine on halves of the axis, pairwise, where the
    interpreter ran it once per element: the same results, exactly for a max with its first index (ties
    included) and whole-number sums, and within float32 rounding for sums of random values; shapes as before,
    with keep_dims and over every element."""
    from triton.runtime import interpreter

    def run(x):
        R, C = x.shape
        out = [torch.empty(R), torch.empty(R), torch.empty(C), torch.empty(C, dtype=torch.int32), torch.empty(1),
               torch.empty(R)]
        _custom_reduce_kernel[(1,)](x, *out, R=R, C=C)
        return out

    ints = torch.randint(-4, 5, (8, 16)).float()  # sums exact in any order; ties for the max
    floats = torch.randn(4, 32)
    tree = [run(ints), run(floats)]
    assert getattr(interpreter.ReduceOps.generic_reduce, "_tree", False)
    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", interpreter.ReduceOps.generic_reduce.__wrapped__)
    sequential = [run(ints), run(floats)]
    for got, want in zip(tree[0], sequential[0]):
        assert torch.equal(got, want)
    for got, want in zip(tree[1], sequential[1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(tree[1][0], floats.sum(1))
    assert torch.equal(tree[0][3].long(), ints.argmax(0) * 16 + torch.arange(16))


@triton.jit
def _int32_overflow_kernel(o_ptr, big):
    tl.store(o_ptr, big * 4)  # int32 times int32: wraps


@pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter")
def test_interpreter_sanitizes_overflow_only_where_it_can_report_it():
    """The interpreter's front end computes a 64-bit overflow check for every 32-bit integer add, sub and mul
    when asked to sanitize, and asserts it only in debug mode. Its default (sanitize, no debug) did the work and
    never reported: an int32 product past 2**31 wraps, as in compiled code, with or without the work; debug
    mode with sanitizing reports it. tritongrad makes sanitizing follow debug."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    before = builder.options
    assert before.sanitize_overflow == before.debug  # tritongrad's setting
    out = torch.zeros(1, dtype=torch.int32)
    try:
        for sanitize in (True, False):
            builder.options = dataclasses.replace(before, sanitize_overflow=sanitize, debug=False)
            out.zero_()
            _int32_overflow_kernel[(1,)](out, 2**30 + 1)
            assert out.item() == 4  # (2**30 + 1) * 4 mod 2**32: the same, checked or not
        builder.options = dataclasses.replace(before, sanitize_overflow=True, debug=True)
        with pytest.raises(BaseException, match="overflow"):
            _int32_overflow_kernel[(1,)](out, 2**30 + 1)
    finally:
        builder.options = before


BOUND_DEFAULTS = """
import sys; sys.path.insert(0, {src!r})
import torch, triton, triton.language as tl
from tritongrad import _runtime as rt

@triton.jit
def k(x_ptr, N, BLOCK: tl.constexpr, SCALE: tl.constexpr = 2.0):
    pass

kern = rt.Kernel(k)
assert not rt.INTERPRET and kern._constexpr_names == ["BLOCK", "SCALE"], kern._constexpr_names
print(rt.Bound(kern, (1,), (torch.empty(4), 4), 4, {{"BLOCK": 16}}).tail,
      rt.Bound(kern, (1,), (torch.empty(4), 4), 4, {{"BLOCK": 16, "SCALE": 3.0}}).tail)
"""


def test_compiled_launches_fill_constexpr_defaults(tmp_path):
    # A compiled launch passes every constexpr by name (rt.Kernel, rt.Bound); one a launcher leaves out takes
    # the kernel's default, as Triton's own launch does (a KeyError before, on the GPU only: the interpreter
    # takes Triton's path). A file: triton.jit reads the kernel's source.
    script = tmp_path / "bound_defaults.py"
    script.write_text(BOUND_DEFAULTS.format(src=str(ROOT / "src")))
    out = run_without_interpreter([str(script)])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["(16,", "2.0)", "(16,", "3.0)"], out.stdout


# ---------------------------------------------------------------- torch.compile's caches
_CACHED_HELPER = '''
def scale():
    return {scale}
'''

_CACHED_OP = '''
import torch, triton, triton.language as tl, tritongrad
from cached_helper import scale


@triton.jit
def _twice_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < n) * 2.0, mask=o < n)


_twice = tritongrad.kernel(_twice_kernel)


@tritongrad.op("cachetest::twice", reference=lambda x: x * 2.0, outputs=("y",), save=(),
               traced_backward=lambda ctx, dy: dy * (2.0 * scale()))
def twice(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    _twice[(triton.cdiv(x.numel(), 64),)](x, y, x.numel(), BLOCK=64)
    return y


@twice.backward
def _(ctx, dy):
    dx = torch.empty_like(dy)
    _twice[(triton.cdiv(dy.numel(), 64),)](dy.contiguous(), dx, dy.numel(), BLOCK=64)
    return dx
'''

_COMPILE_IT = '''
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, sys.argv[1])
import torch, cached_op
x = torch.ones(8, requires_grad=True)
torch.compile(lambda x: cached_op.twice(x).sum(), backend="inductor", fullgraph=True)(x).backward()
print("grad", x.grad[0].item())
'''


@pytest.mark.extended
def test_compile_caches_key_on_the_ops_python(tmp_path):
    # Compiled code bakes in the Python it was traced through (here a traced backward and a helper it calls
    # from another file); torch's caches key on the calling graph and the Triton kernels' source, not on it.
    # The helper edited between two processes that share a cache, the second must compile anew, not serve the
    # first's code (rt.note_sources).
    script = tmp_path / "compile_it.py"
    script.write_text(_COMPILE_IT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_FORCE_DISABLE", "TORCH_COMPILE"))}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT / "src"))
    grads = []
    (tmp_path / "cached_op.py").write_text(_CACHED_OP)
    for scale in (1.0, 3.0):
        (tmp_path / "cached_helper.py").write_text(_CACHED_HELPER.format(scale=scale))
        done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        grads.append(float(re.search(r"grad (\S+)", done.stdout).group(1)))
    assert grads == [2.0, 6.0], grads


def test_compile_cache_tag_keeps_the_users_own(tmp_path):
    # The sources' digest goes after the user's own tag, replacing the digest an earlier declaration put there;
    # a function from a file not seen before changes it; a tag set later gets it back when an op is traced.
    import importlib.util

    (tmp_path / "cache_tag_helper.py").write_text("def helper():\n    return 1\n")
    spec = importlib.util.spec_from_file_location("cache_tag_helper", tmp_path / "cache_tag_helper.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    cfg = torch.compiler.config
    before = cfg.cache_key_tag
    try:
        cfg.cache_key_tag = "mine"
        rt.note_sources(test_compile_cache_tag_keeps_the_users_own)
        first = cfg.cache_key_tag
        assert re.fullmatch(r"mine\|tritongrad:[0-9a-f]{20}", first), first
        rt.note_sources(helper.helper)
        second = cfg.cache_key_tag
        assert re.fullmatch(r"mine\|tritongrad:[0-9a-f]{20}", second) and second != first
        # A tag set after the declarations: tracing an op puts the digest back before the caches are keyed
        # (where the op serves the tensors: a CPU without the interpreter traces the reference instead).
        cfg.cache_key_tag = "other"
        torch._dynamo.reset()
        x, w = torch.randn(3, 8, device=DEVICE), torch.randn(8, device=DEVICE)
        torch.compile(tritongrad.weighted_sum, backend="aot_eager", fullgraph=True)(x, w)
        assert cfg.cache_key_tag == "other|" + second.split("|")[1], cfg.cache_key_tag
    finally:
        cfg.cache_key_tag = before


@triton.jit
def _to_bfloat16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < n).to(tl.bfloat16), mask=o < n)


@pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter")
def test_interpreter_rounds_float32_to_bfloat16_as_a_gpu():
    """The interpreter truncates float32 to bfloat16 (and its "rtne" mode does not carry into the exponent);
    tritongrad's patch rounds to nearest even, as a GPU's conversion and PyTorch's do: every bit pattern of a
    random sample, ties, overflow to infinity, subnormals, NaN, bitwise PyTorch's. The kit's tolerances allow
    no truncation ulp since."""
    from tritongrad import _runtime as rt

    assert not rt.BF16_TRUNCATES
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1.0 - 2**-9, 3.3961775e38,
                            -3.3961775e38, float("inf"), float("-inf"), float("nan"), 1e-45, 2**-130, 1.0 + 2**-7])
    x = torch.cat([bits.view(torch.float32), special])
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    _to_bfloat16_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = x.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].view(torch.int16), want[~nan].view(torch.int16))
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)  # exact: low bits zero
    assert (y[~nan].view(torch.int16) != truncated[~nan].view(torch.int16)).float().mean() > 0.4  # rounding shows

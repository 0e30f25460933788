"""swiglu (``silu(gate) * up``), geglu (``gelu(gate) * up``) and the SwiGLUMLP and GeGLUMLP modules: the OpSuite battery of
each op, then what is special to them: Hugging Face's LlamaMLP in float64 and Gemma's MLP activation, GELU's
formulas in float64, the halves of a fused projection read in place, inputs never written, inplace_backward
and every graph that is used again (retained, checkpointed, accumulated, hooked, compiled), determinism,
bad inputs, export, CUDA graphs and the sm_90 compile of every specialization."""

import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, KernelSpy, backward_graphs_backend, run_without_interpreter

import tritongrad
from tritongrad.ops.swiglu import launch as sw_launch
from tritongrad.ops.swiglu import geglu, geglu_reference, swiglu, swiglu_reference
from tritongrad.testing import OpSuite

# large_gate's e^-g overflows to inf on purpose (the interpreter's numpy says so).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def randn(*shape, dtype, device):
    return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)


# Samples, and why each is here.
def odd_sizes(dtype, device):
    # D = 37: no power-of-two divisor, a masked column block; 5 rows, not a multiple of the row block.
    return randn(5, 37, dtype=dtype, device=device), randn(5, 37, dtype=dtype, device=device)


def fused_halves(dtype, device):
    # gate and up as the two halves of one [N, 2I] projection: row stride 2I, read in place.
    x = randn(6, 2 * 48, dtype=dtype, device=device)
    return x[:, :48], x[:, 48:]


def leading_dims(dtype, device):
    # [B, T, I] activations: leading dims merged into rows.
    return randn(2, 3, 40, dtype=dtype, device=device), randn(2, 3, 40, dtype=dtype, device=device)


def column_blocks(dtype, device):
    # 1536 = 3 x 512 columns (float32: 512-column blocks): several programs per row, the grid's column index.
    return randn(3, 1536, dtype=dtype, device=device), randn(3, 1536, dtype=dtype, device=device)


def large_gate(dtype, device):
    # gate out to +-120: sigmoid saturates (e^-g overflows to inf for g < -88 in float32): no NaN, silu' -> 0.
    g = torch.linspace(-120, 120, 64, device=device).to(dtype).reshape(2, 32)
    return g, randn(2, 32, dtype=dtype, device=device)


def eager(gate, up, inplace_backward=False):
    """What a user writes in PyTorch: the error baseline (silu rounded to the dtype before the product)."""
    return F.silu(gate) * up


suite = OpSuite(swiglu, [odd_sizes, fused_halves, leading_dims, column_blocks, large_gate], baseline=eager,
                leading=("gate", "up"), mixed=True)
test_swiglu_suite = suite.pytest()


def geglu_eager(gate, up, approximate="none", inplace_backward=False):
    """The error baseline of geglu: ``F.gelu(gate) * up``, gelu rounded to the dtype before the product."""
    return F.gelu(gate, approximate=approximate) * up


def _tanh(sample):
    """``sample``'s tensors with ``approximate="tanh"`` (Gemma's GELU)."""

    def make(dtype, device):
        gate, up = sample(dtype, device)
        return dict(gate=gate, up=up, approximate="tanh")

    make.__name__ = sample.__name__ + "_tanh"
    return make


# Both GELUs on the samples that reach a kernel path of their own: masked columns, strided halves, leading
# dims, saturated tails (erf and the tanh form's sigmoid at +-120). float64 values below.
GEGLU_SAMPLES = [odd_sizes, _tanh(odd_sizes), _tanh(fused_halves), leading_dims, large_gate, _tanh(large_gate)]
geglu_suite = OpSuite(geglu, GEGLU_SAMPLES, baseline=geglu_eager, dtypes=(torch.float32, torch.float16, torch.bfloat16),
                      leading=("gate", "up"), mixed=True)
test_geglu_suite = geglu_suite.pytest()


@pytest.mark.parametrize("sample", GEGLU_SAMPLES, ids=lambda s: s.__name__)
def test_geglu_suite_float64_values(sample):
    # The kit's float64 case, whose baseline is the reference itself (F.gelu in float64, error 0): the erf GELU
    # shares F.gelu's formulas and passes at the kit's 4 ulps. The tanh form's derivative is computed without
    # 1 - tanh^2's cancellation: F.gelu's own float64 derivative is off by up to 22 eps for |g| < 8 (ours by
    # 2: test_geglu_float64_values_and_gradients, against 40-digit truth), so the two differ by F.gelu's error.
    tanh = sample(torch.float64, "meta").get("approximate") == "tanh" if isinstance(
        sample(torch.float64, "meta"), dict) else False
    OpSuite(geglu, [sample], baseline=geglu_eager, ulps=24.0 if tanh else 4.0).check_values(sample, torch.float64)


# ---------------------------------------------------------------- Hugging Face's LlamaMLP
def _llama_mlp(hidden, inter, bias):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu", mlp_bias=bias,
                      num_attention_heads=4, num_key_value_heads=4)
    return LlamaMLP(cfg).to(device=DEVICE, dtype=torch.float64)


@pytest.mark.parametrize("bias", [False, True])
def test_module_is_a_drop_in_for_llama_mlp(bias):
    hf = _llama_mlp(24, 40, bias)
    ours = tritongrad.nn.SwiGLUMLP(24, 40, bias=bias, device=DEVICE, dtype=torch.float64)
    assert list(ours.state_dict()) == list(hf.state_dict())
    assert [(k, v.shape) for k, v in ours.named_parameters()] == [(k, v.shape) for k, v in hf.named_parameters()]
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 5, 24, dtype=torch.float64, device=DEVICE)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), hf(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-12, atol=1e-12)
    for (name, pa), (_, pb) in zip(ours.named_parameters(), hf.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_module_runs_the_op():
    m = tritongrad.nn.SwiGLUMLP(8, 12, device=DEVICE)
    seen = []
    m.down_proj.register_forward_pre_hook(lambda mod, args: seen.append(type(args[0].grad_fn).__name__))
    m(torch.randn(3, 8, device=DEVICE))
    assert seen == ["SwigluBackward"]
    assert "hidden_size=8, intermediate_size=12" in repr(m)


def test_float64_equals_hugging_face_activation():
    # LlamaMLP's act_fn(gate) * up with ACT2FN["silu"], in float64: the same values to the last bits.
    from transformers.activations import ACT2FN

    g = torch.randn(4, 33, dtype=torch.float64, device=DEVICE)
    u = torch.randn(4, 33, dtype=torch.float64, device=DEVICE)
    torch.testing.assert_close(swiglu(g, u), ACT2FN["silu"](g) * u, rtol=1e-14, atol=1e-15)


# ---------------------------------------------------------------- geglu: GELU's formulas, Gemma's activation
def _gelu_truth(g, approximate):
    """GELU, its derivative, and the derivative's two terms in magnitude (their sum is the scale of its
    rounding, where they cancel), from the kernels' docstring in 40-digit arithmetic (mpmath), rounded to
    float64: the truth that float64 results are measured against."""
    import mpmath

    mpmath.mp.dps = 40
    k, c = mpmath.sqrt(2 / mpmath.pi), mpmath.mpf("0.044715")

    def one(x):
        # Exact identities keep the tails' digits: 1 + erf(y) = erfc(-y), 1 +- tanh(z) = 2 / (1 + e^(-+2z)).
        x = mpmath.mpf(x)
        if approximate == "none":
            cdf = mpmath.erfc(-x / mpmath.sqrt(2)) / 2
            left, right = cdf, x * mpmath.exp(-x * x / 2) / mpmath.sqrt(2 * mpmath.pi)
            return x * cdf, left + right, abs(left) + abs(right)
        z = k * (x + c * x**3)
        one_plus_t, one_minus_t = 2 / (1 + mpmath.exp(-2 * z)), 2 / (1 + mpmath.exp(2 * z))
        left, right = one_plus_t / 2, x * one_minus_t * one_plus_t * k * (1 + 3 * c * x * x) / 2
        return x * one_plus_t / 2, left + right, abs(left) + abs(right)

    rows = [one(x) for x in g.flatten().tolist()]
    return [torch.tensor([float(r[i]) for r in rows], dtype=torch.float64).reshape(g.shape).to(g.device)
            for i in (0, 1, 2)]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_geglu_float64_values_and_gradients(approximate):
    # Over the range where GELU bends (|g| < 6) and into both tails: values and both gradients against
    # 40-digit truth, each error at most twice F.gelu's own float64 error (erf's left tail cancels in
    # 1 + erf, for both) plus 4 ulps; and against F.gelu's autograd.
    g = torch.cat((torch.linspace(-6, 6, 97), torch.tensor([-30.0, -12.0, 12.0, 30.0]))).to(torch.float64)
    g = torch.cat((g, torch.randn(3 * 101 - g.numel(), dtype=torch.float64))).reshape(3, 101).to(DEVICE)
    u = torch.randn(3, 101, dtype=torch.float64, device=DEVICE)
    dout = torch.randn(3, 101, dtype=torch.float64, device=DEVICE)
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    out = geglu(gr, ur, approximate=approximate)
    dg, du = torch.autograd.grad(out, (gr, ur), dout)
    gf, uf = g.clone().requires_grad_(), u.clone().requires_grad_()
    eager = F.gelu(gf, approximate=approximate)
    eager_d = torch.autograd.grad(eager, gf, torch.ones_like(g), retain_graph=True)[0]
    act, dact, dact_terms = _gelu_truth(g, approximate)
    ulp = torch.finfo(torch.float64).eps
    for what, got, base, want, scale in (("gelu", out / u, eager, act, act.abs()),
                                         ("gelu'", dg / (dout * u), eager_d, dact, dact_terms),
                                         ("gelu in the backward", du / dout, eager, act, act.abs())):
        err, base_err = (got - want).abs(), (base.detach() - want).abs()
        limit = 2 * base_err + 4 * ulp * scale + 1e-300
        worst = (err - limit).argmax()
        assert (err <= limit).all(), (f"{what}({g.flatten()[worst].item()}) = {got.flatten()[worst].item()!r}, "
                                      f"true {want.flatten()[worst].item()!r}, F.gelu's {base.flatten()[worst].item()!r}")
    # And F.gelu's autograd itself, to its own float64 precision: it rounds the tails' tiny values to 0 (1 + tanh
    # cancels) and loses up to ~1e-10 of its tanh derivative near g = -5.
    ref = eager * uf
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-15)
    for a, b in zip((dg, du), torch.autograd.grad(ref, (gf, uf), dout)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-15)


def test_geglu_approximations_differ():
    # The two GELUs differ by up to ~1e-3 near |g| = 2: each call must run the one it names.
    g = torch.linspace(-4, 4, 64, dtype=torch.float64, device=DEVICE).reshape(2, 32)
    u = torch.ones_like(g)
    exact, tanh = geglu(g, u), geglu(g, u, approximate="tanh")
    torch.testing.assert_close(exact, F.gelu(g), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(tanh, F.gelu(g, approximate="tanh"), rtol=1e-13, atol=1e-15)
    assert (exact - tanh).abs().max() > 1e-4


def _gemma_mlp(dtype):
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    cfg = GemmaConfig(hidden_size=24, intermediate_size=40, hidden_act="gelu_pytorch_tanh",
                      num_attention_heads=4, num_key_value_heads=1, head_dim=8)
    return GemmaMLP(cfg).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_geglu_tanh_equals_gemma_mlp_activation(dtype):
    # GemmaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)), act_fn = ACT2FN["gelu_pytorch_tanh"] (GELUTanh,
    # PytorchGELUTanh's new name): geglu(gate, up, approximate="tanh") is it to float rounding, gradients too.
    from transformers import activations

    assert activations.PytorchGELUTanh is activations.GELUTanh
    torch.manual_seed(0)
    mlp = _gemma_mlp(dtype)
    assert isinstance(mlp.act_fn, activations.GELUTanh)
    x = torch.randn(2, 5, 24, device=DEVICE, dtype=dtype)
    gate, up = mlp.gate_proj(x).detach(), mlp.up_proj(x).detach()
    ga, ua = gate.clone().requires_grad_(), up.clone().requires_grad_()
    gb, ub = gate.clone().requires_grad_(), up.clone().requires_grad_()
    ours, hf = geglu(ga, ua, approximate="tanh"), mlp.act_fn(gb) * ub
    dout = torch.randn_like(hf)
    torch.autograd.backward(ours, dout)
    torch.autograd.backward(hf, dout)
    # Float32: a few ulps; bfloat16: geglu rounds once where Hugging Face rounds gelu, then the product.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for what, a, b in (("out", ours, hf), ("dgate", ga.grad, gb.grad), ("dup", ua.grad, ub.grad)):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}: {m}")
    # And the whole MLP with geglu in place of act_fn(gate) * up.
    torch.testing.assert_close(mlp.down_proj(geglu(mlp.gate_proj(x), mlp.up_proj(x), approximate="tanh")), mlp(x),
                               **tol)


def test_geglu_module_is_a_drop_in_for_gemma_mlp():
    hf = _gemma_mlp(torch.float64)
    ours = tritongrad.nn.GeGLUMLP(24, 40, device=DEVICE, dtype=torch.float64)
    assert [(k, v.shape) for k, v in ours.named_parameters()] == [(k, v.shape) for k, v in hf.named_parameters()]
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 5, 24, dtype=torch.float64, device=DEVICE)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), hf(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-12, atol=1e-12)
    for (name, pa), (_, pb) in zip(ours.named_parameters(), hf.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-12, atol=1e-12, msg=name)
    seen = []
    ours.down_proj.register_forward_pre_hook(lambda mod, args: seen.append(type(args[0].grad_fn).__name__))
    ours(xa)
    assert seen == ["GegluBackward"] and "approximate='tanh'" in repr(ours)
    with pytest.raises(ValueError, match="approximate"):
        tritongrad.nn.GeGLUMLP(4, 8, approximate="exact")


@pytest.mark.parametrize("approximate, words", [
    ("exact", ["approximate", "'exact'", "(3, 8)"]),
    ("TANH", ["approximate", "'TANH'"]),
    (None, ["approximate", "None"]),
])
def test_geglu_refuses_unknown_approximations(approximate, words):
    g = torch.randn(3, 8, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError) as info:
        geglu(g, torch.randn(3, 8, device=DEVICE), approximate=approximate)
    for w in words:
        assert w in str(info.value) and "tritongrad.geglu" in str(info.value), str(info.value)


def test_geglu_bad_shapes_name_the_op():
    with pytest.raises(ValueError, match=r"tritongrad.geglu: gate \(3, 8\) and up \(3, 9\) must have the same shape"):
        geglu(torch.randn(3, 8, device=DEVICE), torch.randn(3, 9, device=DEVICE), approximate="tanh")


def test_geglu_is_exported_and_runs_its_own_node():
    assert tritongrad.geglu is geglu
    g = torch.randn(3, 8, device=DEVICE, requires_grad=True)
    assert type(tritongrad.geglu(g, torch.randn(3, 8, device=DEVICE)).grad_fn).__name__ == "GegluBackward"


# ---------------------------------------------------------------- memory: in place, no copies, no writes
def test_fused_halves_are_read_in_place(kernel_spy):
    I = 40
    x = torch.randn(2, 3, 2 * I, device=DEVICE)
    fwd, bwd = kernel_spy(sw_launch._fwd_kernel), kernel_spy(sw_launch._bwd_kernel)
    xr = x.clone().requires_grad_()
    out = swiglu(xr[..., :I], xr[..., I:])
    out.sum().backward()
    base, step = xr.data_ptr(), I * xr.element_size()
    assert fwd.ptrs[0][:2] == [base, base + step]  # gate and up: the projection's own memory
    assert bwd.ptrs[0][:2] == [base, base + step]
    torch.testing.assert_close(xr.grad, torch.func.grad(lambda t: swiglu_reference(t[..., :I], t[..., I:]).sum())(x))


def test_a_kept_launch_serves_only_calls_that_differ_in_data_alone():
    # Launches are kept per shapes, strides, dtypes and flags (launch._LAUNCHES). Each variant differs from
    # the base in one of those (the permuted one's rows are copies, not views); run in turn, each must equal
    # the float64 reference, which a launch kept for another variant would not give.
    def base():
        return randn(4, 6, 40, dtype=torch.float32, device=DEVICE), randn(4, 6, 40, dtype=torch.float32, device=DEVICE)

    def halves(n):  # the halves of a fused projection: row stride 2I
        x = randn(4, 6, 2 * n, dtype=torch.float32, device=DEVICE)
        return x[..., :n], x[..., n:]

    def one(i, change):
        ab = list(base())
        ab[i] = change(ab[i])
        return tuple(ab)

    variants = [
        base, lambda: halves(40), lambda: (base()[0], halves(40)[1]),  # the strides of both, of up alone
        lambda: one(0, lambda g: g.transpose(0, 1).contiguous().transpose(0, 1)),  # permuted: rows copied
        lambda: one(1, lambda u: u.transpose(0, 1).contiguous().transpose(0, 1)),
        lambda: (randn(3, 6, 40, dtype=torch.float32, device=DEVICE), randn(3, 6, 40, dtype=torch.float32, device=DEVICE)),
        lambda: one(1, torch.Tensor.double), lambda: one(0, torch.Tensor.double),
    ]
    for make in variants:
        for op, ref in ((swiglu, swiglu_reference), (geglu, geglu_reference)):
            for need_gate in (True, False):
                g0, u0 = make()
                g, u = g0.detach().requires_grad_(need_gate), u0.detach().requires_grad_()
                out = op(g, u)
                for expanded in (False, True):  # the upstream gradient dense, then expanded (stride 0)
                    d = torch.randn(out.shape[-1], dtype=out.dtype, device=DEVICE).expand(out.shape) if expanded \
                        else torch.randn_like(out)
                    g.grad = u.grad = None
                    out.backward(d, retain_graph=True)
                    g64, u64 = g0.detach().double().requires_grad_(), u0.detach().double().requires_grad_()
                    want = ref(g64, u64)
                    want.backward(d.double())
                    pairs = [(out, want), (u.grad, u64.grad)] + ([(g.grad, g64.grad)] if need_gate else [])
                    for got, w in pairs:
                        torch.testing.assert_close(got.double(), w, rtol=1e-5, atol=1e-5)


def test_inputs_are_never_written_and_results_are_deterministic():
    g = torch.randn(7, 300, device=DEVICE, dtype=torch.bfloat16)
    u = torch.randn(7, 300, device=DEVICE, dtype=torch.bfloat16)
    dout = torch.randn(7, 300, device=DEVICE, dtype=torch.bfloat16)
    before = [t.clone() for t in (g, u, dout)]
    runs = []
    for _ in range(2):
        gr, ur = g.detach().requires_grad_(), u.detach().requires_grad_()
        out = swiglu(gr, ur)
        out.backward(dout)
        runs.append((out, gr.grad, ur.grad))
    for a, b in zip(before, (g, u, dout)):
        assert torch.equal(a, b)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _projected(dtype=torch.bfloat16):
    """gate and up as an MLP makes them: intermediate results of products with leaves that require grad."""
    x = torch.randn(7, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    wg = torch.randn(32, 300, device=DEVICE, dtype=dtype, requires_grad=True)
    wu = torch.randn(32, 300, device=DEVICE, dtype=dtype, requires_grad=True)
    return (x, wg, wu), x @ wg, x @ wu


# The gated ops as an MLP calls them, and what a user writes in PyTorch for each.
GATED = {
    "swiglu": (swiglu, lambda g, u: F.silu(g) * u),
    "geglu": (geglu, lambda g, u: F.gelu(g) * u),
    "geglu_tanh": (lambda g, u, **kw: geglu(g, u, approximate="tanh", **kw),
                   lambda g, u: F.gelu(g, approximate="tanh") * u),
}


@pytest.mark.parametrize("name", list(GATED))
def test_inplace_backward_reuses_intermediates_and_gives_the_same_gradients(name):
    fn = GATED[name][0]
    dout = torch.randn(7, 300, device=DEVICE, dtype=torch.bfloat16)
    grads = {}
    for inplace in (False, True):
        torch.manual_seed(0)
        leaves, g, u = _projected()
        with KernelSpy(sw_launch._bwd_kernel) as bwd:
            fn(g, u, inplace_backward=inplace).backward(dout)
        grads[inplace] = [t.grad for t in leaves]
        # In place: the gradients were written over gate and up (the backward allocated neither).
        assert (bwd.ptrs[0][3:5] == [g.data_ptr(), u.data_ptr()]) == inplace
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)


def _fused(dtype=torch.bfloat16, parts=2, order=(0, 1)):
    """gate and up as a fused MLP makes them: two of the ``parts`` chunks of one projection's output."""
    x = torch.randn(7, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    w = torch.randn(32, 300 * parts, device=DEVICE, dtype=dtype, requires_grad=True)
    base = x @ w
    chunks = base.chunk(parts, dim=-1)
    return (x, w), base, chunks[order[0]], chunks[order[1]]


@pytest.mark.parametrize("name", list(GATED))
@pytest.mark.parametrize("layout", ["gate first", "up first", "two of three"])
def test_inplace_backward_writes_the_halves_of_one_projection_over_it(name, layout):
    # Phi3's gate_up_proj(x).chunk(2, -1): the projection's output takes both gradients; two chunks of three
    # do not cover it, so they are left alone.
    fn = GATED[name][0]
    parts, order = {"gate first": (2, (0, 1)), "up first": (2, (1, 0)), "two of three": (3, (0, 1))}[layout]
    dout = torch.randn(7, 300, device=DEVICE, dtype=torch.bfloat16)
    grads = {}
    for inplace in (False, True):
        torch.manual_seed(0)
        leaves, base, g, u = _fused(parts=parts, order=order)
        before = base.detach().clone()
        with KernelSpy(sw_launch._bwd_kernel) as bwd:
            fn(g, u, inplace_backward=inplace).backward(dout)
        grads[inplace] = [t.grad for t in leaves]
        taken = inplace and parts == 2
        assert (bwd.ptrs[0][3:5] == [g.data_ptr(), u.data_ptr()]) == taken
        assert torch.equal(base.detach(), before) != taken
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)


def test_inplace_backward_on_halves_bumps_the_projections_version():
    leaves, base, g, u = _fused(torch.float32)
    other = base.sin().sum()  # sin saves the projection's output; its backward runs after swiglu's
    loss = swiglu(g, u, inplace_backward=True).sum() + other
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("case", ["leaf", "view", "same_tensor"])
def test_inplace_backward_leaves_leaves_views_and_aliases_alone(case):
    torch.manual_seed(0)
    leaves, g, u = _projected()
    if case == "leaf":
        g = g.detach().requires_grad_()
    elif case == "view":
        g = g[:, :150]
        u = u[:, :150]
    else:
        u = g
    before_g, before_u = g.detach().clone(), u.detach().clone()
    dout = torch.randn(g.shape, device=DEVICE, dtype=g.dtype)
    swiglu(g, u, inplace_backward=True).backward(dout)
    assert torch.equal(g.detach(), before_g)  # a leaf, a view, or sharing storage with up: never written
    if case != "leaf":  # (with a leaf gate, up is still an intermediate: it takes its gradient)
        assert torch.equal(u.detach(), before_u)


def test_inplace_backward_bumps_versions_so_other_saved_uses_raise():
    leaves, g, u = _projected(torch.float32)
    other = (g * 2).sum() + (g.sin() * 1).sum()  # sin saves g for its backward
    loss = swiglu(g, u, inplace_backward=True).sum() + other
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ---------------------------------------------------------------- inplace_backward and graphs used again
# Each case against the same computation with F.silu / F.gelu, in float64: a gradient written over a tensor
# that something still reads would differ, or raise.
def _mlp(seed=0):
    """Leaves of a small float64 MLP: x [5, 12], gate and up weights [12, 40], down [40, 12]."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((5, 12), (12, 40), (12, 40), (40, 12))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_() for s in shapes]


def _mlp_loss(leaves, act, gate_hook=None):
    x, wg, wu, wd = leaves
    g, u = x @ wg, x @ wu  # intermediates: inplace_backward may take their storage
    if gate_hook is not None:
        gate_hook(g, u)
    return ((act(g, u) @ wd) ** 2).sum()


def _ours(name):
    fn = GATED[name][0]
    return lambda g, u: fn(g, u, inplace_backward=True)


def _want(name, leaves, loss_fn=_mlp_loss):
    return torch.autograd.grad(loss_fn(leaves, GATED[name][1]), leaves)


def _assert_grads(got, want, what):
    for k, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}, leaf {k}: {m}")


@pytest.mark.parametrize("name", list(GATED))
def test_inplace_backward_survives_a_second_backward(name):
    # loss.backward(retain_graph=True); loss.backward() raised "modified by an inplace operation": the first
    # backward wrote the gradients over gate and up, which the matmuls' graph still needed.
    leaves = _mlp()
    want = _want(name, leaves)
    loss = _mlp_loss(leaves, _ours(name))
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in leaves]
    loss.backward()
    _assert_grads(first, want, "first backward")
    _assert_grads([t.grad for t in leaves], [2 * w for w in want], "accumulated second backward")


@pytest.mark.parametrize("name", list(GATED))
def test_inplace_backward_autograd_grad_with_retain_graph_is_bitwise_repeatable(name, kernel_spy):
    leaves = _mlp()
    want = _want(name, leaves)
    bwd = kernel_spy(sw_launch._bwd_kernel)
    held = {}
    loss = _mlp_loss(leaves, _ours(name), gate_hook=lambda g, u: held.update(g=g.data_ptr(), u=u.data_ptr()))
    runs = [torch.autograd.grad(loss, leaves, retain_graph=True) for _ in range(3)]
    runs.append(torch.autograd.grad(loss, leaves))  # the last: the graph goes, gate and up take the gradients
    for k, run in enumerate(runs):
        _assert_grads(run, want, f"backward {k + 1}")
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b), f"backward {k + 1} is not bitwise the first's"
    written = [ptrs[3:5] == [held["g"], held["u"]] for ptrs in bwd.ptrs]
    assert written == [False, False, False, True], written


def _fused_mlp_loss(leaves, act):
    # _mlp_loss's MLP with gate and up the halves of one projection (Phi3's gate_up_proj(x).chunk(2, -1)).
    x, wg, wu, wd = leaves
    return ((act(*(x @ torch.cat((wg, wu), 1)).chunk(2, -1)) @ wd) ** 2).sum()


@pytest.mark.parametrize("loss_fn", [_mlp_loss, _fused_mlp_loss], ids=["two projections", "halves of one"])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("name", list(GATED))
def test_inplace_backward_under_activation_checkpointing(name, reentrant, loss_fn):
    from torch.utils.checkpoint import checkpoint

    leaves = _mlp()
    want = _want(name, leaves, loss_fn)
    loss = checkpoint(lambda *ls: loss_fn(ls, _ours(name)), *leaves, use_reentrant=reentrant)
    loss.backward(retain_graph=True)  # recomputed each time: the second backward recomputes gate and up
    first = [t.grad.clone() for t in leaves]
    loss.backward()
    _assert_grads(first, want, "checkpointed backward")
    _assert_grads([t.grad for t in leaves], [2 * w for w in want], "second checkpointed backward")


def _gate_also_saved(leaves, act):
    # g.sin() saves g and runs its backward after the gated op's (created first): it must read g, not dgate.
    x, wg, wu, wd = leaves
    g, u = x @ wg, x @ wu
    return (((g.sin() + act(g, u)) @ wd) ** 2).sum()


def _fused_also_saved(leaves, act):
    # The halves of one projection, whose output sin also saves (its backward runs after the gated op's).
    x, wg, wu, wd = leaves
    base = x @ torch.cat((wg, wu), 1)
    g, u = base.chunk(2, -1)
    return (((base.sin()[:, :40] + act(g, u)) @ wd) ** 2).sum()


@pytest.mark.parametrize("loss_fn", [_gate_also_saved, _fused_also_saved], ids=["two projections", "halves of one"])
@pytest.mark.parametrize("name", list(GATED))
def test_inplace_backward_under_non_reentrant_checkpoint_leaves_other_saved_uses_intact(name, loss_fn):
    # Recomputed tensors come back through saved-tensor hooks, which skip the version check: written in place,
    # sin's backward read the gradient, silently.
    from torch.utils.checkpoint import checkpoint

    leaves = _mlp()
    want = _want(name, leaves, loss_fn)
    for t in leaves:
        t.grad = None
    checkpoint(lambda *ls: loss_fn(ls, _ours(name)), *leaves, use_reentrant=False).backward()
    _assert_grads([t.grad for t in leaves], want, "checkpointed, gate or projection also saved by sin")


def test_inplace_backward_under_reentrant_checkpoint_refuses_other_saved_uses():
    # Recomputation without saved-tensor hooks: the version counter guards sin's use of g, as without
    # checkpointing (test_inplace_backward_bumps_versions_so_other_saved_uses_raise).
    from torch.utils.checkpoint import checkpoint

    leaves = _mlp()
    loss = checkpoint(lambda *ls: _gate_also_saved(ls, _ours("swiglu")), *leaves, use_reentrant=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("hooks", ["keep", "save_on_cpu"])
@pytest.mark.parametrize("name", list(GATED))
def test_inplace_backward_leaves_what_saved_tensor_hooks_hold(name, hooks):
    # A pack hook that holds what it packs (and save_on_cpu, which on a CPU tensor holds the tensor itself):
    # neither the held tensors nor sin's saved g may take the gradient.
    leaves = _mlp()
    want = _want(name, leaves, _gate_also_saved)
    held = []
    ctx = (torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t) if hooks == "keep"
           else torch.autograd.graph.save_on_cpu())
    with ctx:
        loss = _gate_also_saved(leaves, _ours(name))
    before = [t.clone() for t in held]
    _assert_grads(torch.autograd.grad(loss, leaves), want, f"under {hooks} hooks")
    assert all(torch.equal(a, b) for a, b in zip(held, before)), "a tensor a pack hook holds was overwritten"


@pytest.mark.parametrize("name", list(GATED))
def test_inplace_backward_leaves_hooked_and_retained_inputs_intact(name):
    # A tensor hook on gate reads gate when its gradient arrives; up.retain_grad() keeps up's gradient: in
    # place, the hook would read the gradient and up.grad would be up's own storage.
    leaves = _mlp()
    want = _want(name, leaves)
    seen = {}

    def hook(g, u):
        seen["g"], seen["u"] = g.detach().clone(), u.detach().clone()
        g.register_hook(lambda grad: seen.update(g_in_hook=g.detach().clone()))
        u.retain_grad()
        seen["tensors"] = (g, u)

    _assert_grads(torch.autograd.grad(_mlp_loss(leaves, _ours(name), gate_hook=hook), leaves), want, "hooked")
    g, u = seen["tensors"]
    assert torch.equal(seen["g_in_hook"], seen["g"]), "the hook on gate read the gradient, not gate"
    assert torch.equal(u.detach(), seen["u"]) and u.grad.data_ptr() != u.data_ptr()


@pytest.mark.parametrize("name", list(GATED))
def test_inplace_backward_with_zero_grad_set_to_none_false_accumulates(name):
    # Training steps that zero .grad in place (zero_grad(set_to_none=False)), two backwards per step (gradient
    # accumulation), with the gate's producer passing its gradient straight to a leaf (x + 0: AddBackward
    # hands dgate on, AccumulateGrad may keep that very tensor as .grad).
    ours_fn, eager_fn = GATED[name][0], GATED[name][1]
    torch.manual_seed(0)

    def make():
        return torch.nn.ModuleDict(dict(gate=torch.nn.Linear(12, 40), up=torch.nn.Linear(12, 40),
                                        down=torch.nn.Linear(40, 12))).to(device=DEVICE, dtype=torch.float64)

    ours, ref = make(), make()
    ref.load_state_dict(ours.state_dict())
    xs = [torch.randn(5, 12, dtype=torch.float64, device=DEVICE) for _ in range(3)]
    pg = [torch.zeros(5, 40, dtype=torch.float64, device=DEVICE, requires_grad=True) for _ in range(2)]

    def loss(m, x, act, p):
        return ((m["down"](act(m["gate"](x) + p, m["up"](x)))) ** 2).sum()

    for step, x in enumerate(xs):
        for m, p in ((ours, pg[0]), (ref, pg[1])):
            m.zero_grad(set_to_none=False)
            if p.grad is not None:
                p.grad.zero_()
        for _ in range(2):
            loss(ours, x, lambda g, u: ours_fn(g, u, inplace_backward=True), pg[0]).backward()
            loss(ref, x, eager_fn, pg[1]).backward()
        for (k, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"step {step} {k}: {m}")
        torch.testing.assert_close(pg[0].grad, pg[1].grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(GATED))
def test_inplace_backward_compiled_retained_graph(name):
    # Compiled code runs the registered backward op, which never writes into saved tensors.
    leaves = _mlp()
    want = _want(name, leaves)
    backend = "inductor" if torch.device(DEVICE).type == "cuda" else "aot_eager"
    torch._dynamo.reset()
    f = torch.compile(lambda *ls: _mlp_loss(ls, _ours(name)), fullgraph=True, backend=backend)
    loss = f(*leaves)
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    _assert_grads(first, want, "compiled")
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "the compiled second backward differs"


@pytest.mark.parametrize("name", list(GATED))
def test_traced_backward_is_pytorch_ops(name):
    # Traced, the backward is PyTorch ops (traced_backward), which Inductor fuses and writes over the saved gate
    # and up instead of allocating the gradients beside them. It computes the kernels' gradients: in float64
    # to its rounding; in bfloat16 to one rounding of each gradient.
    backend, graphs = backward_graphs_backend()
    leaves = _mlp()
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(lambda *ls: _mlp_loss(ls, _ours(name)), fullgraph=True,
                                            backend=backend)(*leaves), leaves)
    _assert_grads(got, torch.autograd.grad(_mlp_loss(leaves, _ours(name)), leaves), "traced")
    (graph,) = graphs
    assert "tritongrad" not in graph and ("silu_backward" if name == "swiglu" else "gelu_backward") in graph, graph

    g, u = (randn(4, 40, dtype=torch.bfloat16, device=DEVICE).requires_grad_() for _ in range(2))
    w = torch.randn(4, 40, device=DEVICE)

    def f(g, u):
        return (GATED[name][0](g, u).float() * w).sum()

    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend=backend)(g, u), (g, u))
    for a, b in zip(got, torch.autograd.grad(f(g, u), (g, u))):
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if n != "swiglu" else n for n in GATED])
def test_inductor_writes_both_gradients_over_dead_buffers(name):
    # Inductor (C++ on CPU, Triton on a GPU) compiles the traced backward into one pass that writes dg over the
    # saved up and du over the upstream gradient: the backward allocates [tokens, intermediate] once, for the
    # upstream gradient's product, as eager's in-place backward does.
    from torch._inductor.utils import run_and_get_code

    leaves = _mlp()
    torch._dynamo.reset()
    compiled = torch.compile(lambda *ls: _mlp_loss(ls, GATED[name][0]), fullgraph=True, backend="inductor")

    def step():
        return torch.autograd.grad(compiled(*leaves), leaves)

    # Without caches: a cached compile keyed by the forward graph would hand back an older backward.
    with torch._inductor.config.patch(force_disable_caches=True):
        got, codes = run_and_get_code(step)
    _assert_grads(got, _want(name, leaves), "inductor")
    backward = codes[-1].split("def call")[-1]
    shape = re.escape(f"({leaves[0].shape[0]}, {leaves[1].shape[1]}), ")
    allocated = re.findall(rf"empty_strided_\w+\({shape}", backward)
    assert len(allocated) == 1, "\n".join(line for line in backward.splitlines() if "empty_strided" in line or "reuse" in line)


def test_output_dtypes_follow_promotion():
    g = torch.randn(3, 16, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(3, 16, device=DEVICE, dtype=torch.float32, requires_grad=True)
    out = swiglu(g, u)
    assert out.dtype == torch.float32 and out.is_contiguous()
    out.sum().backward()
    assert g.grad.dtype == torch.bfloat16 and u.grad.dtype == torch.float32


def test_empty_inputs():
    for shape in ((0, 8), (4, 0), (2, 0, 3)):
        g = torch.randn(shape, device=DEVICE, requires_grad=True)
        u = torch.randn(shape, device=DEVICE, requires_grad=True)
        out = swiglu(g, u)
        assert out.shape == shape
        out.sum().backward()
        assert g.grad.shape == shape and u.grad.shape == shape


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("make, error, words", [
    (lambda: (torch.randn(3, 8), torch.randn(3, 9)), ValueError, ["gate (3, 8)", "up (3, 9)", "same shape"]),
    (lambda: (torch.randn(3, 8), torch.randn(8)), ValueError, ["gate (3, 8)", "up (8,)", "broadcast"]),
    (lambda: (torch.ones(3, 8, dtype=torch.int64), torch.randn(3, 8)), TypeError, ["gate", "torch.int64", "(3, 8)"]),
    (lambda: (torch.randn(3, 8), torch.ones(3, 8, dtype=torch.int32)), TypeError, ["up", "torch.int32"]),
    (lambda: (torch.randn(3, 8), torch.randn(3, 8, device="meta")), ValueError, ["one device", "meta"]),
    (lambda: (torch.randn(3, 8), 2.0), TypeError, ["up must be a Tensor"]),
])
def test_bad_inputs_name_shapes_dtypes_devices(make, error, words):
    gate, up = make()
    gate = gate.to(DEVICE)
    if isinstance(up, torch.Tensor) and up.device.type != "meta":
        up = up.to(DEVICE)
    with pytest.raises(error) as info:
        swiglu(gate, up)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_double_backward_is_refused():
    g = torch.randn(3, 8, device=DEVICE, dtype=torch.float64, requires_grad=True)
    u = torch.randn(3, 8, device=DEVICE, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(swiglu(g, u).sum(), g, create_graph=True)


# ---------------------------------------------------------------- graphs: export, CUDA graphs
def test_export_of_the_module():
    m = tritongrad.nn.SwiGLUMLP(8, 24, device=DEVICE)
    x = torch.randn(2, 5, 8, device=DEVICE)
    ep = torch.export.export(m, (x,))
    assert any("swiglu" in str(n.target) for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(x), m(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay():
    g = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up: compile the kernels outside the capture
        for _ in range(2):
            g.grad = u.grad = None
            swiglu(g, u).backward(dout)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    g.grad = u.grad = None
    with torch.cuda.graph(graph):
        out = swiglu(g, u)
        out.backward(dout)
    with torch.no_grad():
        g.copy_(torch.randn_like(g))
    graph.replay()
    ref = swiglu_reference(g.detach(), u.detach())
    torch.testing.assert_close(out, ref)


# ---------------------------------------------------------------- sm_90
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite compiles and runs the kernels itself")
@pytest.mark.parametrize("which", ["swiglu", "geglu"])
def test_kernels_compile_for_sm90_with_vector_access(which, sm90_cases):
    script = os.path.join(os.path.dirname(__file__), "sm90_compile_llm_ops.py")
    out = run_without_interpreter([script, which, *sm90_cases], timeout=900)
    assert out.returncode == 0 and " 0 failures" in out.stdout, (out.stdout + out.stderr)[-4000:]

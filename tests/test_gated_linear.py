"""gated_linear (``F.linear(act(gate) * up, weight)``): the OpSuite battery, then what is special to it: the
same values and gradients as the gated product and ``F.linear`` apart, the product not kept for the backward,
its gradients over a fused projection's halves, a retained graph, autocast, and bad inputs."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE

import tritongrad
from tritongrad.ops.swiglu import gated_linear, geglu, swiglu
from tritongrad.testing import OpSuite, saved_bytes


def randn(*shape, dtype, device):
    return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)


# Samples, and why each is here.
def odd_sizes(dtype, device):
    # D = 37 and 11 outputs: masked columns in the gated kernels, a product of odd sizes.
    return randn(5, 37, dtype=dtype, device=device), randn(5, 37, dtype=dtype, device=device), \
        randn(11, 37, dtype=dtype, device=device)


def fused_halves(dtype, device):
    # gate and up as the halves of one [N, 2D] projection (Phi3's MLP): read in place, row stride 2D.
    x = randn(6, 2 * 48, dtype=dtype, device=device)
    return x[:, :48], x[:, 48:], randn(20, 48, dtype=dtype, device=device)


def leading_dims_tanh(dtype, device):
    # [B, T, D] activations and GELU's tanh form (Gemma's MLP): leading dims into rows, the other activation.
    return dict(gate=randn(2, 3, 40, dtype=dtype, device=device), up=randn(2, 3, 40, dtype=dtype, device=device),
                weight=randn(24, 40, dtype=dtype, device=device), approximate="tanh")


def eager(gate, up, weight, approximate=None, inplace_backward=False):
    """What a user writes in PyTorch: the error baseline (the activation rounded before the product)."""
    act = F.silu(gate) if approximate is None else F.gelu(gate, approximate=approximate)
    return F.linear(act * up, weight)


suite = OpSuite(gated_linear, [odd_sizes, fused_halves, leading_dims_tanh], baseline=eager, leading=("gate", "up"),
                mixed=True)
test_gated_linear_suite = suite.pytest()


@pytest.mark.parametrize("approximate", [None, "none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_as_the_gated_product_and_linear_apart(approximate, dtype):
    # The forward is the two ops' own code, so its output is theirs bit for bit; the gradients are autograd's
    # products on the same operands, equal to the dtype's rounding.
    gate, up = (randn(4, 7, 32, dtype=dtype, device=DEVICE).requires_grad_() for _ in range(2))
    w = randn(24, 32, dtype=dtype, device=DEVICE).requires_grad_()
    dout = randn(4, 7, 24, dtype=dtype, device=DEVICE)
    y = gated_linear(gate, up, w, approximate=approximate)
    got = torch.autograd.grad(y, (gate, up, w), dout)
    h = swiglu(gate, up) if approximate is None else geglu(gate, up, approximate=approximate)
    want_y = F.linear(h, w)
    want = torch.autograd.grad(want_y, (gate, up, w), dout)
    assert torch.equal(y, want_y)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    for name, g, wg in zip(("gate", "up", "weight"), got, want):
        torch.testing.assert_close(g, wg, **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_the_product_is_not_kept_for_the_backward():
    gate, up = (randn(64, 96, dtype=torch.float32, device=DEVICE).requires_grad_() for _ in range(2))
    w = randn(40, 96, dtype=torch.float32, device=DEVICE).requires_grad_()
    fused = saved_bytes(lambda g, u, w_: gated_linear(g, u, w_), gate, up, w)
    apart = saved_bytes(lambda g, u, w_: F.linear(swiglu(g, u), w_), gate, up, w)
    assert fused == 0  # gate, up and weight are the caller's; nothing of its own
    assert apart == 64 * 96 * 4  # the product, kept by F.linear for the weight's gradient


@pytest.mark.parametrize("need", ["weight", "gate", "both"])
def test_inplace_backward_over_a_projections_halves(need):
    # The MLP's call: gate and up the halves of a projection's output, which takes their gradients eager.
    x = randn(6, 16, dtype=torch.float32, device=DEVICE).requires_grad_(need != "weight")
    wp = randn(2 * 24, 16, dtype=torch.float32, device=DEVICE).requires_grad_()
    wd = randn(12, 24, dtype=torch.float32, device=DEVICE).requires_grad_(need != "gate")
    dout = randn(6, 12, dtype=torch.float32, device=DEVICE)
    inputs = [t for t in (x, wp, wd) if t.requires_grad]

    def grads(inplace):
        gate, up = F.linear(x, wp).chunk(2, dim=-1)
        return torch.autograd.grad(gated_linear(gate, up, wd, inplace_backward=inplace), inputs, dout)

    for g, w_ in zip(grads(True), grads(False)):
        torch.testing.assert_close(g, w_, atol=1e-6, rtol=1e-6)


def test_a_retained_graph_gets_the_same_gradients_twice():
    x = randn(6, 16, dtype=torch.float32, device=DEVICE).requires_grad_()
    wp = randn(2 * 24, 16, dtype=torch.float32, device=DEVICE).requires_grad_()
    wd = randn(12, 24, dtype=torch.float32, device=DEVICE).requires_grad_()
    gate, up = F.linear(x, wp).chunk(2, dim=-1)
    y = gated_linear(gate, up, wd, inplace_backward=True).square().sum()
    first = torch.autograd.grad(y, (x, wp, wd), retain_graph=True)
    second = torch.autograd.grad(y, (x, wp, wd))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make, words", [
    (lambda: (torch.randn(3, 8), torch.randn(3, 8), torch.randn(5, 7)), ["weight", "(5, 7)", "[out_features, 8]"]),
    (lambda: (torch.randn(3, 8), torch.randn(3, 8), torch.randn(5, 8, dtype=torch.float64)),
     ["torch.float64", "torch.float32"]),
    (lambda: (torch.randn(3, 8), torch.randn(3, 9), torch.randn(5, 8)), ["(3, 8)", "(3, 9)"]),
])
def test_bad_inputs_name_shapes_and_dtypes(make, words):
    gate, up, w = (t.to(DEVICE) for t in make())
    with pytest.raises(ValueError) as e:
        tritongrad.gated_linear(gate, up, w)
    assert "gated_linear" in str(e.value) and all(w_ in str(e.value) for w_ in words), str(e.value)


def test_unknown_approximations_are_refused():
    t = torch.randn(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="approximate"):
        gated_linear(t, t, torch.randn(3, 4, device=DEVICE), approximate="sigmoid")


def test_autocast_does_not_apply():
    # The dtypes as given, under autocast too (patch takes the op only with autocast off; a direct call under
    # autocast must still compute the function of its inputs, forward and backward, not a half-cast mix).
    gate, up = (randn(5, 16, dtype=torch.float32, device=DEVICE).requires_grad_() for _ in range(2))
    w = randn(8, 16, dtype=torch.float32, device=DEVICE).requires_grad_()
    want = gated_linear(gate, up, w)
    want_grads = torch.autograd.grad(want.sum(), (gate, up, w))
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        got = gated_linear(gate, up, w)
        got_grads = torch.autograd.grad(got.sum(), (gate, up, w))  # the backward inside the region too
    assert got.dtype == torch.float32 and torch.equal(got, want)
    for g, w_ in zip(got_grads, want_grads):
        assert torch.equal(g, w_)

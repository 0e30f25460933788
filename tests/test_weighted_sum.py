"""weighted_sum on small shapes: through Triton's interpreter on CPU, compiled on a GPU."""

import pytest
import torch
from conftest import ATOL, DEVICE, run_without_interpreter

import tritongrad
from tritongrad import _runtime as rt
from tritongrad.ops.weighted_sum import launch as ws_launch
from tritongrad.ops.weighted_sum import weighted_sum_reference
from tritongrad.testing import assert_close_earned, make_rows

# (leading shape, D): why each is here
SHAPES = [
    ((1,), 1),          # smallest: one program, one element
    ((5,), 37),         # D not a power of two and N not a multiple of the row tile: both masks active
    ((3,), 1500),       # few rows of one partly masked block; backward with widened column blocks
    ((2,), 140000),     # rows longer than the forward's tile (8192): split-D forward, 2 steps per split
    ((37,), 1100),      # few rows: backward programs of 1024 columns loop over row steps, the last one ragged
    ((300,), 24),       # many row tiles: several grad_w partial rows, reduced by the second stage
    ((2, 3), 20),       # 3-D input
    ((2, 2, 3), 9),     # 4-D input
    ((0,), 8),          # N = 0
    ((4,), 0),          # D = 0: y is zeros, grad_w empty
    ((2, 0), 5),        # a size-0 leading dim
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def eager(x, w):
    """What a user would write in plain PyTorch, in the inputs' own dtypes: the error baseline."""
    return (x * w).sum(-1)


def check(x, w, g=None, needs=(True, True), factor=2.0):
    """Forward and the requested gradients against float64, within 2x eager PyTorch's own error."""
    out_dtype = torch.promote_types(x.dtype, w.dtype)
    atol = ATOL[out_dtype] * max(1.0, x.shape[-1] ** 0.5)
    xs = x.detach().requires_grad_(needs[0])
    ws = w.detach().requires_grad_(needs[1])
    y = tritongrad.weighted_sum(xs, ws)
    assert y.dtype == out_dtype and y.shape == x.shape[:-1]
    x64 = x.detach().double().requires_grad_(needs[0])
    w64 = w.detach().double().requires_grad_(needs[1])
    y64 = weighted_sum_reference(x64, w64)
    xe = x.detach().requires_grad_(needs[0])
    we = w.detach().requires_grad_(needs[1])
    ye = eager(xe, we)
    assert_close_earned("y", y, y64, ye, factor, atol)
    if not any(needs):
        assert y.grad_fn is None
        return
    if g is None:
        g = torch.randn(y.shape, dtype=y.dtype, device=y.device)
    y.backward(g)
    y64.backward(g.double())
    ye.backward(g)
    if needs[0]:
        assert xs.grad.dtype == x.dtype and xs.grad.shape == x.shape
        assert_close_earned("grad_x", xs.grad, x64.grad, xe.grad, factor, atol)
    else:
        assert xs.grad is None
    if needs[1]:
        assert ws.grad.dtype == w.dtype and ws.grad.shape == w.shape
        gw_atol = ATOL[w.dtype] * max(1.0, (x.numel() // max(1, x.shape[-1])) ** 0.5)
        assert_close_earned("grad_w", ws.grad, w64.grad, we.grad, factor, gw_atol)
    else:
        assert ws.grad is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,D", SHAPES, ids=lambda v: str(v))
def test_shapes_and_dtypes(lead, D, dtype):
    x = torch.randn(*lead, D, device=DEVICE).to(dtype)
    w = torch.randn(D, device=DEVICE).to(dtype)
    check(x, w)


@pytest.mark.parametrize(
    "layout,shape",
    [
        ("transposed", (37, 24)),   # column stride N: read in place, no copy
        ("row-sliced", (37, 24)),   # row stride D + 7
        ("col-strided", (37, 24)),  # column stride 2
        ("permuted", (3, 5, 24)),   # leading dims not mergeable: copied once
        ("transposed", (4, 5, 24)), # 3-D with the feature dim outermost in memory
    ],
)
def test_layouts(layout, shape):
    x = make_rows(shape, torch.float32, DEVICE, layout)
    w = torch.randn(2 * shape[-1], device=DEVICE)[::2]  # w strided too
    check(x, w)


def test_strided_x_is_not_copied(monkeypatch):
    # A transposed 2-D x must reach the kernel as the same storage, not as a contiguous copy.
    x = make_rows((33, 16), torch.float32, DEVICE, "transposed")
    w = torch.randn(16, device=DEVICE)
    seen = []
    kernel = ws_launch._fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(x_arg, *args, **kw):
                seen.append((x_arg.data_ptr(), x_arg.stride()))
                return kernel[grid](x_arg, *args, **kw)
            return run

    monkeypatch.setattr(ws_launch, "_fwd_kernel", Spy())
    tritongrad.weighted_sum(x, w)
    assert seen == [(x.data_ptr(), x.stride())]


def test_expanded_grad_from_sum_backward():
    # y.sum().backward() hands the backward a stride-0 grad_y.
    x = torch.randn(6, 5, 11, device=DEVICE, requires_grad=True)
    w = torch.randn(11, device=DEVICE, requires_grad=True)
    tritongrad.weighted_sum(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.detach().expand_as(x))
    torch.testing.assert_close(w.grad, x.detach().sum((0, 1)))


def test_strided_grad_y():
    x = torch.randn(7, 13, device=DEVICE)
    w = torch.randn(13, device=DEVICE)
    g = torch.randn(7, 3, device=DEVICE)[:, 1]  # stride 3
    check(x, w, g=g)


@pytest.mark.parametrize(
    "xdt,wdt",
    [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float32, torch.float64),
     (torch.bfloat16, torch.float64)],  # float64 accumulation, grad_x stored to bfloat16
    ids=str,
)
def test_mixed_dtypes(xdt, wdt):
    # y follows type promotion; each gradient comes back in its own input's dtype.
    x = torch.randn(9, 70, device=DEVICE).to(xdt)
    w = torch.randn(70, device=DEVICE).to(wdt)
    check(x, w)


@pytest.mark.parametrize("needs", [(True, False), (False, True), (False, False)])
def test_needs_input_grad(needs, monkeypatch):
    seen = []
    backward = ws_launch._OP.backward
    monkeypatch.setattr(ws_launch._OP, "backward", lambda *a: seen.append(a[-1]) or backward(*a))
    x = torch.randn(10, 33, device=DEVICE)
    w = torch.randn(33, device=DEVICE)
    check(x, w, needs=needs)
    assert seen == ([needs] if any(needs) else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,layout",
    [
        ((300, 24), "contiguous"),  # several row tiles, and grad_w through the partial rows
        ((5, 37), "transposed"),    # masks on both axes; x read with column stride N
        ((3, 1500), "row-sliced"),  # few rows: widened column blocks; row stride != D
    ],
    ids=str,
)
def test_two_pass_backward(shape, layout, dtype, monkeypatch):
    # Large inputs of many rows take grad_x and grad_w in two launches (read-only, then write-only); the
    # thresholds are lowered so that small inputs take that path.
    monkeypatch.setattr(ws_launch, "_SPLIT_BWD_BYTES", 0)
    monkeypatch.setattr(ws_launch, "_SPLIT_BWD_ROWS", 0)
    launches = []
    kernel = ws_launch._bwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                launches.append((kw["HAS_GX"], kw["HAS_GW"]))
                return kernel[grid](*args, **kw)
            return run

    monkeypatch.setattr(ws_launch, "_bwd_kernel", Spy())
    x = make_rows(shape, dtype, DEVICE, layout)
    check(x, torch.randn(shape[-1], device=DEVICE).to(dtype))
    assert launches == [(False, True), (True, False)]


@pytest.mark.parametrize("two_pass", [False, True], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("D,sx,want", [(24, 24, 8), (24, 28, 4), (20, 22, 2)], ids=str)
def test_rows_aligned_below_16(D, sx, want, two_pass, monkeypatch):
    # Row lengths and strides that are multiples of 8, 4 or 2 elements but not of 16: the kernels are told
    # the largest power of two dividing D and x's row stride (ALIGN, ops/_tl.aligned); one that does not
    # divide both would round it down in the kernel and misplace rows.
    if two_pass:
        monkeypatch.setattr(ws_launch, "_SPLIT_BWD_BYTES", 0)
        monkeypatch.setattr(ws_launch, "_SPLIT_BWD_ROWS", 0)
    seen = set()
    launch = rt.Kernel._launch

    def spy(self, grid, *args, **kw):
        seen.add(kw.get("ALIGN"))
        return launch(self, grid, *args, **kw)

    monkeypatch.setattr(rt.Kernel, "_launch", spy)
    x = torch.randn(300, sx, device=DEVICE)[:, :D]
    check(x, torch.randn(D, device=DEVICE))
    assert seen - {None} == {want}  # None: column_sum


@pytest.mark.parametrize("D,step", [(5120, 1024), (2560, 512), (3072, 4096), (5000, 8192)])
def test_forward_steps_over_exact_chunks(D, step):
    # A row that one power-of-two step would cover with many lanes masked (5120 in 8192) is walked in
    # steps of a power of two dividing it; 3072 (a quarter masked) and 5000 (no divisor of 512 or more)
    # keep the one step. 3 rows: the interpreter walks 5 steps of 1024 quickly.
    for elem in (2, 4):
        assert ws_launch._fwd_config(1 << 16, D, elem, 132)[1] == step
    check(torch.randn(3, D, device=DEVICE), torch.randn(D, device=DEVICE))


@pytest.mark.parametrize("N,D", [(64, 2**23 + 128), (1, 2**27), (2**20, 2**26)])
def test_column_blocks_fit_the_grid(N, D):
    # Column blocks sit on the grid's second axis, which CUDA limits to 65535 blocks: the first shape needs
    # 65537 blocks of the usual 128 columns.
    for elem in (2, 4, 8):
        for fused in (True, False):
            _, BLOCK_D, d_blocks = ws_launch._bwd_config(N, D, elem, 132, fused)[:3]
            assert d_blocks <= 65535 and d_blocks * BLOCK_D >= D
        _, BLOCK_D, d_blocks, _ = ws_launch._gx_config(N, D, elem)
        assert d_blocks <= 65535 and d_blocks * BLOCK_D >= D


def test_no_grad_saves_nothing():
    x = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(8, device=DEVICE, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        with torch.no_grad():
            y = tritongrad.weighted_sum(x, w)
        assert y.grad_fn is None and not y.requires_grad and packed == []
        y = tritongrad.weighted_sum(x, w)  # the hook does see saves when grad is on
        assert y.grad_fn is not None and len(packed) == 2


def test_gradcheck_float64():
    for x in (torch.randn(3, 4, 7, dtype=torch.float64, device=DEVICE),
              make_rows((6, 5), torch.float64, DEVICE, "transposed")):
        w = torch.randn(x.shape[-1], dtype=torch.float64, device=DEVICE)
        assert torch.autograd.gradcheck(tritongrad.weighted_sum, (x.requires_grad_(), w.requires_grad_()))


def test_double_backward_is_refused():
    x = torch.randn(3, 4, device=DEVICE, requires_grad=True)
    w = torch.randn(4, device=DEVICE, requires_grad=True)
    # A gradient penalty would otherwise silently lose d(grad_x)/dw.
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(tritongrad.weighted_sum(x, w).sum(), x, create_graph=True)


def test_grad_w_is_bitwise_deterministic():
    # 1000 rows of D=8 give several row chunks, so grad_w goes through the partial buffer.
    x = torch.randn(1000, 8, device=DEVICE)
    w = torch.randn(8, device=DEVICE, requires_grad=True)
    g = torch.randn(1000, device=DEVICE)
    grads = []
    for _ in range(3):
        w.grad = None
        tritongrad.weighted_sum(x, w).backward(g)
        grads.append(w.grad.clone())
    assert all(torch.equal(grads[0], gr) for gr in grads[1:])


def test_opcheck():
    x = torch.randn(5, 3, 6, device=DEVICE, requires_grad=True)
    w = torch.randn(6, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.tritongrad.weighted_sum.default, (x, w))
    g = torch.randn(5, 3, device=DEVICE)
    for needs in ([True, True], [False, True], [True, False]):
        torch.library.opcheck(
            torch.ops.tritongrad.weighted_sum_backward.default, (g, x, w, needs),
            test_utils=("test_schema", "test_faketensor"),
        )


def test_compile_fullgraph_and_export():
    x = torch.randn(4, 3, 10, device=DEVICE, requires_grad=True)
    w = torch.randn(10, device=DEVICE, requires_grad=True)
    f = lambda x, w: tritongrad.weighted_sum(x, w).tanh().sum()  # noqa: E731
    loss = torch.compile(f, fullgraph=True)(x, w)
    gx, gw = torch.autograd.grad(loss, (x, w))
    loss_e = f(x, w)
    gx_e, gw_e = torch.autograd.grad(loss_e, (x, w))
    torch.testing.assert_close((loss, gx, gw), (loss_e, gx_e, gw_e))
    m = tritongrad.nn.WeightedSum(10, device=DEVICE)
    ep = torch.export.export(m, (x.detach(),))
    assert "tritongrad.weighted_sum" in ep.graph_module.code
    torch.testing.assert_close(ep.module()(x.detach()), m(x.detach()))


BAD_INPUTS = [
    (lambda: (torch.randn(3, 4), torch.randn(5)), ValueError, r"\(3, 4\).*\(5,\)"),
    (lambda: (torch.randn(3, 4), torch.randn(2, 2)), ValueError, r"w must be 1-D.*\(2, 2\)"),
    (lambda: (torch.tensor(1.0), torch.randn(1)), ValueError, "0-d"),
    (lambda: (torch.ones(3, 4, dtype=torch.int32), torch.randn(4)), TypeError, "torch.int32"),
    (lambda: (torch.ones(3, 4, dtype=torch.bool), torch.ones(4, dtype=torch.bool)), TypeError, "torch.bool"),
    (lambda: (torch.randn(3, 4, dtype=torch.complex64), torch.randn(4)), TypeError, "complex64"),
    (lambda: (torch.randn(3, 4), torch.randn(4, device="meta")), ValueError, "cpu.*meta"),
    (lambda: (torch.randn(3, 4), [1.0, 2.0, 3.0, 4.0]), TypeError, "w must be a Tensor"),
    (lambda: (torch.randn(3, 4), None), TypeError, "w must be a Tensor, got NoneType"),
    (lambda: (None, torch.randn(4)), TypeError, "x must be a Tensor, got NoneType"),
    (lambda: (torch.randn(3, 4), torch.randn(4, 1)), ValueError, r"w must be 1-D.*\(4, 1\)"),  # matmul would take it
]


@pytest.mark.parametrize("make,exc,match", BAD_INPUTS)
def test_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        tritongrad.weighted_sum(*make())


def test_module():
    m = tritongrad.nn.WeightedSum(12, device=DEVICE, dtype=torch.float32)
    assert repr(m) == "WeightedSum(in_features=12)" and list(m.state_dict()) == ["weight"]
    assert m.weight.abs().max() <= 12 ** -0.5
    before = m.weight.detach().clone()
    m.reset_parameters()
    assert not torch.equal(before, m.weight)
    # A few SGD steps fit a target weight: the module trains like any PyTorch layer.
    target = torch.randn(12, device=DEVICE)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(64, 12, device=DEVICE)
    losses = []
    for _ in range(20):
        loss = (m(x) - x @ target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]


@pytest.mark.skipif(DEVICE != "cpu", reason="the PyTorch path serves CPU tensors only when no GPU kernels do")
def test_cpu_without_interpreter():
    # A fresh process without TRITON_INTERPRET: CPU tensors take the PyTorch path, eager and compiled.
    code = """
import torch, tritongrad
from tritongrad import _runtime
assert not _runtime.INTERPRET
x = torch.randn(4, 3, 9, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(9, requires_grad=True)
y = tritongrad.weighted_sum(x, w)
assert y.dtype == torch.float32
y.backward(torch.ones_like(y))
torch.testing.assert_close(w.grad, x.detach().float().sum((0, 1)))
assert x.grad.dtype == torch.bfloat16
f = torch.compile(lambda x, w: tritongrad.weighted_sum(x, w).sum(), fullgraph=True)
gx, gw = torch.autograd.grad(f(x, w), (x, w))
torch.testing.assert_close(gw, w.grad)
torch.library.opcheck(torch.ops.tritongrad.weighted_sum.default, (x.detach().float(), w))
print("ok")
"""
    out = run_without_interpreter(["-c", code])
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_shape_comments_hold():
    # The reasons given in SHAPES rely on these launch decisions (4 "SMs" off the GPU, float32).
    assert ws_launch._fwd_config(2, 140000, 4, 4)[3] > 1      # (2, 140000): split-D forward ...
    assert ws_launch._fwd_config(2, 140000, 4, 4)[4] == 2 * ws_launch._fwd_config(2, 140000, 4, 4)[1]  # 2 steps
    assert ws_launch._bwd_config(300, 24, 4, 4)[3] > 1        # (300, 24): several grad_w partial rows
    assert ws_launch._bwd_config(1000, 8, 4, 4)[3] > 1        # determinism test goes through the partials
    assert 5 % ws_launch._fwd_config(5, 37, 4, 4)[0] != 0     # (5, 37): N not a multiple of the row tile
    BLOCK_N, BLOCK_D, _, _, rows_per_prog, _ = ws_launch._bwd_config(37, 1100, 4, 4)
    assert BLOCK_D == 1024 and rows_per_prog > BLOCK_N and 37 % BLOCK_N != 0  # (37, 1100)

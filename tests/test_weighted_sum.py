"""weighted_sum beyond the kit (tests/test_ops_kit.py): which launches serve which shapes, with their results;
bitwise reproducible grad_w; strided inputs read in place; upstream gradients of unusual strides; argument
errors; the module."""

import dataclasses

import pytest
import torch
from conftest import DEVICE, check_values, kernel_names

import tritongrad
from tritongrad import _runtime as rt
from tritongrad.ops.weighted_sum import plans as ws_plans
from tritongrad.ops.weighted_sum import weighted_sum
from tritongrad.testing import make_rows

H200 = rt.DeviceProps(132, 228 * 1024)
FWD, BWD, COLUMN_SUM = "_weighted_sum_fwd_kernel", "_weighted_sum_bwd_kernel", "_column_sum_kernel"


def eager(x, w):
    """What a user would write in plain PyTorch, in the inputs' own dtypes: the error baseline."""
    return (x * w).sum(-1)


def check(x, w):
    check_values(weighted_sum, x, w, baseline=eager)


def of(seen, kernel):
    return [launch for launch in seen if launch.kernel == kernel]


@pytest.fixture
def two_pass():
    """Large inputs of many rows take grad_x and grad_w in two launches (read-only, then write-only); the
    thresholds are lowered so that small inputs take that path."""
    with ws_plans.using(dataclasses.replace(ws_plans.TABLE, SPLIT_BWD_BYTES=0, SPLIT_BWD_ROWS=0)):
        yield


# ---------------------------------------------------------------- which launches serve which shapes
def test_forward_splits_long_rows_across_programs(launches, four_sms):
    # 16 rows of 33000 columns: 16 row tiles for 4 SMs, so each row is split across 2 programs, of 3 column
    # steps and of 2 (the last ragged), and column_sum adds each row's two partial sums in order.
    x, w = torch.randn(16, 33000, device=DEVICE), torch.randn(33000, device=DEVICE)
    check(x, w)
    (fwd,) = of(launches, FWD)
    d_per_split, block_d = fwd.args[9], fwd.kw["BLOCK_D"]
    assert fwd.grid == (16, 2) and d_per_split == 3 * block_d
    assert kernel_names(launches)[:2] == [FWD, COLUMN_SUM]


@pytest.mark.parametrize(
    "D,step",
    [
        (5120, 1024),  # one step of 8192 would mask 37.5% of its lanes: five exact steps of 1024 instead
        (2560, 512),   # the same at 16-bit tile widths: five steps of 512
        (3072, 4096),  # a quarter masked: one step
        (5000, 8192),  # no power of two of 512 or more divides 5000: one step
    ],
)
def test_forward_steps_over_exact_chunks(D, step, launches):
    # 3 rows: the interpreter walks five steps quickly.
    check(torch.randn(3, D, device=DEVICE), torch.randn(D, device=DEVICE))
    assert of(launches, FWD)[0].kw["BLOCK_D"] == step


@pytest.mark.parametrize(
    "needs,passes",
    [
        ((True, True), [(True, True)]),    # both gradients in one launch
        ((True, False), [(True, False)]),  # grad_x alone: the write-only launch, x not read
        ((False, True), [(False, True)]),  # grad_w alone: the read-only launch, no [N, D] output
    ],
    ids=str,
)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_backward_launches_what_is_asked(needs, passes, layout, launches):
    x = make_rows((300, 24), torch.float32, DEVICE, layout)
    w = torch.randn(24, device=DEVICE)
    xs, ws = (t.detach().requires_grad_(n) for t, n in zip((x, w), needs))
    g = torch.randn(300, device=DEVICE)
    got = torch.autograd.grad(weighted_sum(xs, ws), [t for t in (xs, ws) if t.requires_grad], g)
    assert [(s.kw["HAS_GX"], s.kw["HAS_GW"]) for s in of(launches, BWD)] == passes
    want = dict(zip("xw", (g[:, None] * w, g @ x)))
    for name, grad in zip([n for n, k in zip("xw", needs) if k], got):
        torch.testing.assert_close(grad, want[name], atol=1e-5, rtol=1e-5)


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
def test_two_pass_backward(shape, layout, dtype, two_pass, launches):
    check(make_rows(shape, dtype, DEVICE, layout), torch.randn(shape[-1], device=DEVICE).to(dtype))
    # The read-only pass first (it finds the tail of x still in L2 after the forward), then the write-only one.
    assert [(s.kw["HAS_GX"], s.kw["HAS_GW"]) for s in of(launches, BWD)] == [(False, True), (True, False)]


def test_few_rows_loop_over_row_steps(launches, four_sms):
    # 37 rows of 1100 columns: two column blocks of 1024 (the second mostly masked); each program loops over
    # its chunk of rows in several steps, and the last chunk is ragged.
    check(torch.randn(37, 1100, device=DEVICE), torch.randn(1100, device=DEVICE))
    (bwd,) = of(launches, BWD)
    rows_per_prog, block_n = bwd.args[13], bwd.kw["BLOCK_N"]
    assert bwd.grid[1] == 2 and bwd.kw["BLOCK_D"] == 1024
    assert rows_per_prog > block_n and 37 % rows_per_prog


@pytest.mark.parametrize("two_pass_bwd", [False, True], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("D,sx,want", [(24, 24, 8), (24, 28, 4), (20, 22, 2)], ids=str)
def test_rows_aligned_below_16(D, sx, want, two_pass_bwd, launches, request):
    # Row lengths and strides that are multiples of 8, 4 or 2 elements but not of 16: the kernels are told
    # the largest power of two dividing D and x's row stride (ALIGN, ops/_tl.aligned); one that does not
    # divide both would round it down in the kernel and misplace rows.
    if two_pass_bwd:
        request.getfixturevalue("two_pass")
    check(torch.randn(300, sx, device=DEVICE)[:, :D], torch.randn(D, device=DEVICE))
    row_kernels = [s for s in launches if s.kernel != COLUMN_SUM]
    assert {s.kernel for s in row_kernels} == {FWD, BWD}
    assert {s.kw["ALIGN"] for s in row_kernels} == {want}


@pytest.mark.parametrize("N,D", [(64, 2**23 + 128), (1, 2**27), (2**20, 2**26)])
def test_column_blocks_fit_the_grid(N, D):
    # Column blocks sit on the grid's second axis, which CUDA limits to 65535 blocks: the first shape needs
    # 65537 blocks of the usual 128 columns. Too large for the interpreter: the plans are checked alone.
    for elem in (2, 4, 8):
        for fused in (True, False):
            p = ws_plans.bwd_plan(N, D, elem, H200, fused)
            assert p.d_blocks <= 65535 and p.d_blocks * p.BLOCK_D >= D
        p = ws_plans.gx_plan(N, D, elem)
        assert p.d_blocks <= 65535 and p.d_blocks * p.BLOCK_D >= D


def test_grad_w_is_bitwise_deterministic(launches):
    # 1000 rows of D=8: several row chunks, so grad_w goes through the partial buffer and column_sum.
    x = torch.randn(1000, 8, device=DEVICE)
    w = torch.randn(8, device=DEVICE, requires_grad=True)
    g = torch.randn(1000, device=DEVICE)
    grads = [torch.autograd.grad(weighted_sum(x, w), w, g)[0] for _ in range(3)]
    assert of(launches, BWD)[0].grid[0] > 1 and COLUMN_SUM in kernel_names(launches)
    assert all(torch.equal(grads[0], gr) for gr in grads[1:])


# ---------------------------------------------------------------- strides
def test_strided_x_is_not_copied(launches):
    # A transposed 2-D x reaches both kernels as the same storage, read through its strides.
    x = make_rows((33, 16), torch.float32, DEVICE, "transposed").requires_grad_()
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    weighted_sum(x, w).backward(torch.randn(33, device=DEVICE))
    assert [(s.args[0].data_ptr(), s.args[0].stride()) for s in launches if s.kernel in (FWD, BWD)] == [
        (x.data_ptr(), x.stride())] * 2


# ---------------------------------------------------------------- argument errors
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


# ---------------------------------------------------------------- the module
def test_module_trains_and_exports():
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
    # torch.export records the registered op.
    ep = torch.export.export(m, (x,))
    assert "tritongrad.weighted_sum" in ep.graph_module.code
    torch.testing.assert_close(ep.module()(x), m(x))

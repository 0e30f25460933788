"""weighted_sum on a GPU: large sizes, torch.compile, CUDA graphs, export. Skipped without CUDA."""

import pytest
import torch
from conftest import ATOL

import tritongrad
from tritongrad.ops.weighted_sum import weighted_sum_reference
from tritongrad.testing import assert_close_earned, make_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def grads(f, x, w, g):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = f(x, w)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def eager(x, w):
    return (x * w).sum(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "shape,layout",
    [
        ((32768, 4096), "contiguous"),    # bandwidth regime
        ((131072, 1024), "contiguous"),   # many rows: many grad_w chunks
        ((16, 1048576), "contiguous"),    # few huge rows: split-D forward
        ((4194304, 32), "contiguous"),    # millions of tiny rows
        ((4, 999, 3001), "row-sliced"),   # odd sizes, 3-D, row stride != D
        ((2048, 2048), "transposed"),     # column-major x read in place
        ((64, 2**23 + 128), "contiguous"),  # more 128-column blocks than the grid's second axis holds
        ((2048, 13000), "contiguous"),    # rows of 8-element alignment (ALIGN hint)
        ((65536, 4100), "contiguous"),    # 4-element alignment; two-pass backward
    ],
    ids=str,
)
def test_large_low_precision(shape, layout, dtype):
    x = make_rows(shape, dtype, "cuda", layout)
    w = torch.randn(shape[-1], device="cuda", dtype=dtype)
    g = torch.randn(shape[:-1], device="cuda", dtype=dtype)
    y, gx, gw = grads(tritongrad.weighted_sum, x, w, g)
    y64, gx64, gw64 = grads(weighted_sum_reference, x.double(), w.double(), g.double())
    ye, gxe, gwe = grads(eager, x, w, g)
    n_rows = x.numel() // shape[-1]
    assert_close_earned("y", y, y64, ye, atol=ATOL[dtype] * shape[-1] ** 0.5)
    assert_close_earned("grad_x", gx, gx64, gxe, atol=ATOL[dtype])
    assert_close_earned("grad_w", gw, gw64, gwe, atol=ATOL[dtype] * n_rows**0.5)


@pytest.mark.parametrize(
    "shape",
    [
        (524289, 4096),      # N * D passes 2**31: two-pass backward (write-only grad_x, read-only grad_w)
        (64, 2**25 + 64),    # the same with few rows: one-launch backward, 1024-column blocks
    ],
    ids=str,
)
def test_int64_offsets(shape):
    # Element offsets pass 2**31 in the last rows, so they must be computed in int64. Rows are independent
    # for y and grad_x: the last rows are checked alone; grad_w against float64 sums taken in slices.
    N, D = shape
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(D, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    y, gx, gw = grads(tritongrad.weighted_sum, x, w, g)
    tail = x[-2:].double()
    torch.testing.assert_close(y[-2:].double(), weighted_sum_reference(tail, w.double()), atol=0.05 * D**0.5, rtol=0.02)
    torch.testing.assert_close(gx[-2:].double(), g[-2:, None].double() * w.double(), atol=2**-7, rtol=2**-7)
    gw64 = torch.zeros(D, device="cuda", dtype=torch.float64)
    step = max(1, 2**27 // D)  # rows per slice: 1 GB of float64
    for r in range(0, N, step):
        gw64 += g[r:r + step].double() @ x[r:r + step].double()
    torch.testing.assert_close(gw.double(), gw64, atol=0.05 * N**0.5, rtol=0.02)
    del x, gx


def test_grad_w_deterministic_large():
    x = torch.randn(131072, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(131072, device="cuda", dtype=torch.bfloat16)
    runs = [grads(tritongrad.weighted_sum, x, w, g)[2] for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(dynamic):
    f = torch.compile(lambda x, w: tritongrad.weighted_sum(x, w).float().sin(), fullgraph=True, dynamic=dynamic)
    for n in (64, 1000):  # a second shape recompiles (or reuses the dynamic graph)
        x = torch.randn(n, 3, 512, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(512, device="cuda", dtype=torch.float32)
        g = torch.randn(n, 3, device="cuda")
        got = grads(f, x, w, g)
        want = grads(lambda x, w: tritongrad.weighted_sum(x, w).float().sin(), x, w, g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_cuda_graph_capture():
    x = torch.randn(256, 1024, device="cuda", requires_grad=True)
    w = torch.randn(1024, device="cuda", requires_grad=True)
    g = torch.randn(256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compiles kernels) outside the capture
        for _ in range(2):
            x.grad = w.grad = None
            tritongrad.weighted_sum(x, w).backward(g)
    torch.cuda.current_stream().wait_stream(s)
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tritongrad.weighted_sum(x, w)
        y.backward(g)
    for _ in range(2):  # replay on fresh data
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            w.copy_(torch.randn_like(w))
            g.copy_(torch.randn_like(g))
        graph.replay()
        torch.cuda.synchronize()
        y_ref, gx_ref, gw_ref = grads(tritongrad.weighted_sum, x, w, g)
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(x.grad, gx_ref)
        torch.testing.assert_close(w.grad, gw_ref)


def test_compile_reduce_overhead():
    # torch.compile's CUDA-graph mode around the op, forward and backward.
    f = torch.compile(lambda x, w: tritongrad.weighted_sum(x, w), mode="reduce-overhead", fullgraph=True)
    w = torch.randn(256, device="cuda")
    for _ in range(3):
        x = torch.randn(128, 256, device="cuda")
        g = torch.randn(128, device="cuda")
        got = grads(f, x, w, g)
        want = grads(tritongrad.weighted_sum, x, w, g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_export_and_opcheck_cuda():
    m = tritongrad.nn.WeightedSum(300, device="cuda")
    x = torch.randn(8, 5, 300, device="cuda")
    ep = torch.export.export(m, (x,))
    assert "tritongrad.weighted_sum" in ep.graph_module.code
    torch.testing.assert_close(ep.module()(x), m(x))
    xr = x.requires_grad_()
    torch.library.opcheck(torch.ops.tritongrad.weighted_sum.default, (xr, m.weight))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_device_while_first_is_current():
    # Tensors on cuda:1 while cuda:0 is current: kernels must run on the tensors' device.
    torch.cuda.set_device(0)
    x = torch.randn(300, 257, device="cuda:1", requires_grad=True)
    w = torch.randn(257, device="cuda:1", requires_grad=True)
    g = torch.randn(300, device="cuda:1")
    y, gx, gw = grads(tritongrad.weighted_sum, x, w, g)
    ye, gxe, gwe = grads(eager, x, w, g)
    torch.testing.assert_close((y, gx, gw), (ye, gxe, gwe), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(32768, 4096), (131072, 1024)], ids=str)
def test_bf16_error_no_worse_than_eager(shape):
    # Products and sums stay in float32 until the final rounding, so y and grad_w are at least as accurate
    # as eager PyTorch's, which rounds every product to bfloat16. Compared as relative L2 error over
    # thousands of outputs: a max over few values would be decided by single roundings.
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16)
    g = torch.randn(shape[0], device="cuda", dtype=torch.bfloat16)
    y, _, gw = grads(tritongrad.weighted_sum, x, w, g)
    y64, _, gw64 = grads(weighted_sum_reference, x.double(), w.double(), g.double())
    ye, _, gwe = grads(eager, x, w, g)

    def rel(a, ref):
        return ((a.double() - ref).norm() / ref.norm()).item()

    assert rel(y, y64) <= rel(ye, y64), (rel(y, y64), rel(ye, y64))
    assert rel(gw, gw64) <= rel(gwe, gw64), (rel(gw, gw64), rel(gwe, gw64))

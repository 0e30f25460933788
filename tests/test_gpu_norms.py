"""rms_norm and layer_norm on a GPU: large sizes, long rows, torch.compile, CUDA graphs, export, opcheck,
determinism, patch() of a Hugging Face model. Skipped without CUDA."""

import pytest
import torch
import torch.nn.functional as F
from conftest import ATOL

import tritongrad
from tritongrad.ops.norm import layer_norm_reference, rms_norm_reference
from tritongrad.testing import assert_close_earned, make_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def eager_layer_norm(x, ns, w, b):
    """PyTorch's CUDA layer_norm wants weight and bias in x's dtype: cast them, as a user would."""
    return F.layer_norm(x, ns, w.to(x.dtype), b.to(x.dtype))


# name -> (tritongrad function, float64-capable reference, eager PyTorch (the error baseline), has a bias)
NORMS = {
    "rms_norm": (tritongrad.rms_norm, rms_norm_reference, F.rms_norm, False),
    "layer_norm": (tritongrad.layer_norm, layer_norm_reference, eager_layer_norm, True),
}


def grads(norm, fn, x, w, b, g):
    """(y, dx, dw, db) of ``fn`` (a norm over the last dim), fresh leaves each call."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    b = b.detach().requires_grad_() if b is not None else None
    y = fn(x, (x.shape[-1],), w, b) if NORMS[norm][3] else fn(x, (x.shape[-1],), w)
    y.backward(g)
    return y.detach(), x.grad, w.grad, (b.grad if b is not None else None)


def check(norm, x, w, b, g):
    fn, ref, eager, _ = NORMS[norm]
    got = grads(norm, fn, x, w, b, g)
    want = grads(norm, ref, x.double(), w.double(), b.double() if b is not None else None, g.double())
    base = grads(norm, eager, x, w, b, g)
    for name, a, r, e in zip(("y", "dx", "dw", "db"), got, want, base):
        if r is None:
            continue
        # A few ulps of the result's dtype at the result's magnitude on top of 2x eager's error.
        atol = ATOL[a.dtype] * max(1.0, r.abs().max().item())
        assert a.dtype == (x.dtype if name in ("y", "dx") else w.dtype)
        assert_close_earned(f"{norm} {name}", a, r, e, atol=atol)


def params(norm, D, dtype, device="cuda"):
    w = 1 + 0.5 * torch.randn(D, device=device, dtype=torch.float32)
    b = 0.5 * torch.randn(D, device=device, dtype=torch.float32) if NORMS[norm][3] else None
    return w.to(dtype), (b.to(dtype) if b is not None else None)


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize(
    "shape,dtype,wdtype,layout",
    [
        ((4096, 4096), torch.bfloat16, torch.bfloat16, "contiguous"),
        ((4096, 4096), torch.float16, torch.float16, "contiguous"),
        ((32768, 4096), torch.bfloat16, torch.bfloat16, "contiguous"),   # the bandwidth benchmark shape
        ((4096, 4096), torch.bfloat16, torch.float32, "contiguous"),     # mixed: bf16 activations, fp32 params
        ((1024, 8192), torch.float16, torch.float16, "contiguous"),      # longest backward register tile
        ((512, 16384), torch.bfloat16, torch.bfloat16, "contiguous"),    # fwd: longest register tile; bwd: long
                                                                         # rows (rms_norm), row-sum pass (layer_norm)
        ((2048, 12288), torch.bfloat16, torch.bfloat16, "contiguous"),   # one-kernel long-row backward, 3 chunks
        ((1000, 10000), torch.float32, torch.float32, "contiguous"),     # the same, float32, ragged last chunk
        ((264, 20480), torch.bfloat16, torch.bfloat16, "contiguous"),    # rms_norm: split long-row backward, 5
                                                                         # chunks in 2 programs; 2 rows per group
        ((300, 24576), torch.float32, torch.float32, "row-sliced"),      # the same, 6 chunks, groups of 2-3 rows
        ((700, 9000), torch.bfloat16, torch.float32, "row-sliced"),      # the same, mixed, row stride != D
        ((1024, 16384), torch.float16, torch.float16, "transposed"),     # long rows read with column stride N
        ((4, 65536), torch.bfloat16, torch.bfloat16, "contiguous"),      # few huge rows: column-split row passes
        ((16, 1048576), torch.bfloat16, torch.float32, "contiguous"),    # the benchmark's skinny shape, mixed
        ((4, 65536), torch.float32, torch.float32, "contiguous"),
        ((262144, 64), torch.bfloat16, torch.bfloat16, "contiguous"),    # many short rows per program step
        ((3, 999, 3001), torch.bfloat16, torch.float32, "row-sliced"),   # odd sizes, 3-D, row stride != D
        ((2048, 2048), torch.bfloat16, torch.bfloat16, "transposed"),    # column-major x read in place
        ((512, 13000), torch.bfloat16, torch.bfloat16, "contiguous"),    # rows of 8-element alignment (ALIGN hint):
                                                                         # long-row backward / row-sum pass
        ((1000, 6500), torch.float32, torch.float32, "contiguous"),      # 4-element alignment, register tiles
        ((264, 24008), torch.bfloat16, torch.bfloat16, "contiguous"),    # rms_norm: split long-row backward on
                                                                         # 16-byte aligned rows
        ((3000, 1536), torch.bfloat16, torch.bfloat16, "contiguous"),    # fwd: 3 chunks of 512 in parts; bwd: a
                                                                         # quarter of the tile masked, deeper pipeline
        ((2000, 5120), torch.float32, torch.float32, "contiguous"),      # fwd: 5 chunks of 1024 in parts, 8 warps
        ((2000, 5120), torch.bfloat16, torch.float32, "contiguous"),     # the same, mixed, 16-bit backward
        ((1000, 7168), torch.bfloat16, torch.bfloat16, "row-sliced"),    # fwd: 7 chunks in 3 parts, unaligned rows
        ((700, 5000), torch.float32, torch.float32, "contiguous"),       # layer_norm fwd: 8 warps, tile of 8192
    ],
    ids=str,
)
def test_large(norm, shape, dtype, wdtype, layout):
    x = make_rows(shape, dtype, "cuda", layout, scale=2.0)
    if norm == "layer_norm":
        x.add_(3)  # a non-zero mean, so that the mean subtraction matters (in place: keeps the layout)
    w, b = params(norm, shape[-1], wdtype)
    g = torch.randn(shape, device="cuda", dtype=dtype)
    check(norm, x, w, b, g)


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("shape", [(32769, 65536), (262145, 8192), (174763, 12288)], ids=str)
def test_int64_offsets(norm, shape):
    # N * D passes 2**31 elements: row offsets must be computed in int64 (chunked, register and long-row
    # paths).
    # Rows are independent, so the last rows are checked against the reference run on those rows alone.
    fn, ref, _, has_bias = NORMS[norm]
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w, b = params(norm, shape[-1], torch.bfloat16)
    args = (w, b) if has_bias else (w,)
    y = fn(x, (shape[-1],), *args)
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    tail = x.detach()[-3:].double().requires_grad_()
    y64 = ref(tail, (shape[-1],), *[a.double() for a in args])
    (dx64,) = torch.autograd.grad(y64, tail, g[-3:].double())
    torch.testing.assert_close(y[-3:].double(), y64, atol=0.05, rtol=0.02)
    torch.testing.assert_close(dx[-3:].double(), dx64, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("shape", [(32768, 1024), (8, 65536), (4096, 12288)], ids=str)
def test_param_grads_bitwise_deterministic(norm, shape):
    # (32768, 1024): 2 x SMs partial rows; (8, 65536): column-split backward of long rows; (4096, 12288):
    # the one-kernel long-row backward.
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w, b = params(norm, shape[-1], torch.float32)
    g = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    runs = [grads(norm, NORMS[norm][0], x, w, b, g) for _ in range(3)]
    for r in runs[1:]:
        for a, c in zip(r[1:], runs[0][1:]):
            assert a is None or torch.equal(a, c)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(dynamic):
    def f(x, w, b, rms=tritongrad.rms_norm, ln=tritongrad.layer_norm):
        return ln(rms(x, (512,), w), (512,), w, b).float().sin()

    fc = torch.compile(f, fullgraph=True, dynamic=dynamic)
    w = torch.randn(512, device="cuda", requires_grad=True)
    b = torch.randn(512, device="cuda", requires_grad=True)
    for n in (64, 1000):  # a second shape recompiles (or reuses the dynamic graph)
        x = torch.randn(n, 3, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(n, 3, 512, device="cuda")
        got = torch.autograd.grad(fc(x, w, b), (x, w, b), g)
        want = torch.autograd.grad(f(x, w, b), (x, w, b), g)
        args64 = [t.detach().double().requires_grad_() for t in (x, w, b)]
        ref = torch.autograd.grad(f(*args64, rms=torch.nn.functional.rms_norm, ln=torch.nn.functional.layer_norm),
                                  args64, g.double())
        # The same kernels run; Inductor computes sin and its gradient around them in fused float32, so the
        # gradients may differ from eager's by roundings: compiled must be as close to float64 as eager is.
        for name, a, c, r in zip(("x", "w", "b"), got, want, ref):
            assert_close_earned(f"grad {name} (dynamic={dynamic}, n={n})", a, r, c, 2.0, 2 ** -7 * r.abs().max().item())


def test_cuda_graph_capture():
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2048, device="cuda", requires_grad=True)
    b = torch.randn(2048, device="cuda", requires_grad=True)
    g = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)

    def step():
        y = tritongrad.layer_norm(tritongrad.rms_norm(x, (2048,), w), (2048,), w, b)
        y.backward(g)
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compiles kernels) outside the capture
        for _ in range(2):
            x.grad = w.grad = b.grad = None
            step()
    torch.cuda.current_stream().wait_stream(s)
    x.grad = w.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    for _ in range(2):  # replay on fresh data
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            w.copy_(torch.randn_like(w))
            b.copy_(torch.randn_like(b))
            g.copy_(torch.randn_like(g))
        graph.replay()
        torch.cuda.synchronize()
        xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
        y_ref = tritongrad.layer_norm(tritongrad.rms_norm(xs, (2048,), ws), (2048,), ws, bs)
        y_ref.backward(g)
        torch.testing.assert_close(y, y_ref.detach())
        torch.testing.assert_close(x.grad, xs.grad)
        torch.testing.assert_close(w.grad, ws.grad)
        torch.testing.assert_close(b.grad, bs.grad)


def test_compile_reduce_overhead():
    # torch.compile's CUDA-graph mode around the ops, forward and backward.
    f = torch.compile(lambda x, w: tritongrad.rms_norm(x, (256,), w), mode="reduce-overhead", fullgraph=True)
    w = torch.randn(256, device="cuda", requires_grad=True)
    for _ in range(3):
        x = torch.randn(128, 256, device="cuda", requires_grad=True)
        g = torch.randn(128, 256, device="cuda")
        got = torch.autograd.grad(f(x, w), (x, w), g)
        want = torch.autograd.grad(tritongrad.rms_norm(x, (256,), w), (x, w), g)
        for a, c in zip(got, want):
            torch.testing.assert_close(a, c)


@pytest.mark.parametrize(
    "module",
    [lambda: tritongrad.nn.RMSNorm(300, device="cuda"), lambda: tritongrad.nn.LayerNorm(300, device="cuda")],
    ids=["RMSNorm", "LayerNorm"],
)
def test_export_cuda(module):
    m = module()
    x = torch.randn(8, 5, 300, device="cuda")
    ep = torch.export.export(m, (x,))
    assert "tritongrad." in ep.graph_module.code and "_norm" in ep.graph_module.code
    torch.testing.assert_close(ep.module()(x), m(x))


def test_opcheck_cuda():
    x = torch.randn(5, 3, 300, device="cuda", requires_grad=True)
    w = torch.randn(300, device="cuda", requires_grad=True)
    b = torch.randn(300, device="cuda", requires_grad=True)
    g = torch.randn(5, 3, 300, device="cuda")
    ops = torch.ops.tritongrad
    torch.library.opcheck(ops.rms_norm.default, (x, [300], w, None, 0.0))
    torch.library.opcheck(ops.layer_norm.default, (x, [300], w, b, 1e-5))
    _, rstd = ops.rms_norm.default(x.detach(), [300], w.detach(), None, 0.0)
    _, mean, rstd_ln = ops.layer_norm.default(x.detach(), [300], w.detach(), b.detach(), 1e-5)
    test_utils = ("test_schema", "test_faketensor")
    # The backward ops take (gradient per output, saved tensors, non-tensor arguments, needs per tensor input).
    torch.library.opcheck(ops.rms_norm_backward.default, (g, x, w, rstd, [300], None, 0.0, [True, True]), test_utils=test_utils)
    torch.library.opcheck(
        ops.layer_norm_backward.default, (g, x, w, b, mean, rstd_ln, [300], 1e-5, [True, False, True]),
        test_utils=test_utils,
    )


def test_patch_llama_cuda():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    for wdtype in (torch.bfloat16, torch.float32):
        m = llama.LlamaRMSNorm(4096, eps=1e-6).to("cuda", wdtype)
        with torch.no_grad():
            m.weight.normal_(1.0, 0.2)
        x = torch.randn(2, 512, 4096, device="cuda", dtype=torch.bfloat16)
        want = m(x)
        assert tritongrad.patch(m).count == 1
        got = m(x)
        # Same dtype rule as Hugging Face's code (float32 weight -> float32 output); same values up to a
        # flipped rounding of xhat where the float32 sums differ in their last bit.
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)

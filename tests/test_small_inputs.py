"""Small inputs: PyTorch's own ops serve them (``tritongrad.set_small_input_threshold``).

On CPU: each op's native version computes the op's function (float64, against the reference), the
threshold's argument checks, that a call autograd records takes it only where it keeps no more for the
backward than the kernels, and that the interpreter keeps testing the kernels at every size. On a GPU:
which inputs take which path, accuracy against eager, reproducible weight gradients, CUDA graph capture
after a warm-up, torch.compile.
"""

import contextlib

import pytest
import torch
from conftest import ATOL, DEVICE

import tritongrad
from tritongrad import _pattern
from tritongrad import _runtime as rt
from tritongrad.ops.norm import (
    layer_norm_op, layer_norm_reference, llama_rms_norm, llama_rms_norm_reference, rms_norm_op, rms_norm_reference,
)
from tritongrad.ops.weighted_sum import weighted_sum, weighted_sum_reference
from tritongrad.testing import OpSuite, assert_close_earned

DEFAULT = _pattern.SMALL_INPUT_THRESHOLD


def _ws(x, p):
    return tritongrad.weighted_sum(x, p[0])


# name -> (public call, float64 reference with the same arguments, parameter tensors [D] it takes)
CASES = {
    "weighted_sum": (_ws, lambda x, p: weighted_sum_reference(x, p[0]), 1),
    "rms_norm": (lambda x, p: tritongrad.rms_norm(x, [x.shape[-1]], p[0]),
                 lambda x, p: rms_norm_reference(x, [x.shape[-1]], p[0]), 1),
    "rms_norm_no_weight": (lambda x, p: tritongrad.rms_norm(x, [x.shape[-1]]),
                           lambda x, p: rms_norm_reference(x, [x.shape[-1]]), 0),
    "layer_norm": (lambda x, p: tritongrad.layer_norm(x, [x.shape[-1]], p[0], p[1]),
                   lambda x, p: layer_norm_reference(x, [x.shape[-1]], p[0], p[1]), 2),
    "llama_rms_norm": (lambda x, p: llama_rms_norm(x, p[0], 1e-6),
                       lambda x, p: llama_rms_norm_reference(x, p[0], 1e-6), 1),
}


CASE_OP = {"weighted_sum": weighted_sum, "rms_norm": rms_norm_op, "rms_norm_no_weight": rms_norm_op,
           "layer_norm": layer_norm_op, "llama_rms_norm": llama_rms_norm}


@contextlib.contextmanager
def _spy(op):
    """Records, per call of ``op.native``, whether it took the call (did not decline)."""
    real, calls = op.native, []

    def native(*args):
        out = real(*args)
        calls.append(out is not NotImplemented)
        return out

    op.native = native
    try:
        yield calls
    finally:
        op.native = real


def _inputs(shape, n_params, dtype, device):
    x = torch.randn(shape, device=device, dtype=dtype)
    params = [(1 + 0.5 * torch.randn(shape[-1], device=device)).to(dtype) for _ in range(n_params)]
    return x, params


def _run(fn, x, params, g):
    """(y, grads of x and every parameter), from fresh leaves; and whether tritongrad's kernels ran."""
    leaves = [t.detach().requires_grad_() for t in (x, *params)]
    y = fn(leaves[0], leaves[1:])
    kernels = isinstance(y.grad_fn, torch.autograd.function.BackwardCFunction)
    y.backward(g)
    return [y.detach(), *[t.grad for t in leaves]], kernels


def test_threshold_argument_checks():
    prev = tritongrad.set_small_input_threshold(123)
    try:
        assert tritongrad.set_small_input_threshold(prev) == 123
        for bad in (-1, 2.5, "1"):
            with pytest.raises(ValueError, match="numel must be an int >= 0"):
                tritongrad.set_small_input_threshold(bad)
    finally:
        tritongrad.set_small_input_threshold(prev)


@pytest.mark.parametrize("name", list(CASES))
def test_native_versions_compute_the_op(name):
    # The native versions are plain PyTorch, so float64 on CPU checks their formulas (and the default eps of
    # rms_norm) against the references, values and gradients, to float64 rounding.
    _, ref, n = CASES[name]
    x, params = _inputs((3, 5, 48), n, torch.float64, "cpu")
    g = torch.randn((3, 5) if name == "weighted_sum" else (3, 5, 48), dtype=torch.float64)
    natives = {
        "weighted_sum": lambda x, p: weighted_sum.native(x, p[0]),
        "rms_norm": lambda x, p: rms_norm_op.native(x, [48], p[0], None),
        "rms_norm_no_weight": lambda x, p: rms_norm_op.native(x, [48], None, None),
        "layer_norm": lambda x, p: layer_norm_op.native(x, [48], p[0], p[1], 1e-5),
        "llama_rms_norm": lambda x, p: llama_rms_norm.native(x, p[0], 1e-6),
    }
    want, _ = _run(ref, x, params, g)
    if name.startswith("rms_norm"):
        # Off CUDA torch.rms_norm is composite and keeps float32 copies: a call autograd records is declined
        # (its gradients are checked on the GPU); the values here.
        with torch.no_grad():
            y = natives[name](x, params)
        leaf = x.detach().requires_grad_()
        assert natives[name](leaf, params) is NotImplemented
        torch.testing.assert_close(y, want[0], atol=1e-12, rtol=1e-12)
        return
    got, _ = _run(natives[name], x, params, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["weighted_sum", "rms_norm", "layer_norm", "llama_rms_norm"])
def test_native_versions_decline_long_rows(name):
    # PyTorch's norms give each row to one block, and its matrix-vector product of one long row is slow:
    # long rows stay with the kernels.
    native = {
        "weighted_sum": lambda x, w: weighted_sum.native(x, w),
        "rms_norm": lambda x, w: rms_norm_op.native(x, [x.shape[-1]], w, None),
        "layer_norm": lambda x, w: layer_norm_op.native(x, [x.shape[-1]], w, None, 1e-5),
        "llama_rms_norm": lambda x, w: llama_rms_norm.native(x, w, 1e-6),
    }[name]
    for D, declined in ((rt.NATIVE_MAX_D, False), (rt.NATIVE_MAX_D + 1, True)):
        out = native(torch.randn(1, D, dtype=torch.float64), torch.ones(D, dtype=torch.float64))
        assert (out is NotImplemented) == declined, D


def _bad_calls():
    from test_norms import BAD_INPUTS as norm_bad
    from test_weighted_sum import BAD_INPUTS as ws_bad

    calls = [pytest.param(make, exc, match, id=f"norms-{i}") for i, (make, exc, match) in enumerate(norm_bad)]
    calls += [pytest.param(lambda make=make: tritongrad.weighted_sum(*make()), exc, match, id=f"weighted_sum-{i}")
              for i, (make, exc, match) in enumerate(ws_bad)]
    return calls


@pytest.fixture
def small_path_on_cpu():
    # The small-input path runs before tritongrad's argument checks and leaves most of them to PyTorch's
    # ops (_pattern, ``native``). Opened to CPU tensors, every bad input of the other test modules must still
    # get tritongrad's error, not PyTorch's and not a result.
    with _pattern.SMALL.on_cpu():
        tritongrad.set_small_input_threshold(DEFAULT)
        yield


def test_small_path_serves_cpu_tensors_when_opened(small_path_on_cpu):
    # What makes the next test meaningful: good inputs of the same kinds do take the path here. With inputs
    # that require grad, only ops declared native_grad (the others' kernels keep less for the backward), and
    # of those not rms_norm, whose torch.rms_norm is composite off CUDA.
    with_grad = {"weighted_sum": True, "layer_norm": True}
    for name, (fn, _, n) in CASES.items():
        x, params = _inputs((3, 4), n, torch.float32, "cpu")
        with _spy(CASE_OP[name]) as calls, torch.no_grad():
            fn(x, params)
        assert calls == [True], name
        with _spy(CASE_OP[name]) as calls:
            _run(fn, x, params, torch.randn((3,) if name == "weighted_sum" else (3, 4)))
        assert any(calls) == with_grad.get(name, False), (name, calls)
        assert not calls or CASE_OP[name].native_grad, name  # declined before native is asked


@pytest.mark.parametrize("make,exc,match", _bad_calls())
def test_small_path_gives_tritongrads_errors(small_path_on_cpu, make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter runs on CPU")
def test_interpreter_runs_the_kernels_at_every_size():
    # The threshold applies to CUDA tensors only: the CPU suite tests the kernels whatever it is set to.
    tritongrad.set_small_input_threshold(1 << 30)
    fn, _, n = CASES["layer_norm"]
    x, params = _inputs((4, 64), n, torch.float32, "cpu")
    _, kernels = _run(fn, x, params, torch.randn(4, 64))
    assert kernels


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("shape", [(4, 64), (2, 8, 512), (DEFAULT // 1024, 1024)], ids=str)  # tiny, 3-D, at the threshold
def test_small_cuda_inputs_run_pytorch(name, shape, dtype):
    tritongrad.set_small_input_threshold(DEFAULT)
    fn, ref, n = CASES[name]
    x, params = _inputs(shape, n, dtype, "cuda")
    assert x.numel() <= DEFAULT
    g = torch.randn(shape[:-1] if name == "weighted_sum" else shape, device="cuda", dtype=dtype)
    got, kernels = _run(fn, x, params, g)
    assert kernels != CASE_OP[name].native_grad
    if not CASE_OP[name].native_grad:  # the path serves calls without gradients: their values
        with _spy(CASE_OP[name]) as calls, torch.no_grad():
            got = [fn(x, params)]
        assert calls == [True]
    want, _ = _run(ref, x.double(), [p.double() for p in params], g.double())
    tritongrad.set_small_input_threshold(0)
    base, kernels = _run(fn, x, params, g)  # the kernels' error is the bar: the native path must match it
    assert kernels
    D = shape[-1]
    for what, a, r, b in zip(("y", "dx", "dw", "db"), got, want, base):
        assert a.dtype == b.dtype
        assert_close_earned(f"{name} {what}", a, r, b, atol=ATOL[dtype] * D**0.5 * max(1.0, r.abs().max().item()))
    # Reproducible weight gradients on this path too.
    tritongrad.set_small_input_threshold(DEFAULT)
    again, _ = _run(fn, x, params, g)
    for a, b in zip(got[2:], again[2:]):
        assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize(
    "case",
    [
        "above the threshold",   # numel = threshold + one row
        "mixed dtypes",          # bfloat16 x, float32 parameters: tritongrad's mixed-precision semantics
        "transposed x",          # not contiguous: the kernels read it in place, return a contiguous y
        "long rows",             # one row longer than NATIVE_MAX_D
        "empty",                 # no rows: the kernels' launchers handle N = 0 themselves
        "autocast",              # PyTorch's ops would change dtypes under autocast; the kernels keep x's (above
                                 # the threshold: an op declared to cast to float32 under autocast may then take
                                 # the native path, which gives the same float32 result)
    ],
)
@pytest.mark.parametrize("name", list(CASES))
def test_other_inputs_run_the_kernels(name, case):
    tritongrad.set_small_input_threshold(DEFAULT)
    fn, _, n = CASES[name]
    shape, dtype, pdtype = (DEFAULT // 64 + 1, 64), torch.bfloat16, torch.bfloat16
    if case == "mixed dtypes":
        if n == 0:
            pytest.skip("no parameter tensor to differ in dtype")
        shape, pdtype = (4, 64), torch.float32
    if case == "long rows":
        shape = (1, rt.NATIVE_MAX_D * 2)
    if case == "empty":
        shape = (0, 64)
    x, params = _inputs(shape, n, dtype, "cuda")
    params = [p.to(pdtype) for p in params]
    if case == "transposed x":
        x = torch.randn(64, 4, device="cuda", dtype=dtype).t()
    g = torch.randn(x.shape[:-1] if name == "weighted_sum" else x.shape, device="cuda", dtype=dtype)
    if case == "autocast":
        x, params, g = x.float(), [p.float() for p in params], g.float()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=case == "autocast"):
        (y, *_), kernels = _run(fn, x, params, g)
    assert kernels
    if case == "autocast":
        assert y.dtype == torch.float32  # PyTorch's matmul would give bfloat16 here


@gpu
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_graph_after_warmup(name):
    # The path depends on the inputs alone: capture replays what the warm-up ran, and loads no Triton
    # kernel mid-capture (which CUDA forbids).
    tritongrad.set_small_input_threshold(DEFAULT)
    fn, _, n = CASES[name]
    x, params = _inputs((8, 256), n, torch.bfloat16, "cuda")
    leaves = [t.detach().requires_grad_() for t in (x, *params)]
    g = torch.randn((8,) if name == "weighted_sum" else (8, 256), device="cuda", dtype=torch.bfloat16)

    def step():
        for t in leaves:
            t.grad = None
        y = fn(leaves[0], leaves[1:])
        y.backward(g)
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    want_y = y.detach().clone()
    with torch.no_grad():
        leaves[0].copy_(torch.randn_like(leaves[0]))
    graph.replay()
    torch.cuda.synchronize()
    fresh, _ = _run(fn, leaves[0].detach(), [t.detach() for t in leaves[1:]], g)
    assert not torch.equal(y, want_y)  # the replay computed the new x
    torch.testing.assert_close(y.detach(), fresh[0])
    for t, want in zip(leaves, fresh[1:]):
        torch.testing.assert_close(t.grad, want)


@gpu
@pytest.mark.parametrize("name", list(CASES))
def test_small_cuda_inputs_on_two_devices(name):
    # A parameter on the CPU with a small CUDA x: tritongrad's device message, from either path.
    tritongrad.set_small_input_threshold(DEFAULT)
    fn, _, n = CASES[name]
    if n == 0:
        pytest.skip("no parameter tensor")
    x, params = _inputs((4, 64), n, torch.float32, "cuda")
    with pytest.raises(ValueError, match="all tensors must be on one device.*cuda:0.*cpu"):
        fn(x, [params[0].cpu(), *params[1:]])


@gpu
def test_compile_traces_the_registered_op_at_small_sizes():
    tritongrad.set_small_input_threshold(DEFAULT)
    # Under torch.compile the graph holds tritongrad's op whatever the size; no graph break.
    x, (w, b) = _inputs((4, 64), 2, torch.float32, "cuda")
    torch._dynamo.reset()
    traced = []

    def backend(gm, inputs):
        traced.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    y = torch.compile(lambda x, w, b: tritongrad.layer_norm(x, [64], w, b), fullgraph=True, backend=backend)(x, w, b)
    assert any("tritongrad.layer_norm" in t for t in traced), traced
    want = layer_norm_reference(x.double(), [64], w.double(), b.double())
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)


def _native_sample(name):
    n = CASES[name][2]

    def sample(dtype, device):
        x, params = _inputs((3, 5, 48), n, dtype, device)
        return {
            "weighted_sum": lambda: (x, params[0]),
            "rms_norm": lambda: (x, [48], params[0], None),
            "layer_norm": lambda: (x, [48], params[0], params[1], 1e-5),
            "llama_rms_norm": lambda: (x, params[0], 1e-6),
        }[name]()

    return sample


NATIVE_OPS = {"weighted_sum": weighted_sum, "rms_norm": rms_norm_op, "layer_norm": layer_norm_op,
              "llama_rms_norm": llama_rms_norm}


def test_every_native_op_is_checked_for_memory():
    have = {o.qualname for o in _pattern._OPS.values() if o.native is not None and o.namespace == "tritongrad"}
    assert have == {o.qualname for o in NATIVE_OPS.values()}


@pytest.mark.parametrize("name", list(NATIVE_OPS))
def test_small_path_keeps_no_more_for_the_backward_than_the_kernels(name):
    # Hugging Face's RMSNorm ops keep a float32 copy of x for their backward, three times the kernels' bytes
    # in bfloat16 (a per-head k_norm of 2**22 elements in every layer): calls autograd records take the
    # kernels unless the op declares native_grad, and the kit checks each declaration.
    op, sample = NATIVE_OPS[name], _native_sample(name)
    OpSuite(op, [sample], device=DEVICE).check_native_memory(sample)

"""The test kit (``tritongrad.testing.OpSuite``) applied to every op: values and gradients against float64 in
every dtype, memory layouts with NaN guard bands, leading dims, mixed precision, needs_input_grad, no_grad,
repeated and accumulated backwards, torch.func transforms, gradcheck, opcheck and torch.compile, every case
on every sample; then the kit against 13 bugs planted in a user's op. What is special to one family (launch
paths, determinism, modules) is in its own file.

Each sample says why it is in the grid. Shapes are small: through Triton's interpreter a larger shape proves
nothing more unless it changes the launch plan, and the plans' paths (rows read in chunks, the long-row
backward, ...) are tested in the family files, at full size and with shrunken tiles.
"""

import pytest
import torch
from conftest import DEVICE, import_example

import tritongrad
from tritongrad.ops.norm import layer_norm_op, llama_rms_norm, rms_norm_op
from tritongrad.ops.weighted_sum import weighted_sum
from tritongrad.testing import OpSuite

softcap = import_example("softcap").softcap


def randn(*shape, dtype, device, scale=1.0, shift=0.0):
    return (scale * torch.randn(shape, device=device) + shift).to(dtype)


def weight(*shape, dtype, device):
    """A norm weight around 1, so that the output keeps the normalised magnitudes."""
    return randn(*shape, dtype=dtype, device=device, scale=0.5, shift=1.0)


# ---------------------------------------------------------------- weighted_sum: y = (x * w).sum(-1)
def ws_sample(lead, D):
    def make(dtype, device):
        return randn(*lead, D, dtype=dtype, device=device), randn(D, dtype=dtype, device=device)

    make.__name__ = "x".join(map(str, (*lead, D)))
    return make


WS_SAMPLES = [
    ws_sample((5,), 37),        # D not a power of two, N not a multiple of the row tile: both masks active
    ws_sample((1,), 1),         # smallest: one program, one element
    ws_sample((3,), 1500),      # few rows: backward column blocks of 1024 that loop over row steps, one masked
    ws_sample((300,), 24),      # many row tiles: grad_w through several partial rows and column_sum
    ws_sample((2,), 9000),      # rows longer than the forward's tile (8192): D split across programs
    ws_sample((2, 3), 20),      # 3-D x: leading dims flattened into rows without a copy (4-D: the same path)
    ws_sample((2, 0), 8),       # no rows (a size-0 leading dim): y empty, grad_w zeros
    ws_sample((4,), 0),         # rows of no columns: y zeros, grad_w empty
]


def ws_eager(x, w):
    """What a user writes in plain PyTorch, in the inputs' own dtypes (products rounded): the error baseline."""
    return (x * w).sum(-1)


# ---------------------------------------------------------------- the norms
def norm_sample(lead, ns, *, affine=("weight",), eps=None, scale=2.0, shift=0.0, name=None, swap=None,
                offset=None):
    """Arguments of rms_norm_op / layer_norm_op: x [*lead, *ns], the parameters named in ``affine`` (the others
    None), ``eps`` (None: the op's default); ``swap``: two leading dims of x transposed (a view, made as the
    transpose of a dense tensor)."""

    def make(dtype, device):
        shape = list(lead)
        if swap is not None:
            shape[swap[0]], shape[swap[1]] = shape[swap[1]], shape[swap[0]]
        x = randn(*shape, *ns, dtype=dtype, device=device, scale=scale, shift=shift)
        args = {"input": x if swap is None else x.transpose(*swap), "normalized_shape": list(ns)}
        if "weight" in affine:
            args["weight"] = weight(*ns, dtype=dtype, device=device)
        if "bias" in affine:
            args["bias"] = randn(*ns, dtype=dtype, device=device, scale=0.5)
        if eps is not None:
            args["eps"] = eps
        if offset is not None:
            args["weight_offset"] = offset
        return args

    make.__name__ = name or "x".join(map(str, (*lead, *ns)))
    return make


def rms_samples(affine):
    return [
        norm_sample((5,), (37,), affine=affine),      # D not a power of two, N not a multiple of the row tile
        norm_sample((1,), (64,), affine=affine),      # one row
        norm_sample((130,), (24,), affine=affine),    # several row chunks (tiles of 64 or 128 rows): dw/db through
                                                      # the partial buffer and column_sum
        norm_sample((2, 3), (4, 6), affine=affine),   # two normalised dims (weight [4, 6]), two leading dims
        norm_sample((2, 3, 5), (16,), affine=affine, swap=(1, 2), name="heads-transposed"),  # [B, T, H, D]
                                                      # viewed as [B, H, T, D]: rows in memory order, in place
        norm_sample((4,), (16,), affine=affine, scale=1e-3, eps=1e-4, name="eps-dominates"),  # eps > mean
                                                      # square: a dropped or misplaced eps fails
        norm_sample((7,), (45,), affine=(), name="no-affine"),  # no weight (nor bias)
        norm_sample((2, 0), (8,), affine=affine),     # no rows (a size-0 leading dim): dw/db zeros
        norm_sample((4,), (0,), affine=affine),       # rows of no columns: everything empty
    ]


RMS_SAMPLES = rms_samples(("weight",)) + [
    norm_sample((6,), (40,), scale=2.0, offset=1.0, name="weight-offset"),  # Gemma's xhat * (1 + w)
]
# layer_norm: rows with a mean far from 0, so that a mean subtraction that is off shows.
LN_SAMPLES = [norm_sample((5,), (37,), affine=("weight", "bias"), shift=1.5)] + [
    norm_sample((7,), (45,), affine=a, shift=1.5, name=f"{'-'.join(a)}-only") for a in (("weight",), ("bias",))
] + rms_samples(("weight", "bias"))[1:]


def llama_sample(lead, D, swap=None):
    def make(dtype, device):
        shape = list(lead)
        if swap is not None:
            shape[swap[0]], shape[swap[1]] = shape[swap[1]], shape[swap[0]]
        x = randn(*shape, D, dtype=dtype, device=device, scale=2.0)
        return (x if swap is None else x.transpose(*swap)), weight(D, dtype=dtype, device=device), 1e-6

    make.__name__ = "x".join(map(str, (*lead, D)))
    return make


LLAMA_SAMPLES = [
    llama_sample((5,), 37),     # both masks
    llama_sample((6,), 1280),   # the parted forward: 5 chunks of 256 columns
    llama_sample((2, 3), 20),   # 3-D x
    llama_sample((2, 3, 5), 16, swap=(1, 2)),  # a per-head norm after the heads' transpose (Gemma 3's q_norm)
]


# ---------------------------------------------------------------- the example: softcap, y = cap * tanh(x / cap)
def softcap_small(dtype, device):
    # one block of 1024 elements, mostly masked
    return {"x": randn(7, 33, dtype=dtype, device=device, scale=8.0), "cap": 5.0}


def softcap_blocks(dtype, device):
    # three blocks, the last one ragged; 3-D; the default cap
    return {"x": randn(3, 2, 500, dtype=dtype, device=device, scale=40.0)}


def softcap_eager(x, cap=30.0):
    """What Gemma 2's modeling code writes, in x's dtype: torch.tanh's backward, like the op's, works from the
    saved output, so near saturation 1 - t^2 carries the output's rounding (the error baseline)."""
    return cap * torch.tanh(x / cap)


def softcap_saturated(dtype, device):
    # |x| / cap up to ~100: tanh saturates, and its exp must not overflow; gradients vanish
    return {"x": randn(4, 50, dtype=dtype, device=device, scale=50.0), "cap": 0.5}


# ---------------------------------------------------------------- fused_add_rms_norm: (norm(x + r), x + r)
def add_norm_sample(lead, D, scale=1.0, **norm):
    def make(dtype, device):
        return dict(x=randn(*lead, D, dtype=dtype, device=device, scale=scale),
                    residual=randn(*lead, D, dtype=dtype, device=device), weight=weight(D, dtype=dtype, device=device),
                    eps=1e-6, **norm)

    make.__name__ = "x".join(map(str, (*lead, D))) + "".join(
        f"_{k}{v}" for k, v in norm.items()).replace("cast_before_weightFalse", "_f32")
    return make


GEMMA = dict(weight_offset=1.0, cast_before_weight=False)  # Gemma's norm: (xhat * (1 + w)) in float32
ADD_NORM_SAMPLES = [
    add_norm_sample((5,), 37),      # one tile, ragged columns
    add_norm_sample((70,), 24),     # rows over several tiles and backward programs (dw partials)
    add_norm_sample((2, 3), 20, scale=4.0),    # 3-D
    add_norm_sample((3,), 8200),    # longer than one tile: the add, then llama_rms_norm's kernels
    add_norm_sample((70,), 24, **GEMMA),        # the product in float32, with the offset
    add_norm_sample((5,), 37, cast_before_weight=False),  # Olmo2's: the product in float32, no offset
    add_norm_sample((3,), 8200, **GEMMA),       # longer than one tile: the add, then rms_norm's kernels
]


SUITES = {
    "weighted_sum": OpSuite(weighted_sum, WS_SAMPLES, baseline=ws_eager, leading=("x",), mixed=True),
    "rms_norm": OpSuite(rms_norm_op, RMS_SAMPLES, leading=("input",), mixed=True),
    "layer_norm": OpSuite(layer_norm_op, LN_SAMPLES, leading=("input",), mixed=True),
    "llama_rms_norm": OpSuite(llama_rms_norm, LLAMA_SAMPLES, leading=("hidden_states",), mixed=True),
    "fused_add_rms_norm": OpSuite(tritongrad.fused_add_rms_norm, ADD_NORM_SAMPLES, leading=("x", "residual")),
    "softcap": OpSuite(softcap, [softcap_small, softcap_blocks, softcap_saturated], baseline=softcap_eager,
                       leading=("x",)),
}

test_weighted_sum = SUITES["weighted_sum"].pytest()
test_rms_norm = SUITES["rms_norm"].pytest()
test_layer_norm = SUITES["layer_norm"].pytest()
test_llama_rms_norm = SUITES["llama_rms_norm"].pytest()
test_fused_add_rms_norm = SUITES["fused_add_rms_norm"].pytest()
test_softcap = SUITES["softcap"].pytest()


# ---------------------------------------------------------------- beyond the kit's one mixed case
def with_param_dtype(sample, dtype):
    """``sample`` with every floating tensor after the first (the parameters) cast to ``dtype``."""

    def make(x_dtype, device):
        args = sample(x_dtype, device)
        items = args.items() if isinstance(args, dict) else enumerate(args)
        floats = [k for k, a in items if isinstance(a, torch.Tensor) and a.is_floating_point()]
        cast = {k: args[k].to(dtype) for k in floats[1:]}
        if isinstance(args, dict):
            return {**args, **cast}
        return tuple(cast.get(i, a) for i, a in enumerate(args))

    return make


bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@pytest.mark.parametrize(
    "op,x_dtype,param_dtype",
    [
        # weighted_sum: y in the promoted dtype, each gradient in its own input's dtype
        ("weighted_sum", f16, bf16),   # promotes to float32
        ("weighted_sum", f32, f64),    # promotes to float64: float64 accumulation
        ("weighted_sum", bf16, f64),   # float64 accumulation, grad_x stored to bfloat16
        # the norms: y in x's dtype whatever the parameters' (as torch.nn.functional)
        ("rms_norm", f16, f32),        # float16 rows with float32 parameters (the kit's mixed case is bfloat16)
        ("rms_norm", f32, bf16),       # 16-bit parameters of float32 rows: dw rounded to bfloat16
        ("rms_norm", bf16, f64),       # float64 statistics stored to bfloat16 (through float32)
        ("layer_norm", f16, f32),      # as rms_norm's, with a bias beside the weight
        ("layer_norm", f32, bf16),     # dw and db rounded to bfloat16, side by side in one partial buffer
        ("layer_norm", f32, f64),      # float64 statistics for float32 rows, y still float32
        ("layer_norm", bf16, f64),     # float64 statistics stored to bfloat16 (through float32)
        ("llama_rms_norm", f16, f32),  # y promoted to float32, xhat rounded to float16 first
        ("llama_rms_norm", f32, bf16),  # y stays float32; dw sums in float32, rounded to bfloat16
    ],
    ids=str,
)
def test_parameter_dtypes(op, x_dtype, param_dtype):
    suite = SUITES[op]
    suite.check_values(with_param_dtype(suite.samples[0], param_dtype), x_dtype)


def _arguments(suite, sample, device) -> list:
    """The sample's arguments bound to the op's parameters, defaults filled in."""
    made = sample(torch.float32, device)
    return list(suite.op.bind((), made) if isinstance(made, dict) else suite.op.bind(tuple(made), {}))


@pytest.mark.parametrize("op", list(SUITES))
def test_double_backward_is_refused(op):
    # A gradient penalty through an op whose launchers autograd cannot see would silently lose terms.
    suite = SUITES[op]
    args = _arguments(suite, suite.samples[0], DEVICE)
    x = args[suite.op.tensor_positions[0]].requires_grad_()
    out = suite.op(*args)
    out = out[0] if isinstance(out, tuple) else out
    with pytest.raises(RuntimeError, match=f"{suite.op.label}: double backward"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)


@pytest.mark.parametrize("call,match", [
    (lambda x, w: llama_rms_norm(x, w, None), r"tritongrad.llama_rms_norm: eps must be a float, got None"),
    (lambda x, w: llama_rms_norm(x, w, "1e-6"), r"tritongrad.llama_rms_norm: eps must be a float, got '1e-6'"),
    (lambda x, w: llama_rms_norm(x, w, eps=True), r"tritongrad.llama_rms_norm: eps must be a float, got True"),
    (lambda x, w: tritongrad.rms_norm(x, 8, w, eps=[1e-6]),
     r"tritongrad.rms_norm: eps must be a float or None, got \[1e-06\]"),
    (lambda x, w: tritongrad.layer_norm(x, 8, w, eps=None), r"tritongrad.layer_norm: eps must be a float, got None"),
    (lambda x, w: tritongrad.rms_norm(x, 8.0, w),
     r"tritongrad.rms_norm: normalized_shape must be an int or a sequence of ints, got 8.0"),
    (lambda x, w: tritongrad.layer_norm(x, None, w),
     r"tritongrad.layer_norm: normalized_shape must be an int or a sequence of ints, got None"),
    (lambda x, w: tritongrad.layer_norm(x, "8", w),
     r"tritongrad.layer_norm: normalized_shape must be an int or a sequence of ints, got '8'"),
], ids=["llama-eps-None", "llama-eps-str", "llama-eps-bool", "rms-eps-list", "ln-eps-None", "rms-shape-float",
        "ln-shape-None", "ln-shape-str"])
def test_norm_argument_errors(call, match):
    # A wrong eps or normalized_shape is a TypeError naming the op, the argument and its value (not an error
    # from inside a kernel launch).
    x, w = torch.randn(3, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    with pytest.raises(TypeError, match=match):
        call(x, w)


# ---------------------------------------------------------------- the kit against planted bugs
# A user's op with a weight gradient, y = a * tanh(x / a) * g (g [D], its gradient summed over rows), written
# once with 13 bugs that can be switched on one at a time. The kit alone, on the samples writing-an-op.md
# recommends (a ragged tile, rows over several row tiles, 3-D x), must catch them.
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BUGS = ("scale", "strides", "load_mask", "store_mask", "bf16_math", "alias_input", "out_dtype", "first_chunk",
        "masked_other", "dy_layout", "mutates_saved", "needs_grad", "shared_grad")
_CODE = {b: i + 1 for i, b in enumerate(BUGS)}


@triton.jit
def _tanh(u):
    e = tl.exp(-2.0 * tl.abs(u))  # no overflow
    return tl.where(u < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)


@triton.jit
def _math(v, ref, BUG: tl.constexpr):
    # bug bf16_math (5): every intermediate rounded to the input's 16-bit dtype
    if BUG == 5 and (ref.dtype == tl.bfloat16 or ref.dtype == tl.float16):
        v = v.to(ref.dtype).to(tl.float32)
    return v


@triton.jit
def _tanhw_fwd(x_ptr, g_ptr, y_ptr, N, D, sxn, sxd, sg, a, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BUG: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = (rows[:, None] < N) & (cols[None, :] < D)
    if BUG == 2:  # strides: x read as if contiguous
        offs = rows[:, None] * D + cols[None, :]
    else:
        offs = rows[:, None] * sxn + cols[None, :] * sxd
    if BUG == 3:  # load_mask: x read unmasked
        xr = tl.load(x_ptr + offs)
    else:
        xr = tl.load(x_ptr + offs, mask=m, other=0.0)
    x = xr.to(tl.float64 if xr.dtype == tl.float64 else tl.float32)
    g = tl.load(g_ptr + cols * sg, mask=cols < D, other=0.0).to(x.dtype)
    a = tl.cast(a, x.dtype)
    t = _math(_tanh(_math(x / a, xr, BUG)), xr, BUG)
    y = _math(a * t, xr, BUG) * g
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _tanhw_bwd(x_ptr, g_ptr, dy_ptr, dx_ptr, dg_ptr, N, D, sxn, sxd, sg, sdn, sdd, a, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, BUG: tl.constexpr):
    # One program per column block, over all rows: dx = dy g (1 - t^2), dg = sum_rows dy a t.
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < D
    # the comparison inline: assigned to a name, compiled Triton makes it a tensor, not a constexpr
    g = tl.load(g_ptr + cols * sg, mask=cm, other=0.0).to(tl.float64 if x_ptr.dtype.element_ty == tl.float64
                                                          else tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=g.dtype)
    other = 1.0 if BUG == 9 else 0.0  # masked_other: masked-off rows read as 1, not 0
    steps = 1 if BUG == 8 else tl.cdiv(N, BLOCK_N)  # first_chunk: only the first row tile is summed
    for i in range(0, steps):
        rows = i * BLOCK_N + tl.arange(0, BLOCK_N)
        m = (rows[:, None] < N) & cm[None, :]
        xr = tl.load(x_ptr + rows[:, None] * sxn + cols[None, :] * sxd, mask=m, other=other)
        if BUG == 10:  # dy_layout: dy read as if contiguous
            dy = tl.load(dy_ptr + rows[:, None] * D + cols[None, :], mask=m, other=other).to(g.dtype)
        else:
            dy = tl.load(dy_ptr + rows[:, None] * sdn + cols[None, :] * sdd, mask=m, other=other).to(g.dtype)
        x = xr.to(g.dtype)
        aa = tl.cast(a, g.dtype)
        t = _math(_tanh(_math(x / aa, xr, BUG)), xr, BUG)
        dx = dy * g[None, :] * (1.0 - t * t)
        if BUG == 1:  # scale: dx off by a factor a
            dx = dx * aa
        if BUG == 4:  # store_mask: dx stored unmasked
            tl.store(dx_ptr + rows[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty))
        else:
            tl.store(dx_ptr + rows[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
        acc = _math(acc + tl.sum(_math(dy * aa * t, xr, BUG), axis=0), xr, BUG)
    tl.store(dg_ptr + cols, acc.to(dg_ptr.dtype.element_ty), mask=cm)


fwd_kernel, bwd_kernel = tritongrad.kernel(_tanhw_fwd), tritongrad.kernel(_tanhw_bwd)
TILE_N, TILE_D = 16, 32


def tanhw_reference(x: torch.Tensor, g: torch.Tensor, a: float = 2.0) -> torch.Tensor:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (a * torch.tanh(x.to(acc) / a) * g.to(acc)).to(x.dtype)


def declare_tanhw(bug: str | None):
    code = _CODE.get(bug, 0)
    shared = {}

    def forward(x: torch.Tensor, g: torch.Tensor, a: float = 2.0) -> torch.Tensor:
        D = x.shape[-1]
        x2 = x.reshape(-1, D)
        N = x2.shape[0]
        if bug == "alias_input":  # writes y over x
            y = x2
        else:
            y = torch.empty((N, D), dtype=torch.float32 if bug == "out_dtype" else x.dtype, device=x.device)
        if N and D:
            fwd_kernel[(triton.cdiv(N, TILE_N), triton.cdiv(D, TILE_D))](
                x2, g, y, N, D, x2.stride(0), x2.stride(1), g.stride(0), a, BLOCK_N=TILE_N, BLOCK_D=TILE_D, BUG=code)
        return y.view(x.shape)

    op = tritongrad.op(f"kitbugs::tanhw_{bug or 'right'}", reference=tanhw_reference)(forward)

    @op.backward
    def _(ctx, dy):
        x, g = ctx.x, ctx.g
        if bug == "needs_grad" and not ctx.needs_input_grad[0]:
            return None, None  # gives nothing unless x's gradient is asked for
        D = x.shape[-1]
        x2, dy2 = x.reshape(-1, D), dy.reshape(-1, D)
        N = x2.shape[0]
        dx = x2 if bug == "mutates_saved" else torch.empty((N, D), dtype=x.dtype, device=x.device)
        if bug == "shared_grad":  # one dg buffer per shape, returned to every caller
            dg = shared.setdefault((D, g.dtype), torch.empty(D, dtype=g.dtype, device=g.device))
        else:
            dg = torch.empty(D, dtype=g.dtype, device=g.device)
        if D and N:
            bwd_kernel[(triton.cdiv(D, TILE_D),)](x2, g, dy2, dx, dg, N, D, x2.stride(0), x2.stride(1), g.stride(0),
                                                   dy2.stride(0), dy2.stride(1), a=ctx.a, BLOCK_N=TILE_N,
                                                   BLOCK_D=TILE_D, BUG=code)
        elif D:
            dg.zero_()
        return dx.view(x.shape), dg

    return op


def tanhw_ragged(dtype, device):
    # one tile of rows and columns, both ragged (5 of 16 rows, 37 of 32 + 32 columns): every mask on
    return randn(5, 37, dtype=dtype, device=device, scale=3.0), weight(37, dtype=dtype, device=device), 2.0


def tanhw_rows(dtype, device):
    # rows over several row tiles (150 = 9 x 16 + 6): dg sums partial tiles; the default a
    return randn(150, 20, dtype=dtype, device=device, scale=3.0), weight(20, dtype=dtype, device=device)


def tanhw_3d(dtype, device):
    # 3-D x: leading dims flattened into rows
    return randn(2, 3, 9, dtype=dtype, device=device, scale=3.0), weight(9, dtype=dtype, device=device), 0.5


TANHW_SAMPLES = [tanhw_ragged, tanhw_rows, tanhw_3d]
TANHW_RIGHT = declare_tanhw(None)
test_tanhw = OpSuite(TANHW_RIGHT, TANHW_SAMPLES, leading=("x",)).pytest()


def first_failure(suite) -> str | None:
    """The id of the first quick case of ``suite`` that fails, or None: the quick tier alone must catch the
    bugs (the extended cases repeat its checks on the other samples)."""
    for case_id, check in suite.quick_cases:
        try:
            check()
        except Exception:
            return case_id
    return None


# Every bug the kit catches, with the case that catches it first (the order of OpSuite.cases).
# Where a compiled kernel runs (a GPU), one planted bug changes no checked value: an unmasked load whose lanes are
# never stored reads memory inside the allocator's segment, and only the interpreter's bounds check sees it.
ON_GPU_NOT_CAUGHT = ("load_mask",)
CAUGHT_BY = {
    "scale": "values-tanhw_ragged-float32",
    "strides": "layout-transposed-tanhw_ragged",
    "load_mask": "values-tanhw_ragged-float32",
    "store_mask": "values-tanhw_ragged-float32",
    "bf16_math": "values-tanhw_ragged-float16",
    "alias_input": "values-tanhw_ragged-float32",
    "out_dtype": "values-tanhw_ragged-float16",
    "first_chunk": "values-tanhw_rows-float32",
    "masked_other": "values-tanhw_ragged-float32",
    "dy_layout": "upstream-grads-tanhw_ragged",
    "mutates_saved": "values-tanhw_ragged-float32",
    "needs_grad": "needs_input_grad-tanhw_ragged",
    "shared_grad": "backward-reuse-tanhw_ragged",
}


@pytest.mark.parametrize("bug", BUGS)
def test_kit_catches_planted_bugs(bug):
    suite = OpSuite(declare_tanhw(bug), TANHW_SAMPLES, leading=("x",))
    caught = first_failure(suite)
    expected = None if bug in ON_GPU_NOT_CAUGHT and torch.device(DEVICE).type == "cuda" else CAUGHT_BY.get(bug)
    assert caught == expected, f"bug {bug}: first failing case {caught}, expected {expected}"


def test_quick_tier_has_every_check_and_every_sample():
    # Each kind of check at least once; the representative's values in every dtype, every other sample's in
    # float32 and one other dtype, the others in turn; the rest only in the extended tier.
    suite = OpSuite(TANHW_RIGHT, TANHW_SAMPLES, leading=("x",), mixed=True)
    names = [s.__name__ for s in TANHW_SAMPLES]

    def kind(case_id):
        return next(case_id.replace(f"-{n}", "") for n in names if f"-{n}" in case_id)

    full, quick = [c for c, _ in suite.cases], [c for c, _ in suite.quick_cases]
    assert set(quick) < set(full) and {kind(c) for c in quick} == {kind(c) for c in full} - {"compile"}
    dtypes = ["float32", "float16", "bfloat16", "float64"]
    assert {c for c in quick if c.startswith("values-")} == {f"values-{names[0]}-{d}" for d in dtypes} | {
        f"values-{n}-{d}" for i, n in enumerate(names[1:]) for d in ("float32", dtypes[1 + i % 3])}
    assert all(c.startswith("values-") or c.endswith(names[0]) or c.startswith("layout-") for c in quick)
    marks = {p.id: [m.name for m in p.marks] for p in OpSuite(TANHW_RIGHT, TANHW_SAMPLES).pytest().pytestmark[0].args[1]}
    assert {i for i, m in marks.items() if "extended" not in m} == {c for c, _ in OpSuite(TANHW_RIGHT, TANHW_SAMPLES).quick_cases}


def test_kit_catches_at_least_12_of_13():
    assert len(BUGS) == 13 and len(CAUGHT_BY) >= 12


def test_gradcheck_reports_a_wrong_gradient():
    # A wrong gradient fails gradcheck with torch's own report, on a few elements and projections, within the
    # time cap (on every element, torch's slow-mode report took more than 11 minutes through the interpreter).
    from torch.autograd.gradcheck import GradcheckError

    suite = OpSuite(declare_tanhw("scale"), TANHW_SAMPLES, gradcheck_seconds=60)
    with pytest.raises(GradcheckError, match="Jacobian mismatch for output 0 with respect to input 0"):
        suite.check_gradcheck(tanhw_ragged)


def test_stop_gradient_samples_take_every_check_but_gradcheck():
    # OpSuite(stop_gradient=...): the named sample has no gradcheck case and keeps every other kind of check; the
    # other samples keep their gradcheck; a name that is not a sample is an error, not a silent no-op
    names = [s.__name__ for s in TANHW_SAMPLES]
    plain = [c for c, _ in OpSuite(TANHW_RIGHT, TANHW_SAMPLES).cases]
    stopped = [c for c, _ in OpSuite(TANHW_RIGHT, TANHW_SAMPLES, stop_gradient={names[1]: "why"}).cases]
    assert set(plain) - set(stopped) == {f"gradcheck-{names[1]}"}
    assert f"gradcheck-{names[0]}" in stopped and f"upstream-grads-{names[1]}" in stopped
    with pytest.raises(ValueError, match=r"stop_gradient names \['nope'\], not samples of the suite"):
        OpSuite(TANHW_RIGHT, TANHW_SAMPLES, stop_gradient={"nope": "why"})


def test_isolated_case_reports_a_crash():
    # OpSuite(isolate=True): a case whose process dies (here an abort in the launcher) fails with a message
    # that says so; the test session goes on.
    import os

    def forward(x: torch.Tensor) -> torch.Tensor:
        os.abort()

    op = tritongrad.op("kitbugs::aborts", reference=lambda x: x, save=())(forward)
    op.backward(lambda ctx, dy: dy)
    if torch.device(DEVICE).type != "cpu":  # a forked child cannot use the GPU: refused, not run
        with pytest.raises(ValueError, match=r"isolate=True runs each case in a forked child, which cannot use cuda"):
            OpSuite(op, [lambda dtype, device: (torch.randn(3, dtype=dtype, device=device),)], isolate=True)
        return
    suite = OpSuite(op, [lambda dtype, device: (torch.randn(3, dtype=dtype, device=device),)], isolate=True)
    case_id, check = suite.cases[0]
    with pytest.raises(AssertionError, match=rf"kitbugs.aborts {case_id}: the case crashed its process with SIGABRT"):
        check()
    # a failing assertion comes back from the child as itself
    wrong = OpSuite(declare_tanhw("scale"), TANHW_SAMPLES, isolate=True)
    with pytest.raises(AssertionError, match=r"kitbugs.tanhw_scale\(torch.float32\) grad x: error"):
        dict(wrong.cases)["values-tanhw_ragged-float32"]()


def test_typical_eps_err_takes_tensors_over_quantiles_limit():
    # torch.quantile refuses more than 2**24 elements; above that the nearest rank serves. Errors of 1 eps on
    # three elements in four and 0 on the rest: the 0.75 quantile is 1 eps either way.
    from tritongrad.testing import typical_eps_err

    for n in (4 * 1000, 4 * (2**22 + 1)):
        ref = torch.ones(n, dtype=torch.float64)
        got = ref.float().clone()
        got[n // 4:] += torch.finfo(torch.float32).eps
        assert typical_eps_err(got, ref) == pytest.approx(1.0), n
        assert typical_eps_err(got, ref, q=0.2) == 0.0, n

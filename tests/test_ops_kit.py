"""The test kit (``tritongrad.testing.OpSuite``) applied to every op: values and gradients against float64 in
every dtype, memory layouts, leading dims, mixed precision, needs_input_grad, no_grad, gradcheck, opcheck and
torch.compile. What is special to one family (launch paths, determinism, modules) is in its own file.

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
    ws_sample((2, 3), 20),      # 3-D x: leading dims flattened into rows without a copy
    ws_sample((2, 2, 3), 9),    # 4-D x
    ws_sample((0,), 8),         # no rows: y empty, grad_w zeros
    ws_sample((4,), 0),         # rows of no columns: y zeros, grad_w empty
    ws_sample((2, 0), 5),       # a size-0 leading dim
]


def ws_eager(x, w):
    """What a user writes in plain PyTorch, in the inputs' own dtypes (products rounded): the error baseline."""
    return (x * w).sum(-1)


# ---------------------------------------------------------------- the norms
def norm_sample(lead, ns, *, affine=("weight",), eps=None, scale=2.0, shift=0.0, name=None):
    """Arguments of rms_norm_op / layer_norm_op: x [*lead, *ns], the parameters named in ``affine`` (the others
    None), ``eps`` (None: the op's default)."""

    def make(dtype, device):
        args = {"input": randn(*lead, *ns, dtype=dtype, device=device, scale=scale, shift=shift),
                "normalized_shape": list(ns)}
        if "weight" in affine:
            args["weight"] = weight(*ns, dtype=dtype, device=device)
        if "bias" in affine:
            args["bias"] = randn(*ns, dtype=dtype, device=device, scale=0.5)
        if eps is not None:
            args["eps"] = eps
        return args

    make.__name__ = name or "x".join(map(str, (*lead, *ns)))
    return make


def rms_samples(affine):
    return [
        norm_sample((5,), (37,), affine=affine),      # D not a power of two, N not a multiple of the row tile
        norm_sample((1,), (64,), affine=affine),      # one row
        norm_sample((130,), (24,), affine=affine),    # several row chunks (tiles of 64 or 128 rows): dw/db through
                                                      # the partial buffer and column_sum
        norm_sample((2, 2, 3), (9,), affine=affine),  # 4-D x
        norm_sample((2, 3), (4, 6), affine=affine),   # two normalised dims (weight [4, 6]), two leading dims
        norm_sample((4,), (16,), affine=affine, scale=1e-3, eps=1e-4, name="eps-dominates"),  # eps > mean
                                                      # square: a dropped or misplaced eps fails
        norm_sample((7,), (45,), affine=(), name="no-affine"),  # no weight (nor bias)
        norm_sample((0,), (8,), affine=affine),       # no rows: dw/db zeros
        norm_sample((2, 0), (5,), affine=affine),     # a size-0 leading dim
        norm_sample((4,), (0,), affine=affine),       # rows of no columns: everything empty
    ]


RMS_SAMPLES = rms_samples(("weight",))
# layer_norm: rows with a mean far from 0, so that a mean subtraction that is off shows.
LN_SAMPLES = [norm_sample((5,), (37,), affine=("weight", "bias"), shift=1.5)] + [
    norm_sample((7,), (45,), affine=a, shift=1.5, name=f"{'-'.join(a)}-only") for a in (("weight",), ("bias",))
] + rms_samples(("weight", "bias"))[1:]


def llama_sample(lead, D):
    def make(dtype, device):
        return randn(*lead, D, dtype=dtype, device=device, scale=2.0), weight(D, dtype=dtype, device=device), 1e-6

    make.__name__ = "x".join(map(str, (*lead, D)))
    return make


LLAMA_SAMPLES = [
    llama_sample((5,), 37),     # both masks
    llama_sample((6,), 1280),   # the parted forward: 5 chunks of 256 columns
    llama_sample((2, 3), 20),   # 3-D x
]


# ---------------------------------------------------------------- the example: softcap, y = cap * tanh(x / cap)
def softcap_small(dtype, device):
    # one block of 1024 elements, mostly masked
    return {"x": randn(7, 33, dtype=dtype, device=device, scale=8.0), "cap": 5.0}


def softcap_blocks(dtype, device):
    # three blocks, the last one ragged; 3-D; the default cap
    return {"x": randn(3, 2, 500, dtype=dtype, device=device, scale=40.0)}


def softcap_saturated(dtype, device):
    # |x| / cap up to ~100: tanh saturates, and its exp must not overflow; gradients vanish
    return {"x": randn(4, 50, dtype=dtype, device=device, scale=50.0), "cap": 0.5}


SUITES = {
    "weighted_sum": OpSuite(weighted_sum, WS_SAMPLES, baseline=ws_eager, leading=("x",), mixed=True),
    "rms_norm": OpSuite(rms_norm_op, RMS_SAMPLES, leading=("input",), mixed=True),
    "layer_norm": OpSuite(layer_norm_op, LN_SAMPLES, leading=("input",), mixed=True),
    "llama_rms_norm": OpSuite(llama_rms_norm, LLAMA_SAMPLES, leading=("hidden_states",), mixed=True),
    "softcap": OpSuite(softcap, [softcap_small, softcap_blocks, softcap_saturated], leading=("x",)),
}

test_weighted_sum = SUITES["weighted_sum"].pytest()
test_rms_norm = SUITES["rms_norm"].pytest()
test_layer_norm = SUITES["layer_norm"].pytest()
test_llama_rms_norm = SUITES["llama_rms_norm"].pytest()
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


# The kit runs gradcheck and opcheck on each suite's first sample; these samples differ from it in schema (no
# weight, weight or bias alone, two normalised dims, eps given, a default argument) or take another launch path.
OTHER_SCHEMAS = {
    "weighted_sum": ["2x2x3x9"],
    "rms_norm": ["no-affine", "2x3x4x6", "eps-dominates"],
    "layer_norm": ["weight-only", "bias-only", "no-affine", "2x3x4x6"],
    "llama_rms_norm": ["6x1280"],
    "softcap": ["softcap_blocks"],
}


@pytest.mark.parametrize("op,sample", [(op, name) for op, names in OTHER_SCHEMAS.items() for name in names], ids=str)
def test_gradcheck_and_opcheck(op, sample):
    suite = SUITES[op]
    (make,) = [s for s in suite.samples if s.__name__ == sample]
    suite.check_gradcheck(make)
    suite.check_opcheck(make)


@pytest.mark.parametrize("layout", ["col-strided", "permuted"])
@pytest.mark.parametrize("op", list(SUITES))
def test_other_layouts(op, layout):
    # Beyond the kit's transposed and row-sliced inputs: every other column of a wider tensor (column stride
    # 2), and leading dims that cannot be merged into one stride (a copy), on a 3-D sample.
    suite = SUITES[op]
    sample = next(s for s in suite.samples if _first_tensor(suite, s).dim() >= 3 and _first_tensor(suite, s).numel())
    suite.check_values(sample, torch.float32, layout=layout)


def _arguments(suite, sample, device) -> list:
    """The sample's arguments bound to the op's parameters, defaults filled in."""
    made = sample(torch.float32, device)
    return list(suite.op.bind((), made) if isinstance(made, dict) else suite.op.bind(tuple(made), {}))


def _first_tensor(suite, sample) -> torch.Tensor:
    return _arguments(suite, sample, "meta")[suite.op.tensor_positions[0]]


@pytest.mark.parametrize("op", list(SUITES))
def test_double_backward_is_refused(op):
    # A gradient penalty through an op whose launchers autograd cannot see would silently lose terms.
    suite = SUITES[op]
    args = _arguments(suite, suite.samples[0], DEVICE)
    x = args[suite.op.tensor_positions[0]].requires_grad_()
    out = suite.op(*args)
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

"""rms_norm, layer_norm and llama_rms_norm beyond the kit (tests/test_ops_kit.py): which launches serve which
shapes (rows in registers, the parted forward, rows read in chunks with and without column splits, the
one-kernel long-row backward and its split), each with its results against float64; bitwise reproducible
dw/db; constant rows; eps; strided inputs; argument errors; the drop-in modules and patch().

Plans depend on the SM count: path tests plan for 4 SMs (the interpreter's count) on any device. The fixtures
``small_tiles`` and ``long_rows`` shrink the plans' tiles so that the chunked and long-row paths run at sizes
the interpreter runs quickly."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, check_forward, check_upstream_grad, check_values, kernel_names

import tritongrad
from tritongrad import _runtime as rt
from tritongrad.ops.norm import layer_norm_op, llama_rms_norm, llama_rms_norm_reference, rms_norm_op
from tritongrad.ops.norm import plans as P
from tritongrad.ops.norm.reference import default_eps
from tritongrad.testing import OpSuite, make_rows

NORMS = ["rms_norm", "layer_norm"]
OPS = {"rms_norm": rms_norm_op, "layer_norm": layer_norm_op}
FWD = {"rms_norm": "_norm_fwd_kernel", "layer_norm": "_norm_fwd_kernel"}
PARTS, ROWSUM = "_norm_fwd_parts_kernel", "_norm_bwd_rowsum_kernel"
BWD, LONG = "_norm_bwd_kernel", "_norm_bwd_long_kernel"
COLUMN_SUM = "_column_sum_kernel"
f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


def norm_args(norm, x, w=None, b=None, eps=None, ns=None) -> tuple:
    """Arguments of the registered op of ``norm`` over x's last dim (or ``ns``)."""
    ns = [x.shape[-1]] if ns is None else list(ns)
    if norm == "rms_norm":
        return x, ns, w, eps
    return x, ns, w, b, 1e-5 if eps is None else eps


def params(norm, ns, dtype):
    """A weight around 1 and, for layer_norm, a bias."""
    w = (1 + 0.5 * torch.randn(ns, device=DEVICE)).to(dtype)
    b = (0.5 * torch.randn(ns, device=DEVICE)).to(dtype) if norm == "layer_norm" else None
    return w, b


def rows(norm, *shape, dtype=f32):
    """Random rows; layer_norm's with a mean far from 0, so that a mean subtraction that is off shows."""
    return (2 * torch.randn(shape, device=DEVICE) + (3.0 if norm == "layer_norm" else 0.0)).to(dtype)


def eager_rms_norm(input, normalized_shape, weight, eps, weight_offset=0.0):
    w = _like(weight, input)
    return F.rms_norm(input, normalized_shape, w + weight_offset if weight_offset else w, eps)


def eager_layer_norm(input, normalized_shape, weight, bias, eps):
    return F.layer_norm(input, normalized_shape, _like(weight, input), _like(bias, input), eps)


def _like(t, x):
    # PyTorch's norms want their parameters in x's dtype: cast, as a user would.
    return t.to(x.dtype) if t is not None else None


# What a user would write in plain PyTorch, in the inputs' dtypes: the error baseline (in float64 too, where
# the reference run in float64 would be exact and leave no room for a different order of summation).
EAGER = {"rms_norm": eager_rms_norm, "layer_norm": eager_layer_norm}


def check(norm, x, w=None, b=None, eps=None, ns=None):
    check_values(OPS[norm], *norm_args(norm, x, w, b, eps, ns), baseline=EAGER[norm])


def check_fwd(norm, x, w=None, b=None) -> tuple:
    """The forward alone (where only the forward's launch is in question): ``(y, [mean,] rstd)``."""
    return check_forward(OPS[norm], *norm_args(norm, x, w, b), baseline=EAGER[norm])


def run(norm, x, w=None, b=None):
    """The public function over x's last dim."""
    if norm == "rms_norm":
        return tritongrad.rms_norm(x, x.shape[-1], w)
    return tritongrad.layer_norm(x, x.shape[-1], w, b)


def of(seen, *kernels):
    return [s for s in seen if s.kernel in kernels]


def row_kernels(seen):
    """The launches other than column_sum (which reduces partial rows after several of them)."""
    return [s.kernel for s in seen if s.kernel != COLUMN_SUM]


def bwd_kernels(seen):
    """The backward's row kernels (the forward's and column_sum left out)."""
    return [k for k in row_kernels(seen) if k not in (*FWD.values(), PARTS)]


def tuned(**knobs):
    """The launchers plan from the current table with ``knobs`` changed, inside the ``with`` block."""
    return P.using(dataclasses.replace(P.table(), **knobs))


@pytest.fixture
def small_tiles(four_sms):
    """Rows longer than 8 columns are read in chunks of 4: the two-read forward, Chan's merge over several
    chunks with a ragged last one, the row-sum pass and the column-split backward, at sizes the interpreter
    runs quickly."""
    with tuned(FWD_MAX_BLOCK_D=8, BWD_MAX_BLOCK_D=8, CHUNK_D=4):
        yield


@pytest.fixture
def whole_rows():
    """Rows read in chunks are never split across columns, however few: one program per row tile."""
    with tuned(SPLIT_PROGS_PER_SM=0):
        yield


@pytest.fixture
def long_rows(four_sms):
    """Rows of 17 to 32 columns take the one-kernel long-row backward, in 3 or 4 chunks of 8 columns (the
    last one ragged unless D is a multiple of 8), at sizes the interpreter runs quickly; 4 rows fill the 4
    SMs (the path needs a row per SM)."""
    with tuned(BWD_MAX_BLOCK_D=16, LONG_BWD_CHUNK=8):
        yield


# The backward kernels each path launches (plus column_sum where partial rows or row sums are split).
PATH_BWD = {"registers": [BWD], "small_tiles": [ROWSUM, BWD], "long_rows": [LONG]}


def path_bwd(path, dtype=f32):
    # The long-row kernel keeps float32 accumulators: float64 rows take the row-sum pass instead.
    return [ROWSUM, BWD] if path == "long_rows" and dtype == f64 else PATH_BWD[path]


def use_path(path, request):
    if path != "registers":
        request.getfixturevalue(path)


# ---------------------------------------------------------------- which launches serve which shapes
@pytest.mark.parametrize(
    "shape,fwd,bwd",
    [
        # whole rows in registers, one tile of rows per program (the last one ragged)
        pytest.param((5, 37), [("fwd", {"ONE_TILE": True, "PHASE": 0})], [(BWD, {"ONE_TILE": True})],
                     id="registers"),
        # 5 chunks of 256 columns, held in parts of 4 and 1: the parted forward
        pytest.param((6, 1280), [(PARTS, {"NCH": 5, "CHUNK": 256})], [(BWD, {"ONE_TILE": True})], id="parts"),
        # longer than one tile, and 3 row tiles for 4 SMs: the columns are split too, the forward in two
        # phases (statistics, then normalise), the backward's row sums by split
        pytest.param((3, 20000), [("fwd", {"ONE_TILE": False, "PHASE": 1}), ("fwd", {"PHASE": 2})],
                     [(ROWSUM, {"splits": 5}), (BWD, {"ONE_TILE": False})], id="chunks-column-split"),
        # longer than one tile, a row tile per SM: whole-row passes; 5 chunks of rows only 8-byte aligned,
        # which the long-row backward does not take
        pytest.param((5, 16502), [("fwd", {"ONE_TILE": False, "PHASE": 0})], [(ROWSUM, {"splits": 1}), (BWD, {})],
                     id="chunks-whole-rows"),
        # longer than the backward's tile (8192), 3 chunks, a row per SM: the one-kernel long-row backward;
        # the forward keeps the row in registers
        pytest.param((5, 9000), [("fwd", {"ONE_TILE": True})], [(LONG, {"NCH": 3, "SPLIT": 1})], id="long-rows"),
    ],
)
@pytest.mark.parametrize("norm", NORMS)
def test_launch_paths(norm, shape, fwd, bwd, launches, four_sms):
    x = rows(norm, *shape)
    check(norm, x, *params(norm, shape[-1], f32))
    want = [(FWD[norm] if k == "fwd" else k, props) for k, props in fwd + bwd]
    got = [s for s in launches if s.kernel != COLUMN_SUM]
    assert [s.kernel for s in got] == [k for k, _ in want]
    for s, (_, props) in zip(got, want):
        for key, value in props.items():
            assert (s.grid[1] if key == "splits" else s.kw[key]) == value, (s.kernel, key)


@pytest.mark.parametrize("split", [True, False], ids=["column-split", "whole-rows"])
@pytest.mark.parametrize("dtype,layout", [(f32, "contiguous"), (bf16, "contiguous"), (f64, "contiguous"),
                                          (f32, "transposed"), (bf16, "row-sliced")], ids=str)
@pytest.mark.parametrize("lead,ns", [((5,), (13,)), ((3, 2), (2, 7)), ((300,), (9,))], ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_chunked_path(norm, lead, ns, dtype, layout, split, small_tiles, launches, request):
    # With tiles this small every shape here is one row tile, fewer than the 4 SMs: the row passes split the
    # columns into their chunks of 4, unless splits are off. Chunks read through x's strides too: column
    # stride N (transposed), row stride D + 7 (row-sliced).
    if not split:
        request.getfixturevalue("whole_rows")
    x = make_rows((*lead, *ns), dtype, DEVICE, layout, scale=2.0)
    if norm == "layer_norm":
        x.add_(3)
    check(norm, x, *params(norm, ns, dtype), ns=ns)
    assert not any(s.kw["ONE_TILE"] for s in of(launches, FWD[norm], BWD))
    splits = {s.grid[1] for s in of(launches, ROWSUM)}
    assert splits == {math.ceil(math.prod(ns) / 4) if split else 1}


@pytest.mark.parametrize("norm", NORMS)
def test_chunked_path_gradcheck(norm, small_tiles, launches):
    # Chan's merge of chunk statistics and the column-split row sums, differentiated numerically in float64.
    def sample(dtype, device):
        return norm_args(norm, torch.randn(4, 9, dtype=dtype, device=device) + 1,
                         *params(norm, (9,), dtype), eps=1e-3)

    OpSuite(OPS[norm], [sample]).check_gradcheck(sample)
    assert of(launches, ROWSUM) and not of(launches, FWD[norm])[0].kw["ONE_TILE"]


@pytest.mark.parametrize(
    "dtype,case",
    [
        (f32, "plain"), (f16, "plain"), (bf16, "plain"),
        (f16, "mixed"), (bf16, "mixed"),  # 16-bit rows, float32 parameters (for float32 rows: plain)
        (f32, "no-affine"), (bf16, "no-affine"),
    ],
    ids=str,
)
@pytest.mark.parametrize(
    "lead,ns",
    [
        ((5,), (21,)),    # 3 chunks of 8, the last ragged
        ((3, 2), (19,)),  # the same over two leading dims
        ((9,), (3, 8)),   # 3 full chunks over two normalised dims
        ((40,), (17,)),   # 10 rows per program, the last chunk of one column
    ],
    ids=str,
)
@pytest.mark.parametrize("norm", NORMS)
def test_long_rows_path(norm, lead, ns, dtype, case, long_rows, launches):
    w, b = params(norm, ns, f32 if case == "mixed" else dtype)
    if case == "no-affine":
        w = b = None
    check(norm, rows(norm, *lead, *ns, dtype=dtype), w, b, ns=ns)
    assert row_kernels(launches) == [FWD[norm], LONG] and launches[-1].kernel in (LONG, COLUMN_SUM)
    assert of(launches, LONG)[0].kw["NCH"] == 3


@pytest.mark.parametrize("norm", NORMS)
def test_long_rows_read_dy_through_its_strides(norm, long_rows, launches):
    # A transposed x and the stride-0 dy of y.sum().backward(), through the long-row kernel.
    x = make_rows((6, 21), f32, DEVICE, "transposed")
    dy = torch.ones((), device=DEVICE).expand(6, 21)
    check_upstream_grad(OPS[norm], norm_args(norm, x, *params(norm, (21,), f32)), dy)
    assert row_kernels(launches) == [FWD[norm], LONG]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [f32, bf16], ids=str)
@pytest.mark.parametrize(
    "N,D,want",  # want: (SPLIT, NCH, programs)
    [
        (12, 32, (2, 2, 4)),  # 4 chunks in 2 programs of 2; 4 SMs: 2 row groups, added by column_sum
        (7, 48, (2, 3, 4)),   # 6 chunks in 2 programs of 3; 7 rows: groups of unequal length
        (9, 64, (3, 3, 3)),   # 8 chunks in 3 programs of 24, 24 and 16 columns (the last one's third chunk
                              # lies past the row: masked); one group writes dw/db directly
        (10, 40, (2, 3, 4)),  # 5 chunks, 8-element (16-byte) aligned rows that are not multiples of 16
    ],
    ids=str,
)
def test_long_rows_split(norm, N, D, want, dtype, long_rows, launches):
    # Rows whose dw/db accumulators would spill split their columns across SPLIT programs of each row group
    # (LONG_BWD_SPLIT; here for every row of 4 to 8 chunks).
    split = {4: P.SplitPlan(2, 4, 1), 5: P.SplitPlan(2, 4, 1), 6: P.SplitPlan(2, 4, 1), 8: P.SplitPlan(3, 4, 1)}
    with tuned(LONG_BWD_SPLIT={P.SplitKey(c, n, n, k): v for c in (False, True) for n in (2, 4)
                               for k, v in split.items()}, LONG_BWD_WARPS={}):
        check(norm, rows(norm, N, D, dtype=dtype), *params(norm, (D,), dtype))
        (long,) = of(launches, LONG)
        assert (long.kw["SPLIT"], long.kw["NCH"], long.grid[0]) == want
        # Rows of 29 elements are not 16-byte aligned: no vector loads, so not split; the row-sum pass serves.
        launches.clear()
        check(norm, rows(norm, N, 29, dtype=dtype), *params(norm, (29,), dtype))
        assert row_kernels(launches) == [FWD[norm], ROWSUM, BWD]


@pytest.mark.parametrize("dtype", [f32, bf16], ids=str)
@pytest.mark.parametrize("D", [29, 32])
def test_long_rows_four_chunks(D, dtype, long_rows, launches):
    # rms_norm runs rows of 4 chunks (ragged and full) in one kernel; layer_norm's would spill on a GPU and
    # stay with the row-sum pass and the column-block kernel (LONG_BWD_WARPS).
    for norm, backward in (("rms_norm", [LONG]), ("layer_norm", [ROWSUM, BWD])):
        launches.clear()
        check(norm, rows(norm, 12, D, dtype=dtype), *params(norm, (D,), dtype))
        assert row_kernels(launches) == [FWD[norm], *backward]


@pytest.mark.parametrize("path", list(PATH_BWD))
@pytest.mark.parametrize(
    "D,sx,sdy,fwd,bwd",  # row length, row strides of x and dy; the largest power of two dividing D and
    # x's row stride (the forward's rows), and that dividing all three (the backward's)
    [(24, 24, 24, 8, 8), (24, 28, 24, 4, 4), (24, 24, 26, 8, 2), (20, 36, 20, 4, 4)],
    ids=str,
)
@pytest.mark.parametrize("norm", NORMS)
def test_rows_aligned_below_16(norm, D, sx, sdy, fwd, bwd, path, launches, request):
    # Row lengths and strides that are multiples of 8, 4 or 2 elements but not of 16: each kernel is told
    # the largest power of two that divides the ones it reads (ALIGN, so that its loads vectorise on a GPU;
    # ops/_tl.aligned). A hint that one of them does not honour rounds it down in the kernel and misplaces
    # rows: x and dy get different alignments, so each must be counted.
    use_path(path, request)
    x = rows(norm, 12, sx)[:, :D]
    dy = torch.randn(12, sdy, device=DEVICE)[:, :D]
    check_upstream_grad(OPS[norm], norm_args(norm, x, *params(norm, (D,), f32)), dy)
    assert bwd_kernels(launches) == PATH_BWD[path]
    align = {s.kernel: s.kw["ALIGN"] for s in launches if s.kernel != COLUMN_SUM}
    # The chunked forward splits the columns in multiples of 4 (its chunks): ALIGN 4 where rows allow more;
    # so do the backward's row sums.
    split = 4 if path == "small_tiles" else 16
    assert align[FWD[norm]] == min(fwd, split) and align[PATH_BWD[path][-1]] == bwd
    assert align.get(ROWSUM, None) == (min(bwd, split) if path == "small_tiles" else None)


NEEDS = {
    "rms_norm": [(True, False, False), (False, True, False), (True, True, False)],
    "layer_norm": [(True, False, False), (False, True, False), (False, False, True), (False, True, True),
                   (True, True, False)],
}


@pytest.mark.parametrize("path,N", [("registers", 300), ("long_rows", 40)])  # several row chunks in each
@pytest.mark.parametrize("norm,needs", [(n, k) for n in NORMS for k in NEEDS[n]], ids=str)
def test_backward_writes_only_what_is_asked(norm, needs, path, N, launches, request):
    # Each gradient alone or with another: the launch writes only those asked for (dw and db through the
    # partial buffer and column_sum, side by side for layer_norm), each against float64.
    use_path(path, request)
    x = rows(norm, N, 20)
    w, b = params(norm, (20,), f32)
    ours = [t.detach().requires_grad_(n) if t is not None else None for t, n in zip((x, w, b), needs)]
    ref = [t.detach().double().requires_grad_(n) if t is not None else None for t, n in zip((x, w, b), needs)]
    dy = torch.randn(N, 20, device=DEVICE)
    wanted = [i for i, t in enumerate(ours) if t is not None and t.requires_grad]
    got = torch.autograd.grad(run(norm, *ours), [ours[i] for i in wanted], dy)
    want = torch.autograd.grad(OPS[norm].reference(*norm_args(norm, *ref)), [ref[i] for i in wanted], dy.double())
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)
    assert bwd_kernels(launches) == PATH_BWD[path]
    (main,) = of(launches, BWD, LONG)
    assert tuple(main.kw[k] for k in ("HAS_DX", "HAS_DW", "HAS_DB")) == tuple(i in wanted for i in range(3))
    assert main.grid[0] > 1 and (COLUMN_SUM in kernel_names(launches)) == (needs[1] or needs[2])


@pytest.mark.parametrize("layout", ["contiguous", "row-sliced", "transposed"])
@pytest.mark.parametrize(
    "D,dtype,wdtype",
    [
        (384, f32, f32),     # 3 chunks of 128: parts of 2 and 1 chunks
        (640, f64, f64),     # 5 chunks of 128, float64 statistics: parts of 4 and 1
        (1280, bf16, bf16),  # 5 chunks of 256, 16-bit
        (1792, f16, f32),    # 7 chunks of 256: parts of 4, 2 and 1; float32 parameters
        (896, f32, None),    # 7 chunks of 128, no weight or bias
        (1152, f32, f32),    # 9 chunks of 128: parts of 8 and 1
        (3328, bf16, f32),   # 13 chunks of 256: parts of 8, 4 and 1; float32 parameters
    ],
    ids=str,
)
@pytest.mark.parametrize("norm", NORMS)
def test_forward_in_parts(norm, D, dtype, wdtype, layout, launches):
    # The parted forward on every layout (row-sliced: ALIGN 1; transposed: column stride N), with a constant
    # row and a zero row among random ones: y, and the row statistics the backward reads.
    x = make_rows((6, D), dtype, DEVICE, layout, scale=2.0)
    if norm == "layer_norm":
        x.add_(3)
    x[1] = 0.7
    x[2] = 0.0
    w, b = params(norm, (D,), wdtype) if wdtype is not None else (None, None)
    y, *stats = check_fwd(norm, x, w, b)
    assert kernel_names(launches) == [PARTS]
    x64 = x.double()
    eps = 1e-5 if norm == "layer_norm" else default_eps(x.dtype)
    mean = x64.mean(-1) if norm == "layer_norm" else torch.zeros(6, dtype=f64, device=DEVICE)
    want = ([mean] if norm == "layer_norm" else []) + [torch.rsqrt((x64 - mean[:, None]).square().mean(-1) + eps)]
    for got, ref in zip(stats, want):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5 if got.dtype == f32 else 1e-12, atol=1e-6)
    if norm == "rms_norm":
        assert (y[2] == 0).all()
    else:  # x - mean is exactly 0 on a constant row: y = b, rounded to y's dtype as PyTorch rounds it
        want = b if b is not None else torch.zeros(D, device=DEVICE, dtype=y.dtype)
        assert torch.equal(y[1], want.to(y.dtype))


@pytest.mark.parametrize(
    "D,dtype",
    [
        (4096, bf16),   # a power of two: one chunk, the tile plans
        (15360, bf16),  # 15 chunks of 1024: a sixteenth of the tile masked, the parts would lose
        (13000, bf16),  # chunks of 8 columns
        (20480, bf16),  # 5 chunks of 4096, but longer than one register tile: read in chunks
        (384, bf16),    # 3 chunks of 128 two-byte columns: narrower than a warp's 16-byte vectors
    ],
    ids=str,
)
def test_forward_parts_not_taken(D, dtype, launches):
    check_fwd("rms_norm", rows("rms_norm", 2, D, dtype=dtype))
    assert set(kernel_names(launches)) == {FWD["rms_norm"]}


# ---------------------------------------------------------------- launch parameters by dtype and shape
def fwd_tile(seen):
    """(elements per program step, warps) of the forward's launches (one, or two phases of one tile)."""
    (tile,) = {(s.kw["BLOCK_N"] * s.kw["BLOCK_D"], s.kw["num_warps"]) for s in seen if s.kernel in FWD.values()}
    return tile


@pytest.mark.parametrize(
    "D,dtype",
    [
        (100, bf16), (300, bf16), (700, bf16), (1500, bf16), (3000, bf16),  # bf16: 128 to 4096 columns
        (200, f16), (700, f16), (1500, f16),  # float16: its own entries only (256, 1024, 4096), 2048 none
    ],
    ids=str,
)
def test_layer_norm_16bit_forward_tiles(D, dtype, launches):
    # layer_norm's forward over whole 16-bit rows takes its own tiles and warps (its two row reductions want
    # fewer threads per row) where LN_FWD_16BIT has an entry for the row's power of two; with float64
    # parameters (float64 statistics) and for rms_norm, the tile plans. 9 rows: the last row tile ragged.
    x = rows("layer_norm", 9, D, dtype=dtype)
    w, b = params("layer_norm", (D,), dtype)
    tiles = {}
    for name, norm, args in (("layer_norm", "layer_norm", (x, w, b)), ("rms_norm", "rms_norm", (x,)),
                             ("float64 statistics", "layer_norm", (x, w.double(), b.double()))):
        launches.clear()
        check_fwd(norm, *args)
        tiles[name] = fwd_tile(launches)
    own = P.TABLE.LN_FWD_16BIT[dtype].get(rt.next_pow2(D)) is not None
    assert (tiles["layer_norm"] != tiles["rms_norm"]) == own
    assert tiles["float64 statistics"] == tiles["rms_norm"]


@pytest.mark.parametrize(
    "norm,D,dtype,other,fewer",
    [
        ("rms_norm", 8192, bf16, f32, True),     # whole 16-bit rows over 4096 columns: 8 warps, so that two
        ("rms_norm", 16384, bf16, f32, True),    # programs stay resident per SM, where float32 rows take 16
        ("rms_norm", 4096, bf16, f32, False),    # shorter rows: the same tile as float32
        ("rms_norm", 32768, bf16, f32, False),   # rows read in chunks: the same tile
        ("layer_norm", 5000, f32, "rms_norm", True),   # float32 rows masking a quarter or more of an 8192 tile:
        ("layer_norm", 6000, f32, "rms_norm", True),   # 8 warps for layer_norm's two reductions
        ("layer_norm", 7000, f32, "rms_norm", False),  # an eighth masked: rms_norm's 16
    ],
    ids=str,
)
def test_forward_warps(norm, D, dtype, other, fewer, launches):
    # The forward's warps against another launch of the same row length (another dtype, or rms_norm), with
    # the forward's values.
    x = rows(norm, 1, D, dtype=dtype)
    check_fwd(norm, x)
    warps = fwd_tile(launches)[1]
    launches.clear()
    check_fwd(other, x) if isinstance(other, str) else check_fwd(norm, x.to(other))
    other_warps = fwd_tile(launches)[1]
    assert (warps < other_warps) if fewer else (warps == other_warps)


@pytest.mark.parametrize(
    "D,stages",
    [
        (2560, P.TABLE.BWD_MASKED_16BIT.stages),  # whole 16-bit rows masking a quarter or more of their tile of 4096:
        (1536, P.TABLE.BWD_MASKED_16BIT.stages),  # a stage more (the pipeline copies whole tiles)
        (2048, P.TABLE.BWD_STAGES),               # a full tile
        (3584, P.TABLE.BWD_STAGES),               # an eighth masked
    ],
)
def test_backward_pipelines_masked_16bit_rows_deeper(D, stages, launches):
    h200_smem = dataclasses.replace(rt.device_props(torch.device(DEVICE)), shared_mem_per_sm=228 * 1024)
    with rt.assume_device(h200_smem):  # an H200's shared memory, on any device
        check("rms_norm", rows("rms_norm", 3, D, dtype=bf16))
    (bwd,) = of(launches, BWD)
    assert bwd.kw["STAGES"] == stages and bwd.kw["num_warps"] <= P.TABLE.BWD_MASKED_16BIT.max_warps


def test_backward_pipelining_depth_fits_shared_memory():
    # BWD_STAGES - 1 row tiles of x and dy per resident program, fewer where they would not fit the SM.
    h200, small = 228 * 1024, 100 * 1024
    t = P.bwd_plan(32768, 4096, 132)[0]
    assert (t.BLOCK_N * t.BLOCK_D, P.bwd_per_sm(t)) == (4096, 2)
    assert P.bwd_stages(t, 2 + 2, h200) == P.TABLE.BWD_STAGES == 3   # bf16: 2 x 16 KiB per program
    assert P.bwd_stages(t, 4 + 4, h200) == 3                   # float32: 2 x 32 KiB
    assert P.bwd_stages(t, 8 + 8, h200) == 2                   # float64: 64 KiB tiles, only one ahead fits
    assert P.bwd_stages(t, 4 + 4, small) == 2
    assert P.bwd_stages(t, 8 + 8, small) == 1                  # no pipelining rather than one program less
    wide = P.bwd_plan(16384, 8192, 132)[0]
    assert P.bwd_per_sm(wide) == 1 and P.bwd_stages(wide, 8 + 8, h200) == 2


def test_layer_norm_backward_steps_over_fewer_rows_in_32_bits(launches):
    # layer_norm's backward with 32- and 64-bit x handles half the rows per step (LN_BWD_TILE_32BIT, faster on
    # an H200); 16-bit x and rms_norm keep BWD_TILE. 130 rows of 32 columns: no tile is clamped by N.
    block_n = {}
    for norm, dtype in (("layer_norm", f32), ("layer_norm", f64), ("layer_norm", bf16), ("rms_norm", f32)):
        launches.clear()
        check(norm, rows(norm, 130, 32, dtype=dtype), *params(norm, (32,), dtype))
        block_n[norm, dtype] = of(launches, BWD)[0].kw["BLOCK_N"]
    assert block_n["layer_norm", f32] == block_n["layer_norm", f64] == block_n["rms_norm", f32] // 2
    assert block_n["layer_norm", bf16] == block_n["rms_norm", f32]


# ---------------------------------------------------------------- determinism, constant rows, eps
@pytest.mark.parametrize(
    "path,N,D",
    [
        ("registers", 300, 64),     # row tiles of 64 rows: 5 row chunks
        ("small_tiles", 2048, 13),  # row tiles of 1024 rows, 4 column blocks: 2 row chunks
        ("long_rows", 40, 19),      # a row group per SM: 4 row chunks
    ],
)
@pytest.mark.parametrize("norm", NORMS)
def test_param_grads_bitwise_deterministic(norm, path, N, D, launches, request):
    # Several row chunks: dw/db go through the partial buffer and column_sum, whose order is fixed.
    use_path(path, request)
    x = torch.randn(N, D, device=DEVICE)
    w, b = (t.requires_grad_() if t is not None else None for t in params(norm, (D,), f32))
    dy = torch.randn(N, D, device=DEVICE)
    runs = [torch.autograd.grad(run(norm, x, w, b), [t for t in (w, b) if t is not None], dy) for _ in range(3)]
    after = next(i for i, s in enumerate(launches) if s.kernel == PATH_BWD[path][-1])
    assert launches[after].grid[0] > 1 and launches[after + 1].kernel == COLUMN_SUM
    assert all(torch.equal(a, c) for r in runs[1:] for a, c in zip(r, runs[0]))


@pytest.mark.parametrize("path", list(PATH_BWD))
@pytest.mark.parametrize("dtype", [f32, bf16, f64], ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_zero_variance_rows(norm, dtype, path, launches, request):
    # Constant rows (a mean that is not exactly representable, so the deviations are rounding noise) and
    # all-zero rows: outputs and gradients finite and as accurate as the reference's in the same dtype. In
    # float64 their r = 1/sqrt(eps) shows an eps rounded to float32, Triton's type for a float argument
    # (rt.split_float).
    use_path(path, request)
    x = torch.randn(6, 21, device=DEVICE)
    x[0] = 0.1
    x[1] = 0.0
    x[2] = -3.7
    x[3, :] = 1e-20  # underflows in float32 squares
    x = x.to(dtype)
    w, b = params(norm, (21,), dtype)
    check(norm, x, w, b)
    assert bwd_kernels(launches) == path_bwd(path, dtype)
    y = run(norm, x, w, b)
    assert torch.isfinite(y).all()
    if norm == "rms_norm":
        assert (y[1] == 0).all()  # a zero row normalises to zero: r = 1/sqrt(eps) stays finite
    else:
        torch.testing.assert_close(y[1].float(), b.float(), atol=0, rtol=0)  # x - mean = 0 exactly


@pytest.mark.parametrize("tiles", ["four_sms", pytest.param("small_tiles", marks=pytest.mark.extended)])
def test_a_kept_launch_serves_only_calls_that_differ_in_data_alone(tiles, request):
    # Launches are kept per shapes, strides, dtypes and flags (launch._LAUNCHES). Each variant differs from
    # the base in one of those (the permuted x's rows are a copy, not a view); run in turn, each must equal
    # float64 PyTorch, which a launch kept for another variant would not give. Rows in one tile, their dw
    # and db in partial rows (four SMs); small tiles: column-split forwards, row-sum backwards.
    request.getfixturevalue(tiles)
    def rnd(*shape, dtype=f32):
        return torch.randn(shape, dtype=f32, device=DEVICE).to(dtype)

    def base(**o):
        return dict(norm="layer_norm", x=rnd(4, 6, 40), w=rnd(40), b=rnd(40), eps=1e-5, ns=(40,), dy=None) | o

    def one(name, change):
        a = base()
        return a | {name: change(a[name])}

    variants = [
        base, lambda: base(norm="rms_norm", b=None), lambda: base(norm="rms_norm", b=None, w=None),
        lambda: base(norm="llama", b=None),
        lambda: one("x", lambda x: x.transpose(0, 1).contiguous().transpose(0, 1)),  # rows copied
        lambda: one("x", lambda x: torch.cat([x, x], -1)[..., :40]),  # row stride 80
        lambda: one("x", lambda x: x[:3]), lambda: one("x", lambda x: rnd(4, 6, 48)) | dict(w=rnd(48), b=rnd(48), ns=(48,)),
        lambda: one("w", lambda w: torch.cat([w, w])[::2]), lambda: one("b", lambda b: torch.cat([b, b])[::2]),
        lambda: one("w", lambda w: w.double()), lambda: one("x", lambda x: x.double()),
        lambda: one("eps", lambda e: 0.5), lambda: base(x=rnd(4, 6, 5, 8), w=rnd(5, 8), b=rnd(5, 8), ns=(5, 8)),
        lambda: base(dy=rnd(40).expand(4, 6, 40)),  # the upstream gradient expanded (stride 0)
        # bfloat16 x, float32 weight: rms_norm's y in x's dtype, Llama's promoted (its x-hat rounded first)
        lambda: base(norm="rms_norm", b=None, x=rnd(4, 6, 40, dtype=bf16)),
        lambda: base(norm="llama", b=None, x=rnd(4, 6, 40, dtype=bf16)),
    ]
    for make in variants:
        for needs in ((True, True, True), (False, True, True), (True, False, False)):
            a = make()
            norm, ns = a["norm"], list(a["ns"])
            ins = [t.detach().requires_grad_(need) if t is not None else None
                   for t, need in zip((a["x"], a["w"], a["b"]), needs)]
            if not any(t is not None and t.requires_grad for t in ins):
                continue
            ins64 = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in ins]

            def run(x, w, b, norm=norm, ns=ns, eps=a["eps"]):
                if norm == "llama":
                    return llama_rms_norm(x, w, eps)
                if norm == "rms_norm":
                    return tritongrad.rms_norm(x, ns, w, eps)
                return tritongrad.layer_norm(x, ns, w, b, eps)

            def want(x, w, b, norm=norm, ns=ns, eps=a["eps"]):
                if norm == "llama":
                    return llama_rms_norm_reference(x, w, eps)
                return F.rms_norm(x, ns, w, eps) if norm == "rms_norm" else F.layer_norm(x, ns, w, b, eps)

            y, y64 = run(*ins), want(*ins64)
            x_, w_ = ins[0], ins[1]
            assert y.dtype == (torch.promote_types(x_.dtype, w_.dtype) if norm == "llama" else x_.dtype)
            dy = a["dy"] if a["dy"] is not None else torch.randn_like(y)
            y.backward(dy)
            y64.backward(dy.double())
            tol = dict(rtol=1e-5, atol=1e-5) if a["x"].dtype != bf16 else dict(rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(y.double(), y64, **tol)
            for t, t64 in zip(ins, ins64):
                if t is not None and t.requires_grad:
                    torch.testing.assert_close(t.grad.double(), t64.grad, **tol)


def test_split_float():
    # Triton passes a float argument as float32; kernels add hi + lo and get eps to float64 accuracy.
    for v in (1e-5, 1e-6, 1 / 3, 0.0, 1e-12):
        hi, lo = rt.split_float(v)
        assert float(torch.tensor(hi, dtype=torch.float32)) == hi and hi + lo == v


def test_rms_norm_default_eps():
    # PyTorch's rule: eps=None means float32's machine eps for float16/bfloat16/float32 x (even with a
    # float64 weight), float64's for float64 x.
    assert default_eps(bf16) == default_eps(f32) == torch.finfo(f32).eps
    assert default_eps(f64) == torch.finfo(f64).eps
    x = torch.full((2, 8), 1e-4, device=DEVICE)  # mean square 1e-8: float32's eps (1.2e-7) matters
    torch.testing.assert_close(tritongrad.rms_norm(x, (8,)), F.rms_norm(x, (8,)))
    torch.testing.assert_close(tritongrad.rms_norm(x, (8,), torch.ones(8, dtype=f64, device=DEVICE)),
                               F.rms_norm(x, (8,)))


def test_residuals_are_row_stats():
    x = torch.randn(2, 3, 10, dtype=bf16, device=DEVICE)
    y, rstd = torch.ops.tritongrad.rms_norm(x, [10], None, None, 0.0)
    assert rstd.shape == (2, 3) and rstd.dtype == f32
    torch.testing.assert_close(rstd, torch.rsqrt(x.float().square().mean(-1) + default_eps(bf16)))
    y, mean, rstd = torch.ops.tritongrad.layer_norm(x, [10], None, None, 1e-5)
    torch.testing.assert_close(mean, x.float().mean(-1))
    torch.testing.assert_close(rstd, torch.rsqrt(x.float().var(-1, unbiased=False) + 1e-5))


# ---------------------------------------------------------------- strides
@pytest.mark.parametrize("layout", ["row-sliced", "transposed"])
@pytest.mark.parametrize("norm", NORMS)
def test_strided_x_is_not_copied(norm, layout, launches):
    # A row-sliced or transposed 2-D x reaches the forward and backward kernels as the same storage.
    x = make_rows((33, 16), f32, DEVICE, layout).requires_grad_()
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    y = run(norm, x, w)
    y.backward(torch.randn_like(y))
    assert [(s.args[0].data_ptr(), s.args[0].stride()) for s in of(launches, FWD[norm], BWD)] == [
        (x.data_ptr(), x.stride())] * 2


@pytest.mark.parametrize("dy_layout", ["like-x", "contiguous"])
@pytest.mark.parametrize("norm", NORMS)
def test_transposed_heads_are_read_in_place(norm, dy_layout, launches):
    # [B, T, H, D] viewed as [B, H, T, D] (a per-head norm after the heads' transpose, Gemma 3's q_norm): the
    # kernels read x where it lies, rows in memory order, and y and dx come in x's layout, as PyTorch's
    # elementwise ops keep it; a contiguous y made the next ops copy (attention's output, o_proj's input).
    x = torch.randn(2, 5, 3, 16, device=DEVICE).transpose(1, 2).requires_grad_()
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    y = run(norm, x, w)
    assert y.stride() == x.stride()
    g = torch.randn(2, 5, 3, 16, device=DEVICE).transpose(1, 2) if dy_layout == "like-x" else torch.randn(2, 3, 5, 16,
                                                                                                          device=DEVICE)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    assert gx.stride() == x.stride()
    assert [s.args[0].data_ptr() for s in of(launches, FWD[norm], BWD)] == [x.data_ptr()] * 2
    ref = torch.nn.functional.rms_norm if norm != "layer_norm" else torch.nn.functional.layer_norm
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = ref(x64, (16,), w64) if norm != "layer_norm" else ref(x64, (16,), w64)  # the defaults' eps
    want = torch.autograd.grad(y64, (x64, w64), g.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    for a, b in zip((gx, gw), want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(5, 37), (3, 5120), (130, 24), (2, 12288), (6, 20000)])
def test_weight_offset_is_the_offset_weight_in_every_kernel(shape, launches):
    # weight_offset=1 (Gemma's 1 + w, added in the kernels) equals the offset weight made outside, bit for bit
    # in float32, through every kernel it reaches: whole rows, parts, partial rows, long and split rows.
    x = (2 * torch.randn(shape, device=DEVICE)).requires_grad_()
    w = (0.3 * torch.randn(shape[-1], device=DEVICE)).requires_grad_()
    g = torch.randn(shape, device=DEVICE)
    y = tritongrad.rms_norm(x, shape[-1], w, 1e-6, weight_offset=1.0)
    got = (y, *torch.autograd.grad(y, (x, w), g))
    y1 = tritongrad.rms_norm(x, shape[-1], 1.0 + w, 1e-6)
    want = (y1, *torch.autograd.grad(y1, (x, w), g))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # PyTorch's rms_norm (small inputs) has no offset: the kernels serve.
    assert rms_norm_op.native(x, [shape[-1]], w, 1e-6, 1.0) is NotImplemented


# ---------------------------------------------------------------- argument errors
BAD_INPUTS = [
    (lambda: tritongrad.rms_norm(torch.randn(3, 4), (5,)), ValueError, r"input of shape \(3, 4\).*\(5,\)"),
    (lambda: tritongrad.layer_norm(torch.randn(3, 4), (2, 4)), ValueError, r"input of shape \(3, 4\).*\(2, 4\)"),
    (lambda: tritongrad.rms_norm(torch.randn(4), (2, 4)), ValueError, r"\(4,\).*\(2, 4\)"),
    (lambda: tritongrad.rms_norm(torch.randn(3, 4), (4,), torch.randn(5)), ValueError, r"weight.*\(5,\).*\(4,\)"),
    (lambda: tritongrad.layer_norm(torch.randn(3, 4), (4,), torch.randn(4), torch.randn(1, 4)), ValueError,
     r"bias.*\(1, 4\).*\(4,\)"),
    (lambda: tritongrad.layer_norm(torch.randn(3, 4), []), ValueError, "at least one dim"),
    (lambda: tritongrad.rms_norm(torch.randn(3, 4), (4.0,)), TypeError, "list of ints"),
    (lambda: tritongrad.rms_norm(torch.ones(3, 4, dtype=torch.int32), (4,)), TypeError, "torch.int32"),
    (lambda: tritongrad.layer_norm(torch.randn(3, 4), (4,), torch.ones(4, dtype=torch.int64)), TypeError,
     "weight has dtype torch.int64"),
    (lambda: tritongrad.rms_norm(torch.randn(3, 4, dtype=torch.complex64), (4,)), TypeError, "complex64"),
    (lambda: tritongrad.rms_norm(torch.randn(3, 4), (4,), torch.randn(4, device="meta")), ValueError, "cpu.*meta"),
    (lambda: tritongrad.layer_norm(torch.randn(3, 4), (4,), None, torch.randn(4, device="meta")), ValueError,
     "cpu.*meta"),
    (lambda: tritongrad.rms_norm(torch.randn(3, 4), (4,), [1.0] * 4), TypeError, "weight must be a Tensor"),
    (lambda: tritongrad.layer_norm(torch.randn(3, 4), (4,), eps=None), TypeError, "eps"),
    (lambda: tritongrad.rms_norm(torch.randn(3, 4), (4,), eps="1e-5"), TypeError, "eps"),
    (lambda: llama_rms_norm(torch.randn(3, 4), torch.randn(2, 2)), ValueError, r"weight.*\(2, 2\).*\(4,\)"),
    # A weight that PyTorch's ops would broadcast, and a missing weight that is not optional.
    (lambda: llama_rms_norm(torch.randn(3, 4), torch.randn(1)), ValueError, r"weight.*\(1,\).*\(4,\)"),
    (lambda: tritongrad.rms_norm(torch.randn(3, 4), (4,), torch.randn(1)), ValueError, r"weight.*\(1,\).*\(4,\)"),
    (lambda: llama_rms_norm(torch.randn(3, 4), None), TypeError, "weight must be a Tensor, got NoneType"),
    (lambda: tritongrad.layer_norm(torch.randn(3, 4), (True,)), TypeError, "list of ints"),
    (lambda: tritongrad.rms_norm(torch.randn(3, 4), (4,), eps=True), TypeError, "eps"),  # PyTorch takes a bool
    (lambda: tritongrad.rms_norm(torch.randn(3, 4), (4,), weight_offset=1.0), ValueError, "needs a weight"),
    (lambda: tritongrad.rms_norm(torch.randn(3, 4), (4,), torch.randn(4), weight_offset=float("nan")), TypeError,
     "weight_offset must be a finite float"),
]


@pytest.mark.parametrize("make,exc,match", BAD_INPUTS)
def test_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# ---------------------------------------------------------------- modules and patch()
@pytest.mark.parametrize(
    "name,kwargs",
    [(name, kw) for name in ("RMSNorm", "LayerNorm") for kw in ({}, {"eps": 1e-3}, {"elementwise_affine": False})]
    + [("LayerNorm", {"bias": False})],  # torch.nn.RMSNorm has no bias argument
    ids=str,
)
def test_modules_are_drop_in(name, kwargs):
    ours = getattr(tritongrad.nn, name)((3, 8), device=DEVICE, dtype=f32, **kwargs)
    theirs = getattr(torch.nn, name)((3, 8), device=DEVICE, dtype=f32, **kwargs)
    assert isinstance(ours, type(theirs))
    assert repr(ours) == repr(theirs)
    assert [(k, v.shape, v.dtype) for k, v in ours.state_dict().items()] == [
        (k, v.shape, v.dtype) for k, v in theirs.state_dict().items()
    ]
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    for p in theirs.parameters():
        with torch.no_grad():
            p.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 3, 8, device=DEVICE)
    torch.testing.assert_close(ours(x), theirs(x))
    ours.reset_parameters()
    theirs.reset_parameters()
    for a, c in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, c)


@pytest.mark.parametrize("name", ["RMSNorm", "LayerNorm"])
def test_modules_export(name):
    m = getattr(tritongrad.nn, name)(10, device=DEVICE)
    x = torch.randn(4, 3, 10, device=DEVICE)
    ep = torch.export.export(m, (x,))
    assert {"RMSNorm": "tritongrad.rms_norm", "LayerNorm": "tritongrad.layer_norm"}[name] in ep.graph_module.code
    torch.testing.assert_close(ep.module()(x), m(x))


def test_module_trains():
    m = tritongrad.nn.LayerNorm(12, device=DEVICE)
    target_w, target_b = torch.randn(12, device=DEVICE), torch.randn(12, device=DEVICE)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    x = torch.randn(64, 12, device=DEVICE)
    want = F.layer_norm(x, (12,), target_w, target_b)
    losses = []
    for _ in range(20):
        loss = (m(x) - want).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]


class _TorchForwardLayerNorm(torch.nn.LayerNorm):
    """A subclass that keeps torch's forward: patched."""


class _OwnForwardRMSNorm(torch.nn.RMSNorm):
    """A subclass with its own math: left alone."""

    def forward(self, x):
        return super().forward(x) * 2


def _small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.LayerNorm(8),
        torch.nn.Unflatten(1, (2, 4)),
        torch.nn.RMSNorm((2, 4), eps=1e-4),
        torch.nn.Flatten(),
        torch.nn.Sequential(_TorchForwardLayerNorm(8, bias=False), _OwnForwardRMSNorm(8)),
        torch.nn.LayerNorm(8, elementwise_affine=False),
    ).to(DEVICE)


def test_patch_torch_model():
    m = _small_model()
    x = torch.randn(5, 8, device=DEVICE)
    params_before = dict(m.named_parameters())
    keys, text, want = list(m.state_dict()), repr(m), m(x)
    norm_types = [type(mod) for mod in m.modules()]
    assert tritongrad.patch(m).count == 4
    assert tritongrad.patch(m).count == 0  # already patched
    assert dict(m.named_parameters()) == params_before  # the same Parameter objects
    assert all(p is params_before[n] for n, p in m.named_parameters())
    assert list(m.state_dict()) == keys and repr(m) == text
    assert all(isinstance(mod, t) for mod, t in zip(m.modules(), norm_types))
    assert type(m[1]) is tritongrad.nn.LayerNorm and type(m[3]) is tritongrad.nn.RMSNorm
    assert type(m[5][1]) is _OwnForwardRMSNorm
    torch.testing.assert_close(m(x), want)
    # The patched modules run tritongrad's ops (torch's would be NativeLayerNormBackward0).
    assert type(m[1](x).grad_fn).__name__ == "LayerNormBackward"
    m(x).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_patch_module_itself():
    m = torch.nn.RMSNorm(6, device=DEVICE)
    assert tritongrad.patch(m).count == 1 and type(m) is tritongrad.nn.RMSNorm


def test_llama_rms_norm_semantics():
    # Hugging Face's LlamaRMSNorm: normalise in float32, round to x's dtype, then weight * that; the
    # output dtype is promoted with the weight's (float32 weight and bfloat16 x give float32).
    # 1280 columns: the parted forward (5 chunks of 256).
    combos = ((f16, f16), (bf16, f32), (f32, f32))
    for D, (xdt, wdt) in [(D, c) for D in (40, 1280) for c in combos]:
        x = torch.randn(6, D, device=DEVICE).to(xdt).requires_grad_()
        w = (1 + 0.3 * torch.randn(D, device=DEVICE)).to(wdt).requires_grad_()
        y = llama_rms_norm(x, w, 1e-6)
        want = llama_rms_norm_reference(x, w, 1e-6)
        assert y.dtype == want.dtype == torch.promote_types(xdt, wdt)
        # Where the float32 statistics differ in their last bit, xhat may round the other way: one ulp of
        # x's dtype.
        rtol = torch.finfo(xdt).eps if xdt != f32 else 1e-6
        torch.testing.assert_close(y, want, rtol=rtol, atol=0)
        g = torch.randn_like(y)
        gx, gw = torch.autograd.grad(y, (x, w), g)
        gx64, gw64 = torch.autograd.grad(llama_rms_norm_reference(x.double(), w.double(), 1e-6), (x, w), g.double())
        assert gx.dtype == xdt and gw.dtype == wdt
        torch.testing.assert_close(gx.double(), gx64.double(), rtol=0.02, atol=0.02)
        torch.testing.assert_close(gw.double(), gw64.double(), rtol=0.02, atol=0.05)
    # The rounding of xhat itself: with float16 x and a float32 weight the float32 output shows it. Skipping
    # the rounding moves almost every element by up to 2**-11 relative; keeping it matches the reference to
    # float32 rounding except where float32 noise in the statistics flips xhat's float16 rounding (rare).
    x = torch.randn(64, 40, device=DEVICE).half()
    w = 1 + 0.3 * torch.randn(40, device=DEVICE)
    y, want = llama_rms_norm(x, w, 1e-6), llama_rms_norm_reference(x, w, 1e-6)
    assert ((y - want).abs() > 1e-6 * want.abs()).float().mean() < 0.05


def test_patch_transformers_llama():
    # transformers is in the test extra, so CI runs this; skipped only where it is not installed.
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    for xdt, wdt in ((bf16, bf16), (bf16, f32), (f32, f32)):
        m = llama.LlamaRMSNorm(64, eps=1e-5).to(DEVICE, wdt)
        with torch.no_grad():
            m.weight.normal_(1.0, 0.2)
        weight, text = m.weight, repr(m)
        x = torch.randn(3, 5, 64, device=DEVICE).to(xdt)
        want = m(x)
        assert tritongrad.patch(m).count == 1 and tritongrad.patch(m).count == 0
        assert isinstance(m, llama.LlamaRMSNorm) and m.weight is weight and repr(m) == text
        got = m(x)
        assert got.dtype == want.dtype
        rtol = 2 * torch.finfo(xdt).eps if xdt != f32 else 1e-6
        torch.testing.assert_close(got, want, rtol=rtol, atol=0)
        assert type(got.grad_fn).__name__ == "LlamaRmsNormBackward"
    # A class with other math (Gemma's 1 + weight, applied in float32) gets its own semantics
    # (tests/test_patch_models.py checks them).
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    assert tritongrad.patch(gemma.GemmaRMSNorm(16)).targets("rms_norm")


def test_backward_of_a_per_head_norm_traced_with_fake_tensors():
    """Qwen3's q/k norm: rms_norm over [B, T, H, D] heads, then transposed to [B, H, T, D]. A traced backward
    gets the upstream gradient transposed back, whose leading dims do not merge; with fake tensors a failing
    view raises ValueError, not RuntimeError, so the launcher must not try one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(2, 5, 4, 16, device=DEVICE)
    w = torch.randn(16, device=DEVICE)
    dy = torch.randn(2, 4, 5, 16, device=DEVICE).transpose(1, 2)  # [B, T, H, D] with [B, H, T, D] strides
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx, fw, fdy = (mode.from_tensor(t) for t in (x, w, dy))
        assert rt.as_rows(fdy).shape == (40, 16)
    y_ref = x.clone().requires_grad_()
    w_ref = w.clone().requires_grad_()
    F.rms_norm(y_ref, (16,), w_ref, 1e-6).backward(dy)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    tritongrad.rms_norm(xg, (16,), wg, 1e-6).backward(dy)
    torch.testing.assert_close(xg.grad, y_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wg.grad, w_ref.grad, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- fused_add_rms_norm beyond the kit's cases
def _decoder_add_norm(x, residual, weight, eps):
    # What a Llama decoder layer writes: the stream's add in its dtype, then LlamaRMSNorm
    s = residual + x
    return llama_rms_norm_reference(s, weight, eps), s


@pytest.mark.parametrize("D", [48, 8200])  # one tile; longer rows (the add, then llama_rms_norm's kernels)
def test_fused_add_rms_norm_is_the_decoder_layers_add_and_norm(D):
    # The stream bitwise, y to its one rounding; a float32 weight gives a float32 y, as Hugging Face's product
    # promotes.
    for dtype in (torch.float16, torch.bfloat16):
        x, r = torch.randn(2, 3, D, device=DEVICE).to(dtype), torch.randn(2, 3, D, device=DEVICE).to(dtype)
        for w in (torch.rand(D, device=DEVICE).to(dtype) + 0.5, torch.rand(D, device=DEVICE) + 0.5):
            y, s = tritongrad.fused_add_rms_norm(x, r, w, 1e-6)
            want_y, want_s = _decoder_add_norm(x, r, w, 1e-6)
            assert torch.equal(s, want_s) and y.dtype == want_y.dtype and s.is_contiguous()
            # xhat is rounded to x's dtype before the product: a statistic's last bit may flip that rounding
            torch.testing.assert_close(y, want_y, atol=0, rtol=2 * torch.finfo(dtype).eps)
    # transposed inputs (read in place): the stream still comes back contiguous, bitwise the add
    xt, rt_ = torch.randn(D, 5, device=DEVICE).half().t(), torch.randn(D, 5, device=DEVICE).half().t()
    y, s = tritongrad.fused_add_rms_norm(xt, rt_, torch.rand(D, device=DEVICE).half() + 0.5, 1e-6)
    assert s.is_contiguous() and y.is_contiguous() and torch.equal(s, rt_ + xt)


def test_fused_add_rms_norm_reference_keeps_the_layout_contract():
    # The reference is what CPU tensors run without the interpreter: the same contiguous outputs as the
    # kernels, also for a strided x beside a contiguous residual (Inkling's decoder views the stream after).
    from tritongrad.ops.norm.residual import fused_add_rms_norm_reference

    x, r = torch.randn(8, 5, dtype=torch.float64).t(), torch.randn(5, 8, dtype=torch.float64)
    y, s = fused_add_rms_norm_reference(x, r, torch.rand(8, dtype=torch.float64) + 0.5, 1e-6)
    assert s.is_contiguous() and y.is_contiguous() and torch.equal(s, r + x)


def test_fused_add_rms_norm_gives_each_input_its_own_gradient():
    x, r = [torch.randn(6, 40, device=DEVICE, requires_grad=True) for _ in range(2)]
    w = torch.rand(40, device=DEVICE, requires_grad=True)
    y, s = tritongrad.fused_add_rms_norm(x, r, w, 1e-6)
    (y.square().sum() + s.sum()).backward()
    assert x.grad.data_ptr() != r.grad.data_ptr() and torch.equal(x.grad, r.grad)
    x.grad.add_(1.0)  # the caller owns it: r's gradient is untouched
    assert not torch.equal(x.grad, r.grad)


@pytest.mark.parametrize("bad, match", [
    (dict(residual=torch.zeros(4, 9)), r"x and residual must share a shape \[\.\.\., D\] and a dtype, got \(4, 8\) "
                                       r"torch.float32 and \(4, 9\) torch.float32"),
    (dict(residual=torch.zeros(4, 8, dtype=torch.float16)), r"and a dtype, got \(4, 8\) torch.float32 and \(4, 8\) "
                                                            r"torch.float16"),
    (dict(weight=torch.ones(9)), r"weight must be \[D\] = \[8\] for x of shape \(4, 8\), got \(9,\)"),
])
def test_fused_add_rms_norm_refuses_mismatched_inputs(bad, match):
    args = dict(x=torch.zeros(4, 8), residual=torch.zeros(4, 8), weight=torch.ones(8))
    args.update({k: v.to(DEVICE) for k, v in bad.items()})
    with pytest.raises(ValueError, match=match):
        tritongrad.fused_add_rms_norm(**{k: v.to(DEVICE) for k, v in args.items()})

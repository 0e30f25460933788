"""rms_norm and layer_norm on small shapes: through Triton's interpreter on CPU, compiled on a GPU."""

import math
import pytest
import torch
import torch.nn.functional as F
from conftest import ATOL, DEVICE, run_without_interpreter

import tritongrad
from tritongrad import _runtime as rt
from tritongrad.ops import _norm_backward as nb
from tritongrad.ops import _norm_common as nc
from tritongrad.ops.layer_norm import launch as ln_launch
from tritongrad.ops.layer_norm import layer_norm_reference
from tritongrad.ops.rms_norm import launch as rms_launch
from tritongrad.ops.rms_norm import llama_rms_norm, llama_rms_norm_reference, rms_norm_reference
from tritongrad.ops.rms_norm.reference import default_eps
from tritongrad.testing import assert_close_earned, make_rows

NORMS = ["rms_norm", "layer_norm"]
HAS_BIAS = {"rms_norm": False, "layer_norm": True}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

# (leading shape, normalized_shape): why each is here
SHAPES = [
    ((1,), (64,)),          # one row
    ((5,), (37,)),          # D not a power of two, N not a multiple of the row tile: both masks active
    ((3,), (20000,)),       # D > FWD/BWD_MAX_BLOCK_D, few rows: chunks, row passes split across columns
    ((5,), (16502,)),       # D > FWD/BWD_MAX_BLOCK_D, a row tile per "SM": chunks, whole-row passes
    ((5,), (9000,)),        # BWD_MAX_BLOCK_D < D <= 3 LONG_BWD_CHUNKs, a row per "SM": one-kernel backward
    ((300,), (24,)),        # several row chunks: dw/db go through the partial buffer and column_sum
    ((2, 3), (20,)),        # 3-D input
    ((2, 2, 3), (9,)),      # 4-D input
    ((4,), (3, 5)),         # normalized_shape spanning 2 dims (weight [3, 5])
    ((2, 3), (4, 6)),       # 4-D input, 2 normalised dims
    ((0,), (8,)),           # N = 0: dw/db are zeros
    ((2, 0), (5,)),         # a size-0 leading dim
    ((4,), (0,)),           # D = 0: everything empty
]


def call(norm, fn, x, ns, w, b, eps):
    return fn(x, ns, w, b, eps) if HAS_BIAS[norm] else fn(x, ns, w, eps)


def eager(norm, x, ns, w, b, eps):
    """What a user would write in plain PyTorch, in the inputs' dtypes: the error baseline. PyTorch's
    layer_norm wants its parameters in x's dtype on some devices: then they are cast, as a user would."""
    fn = F.layer_norm if HAS_BIAS[norm] else F.rms_norm
    try:
        return call(norm, fn, x, ns, w, b, eps)
    except RuntimeError:
        cast = lambda t: t.to(x.dtype) if t is not None else None  # noqa: E731
        return call(norm, fn, x, ns, cast(w), cast(b), eps)


def default(norm, dtype):
    return default_eps(dtype) if norm == "rms_norm" else 1e-5


def leaves(ts, needs):
    return [t.detach().requires_grad_(n) if t is not None else None for t, n in zip(ts, needs)]


def check(norm, x, ns, w=None, b=None, g=None, needs=None, eps=None, factor=2.0):
    """Forward and requested gradients against float64, within 2x eager PyTorch's error (+ a few ulps)."""
    fn = tritongrad.layer_norm if HAS_BIAS[norm] else tritongrad.rms_norm
    ref = layer_norm_reference if HAS_BIAS[norm] else rms_norm_reference
    eps_used = default(norm, x.dtype) if eps is None else eps
    if needs is None:
        needs = (True, w is not None, b is not None)
    D = math.prod(ns)
    N = x.numel() // max(D, 1) if D else math.prod(x.shape[: x.dim() - len(ns)])
    atol = ATOL[x.dtype]

    ours = leaves((x, w, b), needs)
    y = call(norm, fn, ours[0], ns, ours[1], ours[2], eps if eps is not None or norm == "rms_norm" else eps_used)
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    r64 = leaves([t.double() if t is not None else None for t in (x, w, b)], needs)
    y64 = call(norm, ref, r64[0], ns, r64[1], r64[2], eps_used)
    base = leaves((x, w, b), needs)
    ye = eager(norm, base[0], ns, base[1], base[2], eps_used)
    assert_close_earned("y", y, y64, ye, factor, atol * max(1.0, y64.abs().max().item() if y64.numel() else 1.0))
    if not any(needs):
        assert y.grad_fn is None
        return
    if g is None:
        g = torch.randn(y.shape, dtype=y.dtype, device=y.device)
    y.backward(g)
    y64.backward(g.double())
    ye.backward(g)
    for name, t, o, r, e, n in zip(("dx", "dw", "db"), (x, w, b), ours, r64, base, needs):
        if t is None:
            continue
        if not n:
            assert o.grad is None, f"{name} computed though not needed"
            continue
        assert o.grad.dtype == t.dtype and o.grad.shape == t.shape, name
        # Column sums over N rows: their rounding error grows like sqrt(N).
        scale = max(1.0, r.grad.abs().max().item() if r.grad.numel() else 1.0)
        a = ATOL[t.dtype] * scale * (1.0 if name == "dx" else max(1.0, N**0.5))
        assert_close_earned(name, o.grad, r.grad, e.grad, factor, a)


def params(norm, ns, dtype, device=DEVICE):
    w = (1 + 0.5 * torch.randn(ns, device=device)).to(dtype)
    b = (0.5 * torch.randn(ns, device=device)).to(dtype) if HAS_BIAS[norm] else None
    return w, b


@pytest.fixture
def small_tiles():
    """Rows longer than 8 columns take the chunked path, in chunks of 4: the two-read forward, Chan's
    merge over several chunks with a ragged last one, the row-sum pass and the column-split backward, at
    sizes the interpreter runs quickly."""
    saved = nc.FWD_MAX_BLOCK_D, nc.BWD_MAX_BLOCK_D, nc.CHUNK_D
    nc.FWD_MAX_BLOCK_D, nc.BWD_MAX_BLOCK_D, nc.CHUNK_D = 8, 8, 4
    _clear_plans()
    yield
    nc.FWD_MAX_BLOCK_D, nc.BWD_MAX_BLOCK_D, nc.CHUNK_D = saved
    _clear_plans()


@pytest.fixture
def whole_rows(monkeypatch):
    """Chunked rows are never split across columns, however few: the single-pass-per-row kernels."""
    monkeypatch.setattr(nc, "SPLIT_PROGS_PER_SM", 0)
    _clear_plans()
    yield
    _clear_plans()


@pytest.fixture
def long_rows(monkeypatch):
    """Rows of 17 to 32 columns take the one-kernel long-row backward, in 3 or 4 chunks of 8 columns (the
    last one ragged unless D is a multiple of 8), at sizes the interpreter runs quickly. 4 "SMs" on a GPU
    too, so that a few rows are enough for the path (it needs a row per SM)."""
    monkeypatch.setattr(rt, "sm_count", lambda device: 4)
    monkeypatch.setattr(nc, "BWD_MAX_BLOCK_D", 16)
    monkeypatch.setattr(nc, "LONG_BWD_CHUNK", 8)
    _clear_plans()
    yield
    _clear_plans()


def _long_path_taken(norm, N, D, dtype=torch.float32, wdtype=None):
    return nc.long_bwd_plan(N, D, rt.sm_count(torch.device(DEVICE)), norm == "layer_norm", dtype.itemsize,
                            (wdtype or dtype).itemsize, 4, rt.align(D))


def _clear_plans():
    for plan in (nc.fwd_plan, nc.bwd_plan, nc.column_split, nc.long_bwd_plan):
        plan.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,ns", SHAPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_shapes_and_dtypes(norm, lead, ns, dtype):
    x = (2 * torch.randn(*lead, *ns, device=DEVICE) + (1.5 if norm == "layer_norm" else 0)).to(dtype)
    w, b = params(norm, ns, dtype)
    check(norm, x, ns, w, b)


def test_shape_comments_hold():
    # The reasons given in SHAPES rely on these launch decisions (4 "SMs" off the GPU).
    assert not nc.fwd_plan(3, 20000).ONE_TILE and nc.bwd_plan(3, 20000, 4)[1] > 1   # chunked, column split
    assert nc.column_split(3, 20000, nc.fwd_plan(3, 20000), 4)[0] > 1                # split row passes
    assert nc.column_split(3, 20000, nc.bwd_plan(3, 20000, 4)[0], 4)[0] > 1
    assert not nc.fwd_plan(5, 16502).ONE_TILE and not nc.bwd_plan(5, 16502, 4)[0].ONE_TILE
    assert nc.column_split(5, 16502, nc.fwd_plan(5, 16502), 4)[0] == 1               # whole-row passes
    assert nc.column_split(5, 16502, nc.bwd_plan(5, 16502, 4)[0], 4)[0] == 1
    assert nc.long_bwd_plan(5, 16502, 4, True, 4, 4, 4, 2) is None     # layer_norm: over 4 chunks, two kernels
    assert nc.long_bwd_plan(5, 16502, 4, False, 4, 4, 4, 2) is None    # rms_norm: 5 chunks, but rows of 8 bytes
    assert nc.long_bwd_plan(5, 16500, 4, False, 4, 4, 4, 4).SPLIT == 2  # ... of 16 bytes: two programs
    assert nc.long_bwd_plan(5, 16500, 4, False, 2, 2, 4, 4) is None    # ... in bf16, rows of 8 bytes again
    assert nc.long_bwd_plan(5, 16512, 4, False, 2, 2, 4, 16).SPLIT == 2
    assert all(nc.long_bwd_plan(5, 9000, 4, c, s, s, 4, 8).NCH == 3 for c in (False, True) for s in (2, 4))
    assert nc.long_bwd_plan(3, 9000, 4, False, 4, 4, 4, 8) is None                  # fewer rows than SMs
    assert nc.long_bwd_plan(5, 9000, 4, False, 8, 8, 8, 8) is None                  # float64
    assert nc.long_bwd_plan(5, 9000, 4, True, 4, 2, 4, 8) is None                   # float32 x, 16-bit w
    assert nc.bwd_plan(300, 24, 4)[2] > 1                                            # several partial rows
    assert nc.bwd_plan(1000, 8, 4)[2] > 1                                            # determinism test
    assert 5 % nc.fwd_plan(5, 37).BLOCK_N and 5 % nc.bwd_plan(5, 37, 4)[0].BLOCK_N   # ragged row tile


def test_forward_warps_for_wide_16bit_rows():
    # Whole rows of 16-bit elements longer than 4096 columns run 8 warps (two programs resident per SM on
    # an H200); float32 rows and shorter rows keep row_tile's choice.
    assert nc.fwd_plan(64, 16384, 2).num_warps == nc.FWD_WARPS_WIDE_16BIT == 8
    assert nc.fwd_plan(64, 8192, 2).num_warps == 8
    assert nc.fwd_plan(64, 16384, 4).num_warps == 16
    assert nc.fwd_plan(64, 4096, 2) == nc.fwd_plan(64, 4096, 4)
    assert not nc.fwd_plan(64, 32768, 2).ONE_TILE and nc.fwd_plan(64, 32768, 2) == nc.fwd_plan(64, 32768, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D", [100, 200, 300, 700, 1500, 3000])
def test_layer_norm_16bit_forward_tiles(D, dtype, monkeypatch):
    # layer_norm's forward over 16-bit rows of up to 4096 columns takes its own tiles and warps where
    # LN_FWD_16BIT has them (128 to 4096 columns here, each ragged; 9 rows leave the last row tile ragged
    # where a tile holds several rows); rms_norm, 32-bit x and float64 statistics keep FWD_TILE.
    big = 1 << 20  # rows enough that no tile is clamped to N
    t = nc.fwd_plan(big, D, 2, dtype)
    entry = nc.LN_FWD_16BIT[dtype].get(rt.next_pow2(D))
    if entry is None:
        assert t == nc.fwd_plan(big, D, 2)
    else:
        # bf16 rows that mask a quarter or more of a tile of at most 2048 lanes: twice the table's elements.
        doubled = dtype == torch.bfloat16 and D in (300, 700, 1500)
        assert t.ONE_TILE and (t.BLOCK_N * t.BLOCK_D, t.num_warps) == ((1 + doubled) * entry[0], entry[1])
    assert nc.fwd_plan(big, D, 2) == nc.fwd_plan(big, D, 4, torch.float32) == nc.fwd_plan(big, D, 4)
    # The launcher asks for the table with x's dtype (float32 statistics) and without it for float64 ones.
    asked = []
    plan = nc.fwd_plan
    monkeypatch.setattr(nc, "fwd_plan", lambda *a: asked.append(a[3:]) or plan(*a))
    N = 9
    x = (2 * torch.randn(N, D, device=DEVICE) + 1.5).to(dtype)
    w, b = params("layer_norm", (D,), dtype)
    check("layer_norm", x, (D,), w, b)
    tritongrad.layer_norm(x[:, :16], (16,), w[:16].double(), b[:16].double())
    assert asked == [(dtype,), (None,)]


def test_backward_pipelining_depth_fits_shared_memory():
    # BWD_STAGES - 1 row tiles of x and dy per resident program, fewer where they would not fit the SM.
    h200, small = 228 * 1024, 100 * 1024
    t = nc.bwd_plan(32768, 4096, 132)[0]
    assert (t.BLOCK_N * t.BLOCK_D, nc.bwd_per_sm(t)) == (4096, 2)
    assert nc.bwd_stages(t, 2 + 2, h200) == nc.BWD_STAGES == 3   # bf16: 2 x 16 KiB per program
    assert nc.bwd_stages(t, 4 + 4, h200) == 3                   # float32: 2 x 32 KiB
    assert nc.bwd_stages(t, 8 + 8, h200) == 2                   # float64: 64 KiB tiles, only one ahead fits
    assert nc.bwd_stages(t, 4 + 4, small) == 2
    assert nc.bwd_stages(t, 8 + 8, small) == 1                  # no pipelining rather than one program less
    wide = nc.bwd_plan(16384, 8192, 132)[0]
    assert nc.bwd_per_sm(wide) == 1 and nc.bwd_stages(wide, 8 + 8, h200) == 2


def test_layer_norm_backward_tile_for_32bit_rows(monkeypatch):
    # layer_norm's backward steps over half the rows with 32/64-bit x (faster on an H200, _norm_common);
    # 16-bit x and rms_norm keep BWD_TILE. The spy sees which tile each launcher asks for.
    asked = []
    plan = nc.bwd_plan
    monkeypatch.setattr(nc, "bwd_plan",
                        lambda N, D, sms, tile, itemsize: asked.append(tile) or plan(N, D, sms, tile, itemsize))
    for norm, dtype in (("layer_norm", torch.float32), ("layer_norm", torch.float64), ("layer_norm", torch.bfloat16),
                        ("rms_norm", torch.float32)):
        x = torch.randn(6, 16, device=DEVICE, dtype=dtype, requires_grad=True)
        w, b = params(norm, (16,), dtype)
        w.requires_grad_()
        out = tritongrad.layer_norm(x, (16,), w, b) if norm == "layer_norm" else tritongrad.rms_norm(x, (16,), w)
        out.sum().backward()
    assert asked == [nc.LN_BWD_TILE_32BIT] * 2 + [nc.BWD_TILE] * 2 and nc.LN_BWD_TILE_32BIT < nc.BWD_TILE
    assert plan(4096, 32, 4, nc.LN_BWD_TILE_32BIT)[0].BLOCK_N < plan(4096, 32, 4)[0].BLOCK_N


def test_layer_norm_float32_forward_warps_for_masked_8192_tiles():
    # float32 rows in a tile of 8192 lanes with a quarter or more masked: 8 warps for layer_norm's two
    # reductions (LN_FWD_MASKED_FP32_WARPS); a full or nearly full tile, and rms_norm, keep row_tile's 16.
    # (5120 and 6144 themselves take the parted forward: test_forward_parts_plan.)
    big = 1 << 20
    for D, warps in ((5000, 8), (6000, 8), (7000, 16), (8192, 16)):
        assert nc.fwd_plan(big, D, 4, torch.float32).num_warps == warps
        assert nc.fwd_plan(big, D, 4).num_warps == 16


def test_forward_parts_plan():
    # Rows of 3 to 13 power-of-two chunks (an odd number), up to FWD_MAX_BLOCK_D, take the parted forward,
    # with warps that give each thread one 16-byte vector of every chunk (16-bit rows: at most 8 warps).
    assert nc.fwd_parts(5120, 2) == (1024, 5, 4) and nc.fwd_parts(5120, 4) == (1024, 5, 8)
    assert nc.fwd_parts(1536, 2) == (512, 3, 2) and nc.fwd_parts(7168, 2) == (1024, 7, 4)
    assert nc.fwd_parts(12288, 2) == (4096, 3, 8) and nc.fwd_parts(12288, 4) == (4096, 3, 16)
    assert nc.fwd_parts(4608, 2) == (512, 9, 2) and nc.fwd_parts(13312, 2) == (1024, 13, 4)
    # A power of two, 15 chunks (a sixteenth of the tile masked), chunks of 8 columns, a row longer than one
    # tile, a chunk narrower than a 16-byte vector per thread of one warp: the tile plans.
    for D, elem in ((4096, 2), (15360, 2), (13000, 2), (20480, 2), (24, 4), (384, 2)):
        assert nc.fwd_parts(D, elem) is None


@pytest.mark.parametrize("layout", ["contiguous", "row-sliced", "transposed"])
@pytest.mark.parametrize(
    "D,dtype,wdtype",
    [
        (384, torch.float32, torch.float32),    # 3 chunks of 128: parts of 2 and 1 chunks
        (640, torch.float64, torch.float64),    # 5 chunks of 128, float64 statistics: parts of 4 and 1
        (1280, torch.bfloat16, torch.bfloat16),  # 5 chunks of 256, 16-bit
        (1792, torch.float16, torch.float32),   # 7 chunks of 256: parts of 4, 2 and 1; float32 parameters
        (896, torch.float32, None),             # 7 chunks of 128, no weight or bias
        (1152, torch.float32, torch.float32),   # 9 chunks of 128: parts of 8 and 1
        (3328, torch.bfloat16, torch.float32),  # 13 chunks of 256: parts of 8, 4 and 1; float32 parameters
    ],
    ids=str,
)
@pytest.mark.parametrize("norm", NORMS)
def test_forward_in_parts(norm, D, dtype, wdtype, layout, monkeypatch):
    # The parted forward (ops/_norm_forward.py) on every layout (row-sliced: ALIGN 1; transposed: column
    # stride N), with a constant row and a zero row among random ones, then the backward from its outputs.
    seen = set()
    launch = rt.Kernel._launch
    monkeypatch.setattr(rt.Kernel, "_launch",
                        lambda self, *a, **kw: seen.add(self.fn.__name__) or launch(self, *a, **kw))
    x = make_rows((6, D), dtype, DEVICE, layout, scale=2.0)
    if norm == "layer_norm":
        x.add_(3)
    x[1] = 0.7
    x[2] = 0.0
    w, b = params(norm, (D,), wdtype) if wdtype is not None else (None, None)
    check(norm, x, (D,), w, b)
    assert "_norm_fwd_parts_kernel" in seen and f"_{norm}_fwd_kernel" not in seen
    y = tritongrad.rms_norm(x, (D,), w) if norm == "rms_norm" else tritongrad.layer_norm(x, (D,), w, b)
    if norm == "rms_norm":
        assert (y[2] == 0).all()
    else:  # x - mean is exactly 0 on a constant row: y = b, rounded to y's dtype (the interpreter truncates
        # a float32 b to 16 bits where a GPU rounds: one ulp apart)
        want = b if b is not None else torch.zeros(D, device=DEVICE, dtype=y.dtype)
        rtol = 0 if want.dtype == y.dtype else torch.finfo(y.dtype).eps
        torch.testing.assert_close(y[1].float(), want.to(y.dtype).float(), atol=0, rtol=rtol)


def test_backward_of_masked_16bit_rows_pipelines_deeper(monkeypatch):
    # Whole 16-bit rows that mask a quarter or more of their tile (5120 in 8192, 2560 in 4096, 1536 in
    # 2048) take programs of at most 8 warps and one pipelining stage more; an eighth masked (7168), full
    # tiles, float32 and tiles under 2048 columns keep the plan (BWD_MASKED_16BIT).
    h200 = 228 * 1024
    for D in (5120, 6144, 2560, 1536, 1280, 3072):
        t = nc.bwd_plan(65536, D, 132, nc.BWD_TILE, 2)[0]
        assert nc.masked_16bit(t, D, 2) and t.num_warps <= nc.BWD_MASKED_16BIT[0]
        assert nc.bwd_stages(t, 4, h200, nc.BWD_MASKED_16BIT[1]) == nc.BWD_MASKED_16BIT[1] == nc.BWD_STAGES + 1
    assert nc.bwd_plan(65536, 5120, 132, nc.BWD_TILE, 4)[0].num_warps == 16     # float32: as before
    for D, elem in ((4096, 2), (8192, 2), (7168, 2), (3584, 2), (5120, 4), (1000, 2)):
        t = nc.bwd_plan(65536, D, 132, nc.BWD_TILE, elem)[0]
        assert not nc.masked_16bit(t, D, elem) and t == nc.bwd_plan(65536, D, 132, nc.BWD_TILE, 4)[0]
    # The launcher asks for that depth: the spy sees STAGES of the main backward kernel.
    seen = []
    launch = rt.Kernel._launch
    monkeypatch.setattr(rt.Kernel, "_launch", lambda self, grid, *a, **kw: seen.append(kw.get("STAGES")) or
                        launch(self, grid, *a, **kw))
    monkeypatch.setattr(rt, "shared_mem_per_sm", lambda device: h200)
    for D in (2560, 2048):
        x = torch.randn(3, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        tritongrad.rms_norm(x, (D,)).sum().backward()
    assert [s for s in seen if s is not None] == [nc.BWD_MASKED_16BIT[1], nc.BWD_STAGES]


@pytest.mark.parametrize("split", [True, False], ids=["column-split", "whole-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("lead,ns", [((5,), (13,)), ((3, 2), (2, 7)), ((300,), (9,))], ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_chunked_path(norm, lead, ns, dtype, split, small_tiles, request):
    # With tiles this small every shape here is one row tile, fewer than the 4 "SMs": split by default.
    if not split:
        request.getfixturevalue("whole_rows")
    N, D = math.prod(lead), math.prod(ns)
    t = nc.fwd_plan(N, D)
    assert not t.ONE_TILE and (nc.column_split(N, D, t, 4)[0] > 1) == split
    x = (2 * torch.randn(*lead, *ns, device=DEVICE) + (40.0 if norm == "layer_norm" else 0)).to(dtype)
    w, b = params(norm, ns, dtype)
    check(norm, x, ns, w, b)


@pytest.mark.parametrize("case", ["plain", "transposed-x, expanded-dy", "mixed", "no-affine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lead,ns", [((5,), (21,)), ((3, 2), (19,)), ((9,), (3, 8)), ((40,), (17,))], ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_long_rows_path(norm, lead, ns, dtype, case, long_rows):
    # 21 and 19 columns: 3 chunks, the last ragged; 24: 3 full chunks over 2 normalised dims; 40 rows: 10
    # per program. The launcher's choice is asserted, so a change to the plan cannot turn this into a
    # test of the two-kernel path.
    N, D = math.prod(lead), math.prod(ns)
    assert _long_path_taken(norm, N, D, dtype, torch.float32 if case == "mixed" else dtype).NCH == 3
    if case == "transposed-x, expanded-dy":
        x = make_rows((N, D), torch.float32, DEVICE, "transposed").to(dtype)
        w, b = params(norm, (D,), dtype)
        fn = tritongrad.layer_norm if HAS_BIAS[norm] else tritongrad.rms_norm
        ref = layer_norm_reference if HAS_BIAS[norm] else rms_norm_reference
        got = leaves((x, w, b), (True,) * 3)
        want = leaves([t.double() if t is not None else None for t in (x, w, b)], (True,) * 3)
        call(norm, fn, got[0], (D,), got[1], got[2], 1e-5).sum().backward()
        call(norm, ref, want[0], (D,), want[1], want[2], 1e-5).sum().backward()
        for a, c in zip(got, want):
            if a is not None:
                torch.testing.assert_close(a.grad.double(), c.grad, **_tol(dtype, N))
        return
    x = (2 * torch.randn(*lead, *ns, device=DEVICE) + (40.0 if norm == "layer_norm" else 0)).to(dtype)
    w, b = params(norm, ns, torch.float32 if case == "mixed" else dtype)
    check(norm, x, ns, *((None, None) if case == "no-affine" else (w, b)))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "N,D,want",  # want: (SPLIT, NCH, row groups, programs)
    [
        (12, 32, (2, 2, 2, 4)),  # 4 chunks in 2 programs of 2; 4 "SMs": 2 row groups, added by column_sum
        (7, 48, (2, 3, 2, 4)),   # 6 chunks in 2 programs of 3; 7 rows: groups of unequal length
        (9, 64, (3, 3, 1, 3)),   # 8 chunks in 3 programs of 24, 24 and 16 columns (the last one's third
                                 # chunk lies past the row: masked); one group writes dw/db directly
        (10, 40, (2, 3, 2, 4)),  # 5 chunks, 8-element (16-byte) aligned rows that are not multiples of 16
    ],
    ids=str,
)
def test_long_rows_split(norm, N, D, want, dtype, long_rows, monkeypatch):
    split = {4: (2, 4, 1), 5: (2, 4, 1), 6: (2, 4, 1), 8: (3, 4, 1)}
    monkeypatch.setattr(nc, "LONG_BWD_SPLIT", {(c, n, n, k): v for c in (False, True) for n in (2, 4)
                                               for k, v in split.items()})
    monkeypatch.setattr(nc, "LONG_BWD_WARPS", {})
    _clear_plans()
    plan = _long_path_taken(norm, N, D, dtype)
    assert (plan.SPLIT, plan.NCH, plan.groups, plan.programs) == want
    assert _long_path_taken(norm, N, 29, dtype) is None  # rows of 29 elements: not 16-byte aligned
    x = (2 * torch.randn(N, D, device=DEVICE) + (40.0 if norm == "layer_norm" else 0)).to(dtype)
    check(norm, x, (D,), *params(norm, (D,), dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [29, 32])
def test_long_rows_four_chunks(D, dtype, long_rows):
    # rms_norm runs rows of 4 chunks (ragged and full) in one kernel; layer_norm's would spill on a GPU and
    # stay with the two kernels (LONG_BWD_WARPS).
    assert _long_path_taken("rms_norm", 12, D, dtype).NCH == 4 and _long_path_taken("layer_norm", 12, D, dtype) is None
    x = torch.randn(12, D, device=DEVICE).to(dtype)
    check("rms_norm", x, (D,), *params("rms_norm", (D,), dtype))
    check("layer_norm", x, (D,), *params("layer_norm", (D,), dtype))


@pytest.mark.parametrize("path", ["registers", "small_tiles", "long_rows"])
@pytest.mark.parametrize(
    "D,sx,sdy,fwd,bwd",  # row length, row strides of x and dy; the largest power of two dividing D and
    # x's row stride (the forward's rows), and that dividing all three (the backward's)
    [(24, 24, 24, 8, 8), (24, 28, 24, 4, 4), (24, 24, 26, 8, 2), (20, 36, 20, 4, 4)],
    ids=str,
)
@pytest.mark.parametrize("norm", NORMS)
def test_rows_aligned_below_16(norm, D, sx, sdy, fwd, bwd, path, request, monkeypatch):
    # Row lengths and strides that are multiples of 8, 4 or 2 elements but not of 16: each kernel is told
    # the largest power of two that divides the ones it reads (ALIGN, so that its loads vectorise on a
    # GPU; ops/_tl.aligned). A hint that one of them does not honour rounds it down in the kernel and
    # misplaces rows: x and dy get different alignments, so each must be counted.
    if path != "registers":
        request.getfixturevalue(path)
    N = 12
    assert (_long_path_taken(norm, N, D) is not None) == (path == "long_rows")
    seen = {}
    launch = rt.Kernel._launch

    def spy(self, grid, *args, **kw):
        seen.setdefault(self.fn.__name__, set()).add(kw.get("ALIGN"))
        return launch(self, grid, *args, **kw)

    monkeypatch.setattr(rt.Kernel, "_launch", spy)
    x = (2 * torch.randn(N, sx, device=DEVICE) + (3.0 if norm == "layer_norm" else 0))[:, :D]
    g = torch.randn(N, sdy, device=DEVICE)[:, :D]
    check(norm, x, (D,), *params(norm, (D,), torch.float32), g=g)
    main = seen.get("_norm_bwd_kernel", set()) | seen.get("_norm_bwd_long_kernel", set())
    assert main == {bwd}
    # Column splits (small tiles) are multiples of 4 columns: ALIGN 4 where rows allow more.
    assert max(seen.get("_norm_bwd_rowsum_kernel", {bwd})) <= bwd
    fwd_seen = seen[f"_{norm}_fwd_kernel"]
    assert max(fwd_seen) <= fwd and (path == "small_tiles" or fwd_seen == {fwd})


def _tol(dtype, N):
    a = ATOL[dtype] * max(1.0, N**0.5)
    return {"atol": a, "rtol": 2 * a}


@pytest.mark.parametrize("norm,needs", [(n, k) for n in NORMS for k in ((True, False, False), (False, True, True),
                                                                      (False, True, False))], ids=str)
def test_long_rows_needs_input_grad(norm, needs, long_rows):
    # Only dw (and db): the kernel skips its row-sum pass and stores no dx.
    assert _long_path_taken(norm, 50, 20)
    x = torch.randn(50, 20, device=DEVICE)
    check(norm, x, (20,), *params(norm, (20,), torch.float32), needs=needs)


@pytest.mark.parametrize(
    "xdt,pdt",
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.bfloat16),
     (torch.float32, torch.float64),
     (torch.bfloat16, torch.float64)],  # float64 accumulation stored to bfloat16 (goes through float32)
    ids=str,
)
@pytest.mark.parametrize("norm", NORMS)
def test_mixed_dtypes(norm, xdt, pdt):
    # y in x's dtype (as torch.nn.functional); each gradient in its own input's dtype.
    x = torch.randn(9, 70, device=DEVICE).to(xdt)
    w, b = params(norm, (70,), pdt)
    check(norm, x, (70,), w, b)


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
@pytest.mark.parametrize("norm", NORMS)
def test_layouts(norm, layout, shape):
    x = make_rows(shape, torch.float32, DEVICE, layout)
    w = torch.randn(2 * shape[-1], device=DEVICE)[::2]  # weight strided too
    b = torch.randn(3 * shape[-1], device=DEVICE)[::3] if HAS_BIAS[norm] else None
    g = make_rows(shape, torch.float32, DEVICE, "transposed")  # a non-contiguous dy
    check(norm, x, (shape[-1],), w, b, g=g)


@pytest.mark.parametrize("layout", ["row-sliced", "transposed"])
@pytest.mark.parametrize("norm", NORMS)
def test_strided_x_is_not_copied(norm, layout, monkeypatch):
    # A row-sliced or transposed 2-D x must reach the forward and backward kernels as the same storage.
    launch = rms_launch if norm == "rms_norm" else ln_launch
    x = make_rows((33, 16), torch.float32, DEVICE, layout).requires_grad_()
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    seen = []
    for launch, name in ((launch, "_fwd_kernel"), (nb, "_kernel")):
        kernel = getattr(launch, name)

        class Spy:
            def __getitem__(self, grid, kernel=kernel):
                def run(x_arg, *args, **kw):
                    seen.append((x_arg.data_ptr(), x_arg.stride()))
                    return kernel[grid](x_arg, *args, **kw)
                return run

        monkeypatch.setattr(launch, name, Spy())
    y = tritongrad.rms_norm(x, (16,), w) if norm == "rms_norm" else tritongrad.layer_norm(x, (16,), w)
    y.backward(torch.randn_like(y))
    assert seen == [(x.data_ptr(), x.stride())] * 2


@pytest.mark.parametrize("norm", NORMS)
def test_expanded_grad_from_sum_backward(norm):
    # y.sum().backward() hands the backward a stride-0 dy.
    x = torch.randn(6, 5, 11, device=DEVICE)
    w, b = params(norm, (11,), torch.float32)
    fn = tritongrad.layer_norm if HAS_BIAS[norm] else tritongrad.rms_norm
    ref = layer_norm_reference if HAS_BIAS[norm] else rms_norm_reference
    got, want = leaves((x, w, b), (True,) * 3), leaves((x, w, b), (True,) * 3)
    call(norm, fn, got[0], (11,), got[1], got[2], 1e-5).sum().backward()
    call(norm, ref, want[0], (11,), want[1], want[2], 1e-5).sum().backward()
    for a, c in zip(got, want):
        if a is not None:
            torch.testing.assert_close(a.grad, c.grad, atol=1e-5, rtol=1e-5)


NEEDS = {
    "rms_norm": [(True, False, False), (False, True, False), (False, False, False)],
    "layer_norm": [(True, False, False), (False, True, False), (False, False, True), (False, True, True),
                   (True, True, False), (False, False, False)],
}


@pytest.mark.parametrize("norm,needs", [(n, k) for n in NORMS for k in NEEDS[n]], ids=str)
def test_needs_input_grad(norm, needs, monkeypatch):
    launch = rms_launch if norm == "rms_norm" else ln_launch
    seen = []
    backward = launch._OP.backward
    monkeypatch.setattr(launch._OP, "backward", lambda *a: seen.append(a[-1]) or backward(*a))
    # 300 rows: several row chunks, so dw and db (or either alone) go through the partial buffer and
    # column_sum, where layer_norm puts them side by side.
    assert nc.bwd_plan(300, 33, rt.sm_count(torch.device(DEVICE)))[2] > 1
    x = torch.randn(300, 33, device=DEVICE)
    w, b = params(norm, (33,), torch.float32)
    check(norm, x, (33,), w, b, needs=needs)
    want = needs if HAS_BIAS[norm] else needs[:2]
    assert seen == ([want] if any(needs) else [])


@pytest.mark.parametrize(
    "norm,has_w,has_b",
    [("rms_norm", False, False), ("layer_norm", False, False), ("layer_norm", True, False),
     ("layer_norm", False, True)],
)
def test_weight_bias_none(norm, has_w, has_b):
    x = torch.randn(7, 45, device=DEVICE) + 2
    w, b = params(norm, (45,), torch.float32)
    check(norm, x, (45,), w if has_w else None, b if has_b else None)


@pytest.mark.parametrize("path", ["registers", "small_tiles", "long_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_zero_variance_rows(norm, dtype, path, request):
    # Constant rows (a mean that is not exactly representable, so the deviations are rounding noise) and
    # all-zero rows: outputs and gradients finite and as accurate as eager PyTorch's. In float64 their
    # r = 1/sqrt(eps) shows an eps rounded to float32, Triton's type for a float argument (rt.split_float).
    if path != "registers":
        request.getfixturevalue(path)
    assert (_long_path_taken(norm, 6, 21) is not None) == (path == "long_rows")
    x = torch.randn(6, 21, device=DEVICE)
    x[0] = 0.1
    x[1] = 0.0
    x[2] = -3.7
    x[3, :] = 1e-20  # underflows in float32 squares
    x = x.to(dtype)
    w, b = params(norm, (21,), dtype)
    check(norm, x, (21,), w, b)
    y = tritongrad.rms_norm(x, (21,), w) if norm == "rms_norm" else tritongrad.layer_norm(x, (21,), w, b)
    assert torch.isfinite(y).all()
    if norm == "rms_norm":
        assert (y[1] == 0).all()  # a zero row normalises to zero: r = 1/sqrt(eps) stays finite
    else:
        torch.testing.assert_close(y[1].float(), b.float(), atol=0, rtol=0)  # x - mean = 0 exactly


@pytest.mark.parametrize("norm", NORMS)
def test_eps_is_used(norm):
    # eps dominates the variance for a small-valued row: a dropped or misplaced eps fails this.
    x = 1e-3 * torch.randn(4, 16, device=DEVICE)
    check(norm, x, (16,), *params(norm, (16,), torch.float32), eps=1e-4)


def test_split_float():
    # Triton passes a float argument as float32; kernels add hi + lo and get eps to float64 accuracy.
    for v in (1e-5, 1e-6, 1 / 3, 0.0, 1e-12):
        hi, lo = rt.split_float(v)
        assert float(torch.tensor(hi, dtype=torch.float32)) == hi and hi + lo == v


def test_rms_norm_default_eps():
    # PyTorch's rule: eps=None means float32's machine eps for float16/bfloat16/float32 x (even with a
    # float64 weight), float64's for float64 x.
    assert default_eps(torch.bfloat16) == default_eps(torch.float32) == torch.finfo(torch.float32).eps
    assert default_eps(torch.float64) == torch.finfo(torch.float64).eps
    x = torch.full((2, 8), 1e-4, device=DEVICE)  # mean square 1e-8: float32's eps (1.2e-7) matters
    torch.testing.assert_close(tritongrad.rms_norm(x, (8,)), F.rms_norm(x, (8,)))
    torch.testing.assert_close(tritongrad.rms_norm(x, (8,), torch.ones(8, dtype=torch.float64, device=DEVICE)),
                               F.rms_norm(x, (8,)))


@pytest.mark.parametrize("norm", NORMS)
def test_no_grad_saves_nothing(norm):
    x = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    w, b = leaves(params(norm, (8,), torch.float32), (True, True))
    fn = lambda: call(norm, tritongrad.layer_norm if HAS_BIAS[norm] else tritongrad.rms_norm, x, (8,), w, b, 1e-5)  # noqa: E731
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        with torch.no_grad():
            y = fn()
        assert y.grad_fn is None and packed == []
        y = fn()  # with grad on: x, weight (, bias) and the residuals (rstd; mean and rstd)
        assert y.grad_fn is not None
        assert len([t for t in packed if t is not None]) == (5 if HAS_BIAS[norm] else 3)


def test_residuals_are_row_stats():
    x = torch.randn(2, 3, 10, dtype=torch.bfloat16, device=DEVICE)
    y, rstd = torch.ops.tritongrad.rms_norm(x, [10], None, None)
    assert rstd.shape == (2, 3) and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd, torch.rsqrt(x.float().square().mean(-1) + default_eps(torch.bfloat16)))
    y, mean, rstd = torch.ops.tritongrad.layer_norm(x, [10], None, None, 1e-5)
    torch.testing.assert_close(mean, x.float().mean(-1))
    torch.testing.assert_close(rstd, torch.rsqrt(x.float().var(-1, unbiased=False) + 1e-5))


@pytest.mark.parametrize("chunked", [False, True], ids=["registers", "chunked"])
def test_gradcheck_float64(chunked, request):
    # fast_mode checks random projections of the Jacobian: a few launches instead of one per element.
    if chunked:
        request.getfixturevalue("small_tiles")
    for x in (torch.randn(2, 2, 5, dtype=torch.float64, device=DEVICE) + 1,
              make_rows((4, 9), torch.float64, DEVICE, "transposed")):
        ns = tuple(x.shape[1:]) if x.dim() == 3 else (x.shape[-1],)
        w = torch.randn(ns, dtype=torch.float64, device=DEVICE, requires_grad=True)
        b = torch.randn(ns, dtype=torch.float64, device=DEVICE, requires_grad=True)
        w_last = torch.randn(x.shape[-1], dtype=torch.float64, device=DEVICE, requires_grad=True)
        x.requires_grad_()
        for f, args in (
            (lambda x, w: tritongrad.rms_norm(x, ns, w, 1e-3), (x, w)),
            (lambda x, w, b: tritongrad.layer_norm(x, ns, w, b, 1e-3), (x, w, b)),
            (lambda x: tritongrad.layer_norm(x, ns, None, None, 1e-3), (x,)),
            (lambda x, w: llama_rms_norm(x, w, 1e-3), (x, w_last)),
        ):
            assert torch.autograd.gradcheck(f, args, fast_mode=True)


@pytest.mark.parametrize("norm", NORMS)
def test_double_backward_is_refused(norm):
    x = torch.randn(3, 4, device=DEVICE, requires_grad=True)
    w = torch.randn(4, device=DEVICE, requires_grad=True)
    y = tritongrad.rms_norm(x, (4,), w) if norm == "rms_norm" else tritongrad.layer_norm(x, (4,), w)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


@pytest.mark.parametrize("path", ["registers", "small_tiles", "long_rows"])
@pytest.mark.parametrize("norm", NORMS)
def test_param_grads_bitwise_deterministic(norm, path, request):
    # 1000 rows of D=8 give several row chunks, so dw/db go through the partial buffer.
    if path != "registers":
        request.getfixturevalue(path)
    D = 8 if path == "registers" else 19
    assert (_long_path_taken(norm, 1000, D) is not None) == (path == "long_rows")
    x = torch.randn(1000, D, device=DEVICE)
    w, b = leaves(params(norm, (D,), torch.float32), (True, True))
    g = torch.randn(1000, D, device=DEVICE)
    runs = []
    for _ in range(3):
        y = call(norm, tritongrad.layer_norm if HAS_BIAS[norm] else tritongrad.rms_norm, x, (D,), w, b, 1e-5)
        runs.append(torch.autograd.grad(y, [t for t in (w, b) if t is not None], g))
    assert all(torch.equal(a, c) for r in runs[1:] for a, c in zip(r, runs[0]))


def test_opcheck():
    x = torch.randn(5, 3, 6, device=DEVICE, requires_grad=True)
    w = torch.randn(6, device=DEVICE, requires_grad=True)
    b = torch.randn(6, device=DEVICE, requires_grad=True)
    w2 = torch.randn(3, 6, device=DEVICE, requires_grad=True)
    ops = torch.ops.tritongrad
    torch.library.opcheck(ops.rms_norm.default, (x, [6], w, None))
    torch.library.opcheck(ops.rms_norm.default, (x, [3, 6], w2, 1e-3))
    torch.library.opcheck(ops.rms_norm.default, (x, [6], None, None))
    torch.library.opcheck(ops.layer_norm.default, (x, [6], w, b, 1e-5))
    torch.library.opcheck(ops.layer_norm.default, (x, [6], None, b, 1e-5))
    torch.library.opcheck(ops.llama_rms_norm.default, (x, w, 1e-6))
    g = torch.randn(5, 3, 6, device=DEVICE)
    test_utils = ("test_schema", "test_faketensor")
    _, rstd = ops.rms_norm(x.detach(), [6], w.detach(), None)
    for needs in ([True, True], [False, True], [True, False]):
        torch.library.opcheck(ops.rms_norm_backward.default, (g, x, [6], w, None, rstd, needs), test_utils=test_utils)
        torch.library.opcheck(ops.llama_rms_norm_backward.default, (g, x, w, 1e-6, rstd, needs), test_utils=test_utils)
    _, mean, rstd = ops.layer_norm(x.detach(), [6], w.detach(), b.detach(), 1e-5)
    for needs in ([True, True, True], [False, True, False], [True, False, True], [False, False, True]):
        torch.library.opcheck(
            ops.layer_norm_backward.default, (g, x, [6], w, b, 1e-5, mean, rstd, needs), test_utils=test_utils
        )


def test_compile_fullgraph_and_export():
    x = torch.randn(4, 3, 10, device=DEVICE, requires_grad=True)
    w = torch.randn(10, device=DEVICE, requires_grad=True)
    b = torch.randn(10, device=DEVICE, requires_grad=True)

    def f(x, w, b):
        return tritongrad.layer_norm(tritongrad.rms_norm(x, (10,), w).tanh(), 10, w, b).sin().sum()

    loss = torch.compile(f, fullgraph=True)(x, w, b)
    got = torch.autograd.grad(loss, (x, w, b))
    loss_e = f(x, w, b)
    want = torch.autograd.grad(loss_e, (x, w, b))
    torch.testing.assert_close((loss, *got), (loss_e, *want))
    for m, name in ((tritongrad.nn.RMSNorm(10, device=DEVICE), "tritongrad.rms_norm"),
                    (tritongrad.nn.LayerNorm(10, device=DEVICE), "tritongrad.layer_norm")):
        ep = torch.export.export(m, (x.detach(),))
        assert name in ep.graph_module.code
        torch.testing.assert_close(ep.module()(x.detach()), m(x.detach()))


BAD_INPUTS = [
    (lambda: tritongrad.rms_norm(torch.randn(3, 4), (5,)), ValueError, r"\(3, 4\).*\(5,\)"),
    (lambda: tritongrad.layer_norm(torch.randn(3, 4), (2, 4)), ValueError, r"\(3, 4\).*\(2, 4\)"),
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
]


@pytest.mark.parametrize("make,exc,match", BAD_INPUTS)
def test_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.parametrize(
    "name,kwargs",
    [(name, kw) for name in ("RMSNorm", "LayerNorm") for kw in ({}, {"eps": 1e-3}, {"elementwise_affine": False})]
    + [("LayerNorm", {"bias": False})],  # torch.nn.RMSNorm has no bias argument
    ids=str,
)
def test_modules_are_drop_in(name, kwargs):
    ours = getattr(tritongrad.nn, name)((3, 8), device=DEVICE, dtype=torch.float32, **kwargs)
    theirs = getattr(torch.nn, name)((3, 8), device=DEVICE, dtype=torch.float32, **kwargs)
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
    assert tritongrad.patch(m) == 4
    assert tritongrad.patch(m) == 0  # already patched
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
    assert tritongrad.patch(m) == 1 and type(m) is tritongrad.nn.RMSNorm


def test_llama_rms_norm_semantics():
    # Hugging Face's LlamaRMSNorm: normalise in float32, round to x's dtype, then weight * that; the
    # output dtype is promoted with the weight's (float32 weight and bfloat16 x give float32).
    # 1280 columns: the parted forward (5 chunks of 256).
    combos = ((torch.float16, torch.float16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32))
    for D, (xdt, wdt) in [(D, c) for D in (40, 1280) for c in combos]:
        x = torch.randn(6, D, device=DEVICE).to(xdt).requires_grad_()
        w = (1 + 0.3 * torch.randn(D, device=DEVICE)).to(wdt).requires_grad_()
        y = llama_rms_norm(x, w, 1e-6)
        want = llama_rms_norm_reference(x, w, 1e-6)
        assert y.dtype == want.dtype == torch.promote_types(xdt, wdt)
        # Where the float32 statistics differ in their last bit, xhat may round the other way: one ulp of
        # x's dtype (the interpreter truncates bfloat16, a second ulp).
        rtol = 2 * torch.finfo(xdt).eps if xdt != torch.float32 else 1e-6
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
    for xdt, wdt in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)):
        m = llama.LlamaRMSNorm(64, eps=1e-5).to(DEVICE, wdt)
        with torch.no_grad():
            m.weight.normal_(1.0, 0.2)
        weight, text = m.weight, repr(m)
        x = torch.randn(3, 5, 64, device=DEVICE).to(xdt)
        want = m(x)
        assert tritongrad.patch(m) == 1 and tritongrad.patch(m) == 0
        assert isinstance(m, llama.LlamaRMSNorm) and m.weight is weight and repr(m) == text
        got = m(x)
        assert got.dtype == want.dtype
        rtol = 2 * torch.finfo(xdt).eps if xdt != torch.float32 else 1e-6
        torch.testing.assert_close(got, want, rtol=rtol, atol=0)
        assert type(got.grad_fn).__name__ == "LlamaRmsNormBackward"
    # A class with other math (Gemma's 1 + weight, applied in float32) is left alone.
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    assert tritongrad.patch(gemma.GemmaRMSNorm(16)) == 0


@pytest.mark.skipif(DEVICE != "cpu", reason="the PyTorch path serves CPU tensors only when no GPU kernels do")
def test_cpu_without_interpreter():
    # A fresh process without TRITON_INTERPRET: CPU tensors take the PyTorch path, eager and compiled.
    code = """
import torch, tritongrad
import torch.nn.functional as F
from tritongrad import _runtime
assert not _runtime.INTERPRET
x = torch.randn(4, 3, 9, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(9, requires_grad=True)
b = torch.randn(9, requires_grad=True)
for f, ref in ((lambda x, w, b: tritongrad.rms_norm(x, (9,), w), lambda x, w, b: F.rms_norm(x, (9,), w)),
               (lambda x, w, b: tritongrad.layer_norm(x, (9,), w, b), lambda x, w, b: F.layer_norm(x, (9,), w, b))):
    y = f(x, w, b)
    assert y.dtype == torch.bfloat16
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w), g)
    want = torch.autograd.grad(ref(x.float(), w, b).bfloat16(), (x, w), g)
    torch.testing.assert_close(got[1], want[1], atol=0.05, rtol=0.02)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    fc = torch.compile(lambda x, w, b: f(x, w, b).float().sum(), fullgraph=True)
    gc = torch.autograd.grad(fc(x, w, b), (x, w))
    gy = torch.autograd.grad(f(x, w, b).float().sum(), (x, w))
    torch.testing.assert_close(gc, gy)
torch.library.opcheck(torch.ops.tritongrad.rms_norm.default, (x.detach().float(), [9], w, None))
torch.library.opcheck(torch.ops.tritongrad.layer_norm.default, (x.detach().float(), [9], w, b, 1e-5))
m = torch.nn.Sequential(torch.nn.LayerNorm(9), torch.nn.RMSNorm(9))
assert tritongrad.patch(m) == 2
m(x.float()).sum().backward()
print("ok")
"""
    out = run_without_interpreter(["-c", code])
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]

"""Host-side pieces RMSNorm and LayerNorm share: launch plans, ``normalized_shape`` handling, validation.

Bytes beyond each norm's floor (the formulas are in its launch.py): rows longer than one register tile
(D > FWD_MAX_BLOCK_D in the forward, D > BWD_MAX_BLOCK_D in the backward) read x twice in the forward
(the second read partly from L2). In the backward, rows of 3-4 chunks (rms_norm: up to 6) with a row per SM
read x and dy twice too, the second time from L2 (``long_bwd_plan``); other long rows read them twice from
HBM (a row pass for the row sums first). With fewer row tiles than SMs those row passes also split the
columns (``column_split``), adding S*N floats of partial statistics (S splits) to each pass."""

from __future__ import annotations

import functools
import numbers
from typing import NamedTuple

import torch

from .. import _runtime as rt

# Launch knobs of both norms (they move the same bytes per element, up to a bias and a mean).
FWD_MAX_BLOCK_D = 16384  # longest row the forward keeps whole in registers (float32: 64 KiB over 16 warps)
BWD_MAX_BLOCK_D = 8192  # likewise for the backward, which holds x, dy, w and the dw partial per column
CHUNK_D = 4096  # columns per step for longer rows (read in chunks, twice)
FWD_TILE = 4096  # elements a forward program handles per step when rows are short (several rows a step)
BWD_TILE = 4096  # likewise for the backward
# layer_norm's backward with 32- and 64-bit x: half the rows per step. Measured on an H200, float32
# forward+backward, 4096 -> 2048 elements: 4194304x32 763.6 -> 685.4 us, 1048576x128 748.8 -> 696.0,
# 262144x512 756.3 -> 665.5, 131072x1024 708.2 -> 668.3 (rows longer than 2048 columns take one row a step
# either way). rms_norm keeps 4096 (2048 was 1-4% slower at four of six float32 shapes), and 16-bit x keeps it too.
LN_BWD_TILE_32BIT = 2048
# Forward warps for a whole row of 16-bit elements longer than 4096 columns (row_tile would give 16).
# Measured on an H200: 8 warps keep two such programs resident per SM where 16 warps fit one (layer_norm
# 16384x16384 float16: 89 registers x 512 threads, one program, 60% of copy bandwidth; 8 warps: 128
# registers x 256 threads, two programs, 95%). float32 rows need twice the registers per thread, so
# they keep row_tile's 16 warps (8 would run one program of 8 warps per SM).
FWD_WARPS_WIDE_16BIT = 8
# layer_norm's forward on whole rows of 16-bit x with float32 statistics, by dtype and BLOCK_D: (elements
# per program, warps). Measured on an H200 (x of 256 MB, device time of the forward launcher;
# benchmarks/NOTES.md, seventh session) against FWD_TILE with row_tile's warps, bf16: D=1024 153.7 ->
# 131.4 us, 512 153.8 -> 132.4, 256 146.1 -> 136.5, 128 140.1 -> 135.3, 2048 136.9 -> 131.1, 4096 134.8 ->
# 130.4. Its two row reductions (mean, then the squared deviations) want fewer threads per row than
# rms_norm's one; rms_norm gained at most 2.6% from any such choice and keeps FWD_TILE. float16 takes only
# the entries measured in float16 (D=128 with bf16's entry ran 139.7 -> 151.3 us in float16); the other
# row lengths keep FWD_TILE there.
_LN_FWD_BF16 = {64: (4096, 4), 128: (8192, 4), 256: (4096, 2), 512: (4096, 2), 1024: (2048, 4),
                2048: (2048, 4), 4096: (8192, 8)}
LN_FWD_16BIT = {
    torch.bfloat16: _LN_FWD_BF16,
    torch.float16: {d: _LN_FWD_BF16[d] for d in (256, 1024, 4096)},
}
# layer_norm's forward over rows that leave a quarter or more of their tile's lanes masked (D at most 3/4 of
# its power of two). bf16 rows of up to 2048 columns: twice the elements per program of _LN_FWD_BF16
# (H200, x of 256 MB, forward launcher: 1536 columns 152.8 -> 134.1 us, 1280 171.0 -> 150.3, 768 162.1 ->
# 145.5; 2560 and 3072, in tiles of 4096, gained at most 3% from any rows/warps tried and keep the table).
# float32 rows in a tile of 8192: 8 warps instead of 16 (5120 158.3 -> 132.7, 6144 144.3 -> 134.0; a full
# 8192 keeps 16: 133.0 against 134.9). rms_norm's one reduction was level with either (5120 float32: 131.1
# against 132.6). Those lengths now take the parted forward (FWD_PARTS_NCH, below); these rules serve the
# other rows that mask as much (1500, 5000, ...), which were not measured apart.
LN_FWD_MASKED_BF16_MAX_D = 2048
LN_FWD_MASKED_FP32_WARPS = 8
# Rows of an odd number of power-of-two chunks, NCH in FWD_PARTS_NCH (5120 = 5 x 1024), up to
# FWD_MAX_BLOCK_D: the forward holds them in parts of 8, 4, 2 and 1 chunks, no lane masked
# (ops/_norm_forward.py), one row per program, warps such that each thread loads one 16-byte vector of every
# chunk (16-bit rows: at most FWD_WARPS_WIDE_16BIT warps). Measured on an H200 (x of 256 MB, forward launcher,
# device time; benchmarks/NOTES.md, eleventh session) against one tile of next_pow2(D) lanes, bf16 layer_norm /
# rms_norm: 5120 160.7 -> 133.5 / 140.8 -> 131.7 us, 2560 158.3 -> 131.8 / 135.7 -> 130.2, 10240 176.0 ->
# 134.7 / 146.9 -> 132.9, 12288 159.1 -> 133.6 (8 warps; 16: 146.7) / 137.5 -> 133.2, 6144 148.1 -> 132.3 /
# 132.9 -> 132.4, 1280 153.0 -> 134.3 / 147.7 -> 132.6, 768 148.0 -> 135.1 / 143.7 -> 132.9, 4608 172.8 ->
# 131.9 / 145.5 -> 131.5, 9216 186.9 -> 133.5 / 152.8 -> 132.1, 11264 172.2 -> 133.9 / 139.1 -> 132.6; float32
# layer_norm 12288 169.6 -> 133.6, 9216 199.1 -> 135.8. Elsewhere within 2.3 us of the tile (rms_norm float32
# 4608 131.3 -> 133.6 the largest loss). Rows of 15 chunks, a sixteenth of the tile masked, lose (layer_norm
# bf16 15360 143.4 -> 179.0 us, 7680 134.8 -> 166.3) and keep the tile; half a vector per thread was slower
# everywhere (up to 5x).
FWD_PARTS_NCH = (3, 5, 7, 9, 11, 13)
# Backward programs per SM (each loops over its chunk of rows); also bounds the height of the dw/db
# partial buffers. Measured on an H200 at bf16: 2 for tiles of <= 8 warps (32768x4096: 1 -> 70%, 2 -> 88%
# of copy bandwidth, RMSNorm), 1 for 16-warp tiles (16384x8192: 83% -> 89%), whose registers fill an SM.
BWD_PROGS_PER_SM = 2
BWD_PROGS_PER_SM_WIDE = 1
# Pipelining depth of the backward's row loop (_norm_bwd_kernel): STAGES - 1 row tiles of x and dy in
# flight through shared memory. Measured on an H200 against one tile prefetched in registers (backward
# launcher, device time, benchmarks/NOTES.md): 3 is faster or within 0.7% at every shape measured; e.g.
# layer_norm 32768x4096 bf16 214.7 -> 212.2 us, fp32 421.4 -> 408.9; 16384x8192 bf16 219.8 -> 210.1;
# rms_norm fp32 1048576x128 426.4 -> 407.0. 2 was up to 39% slower in 16-bit, 4 no better than 3.
# Lowered where the tiles would not fit the programs of an SM.
BWD_STAGES = 3
# The backward over whole rows of 16-bit x with a quarter or more of the tile's lanes masked (D at most 3/4
# of the power of two of its tile, tiles of 2048-8192 columns): the pipeline copies whole tiles, masked lanes
# zero-filled, so a stage carries only D / BLOCK_D useful bytes. One stage more, and programs of at most 8
# warps (a grid of two per SM; at 8192 columns their ~200 registers a thread leave one resident at a time,
# read from the sm_90 cubin). Measured on an H200 (bf16, x of 256 MB, backward launcher, device time;
# benchmarks/NOTES.md, tenth session), rms_norm / layer_norm: 5120 columns 237.2 -> 209.4 / 249.5 -> 221.8
# us, 2560 222.7 -> 206.0 / 240.2 -> 224.6, 1280 228.7 -> 204.9 / 257.4 -> 256.5, 6144 220.9 -> 209.6 /
# 232.3 -> 212.1, 3072 209.0 -> 209.7 / 218.7 -> 211.3, 1536 211.1 -> 211.5 / 225.5 -> 220.0. Rows with an
# eighth masked were 1-2% slower with it (7168: 208.4 -> 211.1 / 216.9 -> 217.6, 3584: 207.4 -> 211.4 /
# 210.9 -> 213.8), full tiles too (4096: 211.5 -> 212.2 / 213.3 -> 216.7), and float32 gains nothing
# (5120: 206.9 -> 208.8 / 210.3 -> 212.6).
BWD_MASKED_16BIT = (8, 4)  # (most warps, pipelining depth)
# Rows walked in chunks, but fewer row tiles than SMs (e.g. 16 x 1M): the row passes (forward statistics,
# normalisation, the backward's row sums) also split the columns, for about this many programs per SM.
SPLIT_PROGS_PER_SM = 4
# Backward of rows longer than BWD_MAX_BLOCK_D, of 3 or 4 chunks, with at least one row per SM: one kernel
# (_norm_bwd_long_kernel) that keeps its dw/db partials in registers and reads each row twice, the second time
# from L2, instead of the row-sum pass and _norm_bwd_kernel, which read x and dy twice from HBM. Its registers
# fill an SM (one program per SM). Warps by (layer_norm, 16-bit x, 16-bit weight (or none), chunks per row):
# the best of 8/16/32 in sweeps on an H200 (benchmarks/NOTES.md, "Long rows"). The cases it lacks keep the two
# kernels: layer_norm rows of 4 chunks (they spill the dw and db accumulators, and ran no faster in 16-bit and
# up to 1.3x slower in float32), float32 x with a 16-bit weight (not measured), and float64 accumulators.
LONG_BWD_CHUNK = 4096
LONG_BWD_WARPS = {
    (False, True, True, 3): 8, (False, True, False, 3): 32, (False, False, False, 3): 32,
    (False, True, True, 4): 32, (False, True, False, 4): 32, (False, False, False, 4): 32,
    (True, True, True, 3): 16, (True, True, False, 3): 16, (True, False, False, 3): 32,
}


# Rows too long for one program's accumulators: SPLIT programs share each group of rows, each with the
# dw/db accumulators of an even share of the columns (every program still reads the whole row for the row
# sums; its neighbours read it at the same time, so from L2). Keyed by (layer_norm, bytes per element of
# x, of the weight (0: none), chunks of the whole row): (SPLIT, warps, programs per SM). Measured on an
# H200 against the two kernels (backward launcher, device time; benchmarks/NOTES.md, ninth session):
# rms_norm bf16 12800x20480 641.7 -> 528.2 us, 10240x24576 613.9 -> 461.2, 10240x24000 599.9 -> 466.4,
# fp16 10240x24576 608.0 -> 455.7, fp32 6400x20480 629.7 -> 500.7, 5120x24576 600.5 -> 464.6. Left out,
# slower there: rms_norm without a weight (bf16 24576: 595.5 -> 632.2) or with a float32 weight on bf16 x
# (610.5 -> 681.8), and layer_norm at 4 chunks (3-9% faster at 16384 columns, 4-10% slower at 12800).
# Only for rows (length and strides) aligned to 16 bytes: their loads are vectorised (ops/_tl.aligned).
# Others are slower split (layer_norm bf16 20000x13000 before the ALIGN hint: 1229 us with the two kernels,
# 3113 us split). With the hint, 16-byte aligned rows that are not multiples of 16 elements gain as much
# (rms_norm bf16 10240x24008 611.4 -> 482.0 us, fp32 5120x24004 608.4 -> 476.5).
LONG_BWD_SPLIT = {
    (False, 2, 2, 5): (2, 16, 1), (False, 2, 2, 6): (2, 16, 1),
    (False, 4, 4, 5): (2, 16, 1), (False, 4, 4, 6): (2, 16, 1),
}


class LongBwdPlan(NamedTuple):
    CHUNK: int
    NCH: int  # chunks per program
    SPLIT: int  # programs per row group, side by side over the columns
    COLS: int  # columns per program (D when SPLIT is 1)
    num_warps: int
    programs: int  # groups * SPLIT
    groups: int  # row groups: the rows of the dw/db partial buffers
    rows_per_prog: int


@functools.lru_cache(maxsize=1024)
def fwd_plan(N: int, D: int, itemsize: int = 4, ln_dtype: torch.dtype | None = None) -> rt.RowTile:
    """Forward: one program per BLOCK_N rows (``itemsize``: bytes per element of x). ``ln_dtype``: x's dtype
    for layer_norm with float32 statistics (LN_FWD_16BIT), else None."""
    p2 = rt.next_pow2(D)
    masked = 4 * D <= 3 * p2
    ln16 = LN_FWD_16BIT.get(ln_dtype, {}).get(p2)
    if ln16 is not None:
        tile = ln16[0]
        if masked and ln_dtype == torch.bfloat16 and p2 <= LN_FWD_MASKED_BF16_MAX_D:
            tile *= 2
        t = rt.row_tile(N, D, FWD_MAX_BLOCK_D, CHUNK_D, tile)
        return t._replace(num_warps=min(t.num_warps, ln16[1]))  # no more warps than a small tile has rows for
    t = rt.row_tile(N, D, FWD_MAX_BLOCK_D, CHUNK_D, FWD_TILE)
    if ln_dtype == torch.float32 and masked and t.ONE_TILE and t.BLOCK_D == 8192:
        return t._replace(num_warps=LN_FWD_MASKED_FP32_WARPS)
    if t.ONE_TILE and itemsize <= 2 and t.num_warps > FWD_WARPS_WIDE_16BIT:
        t = t._replace(num_warps=FWD_WARPS_WIDE_16BIT)
    return t


@functools.lru_cache(maxsize=1024)
def fwd_parts(D: int, itemsize: int) -> tuple[int, int, int] | None:
    """``(CHUNK, NCH, warps)`` of the parted forward for rows of D elements of ``itemsize`` bytes
    (FWD_PARTS_NCH), or None: rows of a power of two, of other chunk counts, or longer than one tile."""
    chunk = D & -D
    nch = D // chunk if D else 0
    warps = chunk * itemsize // 512  # a warp: 32 threads x 16 bytes
    if nch not in FWD_PARTS_NCH or D > FWD_MAX_BLOCK_D or warps < 1:
        return None
    return chunk, nch, min(warps, FWD_WARPS_WIDE_16BIT if itemsize <= 2 else 16)


@functools.lru_cache(maxsize=1024)
def bwd_plan(
    N: int, D: int, sms: int, tile: int = BWD_TILE, x_itemsize: int = 4
) -> tuple[rt.RowTile, int, int, int]:
    """Backward: ``(tile, column blocks, row chunks, rows per program)``; grid (row chunks, column blocks),
    each program reducing its contiguous rows into one row of the partial buffers. ``tile``: elements a
    program handles per step when rows are short; ``x_itemsize``: bytes per element of x."""
    t = rt.row_tile(N, D, BWD_MAX_BLOCK_D, CHUNK_D, tile)
    if masked_16bit(t, D, x_itemsize):
        t = t._replace(num_warps=min(t.num_warps, BWD_MASKED_16BIT[0]))
    d_blocks = rt.cdiv(D, t.BLOCK_D)
    chunks, rows_per_prog = rt.row_split(N, t.BLOCK_N, sms, d_blocks, bwd_per_sm(t))
    return t, d_blocks, chunks, rows_per_prog


def masked_16bit(t: rt.RowTile, D: int, x_itemsize: int) -> bool:
    """Whole rows of 16-bit x in a tile of 2048 or more columns, a quarter or more of them masked
    (BWD_MASKED_16BIT)."""
    return x_itemsize <= 2 and t.ONE_TILE and t.BLOCK_D >= 2048 and 4 * D <= 3 * t.BLOCK_D


def bwd_per_sm(t: rt.RowTile) -> int:
    """Backward programs resident per SM for tile ``t``."""
    return BWD_PROGS_PER_SM if t.num_warps <= 8 else BWD_PROGS_PER_SM_WIDE


@functools.lru_cache(maxsize=1024)
def bwd_stages(t: rt.RowTile, elem_bytes: int, shared_mem: int, depth: int = BWD_STAGES) -> int:
    """Pipelining depth of the backward's row loop: ``depth`` (BWD_STAGES, or BWD_MASKED_16BIT's), or less
    where STAGES - 1 tiles of x and dy (``elem_bytes`` per column: x's element size plus dy's) for each
    resident program would not fit the SM's ``shared_mem`` bytes (2 KiB per program kept for the row
    reductions)."""
    per_prog = shared_mem // bwd_per_sm(t) - 2048
    tile = t.BLOCK_N * t.BLOCK_D * elem_bytes
    stages = depth
    while stages > 1 and (stages - 1) * tile > per_prog:
        stages -= 1
    return stages


@functools.lru_cache(maxsize=1024)
def long_bwd_plan(
    N: int, D: int, sms: int, centered: bool, x_itemsize: int, w_itemsize: int, acc_itemsize: int, align: int
) -> LongBwdPlan | None:
    """The one-kernel backward's plan for long rows (``w_itemsize`` 0: no weight; ``align``: elements that
    divide D and the row strides of x and dy, ``rt.align``), or None where the row-sum pass + _norm_bwd_kernel
    serve: rows that fit one tile, fewer rows than SMs, float64 accumulators, and the cases LONG_BWD_WARPS
    and LONG_BWD_SPLIT leave out."""
    nch = rt.cdiv(D, LONG_BWD_CHUNK)
    narrow_x = x_itemsize <= 2
    key = (centered, narrow_x, w_itemsize <= 2 if w_itemsize else narrow_x, nch)
    split, warps, per_sm = 1, LONG_BWD_WARPS.get(key), 1
    if warps is None and align * x_itemsize >= 16:
        split, warps, per_sm = LONG_BWD_SPLIT.get((centered, x_itemsize, w_itemsize, nch), (1, None, 1))
    if D <= BWD_MAX_BLOCK_D or N < sms or acc_itemsize > 4 or warps is None:
        return None
    groups, rows_per_prog = rt.row_split(N, 1, sms, split, per_sm)
    # Even shares of the row, in multiples of 64 columns (aligned loads): no program idles on a short chunk.
    unit = min(64, LONG_BWD_CHUNK)
    cols = D if split == 1 else rt.cdiv(rt.cdiv(D, split), unit) * unit
    return LongBwdPlan(LONG_BWD_CHUNK, rt.cdiv(cols, LONG_BWD_CHUNK), split, cols, warps, groups * split, groups,
                       rows_per_prog)


@functools.lru_cache(maxsize=1024)
def column_split(N: int, D: int, t: rt.RowTile, sms: int) -> tuple[int, int]:
    """``(splits, columns per split)`` for a row pass over tile ``t``: ``(1, D)`` unless rows are walked
    in chunks and there are fewer row tiles than SMs; splits are whole chunks, only the last is ragged."""
    row_tiles = rt.cdiv(N, t.BLOCK_N)
    if t.ONE_TILE or row_tiles >= sms or SPLIT_PROGS_PER_SM == 0:
        return 1, D
    splits = min(rt.cdiv(D, t.BLOCK_D), rt.cdiv(SPLIT_PROGS_PER_SM * sms, row_tiles))
    per_split = rt.cdiv(rt.cdiv(D, splits), t.BLOCK_D) * t.BLOCK_D
    return rt.cdiv(D, per_split), per_split


def native_args_fit(normalized_shape, eps) -> bool:
    """Whether PyTorch's own norm may serve these unvalidated arguments: a non-empty list of ints (PyTorch
    checks x's and the parameters' shapes against it), rows short enough for it (``rt.NATIVE_MAX_D``), and a
    float or None eps. Anything else takes the checked path (``_pattern``'s ``native`` contract)."""
    if type(normalized_shape) is not list or not normalized_shape or not (eps is None or type(eps) is float):
        return False
    d = 1
    for s in normalized_shape:
        if type(s) is not int:
            return False
        d *= s
    return d <= rt.NATIVE_MAX_D


def shape_list(normalized_shape) -> list:
    """``normalized_shape`` as torch.nn.functional accepts it (an int, a list/tuple, a torch.Size), as a list.
    Exact type checks first: the ABC check behind isinstance(s, numbers.Integral) is slow on the hot path."""
    kind = type(normalized_shape)
    if kind is tuple or kind is list or kind is torch.Size:
        return list(normalized_shape)
    if kind is int or isinstance(normalized_shape, (numbers.Integral, torch.SymInt)):
        return [normalized_shape]
    return list(normalized_shape)


def _is_dim(s) -> bool:
    # type(s) is int first: the ABC check behind isinstance(s, numbers.Integral) is slow on the hot path.
    return type(s) is int or (isinstance(s, (numbers.Integral, torch.SymInt)) and not isinstance(s, bool))


def validate(op: str, x: torch.Tensor, normalized_shape, eps, **params) -> None:
    """Shape checks of a norm over the trailing ``normalized_shape`` dims of x; ``params`` are the optional
    per-element tensors (weight, bias), each None or of shape ``normalized_shape``."""
    if not isinstance(normalized_shape, (list, tuple, torch.Size)) or not all(map(_is_dim, normalized_shape)):
        raise TypeError(f"tritongrad.{op}: normalized_shape must be a list of ints, got {normalized_shape!r}")
    ns = tuple(normalized_shape)
    if len(ns) == 0:
        raise ValueError(f"tritongrad.{op}: normalized_shape must have at least one dim, got {ns}")
    if x.dim() < len(ns) or tuple(x.shape[x.dim() - len(ns):]) != ns:
        raise ValueError(
            f"tritongrad.{op}: x of shape {tuple(x.shape)} must end with normalized_shape {ns} "
            f"(x's last {len(ns)} dims are normalised)"
        )
    for name, t in params.items():
        if t is not None and tuple(t.shape) != ns:
            raise ValueError(
                f"tritongrad.{op}: {name} has shape {tuple(t.shape)}, expected normalized_shape {ns}"
            )
    if eps is not None and type(eps) is not float and (isinstance(eps, bool) or not isinstance(eps, numbers.Real)):
        raise TypeError(f"tritongrad.{op}: eps must be a float, got {eps!r}")


def flat(t: torch.Tensor | None) -> torch.Tensor | None:
    """A weight/bias of shape normalized_shape as [D]: a view (any stride) when possible, else a copy."""
    return t if t is None or t.dim() == 1 else t.reshape(-1)


def acc_dtype(x: torch.Tensor, *params: torch.Tensor | None) -> torch.dtype:
    """Accumulation dtype of a norm: float32, or float64 when x or any present weight/bias is float64."""
    dtype = x.dtype
    for p in params:
        if p is not None:
            dtype = torch.promote_types(dtype, p.dtype)
    return rt.acc_dtype(dtype)

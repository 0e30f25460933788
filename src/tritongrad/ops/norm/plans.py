"""Launch plans of the norm family, as named data: which kernel serves a row, with which tile, warps and depth.

Every figure behind these choices is in docs/norms.md (H200 sweeps); here each knob keeps one line of why.
Plans depend on the row length D, dtypes and the SM count, and on the row count N only for speed (callers
pass ``rt.hint(N)``): grids and buffers take N itself.

Bytes beyond each norm's floor: rows longer than one register tile (D > FWD_MAX_BLOCK_D forward, D >
BWD_MAX_BLOCK_D backward) read x twice in the forward (the second read partly from L2). In the backward, rows
of 3-4 chunks (rms_norm: up to 6) with a row per SM read x and dy twice too, the second time from L2
(``long_bwd_plan``); other long rows read them twice from HBM (a row pass for the row sums first). With fewer
row tiles than SMs those row passes also split the columns (``column_split``), adding S*N floats of partial
statistics (S splits) to each pass.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ... import _runtime as rt


class Tile(NamedTuple):
    """A forward tile: elements a program handles per step, and at most this many warps."""

    elems: int
    warps: int


class MaskedBwd(NamedTuple):
    """The backward over whole 16-bit rows with a quarter or more of their tile masked."""

    max_warps: int
    stages: int


class LongKey(NamedTuple):
    """Which rows the one-kernel long-row backward serves with how many warps."""

    layer_norm: bool
    x16: bool  # x of 16 bits
    w16: bool  # the weight of 16 bits (no weight: as x)
    chunks: int  # LONG_BWD_CHUNK-column chunks of the row


class SplitKey(NamedTuple):
    """Long rows whose dw/db accumulators would spill: programs split each row group's columns."""

    layer_norm: bool
    x_bytes: int
    w_bytes: int  # 0: no weight
    chunks: int


class SplitPlan(NamedTuple):
    split: int  # programs per row group
    warps: int
    per_sm: int  # programs per SM


FWD_MAX_BLOCK_D = 16384  # longest row the forward keeps whole in registers (float32: 64 KiB over 16 warps)
BWD_MAX_BLOCK_D = 8192  # likewise for the backward, which holds x, dy, w and the dw partial per column
CHUNK_D = 4096  # columns per step for longer rows (read in chunks, twice)
FWD_TILE = 4096  # elements a forward program handles per step when rows are short (several rows a step)
BWD_TILE = 4096  # likewise for the backward
# layer_norm's backward with 32- and 64-bit x: half the rows per step, 5-10% faster in float32; rms_norm and
# 16-bit x keep BWD_TILE.
LN_BWD_TILE_32BIT = 2048
# Whole 16-bit rows longer than 4096 columns: 8 warps keep two programs resident per SM where 16 fit one.
FWD_WARPS_WIDE_16BIT = 8
# layer_norm's forward on whole bf16 rows, by the row's power of two: its two row reductions (mean, then
# squared deviations) want fewer threads per row than rms_norm's one. float16 takes the entries measured in
# float16 only.
LN_FWD_BF16 = {64: Tile(4096, 4), 128: Tile(8192, 4), 256: Tile(4096, 2), 512: Tile(4096, 2),
               1024: Tile(2048, 4), 2048: Tile(2048, 4), 4096: Tile(8192, 8)}
LN_FWD_16BIT = {
    torch.bfloat16: LN_FWD_BF16,
    torch.float16: {d: LN_FWD_BF16[d] for d in (256, 1024, 4096)},
}
# layer_norm's forward over rows that mask a quarter or more of their tile: bf16 rows of up to 2048 columns
# take twice the elements per program; float32 rows in a tile of 8192 take 8 warps instead of 16.
LN_FWD_MASKED_BF16_MAX_D = 2048
LN_FWD_MASKED_FP32_WARPS = 8
# Rows of an odd number of power-of-two chunks take the parted forward (no lane masked); rows of 15 chunks
# lose with it and keep the tile.
FWD_PARTS_NCH = (3, 5, 7, 9, 11, 13)
# Backward programs per SM (each loops over its chunk of rows; also the height of the dw/db partial
# buffers): 2 for tiles of up to 8 warps, 1 for 16-warp tiles, whose registers fill an SM.
BWD_PROGS_PER_SM = 2
BWD_PROGS_PER_SM_WIDE = 1
# Pipelining depth of the backward's row loop (STAGES - 1 row tiles of x and dy in flight); lowered where
# the tiles would not fit the programs of an SM.
BWD_STAGES = 3
# Whole 16-bit rows in tiles of 2048-8192 columns with a quarter or more masked: the pipeline copies whole
# tiles, so a stage carries fewer useful bytes; one stage more, and programs of at most 8 warps.
BWD_MASKED_16BIT = MaskedBwd(max_warps=8, stages=4)
# Rows walked in chunks with fewer row tiles than SMs (e.g. 16 x 1M): the row passes split the columns
# too, for about this many programs per SM.
SPLIT_PROGS_PER_SM = 4
# The one-kernel backward of rows longer than BWD_MAX_BLOCK_D, of 3 or 4 chunks, a row per SM
# (``_norm_bwd_long_kernel``): warps, the best of 8/16/32. Cases it lacks keep the row-sum pass and
# ``_norm_bwd_kernel``: layer_norm rows of 4 chunks (they spill), float32 x with a 16-bit weight, float64.
LONG_BWD_CHUNK = 4096
LONG_BWD_WARPS = {
    LongKey(False, True, True, 3): 8, LongKey(False, True, False, 3): 32, LongKey(False, False, False, 3): 32,
    LongKey(False, True, True, 4): 32, LongKey(False, True, False, 4): 32, LongKey(False, False, False, 4): 32,
    LongKey(True, True, True, 3): 16, LongKey(True, True, False, 3): 16, LongKey(True, False, False, 3): 32,
}
# Rows too long for one program's accumulators (5-6 chunks): SPLIT programs share each row group, each with
# the accumulators of an even share of the columns; every program reads the whole row for the row sums, its
# neighbours at the same time, so from L2. Only for rows aligned to 16 bytes (vector loads).
LONG_BWD_SPLIT = {
    SplitKey(False, 2, 2, 5): SplitPlan(2, 16, 1), SplitKey(False, 2, 2, 6): SplitPlan(2, 16, 1),
    SplitKey(False, 4, 4, 5): SplitPlan(2, 16, 1), SplitKey(False, 4, 4, 6): SplitPlan(2, 16, 1),
}


class LongBwdPlan(NamedTuple):
    CHUNK: int
    NCH: int  # chunks per program
    SPLIT: int  # programs per row group, side by side over the columns
    COLS: int  # columns per program (D when SPLIT is 1)
    num_warps: int
    rows_per_prog: int  # the row groups (rows of the dw/db partial buffers) are cdiv(N, rows_per_prog)


class PartsPlan(NamedTuple):
    CHUNK: int
    NCH: int
    num_warps: int


@functools.lru_cache(maxsize=1024)
def fwd_plan(N: int, D: int, x_dtype: torch.dtype, layer_norm: bool, acc: torch.dtype) -> rt.RowTile:
    """The forward's tile: one program per BLOCK_N rows."""
    p2 = rt.next_pow2(D)
    masked = 4 * D <= 3 * p2
    ln16 = LN_FWD_16BIT.get(x_dtype, {}).get(p2) if layer_norm and acc == torch.float32 else None
    if ln16 is not None:
        elems = ln16.elems
        if masked and x_dtype == torch.bfloat16 and p2 <= LN_FWD_MASKED_BF16_MAX_D:
            elems *= 2
        t = rt.row_tile(N, D, FWD_MAX_BLOCK_D, CHUNK_D, elems)
        return t._replace(num_warps=min(t.num_warps, ln16.warps))  # no more warps than a small tile has rows for
    t = rt.row_tile(N, D, FWD_MAX_BLOCK_D, CHUNK_D, FWD_TILE)
    if layer_norm and x_dtype == torch.float32 and acc == torch.float32 and masked and t.ONE_TILE and t.BLOCK_D == 8192:
        return t._replace(num_warps=LN_FWD_MASKED_FP32_WARPS)
    if t.ONE_TILE and x_dtype.itemsize <= 2 and t.num_warps > FWD_WARPS_WIDE_16BIT:
        t = t._replace(num_warps=FWD_WARPS_WIDE_16BIT)
    return t


@functools.lru_cache(maxsize=1024)
def fwd_parts(D: int, itemsize: int) -> PartsPlan | None:
    """The parted forward for rows of D elements of ``itemsize`` bytes (FWD_PARTS_NCH), or None: rows of a
    power of two, of other chunk counts, or longer than one tile. Warps: each thread loads one 16-byte
    vector of every chunk."""
    chunk = D & -D
    nch = D // chunk if D else 0
    warps = chunk * itemsize // 512  # a warp: 32 threads x 16 bytes
    if nch not in FWD_PARTS_NCH or D > FWD_MAX_BLOCK_D or warps < 1:
        return None
    return PartsPlan(chunk, nch, min(warps, FWD_WARPS_WIDE_16BIT if itemsize <= 2 else 16))


@functools.lru_cache(maxsize=1024)
def bwd_plan(N: int, D: int, sms: int, tile: int = BWD_TILE, x_itemsize: int = 4) -> tuple[rt.RowTile, int, int]:
    """Backward: ``(tile, column blocks, rows per program)``; grid (row chunks, column blocks), each program
    reducing its contiguous rows into one row of the partial buffers. ``tile``: elements a program handles
    per step when rows are short."""
    t = rt.row_tile(N, D, BWD_MAX_BLOCK_D, CHUNK_D, tile)
    if masked_16bit(t, D, x_itemsize):
        t = t._replace(num_warps=min(t.num_warps, BWD_MASKED_16BIT.max_warps))
    d_blocks = rt.cdiv(D, t.BLOCK_D)
    _, rows_per_prog = rt.row_split(N, t.BLOCK_N, sms, d_blocks, bwd_per_sm(t))
    return t, d_blocks, rows_per_prog


def masked_16bit(t: rt.RowTile, D: int, x_itemsize: int) -> bool:
    """Whole rows of 16-bit x in a tile of 2048 or more columns, a quarter or more of them masked."""
    return x_itemsize <= 2 and t.ONE_TILE and t.BLOCK_D >= 2048 and 4 * D <= 3 * t.BLOCK_D


def bwd_per_sm(t: rt.RowTile) -> int:
    """Backward programs resident per SM for tile ``t``."""
    return BWD_PROGS_PER_SM if t.num_warps <= 8 else BWD_PROGS_PER_SM_WIDE


@functools.lru_cache(maxsize=1024)
def bwd_stages(t: rt.RowTile, elem_bytes: int, shared_mem: int, depth: int = BWD_STAGES) -> int:
    """Pipelining depth of the backward's row loop: ``depth``, or less where STAGES - 1 tiles of x and dy
    (``elem_bytes`` per column) for each resident program would not fit the SM's ``shared_mem`` bytes (2 KiB
    per program kept for the row reductions)."""
    per_prog = shared_mem // bwd_per_sm(t) - 2048
    tile = t.BLOCK_N * t.BLOCK_D * elem_bytes
    stages = depth
    while stages > 1 and (stages - 1) * tile > per_prog:
        stages -= 1
    return stages


@functools.lru_cache(maxsize=1024)
def long_bwd_plan(
    N: int, D: int, sms: int, layer_norm: bool, x_itemsize: int, w_itemsize: int, acc_itemsize: int, align: int
) -> LongBwdPlan | None:
    """The one-kernel backward's plan for long rows (``w_itemsize`` 0: no weight; ``align``: elements that
    divide D and the row strides, ``rt.align``), or None where the row-sum pass + ``_norm_bwd_kernel`` serve:
    rows that fit one tile, fewer rows than SMs, float64 accumulators, and the cases the tables leave out."""
    if D <= BWD_MAX_BLOCK_D or N < sms or acc_itemsize > 4:
        return None
    nch = rt.cdiv(D, LONG_BWD_CHUNK)
    x16 = x_itemsize <= 2
    split = SplitPlan(1, LONG_BWD_WARPS.get(LongKey(layer_norm, x16, w_itemsize <= 2 if w_itemsize else x16, nch)), 1)
    if split.warps is None and align * x_itemsize >= 16:
        split = LONG_BWD_SPLIT.get(SplitKey(layer_norm, x_itemsize, w_itemsize, nch), split)
    if split.warps is None:
        return None
    _, rows_per_prog = rt.row_split(N, 1, sms, split.split, split.per_sm)
    # Even shares of the row, in multiples of 64 columns (aligned loads): no program idles on a short chunk.
    unit = min(64, LONG_BWD_CHUNK)
    cols = D if split.split == 1 else rt.cdiv(rt.cdiv(D, split.split), unit) * unit
    return LongBwdPlan(LONG_BWD_CHUNK, rt.cdiv(cols, LONG_BWD_CHUNK), split.split, cols, split.warps, rows_per_prog)


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

"""Launch plans of the norm family, as named data: which kernel serves a row, with which tile, warps and depth.

The knobs are fields of a frozen ``NormTable`` (``TABLE``, or another one inside ``using(table)``); each
keeps one line of why (the design: docs/norms.md). ``forward`` and ``backward`` are the pure functions the
launchers call: of the row length D, dtypes, the device's properties and a table, and of the row count N only
for speed (callers pass ``rt.hint(N)``; grids and buffers take N itself); they return frozen plans whose
fields the launchers pass to the kernels by keyword.

Bytes beyond each norm's floor: rows longer than one register tile (D > FWD_MAX_BLOCK_D forward, D >
BWD_MAX_BLOCK_D backward) read x twice in the forward (the second read partly from L2). In the backward, rows
of 3-4 chunks (rms_norm: up to 6) with a row per SM read x and dy twice too, the second time from L2
(``long_bwd_plan``); other long rows read them twice from HBM (a row pass for the row sums first). With fewer
row tiles than SMs those row passes also split the columns (``column_split``), adding S*N floats of partial
statistics (S splits) to each pass.
"""

from __future__ import annotations

import dataclasses
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


def _ln_fwd_16bit() -> dict:
    bf16 = {64: Tile(4096, 4), 128: Tile(8192, 4), 256: Tile(4096, 2), 512: Tile(4096, 2),
            1024: Tile(2048, 4), 2048: Tile(2048, 4), 4096: Tile(8192, 8)}
    return {torch.bfloat16: bf16, torch.float16: {d: bf16[d] for d in (256, 1024, 4096)}}


def _long_bwd_warps() -> dict:
    return {
        LongKey(False, True, True, 3): 8, LongKey(False, True, False, 3): 32, LongKey(False, False, False, 3): 32,
        LongKey(False, True, True, 4): 32, LongKey(False, True, False, 4): 32, LongKey(False, False, False, 4): 32,
        LongKey(True, True, True, 3): 16, LongKey(True, True, False, 3): 16, LongKey(True, False, False, 3): 32,
    }


def _long_bwd_split() -> dict:
    return {
        SplitKey(False, 2, 2, 5): SplitPlan(2, 16, 1), SplitKey(False, 2, 2, 6): SplitPlan(2, 16, 1),
        SplitKey(False, 4, 4, 5): SplitPlan(2, 16, 1), SplitKey(False, 4, 4, 6): SplitPlan(2, 16, 1),
    }


@dataclasses.dataclass(frozen=True, eq=False)
class NormTable:
    """The norms' knobs, each with one line of why. ``TABLE`` is the tuned one; tests and sweeps pass another
    (``dataclasses.replace(TABLE, ...)``) through ``using``."""

    FWD_MAX_BLOCK_D: int = 16384  # longest row the forward keeps whole in registers (float32: 64 KiB over 16 warps)
    BWD_MAX_BLOCK_D: int = 8192  # likewise for the backward, which holds x, dy, w and the dw partial per column
    CHUNK_D: int = 4096  # columns per step for longer rows (read in chunks, twice)
    FWD_TILE: int = 4096  # elements a forward program handles per step when rows are short (several rows a step)
    BWD_TILE: int = 4096  # likewise for the backward
    # layer_norm's backward with 32- and 64-bit x: half the rows per step keeps more rows in flight; rms_norm
    # and 16-bit x keep BWD_TILE.
    LN_BWD_TILE_32BIT: int = 2048
    # Whole 16-bit rows longer than 4096 columns: 8 warps keep two programs resident per SM where 16 fit one.
    FWD_WARPS_WIDE_16BIT: int = 8
    # layer_norm's forward on whole 16-bit rows, by the row's power of two: its two row reductions (mean, then
    # squared deviations) want fewer threads per row than rms_norm's one. float16 takes the entries measured in
    # float16 only.
    LN_FWD_16BIT: dict = dataclasses.field(default_factory=_ln_fwd_16bit)
    # layer_norm's forward over rows that mask a quarter or more of their tile: bf16 rows of up to 2048 columns
    # take twice the elements per program; float32 rows in a tile of 8192 take 8 warps instead of 16.
    LN_FWD_MASKED_BF16_MAX_D: int = 2048
    LN_FWD_MASKED_FP32_WARPS: int = 8
    # Rows of an odd number of power-of-two chunks take the parted forward (no lane masked); rows of 15 chunks
    # need more registers in parts than in one tile and keep the tile.
    FWD_PARTS_NCH: tuple = (3, 5, 7, 9, 11, 13)
    # Backward programs per SM (each loops over its chunk of rows; also the height of the dw/db partial
    # buffers): 2 for tiles of up to 8 warps, 1 for 16-warp tiles, whose registers fill an SM.
    BWD_PROGS_PER_SM: int = 2
    BWD_PROGS_PER_SM_WIDE: int = 1
    # Pipelining depth of the backward's row loop (STAGES - 1 row tiles of x and dy in flight); lowered where
    # the tiles would not fit the programs of an SM.
    BWD_STAGES: int = 3
    # Whole 16-bit rows in tiles of 2048-8192 columns with a quarter or more masked: the pipeline copies whole
    # tiles, so a stage carries fewer useful bytes; one stage more, and programs of at most 8 warps.
    BWD_MASKED_16BIT: MaskedBwd = MaskedBwd(max_warps=8, stages=4)
    # Rows walked in chunks with fewer row tiles than SMs (e.g. 16 x 1M): the row passes split the columns
    # too, for about this many programs per SM (0: never).
    SPLIT_PROGS_PER_SM: int = 4
    # The one-kernel backward of rows longer than BWD_MAX_BLOCK_D, of 3 or 4 chunks, a row per SM
    # (``_norm_bwd_long_kernel``): warps, the best of 8/16/32. Cases it lacks keep the row-sum pass and
    # ``_norm_bwd_kernel``: layer_norm rows of 4 chunks (they spill), float32 x with a 16-bit weight, float64.
    LONG_BWD_CHUNK: int = 4096
    LONG_BWD_WARPS: dict = dataclasses.field(default_factory=_long_bwd_warps)
    # Rows too long for one program's accumulators (5-6 chunks): SPLIT programs share each row group, each with
    # the accumulators of an even share of the columns; every program reads the whole row for the row sums, its
    # neighbours at the same time, so from L2. Only for rows aligned to 16 bytes (vector loads).
    LONG_BWD_SPLIT: dict = dataclasses.field(default_factory=_long_bwd_split)


TABLE = NormTable()
_table = rt.Scoped("the norms' tuning table", TABLE)
using = _table.using  # with plans.using(dataclasses.replace(plans.TABLE, ...)): the launchers plan from that table


def table() -> NormTable:
    """The table the launchers plan from now."""
    return _table.value


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


def fwd_plan(N: int, D: int, x_dtype: torch.dtype, layer_norm: bool, acc: torch.dtype, t: NormTable = TABLE
             ) -> rt.RowTile:
    """The forward's tile: one program per BLOCK_N rows."""
    p2 = rt.next_pow2(D)
    masked = 4 * D <= 3 * p2
    ln16 = t.LN_FWD_16BIT.get(x_dtype, {}).get(p2) if layer_norm and acc == torch.float32 else None
    if ln16 is not None:
        elems = ln16.elems
        if masked and x_dtype == torch.bfloat16 and p2 <= t.LN_FWD_MASKED_BF16_MAX_D:
            elems *= 2
        tile = rt.row_tile(N, D, t.FWD_MAX_BLOCK_D, t.CHUNK_D, elems)
        return tile._replace(num_warps=min(tile.num_warps, ln16.warps))  # no more warps than a small tile has rows for
    tile = rt.row_tile(N, D, t.FWD_MAX_BLOCK_D, t.CHUNK_D, t.FWD_TILE)
    if (layer_norm and x_dtype == torch.float32 and acc == torch.float32 and masked and tile.ONE_TILE
            and tile.BLOCK_D == 8192):
        return tile._replace(num_warps=t.LN_FWD_MASKED_FP32_WARPS)
    if tile.ONE_TILE and x_dtype.itemsize <= 2 and tile.num_warps > t.FWD_WARPS_WIDE_16BIT:
        tile = tile._replace(num_warps=t.FWD_WARPS_WIDE_16BIT)
    return tile


def fwd_parts(D: int, itemsize: int, t: NormTable = TABLE) -> PartsPlan | None:
    """The parted forward for rows of D elements of ``itemsize`` bytes (FWD_PARTS_NCH), or None: rows of a
    power of two, of other chunk counts, or longer than one tile. Warps: each thread loads one 16-byte
    vector of every chunk."""
    chunk = D & -D
    nch = D // chunk if D else 0
    warps = chunk * itemsize // 512  # a warp: 32 threads x 16 bytes
    if nch not in t.FWD_PARTS_NCH or D > t.FWD_MAX_BLOCK_D or warps < 1:
        return None
    return PartsPlan(chunk, nch, min(warps, t.FWD_WARPS_WIDE_16BIT if itemsize <= 2 else 16))


def bwd_plan(N: int, D: int, sms: int, tile: int | None = None, x_itemsize: int = 4, t: NormTable = TABLE
             ) -> tuple[rt.RowTile, int, int]:
    """Backward: ``(tile, column blocks, rows per program)``; grid (row chunks, column blocks), each program
    reducing its contiguous rows into one row of the partial buffers. ``tile``: elements a program handles
    per step when rows are short."""
    rows = rt.row_tile(N, D, t.BWD_MAX_BLOCK_D, t.CHUNK_D, t.BWD_TILE if tile is None else tile)
    if masked_16bit(rows, D, x_itemsize):
        rows = rows._replace(num_warps=min(rows.num_warps, t.BWD_MASKED_16BIT.max_warps))
    d_blocks = rt.cdiv(D, rows.BLOCK_D)
    _, rows_per_prog = rt.row_split(N, rows.BLOCK_N, sms, d_blocks, bwd_per_sm(rows, t))
    return rows, d_blocks, rows_per_prog


def masked_16bit(tile: rt.RowTile, D: int, x_itemsize: int) -> bool:
    """Whole rows of 16-bit x in a tile of 2048 or more columns, a quarter or more of them masked."""
    return x_itemsize <= 2 and tile.ONE_TILE and tile.BLOCK_D >= 2048 and 4 * D <= 3 * tile.BLOCK_D


def bwd_per_sm(tile: rt.RowTile, t: NormTable = TABLE) -> int:
    """Backward programs resident per SM for ``tile``."""
    return t.BWD_PROGS_PER_SM if tile.num_warps <= 8 else t.BWD_PROGS_PER_SM_WIDE


def bwd_stages(tile: rt.RowTile, elem_bytes: int, shared_mem: int, depth: int | None = None, t: NormTable = TABLE
               ) -> int:
    """Pipelining depth of the backward's row loop: ``depth``, or less where STAGES - 1 tiles of x and dy
    (``elem_bytes`` per column) for each resident program would not fit the SM's ``shared_mem`` bytes (2 KiB
    per program kept for the row reductions)."""
    per_prog = shared_mem // bwd_per_sm(tile, t) - 2048
    tile_bytes = tile.BLOCK_N * tile.BLOCK_D * elem_bytes
    stages = t.BWD_STAGES if depth is None else depth
    while stages > 1 and (stages - 1) * tile_bytes > per_prog:
        stages -= 1
    return stages


def long_bwd_plan(
    N: int, D: int, sms: int, layer_norm: bool, x_itemsize: int, w_itemsize: int, acc_itemsize: int, align: int,
    t: NormTable = TABLE,
) -> LongBwdPlan | None:
    """The one-kernel backward's plan for long rows (``w_itemsize`` 0: no weight; ``align``: elements that
    divide D and the row strides, ``rt.align``), or None where the row-sum pass + ``_norm_bwd_kernel`` serve:
    rows that fit one tile, fewer rows than SMs, float64 accumulators, and the cases the tables leave out."""
    if D <= t.BWD_MAX_BLOCK_D or N < sms or acc_itemsize > 4:
        return None
    nch = rt.cdiv(D, t.LONG_BWD_CHUNK)
    x16 = x_itemsize <= 2
    split = SplitPlan(1, t.LONG_BWD_WARPS.get(LongKey(layer_norm, x16, w_itemsize <= 2 if w_itemsize else x16, nch)), 1)
    if split.warps is None and align * x_itemsize >= 16:
        split = t.LONG_BWD_SPLIT.get(SplitKey(layer_norm, x_itemsize, w_itemsize, nch), split)
    if split.warps is None:
        return None
    _, rows_per_prog = rt.row_split(N, 1, sms, split.split, split.per_sm)
    # Even shares of the row, in multiples of 64 columns (aligned loads): no program idles on a short chunk.
    unit = min(64, t.LONG_BWD_CHUNK)
    cols = D if split.split == 1 else rt.cdiv(rt.cdiv(D, split.split), unit) * unit
    return LongBwdPlan(t.LONG_BWD_CHUNK, rt.cdiv(cols, t.LONG_BWD_CHUNK), split.split, cols, split.warps,
                       rows_per_prog)


def column_split(N: int, D: int, tile: rt.RowTile, sms: int, t: NormTable = TABLE) -> tuple[int, int]:
    """``(splits, columns per split)`` for a row pass over ``tile``: ``(1, D)`` unless rows are walked
    in chunks and there are fewer row tiles than SMs; splits are whole chunks, only the last is ragged."""
    row_tiles = rt.cdiv(N, tile.BLOCK_N)
    if tile.ONE_TILE or row_tiles >= sms or t.SPLIT_PROGS_PER_SM == 0:
        return 1, D
    splits = min(rt.cdiv(D, tile.BLOCK_D), rt.cdiv(t.SPLIT_PROGS_PER_SM * sms, row_tiles))
    per_split = rt.cdiv(rt.cdiv(D, splits), tile.BLOCK_D) * tile.BLOCK_D
    return rt.cdiv(D, per_split), per_split


# ---------------------------------------------------------------- the launchers' plans
# Each launch decision (dtypes, kernel, grid shape, constexprs) depends on the input's signature alone, so a
# launcher gets it once per signature (cached) and replays it: the eager path's host time per call goes to
# allocations and launches (docs/host-path.md).
@dataclasses.dataclass(frozen=True)
class FwdPlan:
    out_dtype: torch.dtype
    acc: torch.dtype
    parts: bool  # the parted forward (one row per program)
    BLOCK_N: int
    splits: int  # column splits (PHASE 1 statistics, PHASE 2 normalisation) when > 1
    d_split: int
    consts: dict  # constexprs and num_warps of the launch


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    long: LongBwdPlan | None  # the one-kernel long-row backward
    rowsum: bool  # long rows: the row-sum pass first
    BLOCK_N: int
    d_blocks: int
    rows_per_prog: int
    splits: int  # the row-sum pass's column splits
    d_split: int
    consts: dict  # the main kernel's constexprs and num_warps
    rowsum_consts: dict


def _offset(w_offset: float) -> dict:
    # The kernels' W_OFFSET, always passed: a compiled launch takes every constexpr by name (rt.Kernel).
    return {"W_OFFSET": float(w_offset)}


@functools.lru_cache(maxsize=4096)
def forward(*, N: int, D: int, stride_row: int, x_dtype: torch.dtype, w_dtype: torch.dtype | None,
            b_dtype: torch.dtype | None, layer_norm: bool, llama: bool, props: rt.DeviceProps,
            t: NormTable = TABLE, w_offset: float = 0.0) -> FwdPlan:
    """The forward's plan for x ``[N, D]`` (N a hint) with row stride ``stride_row``; no weight or bias: None;
    ``w_offset``: added to the weight in the kernels (Gemma's 1 + w)."""
    out_dtype = torch.promote_types(x_dtype, w_dtype) if llama else x_dtype
    acc = rt.acc_dtype(functools.reduce(torch.promote_types, [d for d in (x_dtype, w_dtype, b_dtype) if d]))
    flags = dict(HAS_W=w_dtype is not None, ACC=rt.tl_acc_dtype(acc), **_offset(w_offset))
    parts = fwd_parts(D, x_dtype.itemsize, t)
    if parts is not None:  # rows of an odd number (3 to 13) of power-of-two chunks
        consts = dict(flags, CHUNK=parts.CHUNK, NCH=parts.NCH, HAS_B=b_dtype is not None, CENTERED=layer_norm,
                      ROUND_XHAT=llama, ALIGN=rt.align(D, stride_row), num_warps=parts.num_warps)
        return FwdPlan(out_dtype, acc, True, 1, 1, D, consts)
    tile = fwd_plan(N, D, x_dtype, layer_norm, acc, t)
    splits, d_split = column_split(N, D, tile, props.sm_count, t)
    consts = dict(flags, BLOCK_N=tile.BLOCK_N, BLOCK_D=tile.BLOCK_D, ONE_TILE=tile.ONE_TILE, HAS_B=b_dtype is not None,
                  CENTERED=layer_norm, ROUND_XHAT=llama, ALIGN=rt.align(D, stride_row, d_split),  # y's row stride: D
                  num_warps=tile.num_warps)
    return FwdPlan(out_dtype, acc, False, tile.BLOCK_N, splits, d_split, consts)


@functools.lru_cache(maxsize=4096)
def backward(*, N: int, D: int, stride_x: int, stride_dy: int, x_dtype: torch.dtype, dy_dtype: torch.dtype,
             w_dtype: torch.dtype | None, acc: torch.dtype, needs: tuple, layer_norm: bool, llama: bool,
             props: rt.DeviceProps, t: NormTable = TABLE, w_offset: float = 0.0) -> BwdPlan:
    """The backward's plan (N a hint); ``needs``: which of the x, weight and bias gradients are wanted."""
    need_x, need_w, need_b = needs
    x_size = x_dtype.itemsize
    sms = props.sm_count
    # layer_norm's backward with 32- and 64-bit x steps over fewer elements.
    tile_elems = t.LN_BWD_TILE_32BIT if layer_norm and x_size >= 4 else t.BWD_TILE
    tile, d_blocks, rows_per_prog = bwd_plan(N, D, sms, tile_elems, x_size, t)
    align = rt.align(D, stride_x, stride_dy)  # dx is contiguous (row stride D)
    lp = None if tile.ONE_TILE else long_bwd_plan(N, D, sms, layer_norm, x_size, w_dtype.itemsize if w_dtype else 0,
                                                  acc.itemsize, align, t)
    if lp is not None:
        rows_per_prog = lp.rows_per_prog
    # The dw/db partial rows are D or 2D apart (one buffer for both).
    align = rt.align(align, D * (need_w + need_b))
    flags = dict(HAS_W=w_dtype is not None, CENTERED=layer_norm, ACC=rt.tl_acc_dtype(acc), ALIGN=align,
                 HAS_DX=need_x, HAS_DW=need_w, HAS_DB=need_b, ROUND_XHAT=llama, **_offset(w_offset))
    if lp is not None:
        consts = dict(flags, CHUNK=lp.CHUNK, NCH=lp.NCH, SPLIT=lp.SPLIT, num_warps=lp.num_warps)
        return BwdPlan(lp, False, 1, 1, rows_per_prog, 1, D, consts, {})
    depth = t.BWD_MASKED_16BIT.stages if masked_16bit(tile, D, x_size) else t.BWD_STAGES
    consts = dict(flags, BLOCK_N=tile.BLOCK_N, BLOCK_D=tile.BLOCK_D, ONE_TILE=tile.ONE_TILE, num_warps=tile.num_warps,
                  STAGES=bwd_stages(tile, x_size + dy_dtype.itemsize, props.shared_mem_per_sm, depth, t))
    rowsum = need_x and not tile.ONE_TILE
    splits, d_split = column_split(N, D, tile, sms, t) if rowsum else (1, D)
    rowsum_consts = dict(BLOCK_N=tile.BLOCK_N, BLOCK_D=tile.BLOCK_D, num_warps=tile.num_warps,
                         HAS_W=w_dtype is not None, CENTERED=layer_norm, ACC=rt.tl_acc_dtype(acc),
                         ALIGN=rt.align(align, d_split), **_offset(w_offset))
    return BwdPlan(None, rowsum, tile.BLOCK_N, d_blocks, rows_per_prog, splits, d_split, consts, rowsum_consts)


@dataclasses.dataclass(frozen=True)
class AddNormPlan:
    """The fused residual add + RMSNorm (``residual.py``): rows held whole in one register tile, forward and
    backward; ``fused`` False where the row is longer than the backward's tile (the op then composes the add
    with ``llama_rms_norm``)."""

    fused: bool
    out_dtype: torch.dtype
    acc: torch.dtype
    fwd: dict  # the forward kernel's constexprs and num_warps
    bwd: dict  # the backward kernel's
    BLOCK_N_BWD: int


@functools.lru_cache(maxsize=1024)
def add_norm(*, N: int, D: int, x_dtype: torch.dtype, w_dtype: torch.dtype, props: rt.DeviceProps,
             t: NormTable = TABLE, w_offset: float = 0.0, cast_first: bool = True) -> AddNormPlan:
    """The fused add + norm's plan for rows ``[N, D]`` (N a hint): the norms' row tiles, one tile a row; the
    backward's row loop pipelined as the norms' (s, dy and the stream's gradient in flight). ``cast_first``:
    Llama's norm (y in the promoted dtype), else rms_norm's with ``w_offset`` (y in x's dtype)."""
    promoted = torch.promote_types(x_dtype, w_dtype)
    out_dtype = promoted if cast_first else x_dtype
    acc = rt.acc_dtype(promoted)
    fwd = rt.row_tile(N, D, t.BWD_MAX_BLOCK_D, t.CHUNK_D, t.FWD_TILE)
    bwd = rt.row_tile(N, D, t.BWD_MAX_BLOCK_D, t.CHUNK_D, t.BWD_TILE)
    flags = dict(ACC=rt.tl_acc_dtype(acc), BLOCK_D=fwd.BLOCK_D, CAST_FIRST=cast_first, **_offset(w_offset))
    return AddNormPlan(fwd.ONE_TILE, out_dtype, acc, dict(flags, BLOCK_N=fwd.BLOCK_N, num_warps=fwd.num_warps),
                       dict(flags, BLOCK_N=bwd.BLOCK_N, num_warps=bwd.num_warps,
                            STAGES=bwd_stages(bwd, 3 * x_dtype.itemsize, props.shared_mem_per_sm, None, t)),
                       bwd.BLOCK_N)

"""weighted_sum's launch plans: a tuning table of named knobs, and one pure function per pass.

A plan is a function of the shape, the element size, the device's properties and a table (``TABLE``, or another
one inside ``using(table)``); launchers pass its fields to the kernels by keyword. N enters a plan as a hint
(callers pass ``rt.hint(N)``): grids and buffers take N itself. Design and measurements: docs/weighted-sum.md.
"""

from __future__ import annotations

import dataclasses
import functools

from ... import _runtime as rt


@dataclasses.dataclass(frozen=True)
class FwdTile:
    bytes: int  # bytes of x per program step
    warps: int
    stages: int  # pipelining depth of the D loop


@dataclasses.dataclass(frozen=True, eq=False)
class WeightedSumTable:
    """The knobs; keyed by element size where 16-bit inputs want other pipelining than float32."""

    # The forward: whole rows per step up to the tile; 16-bit rows want half the tile float32 does.
    FWD_TILES: dict = dataclasses.field(default_factory=lambda: {
        2: FwdTile(16384, 8, 1), 4: FwdTile(32768, 8, 2), 8: FwdTile(16384, 4, 1)})
    FWD_PROGS_PER_SM: int = 8  # forward programs per SM when rows are too few and D is split
    FWD_MASKED_MAX: float = 0.625  # forward steps using at most this share of their lanes ...
    FWD_MIN_EXACT_BLOCK_D: int = 512  # ... step over the widest power of two dividing D, if this wide
    TILE_BYTES: int = 16384  # bytes of x a backward program moves per row step: several 16-byte loads a thread
    NUM_WARPS: int = 4  # warps of the backward launches
    # The one-launch backward: pipelining depth of its row loop, and programs per SM (bounds grad_w's partials).
    BWD_STAGES: dict = dataclasses.field(default_factory=lambda: {2: 2, 4: 3, 8: 1})
    BWD_PROGS_PER_SM: dict = dataclasses.field(default_factory=lambda: {2: 8, 4: 4, 8: 4})
    GW_STAGES: int = 2  # the read-only grad_w pass: pipelining depth ...
    GW_PROGS_PER_SM: int = 4  # ... and programs per SM
    BWD_BLOCK_D: int = 128  # backward column block ...
    FEW_ROWS: int = 64  # ... and with this many rows or fewer (programs then loop over row steps) ...
    FEW_ROWS_BLOCK_D: int = 1024  # ... this one
    GX_MAX_BLOCK_D: int = 1024  # the write-only grad_x pass: widest column block
    SPLIT_BWD_BYTES: int = 192 << 20  # x at least this large ...
    SPLIT_BWD_ROWS: int = 4096  # ... with this many rows: grad_w then grad_x in two passes (reads and writes apart)
    MAX_GRID_Y: int = 65535  # CUDA's limit on the grid's second axis (the column blocks)


TABLE = WeightedSumTable()
_table = rt.Scoped("weighted_sum's tuning table", TABLE)
using = _table.using  # with plans.using(dataclasses.replace(plans.TABLE, ...)): launches plan from that table


def table() -> WeightedSumTable:
    """The table the launchers plan from now."""
    return _table.value


@dataclasses.dataclass(frozen=True)
class FwdPlan:
    BLOCK_N: int
    BLOCK_D: int
    split: int  # programs per row tile along D (partial sums added by column_sum)
    d_per_split: int
    STAGES: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    """The launch that writes grad_w's partial rows, and grad_x too when ``fused``; the row chunks are
    ``cdiv(N, rows_per_prog)``."""

    fused: bool
    BLOCK_N: int
    BLOCK_D: int
    d_blocks: int
    rows_per_prog: int
    STAGES: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class GxPlan:
    """The write-only grad_x launch: one program per tile, nothing to reduce, so no persistent grid."""

    BLOCK_N: int
    BLOCK_D: int
    d_blocks: int
    num_warps: int


@functools.lru_cache(maxsize=1024)
def fwd_plan(N: int, D: int, elem: int, props: rt.DeviceProps, t: WeightedSumTable = TABLE) -> FwdPlan:
    tile_ = t.FWD_TILES[elem]
    tile = tile_.bytes // elem
    BLOCK_D = min(rt.next_pow2(D), tile)
    # Rows whose steps would leave many lanes masked (5120 in one step of 8192: 37.5%) step over a power of
    # two that divides D instead (five steps of 1024), when one that wide exists.
    exact = min(D & -D, tile)
    if D <= t.FWD_MASKED_MAX * rt.cdiv(D, BLOCK_D) * BLOCK_D and exact >= t.FWD_MIN_EXACT_BLOCK_D:
        BLOCK_D = exact
    BLOCK_N = min(tile // BLOCK_D, rt.next_pow2(N))
    row_tiles = rt.cdiv(N, BLOCK_N)
    # Too few rows to fill the GPU: split each row's D across programs, then add the splits in order.
    split = min(rt.cdiv(D, BLOCK_D), max(1, t.FWD_PROGS_PER_SM * props.sm_count // row_tiles))
    d_per_split = rt.cdiv(rt.cdiv(D, split), BLOCK_D) * BLOCK_D
    return FwdPlan(BLOCK_N, BLOCK_D, rt.cdiv(D, d_per_split), d_per_split, tile_.stages, tile_.warps)


def _column_block(D: int, block_d: int, t: WeightedSumTable) -> int:
    # Wider blocks where D would otherwise need more than CUDA's 65535 blocks on the grid's second axis.
    return max(block_d, rt.next_pow2(rt.cdiv(D, t.MAX_GRID_Y)))


def fused_bwd(N: int, D: int, elem: int, t: WeightedSumTable = TABLE) -> bool:
    """Both gradients in one launch: inputs small or of few rows."""
    return N * D * elem < t.SPLIT_BWD_BYTES or N < t.SPLIT_BWD_ROWS


@functools.lru_cache(maxsize=1024)
def bwd_plan(N: int, D: int, elem: int, props: rt.DeviceProps, fused: bool, t: WeightedSumTable = TABLE) -> BwdPlan:
    tile = t.TILE_BYTES // elem
    # Few rows (e.g. 16 x 1M): wide column blocks of a few rows, so that each program still moves full tiles
    # and loops over several row steps (one-step programs of all the rows cannot pipeline their loads).
    BLOCK_D = _column_block(D, min(rt.next_pow2(D), t.FEW_ROWS_BLOCK_D if N <= t.FEW_ROWS else t.BWD_BLOCK_D), t)
    BLOCK_N = max(1, min(tile // BLOCK_D, rt.next_pow2(N)))
    d_blocks = rt.cdiv(D, BLOCK_D)
    progs_per_sm = t.BWD_PROGS_PER_SM[elem] if fused else t.GW_PROGS_PER_SM
    _, rows_per_prog = rt.row_split(N, BLOCK_N, props.sm_count, d_blocks, progs_per_sm)
    stages = t.BWD_STAGES[elem] if fused else t.GW_STAGES
    return BwdPlan(fused, BLOCK_N, BLOCK_D, d_blocks, rows_per_prog, stages, t.NUM_WARPS)


@functools.lru_cache(maxsize=1024)
def gx_plan(N: int, D: int, elem: int, t: WeightedSumTable = TABLE) -> GxPlan:
    BLOCK_D = _column_block(D, min(rt.next_pow2(D), t.GX_MAX_BLOCK_D), t)
    BLOCK_N = max(1, min(t.TILE_BYTES // elem // BLOCK_D, rt.next_pow2(N)))
    return GxPlan(BLOCK_N, BLOCK_D, rt.cdiv(D, BLOCK_D), t.NUM_WARPS)

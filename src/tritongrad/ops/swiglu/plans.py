"""SwiGLU's launch plan, as named data: the tile a program covers and its warps.

The op is a pure stream (no reduction, no reuse): what matters is enough bytes in flight per SM and no
lanes wasted on masks. The knobs are fields of a frozen ``SwigluTable`` (``TABLE``, or another one inside
``using(table)``); ``tile`` is the pure function the launchers call, of D, the element size and a table, and
of the row count only to cap the tile (callers pass ``rt.hint(N)``); grids take N itself. It reads no device
property: the tile is small enough for every GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from ... import _runtime as rt


class Tile(NamedTuple):
    BLOCK_N: int  # rows per program
    BLOCK_D: int  # columns per program
    num_warps: int


@dataclasses.dataclass(frozen=True, eq=False)
class SwigluTable:
    """The knobs, each with one line of why; tests and sweeps pass another (``dataclasses.replace(TABLE, ...)``)
    through ``using``."""

    # Bytes of each input a program reads, and its warps: one 16-byte vector per thread and input, many small
    # programs: at copy bandwidth forward and backward, where larger tiles are slower (docs/swiglu-rope.md).
    TILE_BYTES: int = 4096
    NUM_WARPS: int = 8
    # Column blocks: the widest power of two dividing D, up to the tile (14336 = 7 x 2048, 11008 = 43 x 256),
    # so that no lane is masked; if D has no such divisor of at least MIN_EXACT_BLOCK_D columns, the next
    # power of two above D (capped by the tile), masked at the row's end.
    MIN_EXACT_BLOCK_D: int = 256


TABLE = SwigluTable()
_table = rt.Scoped("swiglu's tuning table", TABLE)
using = _table.using  # with plans.using(dataclasses.replace(plans.TABLE, ...)): the launchers plan from that table


def table() -> SwigluTable:
    """The table the launchers plan from now."""
    return _table.value


@functools.lru_cache(maxsize=256)
def tile(N: int, D: int, elem: int, t: SwigluTable = TABLE) -> Tile:
    """The tile for rows of D elements of ``elem`` bytes (the narrowest tensor's); N is a plan hint."""
    elems = t.TILE_BYTES // elem
    exact = min(D & -D, elems)
    BLOCK_D = exact if exact >= t.MIN_EXACT_BLOCK_D else min(rt.next_pow2(D), elems)
    BLOCK_N = max(1, min(elems // BLOCK_D, rt.next_pow2(N)))
    return Tile(BLOCK_N, BLOCK_D, t.NUM_WARPS)

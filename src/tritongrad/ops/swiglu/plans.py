"""SwiGLU's launch plan, as named data: the tile a program covers and its warps.

The op is a pure stream (no reduction, no reuse): what matters is enough bytes in flight per SM and no
lanes wasted on masks. Plans depend on D and the element size, and on the row count only to cap the tile
(callers pass ``rt.hint(N)``); grids take N itself.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ... import _runtime as rt


class Tile(NamedTuple):
    BLOCK_N: int  # rows per program
    BLOCK_D: int  # columns per program
    num_warps: int


# Bytes of each input a program reads, and its warps: one 16-byte vector per thread and input, many small
# programs: at copy bandwidth forward and backward, where larger tiles were slower (docs/swiglu-rope.md).
TILE_BYTES = 4096
NUM_WARPS = 8
# Column blocks: the widest power of two dividing D, up to the tile (14336 = 7 x 2048, 11008 = 43 x 256),
# so that no lane is masked; if D has no such divisor of at least MIN_EXACT_BLOCK_D columns, the next
# power of two above D (capped by the tile), masked at the row's end.
MIN_EXACT_BLOCK_D = 256


@functools.lru_cache(maxsize=256)
def tile(N: int, D: int, elem: int) -> Tile:
    """The tile for rows of D elements of ``elem`` bytes (the narrowest tensor's); N is a plan hint."""
    elems = TILE_BYTES // elem
    exact = min(D & -D, elems)
    BLOCK_D = exact if exact >= MIN_EXACT_BLOCK_D else min(rt.next_pow2(D), elems)
    BLOCK_N = max(1, min(elems // BLOCK_D, rt.next_pow2(N)))
    return Tile(BLOCK_N, BLOCK_D, NUM_WARPS)

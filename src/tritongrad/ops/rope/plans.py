"""The rotary embedding's launch plan, as named data: tokens and heads per program, and warps.

The op is a stream over q and k with a small table (cos, sin) shared by all heads of a token: a program
takes a block of tokens x a block of heads, so that it loads each token's cos and sin rows once for
BLOCK_H heads and moves about TILE_BYTES of q or k. Plans depend on the head counts, Dh and the element
size, and on the token count only to cap the block (callers pass ``rt.hint``); grids take N itself.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ... import _runtime as rt


class Plan(NamedTuple):
    BLOCK_T: int  # tokens per program
    BLOCK_H: int  # heads per program (of q, or of k)
    BLOCK_HALF: int  # columns of each half-head: Dh / 2, rounded up to a power of two
    num_warps: int


# Bytes of q (or k) a program reads: 4096 bfloat16 elements, four 16-byte vectors per thread at 4 warps,
# as in ops/swiglu: a few programs resident per SM, enough bytes in flight.
TILE_BYTES = 8192
NUM_WARPS = 4


@functools.lru_cache(maxsize=256)
def plan(N: int, HQ: int, HK: int, Dh: int, elem: int) -> Plan:
    """The plan for q of HQ heads and k of HK heads of Dh elements of ``elem`` bytes (the widest of q and
    k); N (tokens) is a plan hint."""
    BLOCK_HALF = rt.next_pow2(max(Dh // 2, 1))
    elems = TILE_BYTES // elem
    max_h = max(1, elems // (2 * BLOCK_HALF))
    # Heads per block: the fewest padded (masked) heads over q's and k's blocks together (32 and 8 heads:
    # 8, no padding; 14 and 2: 2), then the widest, which shares a cos/sin load among the most heads.
    blocks = [1 << i for i in range(rt.next_pow2(min(max(HQ, HK, 1), max_h)).bit_length())]
    BLOCK_H = min(blocks, key=lambda b: (rt.cdiv(HQ, b) * b + rt.cdiv(HK, b) * b, -b))
    BLOCK_T = max(1, min(elems // (BLOCK_H * 2 * BLOCK_HALF), rt.next_pow2(N)))
    return Plan(BLOCK_T, BLOCK_H, BLOCK_HALF, NUM_WARPS)

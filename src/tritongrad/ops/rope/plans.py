"""The rotary embedding's launch plan, as named data: tokens and heads per program, and warps.

The op is a stream over q and k with a small table (cos, sin) shared by all heads of a token: a program
takes a block of tokens x a block of heads (of q, or of k), loads the tokens' cos and sin rows once for its
heads and moves about TILE_BYTES of q or k. Plans depend on the head counts, Dh and the element size, and
on the sequence length only to cap the block (callers pass ``rt.hint(T)``); grids take T itself. Sweeps on
an H200: docs/swiglu-rope.md.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ... import _runtime as rt


class Plan(NamedTuple):
    BLOCK_T: int  # tokens per program
    BLOCK_HQ: int  # heads per program of q ...
    BLOCK_HK: int  # ... and of k
    BLOCK_HALF: int  # columns of each half-head: Dh / 2, rounded up to a power of two
    num_warps: int


# Bytes of q (or k) a program reads (2048 bfloat16 elements: one 16-byte vector per thread and half-head
# load at 4 warps), and its warps. The fastest of 4, 8 and 16 KiB tiles at 2, 4 and 8 warps on an H200.
TILE_BYTES = 4096
NUM_WARPS = 4
# At most this many heads per program: 16 (one token of 16 heads of 128) was 2-3% faster than 8 (two
# tokens of 8 heads) at Llama-8B's 32/8 heads; 32 no better.
MAX_BLOCK_H = 16


def _heads_block(H: int, widest: int) -> int:
    """Heads per block: the fewest padded (masked) heads, then the widest (up to 16: 32 heads: 16; 40: 8;
    28: 4; 14: 2)."""
    blocks = [1 << i for i in range(rt.next_pow2(min(max(H, 1), widest)).bit_length())]
    return min(blocks, key=lambda b: (rt.cdiv(H, b) * b, -b))


@functools.lru_cache(maxsize=256)
def plan(T: int, HQ: int, HK: int, Dh: int, elem: int) -> Plan:
    """The plan for q of HQ heads and k of HK heads (0: not processed) of Dh elements of ``elem`` bytes (the
    narrower of q and k, so that its loads stay 16-byte vectors); T (tokens per sequence) is a plan hint."""
    BLOCK_HALF = rt.next_pow2(max(Dh // 2, 1))
    elems = TILE_BYTES // elem
    widest = max(1, min(MAX_BLOCK_H, elems // (2 * BLOCK_HALF)))
    BLOCK_HQ, BLOCK_HK = _heads_block(HQ, widest), _heads_block(HK, widest)
    BLOCK_T = max(1, min(elems // (max(BLOCK_HQ, BLOCK_HK) * 2 * BLOCK_HALF), rt.next_pow2(T)))
    return Plan(BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, NUM_WARPS)

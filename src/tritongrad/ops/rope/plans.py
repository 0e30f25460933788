"""The rotary embedding's launch plan, as named data: tokens and heads per program, and warps.

The op is a stream over q and k with a small table (cos, sin) shared by all heads of a token: a program
takes a block of tokens x a block of heads (of q, or of k), loads the tokens' cos and sin rows once for its
heads and moves about TILE_BYTES of q or k. The knobs are fields of a frozen ``RopeTable`` (``TABLE``, or
another one inside ``using(table)``); ``plan`` is the pure function the launcher calls, of the head counts,
the head and rotary widths, the element size and a table, and of the sequence length only to cap the block
(callers pass ``rt.hint(T)``); grids take T itself. It reads no device property. Design: docs/swiglu-rope.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from ... import _runtime as rt


class Plan(NamedTuple):
    BLOCK_T: int  # tokens per program
    BLOCK_HQ: int  # heads per program of q ...
    BLOCK_HK: int  # ... and of k
    BLOCK_HALF: int  # pairs of rotated features per head: R / 2, rounded up to a power of two
    BLOCK_PASS: int  # passed features per head: D - R rounded up to a power of two (1 when none)
    num_warps: int


@dataclasses.dataclass(frozen=True, eq=False)
class RopeTable:
    """The knobs, each with one line of why; tests and sweeps pass another (``dataclasses.replace(TABLE, ...)``)
    through ``using``."""

    # Bytes of q (or k) a program reads (2048 bfloat16 elements: one 16-byte vector per thread and half-head
    # load at 4 warps), and its warps: the fastest of 4-16 KiB tiles at 2-8 warps.
    TILE_BYTES: int = 4096
    NUM_WARPS: int = 4
    # At most this many heads per program: one token of 16 heads beats two tokens of 8 at Llama-8B's 32/8
    # heads; 32 is no better.
    MAX_BLOCK_H: int = 16


TABLE = RopeTable()
_table = rt.Scoped("the rotary embedding's tuning table", TABLE)
using = _table.using  # with plans.using(dataclasses.replace(plans.TABLE, ...)): the launcher plans from that table


def table() -> RopeTable:
    """The table the launcher plans from now."""
    return _table.value


def _floor_pow2(n: int) -> int:
    """The largest power of two <= n (1 for n < 1)."""
    return 1 << (max(n, 1).bit_length() - 1)


def _heads_block(H: int, widest: int) -> int:
    """Heads per block: the fewest padded (masked) heads, then the widest (up to 16: 32 heads: 16; 40: 8;
    28: 4; 14: 2)."""
    blocks = [1 << i for i in range(rt.next_pow2(min(max(H, 1), widest)).bit_length())]
    return min(blocks, key=lambda b: (rt.cdiv(H, b) * b, -b))


@functools.lru_cache(maxsize=256)
def plan(T: int, HQ: int, HK: int, D: int, R: int, elem: int, t: RopeTable = TABLE) -> Plan:
    """The plan for q of HQ heads and k of HK heads (0: not processed) of D elements of ``elem`` bytes (the
    narrower of q and k, so that its loads stay 16-byte vectors), the first R of which rotate; T (tokens per
    sequence) is a plan hint. A head's tile is its rotated pairs' two blocks and its passed features' block."""
    BLOCK_HALF = rt.next_pow2(max(R // 2, 1))
    BLOCK_PASS = rt.next_pow2(max(D - R, 1))
    width = 2 * BLOCK_HALF + (BLOCK_PASS if D > R else 0)
    elems = t.TILE_BYTES // elem
    # Powers of two (block shapes), rounded down: a head of passed features makes the width no power of two.
    widest = _floor_pow2(min(t.MAX_BLOCK_H, elems // width))
    BLOCK_HQ, BLOCK_HK = _heads_block(HQ, widest), _heads_block(HK, widest)
    BLOCK_T = min(_floor_pow2(elems // (max(BLOCK_HQ, BLOCK_HK) * width)), rt.next_pow2(T))
    return Plan(BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, BLOCK_PASS, t.NUM_WARPS)

"""Launch plans of the cross-entropy family, as named data, with one line of why each (docs/cross-entropy.md).

Plans depend on the class count C, the element size and the SM count, and on the row count N only for speed
(callers pass ``rt.hint(N)``): grids and buffers take N itself.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ... import _runtime as rt


class RowPlan(NamedTuple):
    """The main kernel over rows of C logits."""

    BLOCK_C: int  # columns per step
    num_warps: int
    stages: int  # chunks in flight per program (software pipelining of the column loops)
    programs: int  # the persistent grid: rows in flight at once


# Rows of at most this many columns are one chunk: read once, held in registers, no second read at all.
# 16 (16-bit), 8 (32-bit) or 4 (64-bit) elements a thread over 8 warps: two 16-byte loads per thread and
# step, and room in registers (16 warps cap a thread at 128 registers, where the options' kernels spill).
ONE_CHUNK_MAX = {2: 4096, 4: 2048, 8: 1024}
# Longer rows step over chunks of that many columns (8 KiB) ...
CHUNK_WARPS = 8
# ... with this many chunks in flight per program: the loads of the next chunks are issued (cp.async into
# shared memory) while this one is reduced; 32 KiB in flight per program for 16-bit logits.
STAGES = {2: 4, 4: 3, 8: 3}
# Pass 2 re-reads a row that pass 1 just read; it comes from L2 if the rows in flight fit. H100/H200 have
# 50-60 MB of L2; the gradient's write-back shares it, so the rows in flight are held to this many bytes.
L2_ROWS_BYTES = 32 << 20
# At most this many resident programs per SM (rows in one chunk: bounded by occupancy, not L2).
MAX_PROGRAMS_PER_SM = 8

# The backward scale kernel: rows per program chosen so that about this many programs cover N, each
# reading its rows' lse gradients in one vector load (all of them exit at once when there is nothing to do).
BWD_PROGRAMS_PER_SM = 4
BWD_MAX_ROWS = 64
BWD_BLOCK_C = {2: 4096, 4: 2048, 8: 1024}  # 16 bytes a thread and step over 8 warps, like the forward
BWD_WARPS = 8
# One program for the cross-row sums (denominator, reduced loss): a few thousand targets per step.
STATS_BLOCK = 2048
STATS_WARPS = 8
# The flat scale of the linear op's gradients: a persistent grid of this many programs per SM.
SCALE_BLOCK = 4096
SCALE_PROGRAMS_PER_SM = 4

# linear_cross_entropy: logits are made in chunks of rows whose buffer holds at most this many bytes
# (192 MiB is 4.6% of the 4.2 GB logits of 16384 tokens x 128256 classes in bfloat16) ...
LCE_CHUNK_BYTES = 192 << 20
# ... a multiple of this many rows (the matrix products' tile height) ...
LCE_ROW_MULTIPLE = 128
# ... and at least this many rows, whatever the vocabulary: smaller products run far from the GPU's peak.
LCE_MIN_ROWS = 128


@functools.lru_cache(maxsize=1024)
def row_plan(N: int, C: int, elem: int, sms: int, narrow: int = 0) -> RowPlan:
    """The main kernel's plan for N rows (a hint) of C classes of ``elem``-byte logits. ``narrow``: halve the
    chunk this many times, for kernels that would spill at full width (class weights with label smoothing
    load a weight per logit; rows not 16-byte aligned load element by element, each with its own address)."""
    width = ONE_CHUNK_MAX[elem] >> narrow
    if C <= width:
        block = rt.next_pow2(max(C, 1))
        warps = max(1, min(CHUNK_WARPS, block * elem // 512))  # 16 bytes a thread at least
        per_sm = MAX_PROGRAMS_PER_SM
    else:
        block, warps = width, CHUNK_WARPS
        per_sm = max(1, min(MAX_PROGRAMS_PER_SM, L2_ROWS_BYTES // (sms * C * elem)))
    return RowPlan(block, warps, STAGES[elem], max(1, min(N, per_sm * sms)))


def bwd_rows(N: int, sms: int) -> int:
    """Rows per program of the backward scale kernel (a power of two)."""
    return min(BWD_MAX_ROWS, rt.next_pow2(rt.cdiv(max(N, 1), BWD_PROGRAMS_PER_SM * sms)))


def lce_chunk_rows(N: int, V: int, elem: int) -> int:
    """Rows of logits linear_cross_entropy makes at once (N a hint): as many as LCE_CHUNK_BYTES holds."""
    rows = LCE_CHUNK_BYTES // max(1, V * elem) // LCE_ROW_MULTIPLE * LCE_ROW_MULTIPLE
    return max(1, min(N, max(LCE_MIN_ROWS, rows)))

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
# Longer rows step over chunks of 32 bytes a thread (16 columns of 16-bit logits) ...
CHUNK_THREAD_BYTES = 32
# ... with programs this small: the kernel is bound by latency, not bytes (a block max per chunk, then its
# exps), so an SM wants many independent rows in flight. 2 warps a program up to LONG_ROW_BYTES a row, 4 beyond
# (fewer, longer chunk loops per row), measured best among 2-16 warps (docs/cross-entropy.md#plans).
CHUNK_WARPS = 2
CHUNK_WARPS_LONG = 4
LONG_ROW_BYTES = 128 << 10
# Warps of the persistent grid per SM: 16 measured best, although long rows in flight then outgrow L2 (528
# rows of 256 KB), so pass 2 may re-read them from HBM; bounding the rows in flight to fit L2 measured slower.
WARPS_PER_SM = 16
STAGES = {2: 6, 4: 4, 8: 4}  # chunks in flight per program (cp.async into shared memory) for rows ...
STAGES_LONG = {2: 4, 4: 4, 8: 4}  # ... up to LONG_ROW_BYTES, and beyond

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
# ... of equal size (a ragged last chunk would be a small, inefficient product), a multiple of this many rows ...
LCE_ROW_MULTIPLE = 16
# ... and at least this many rows, whatever the vocabulary: smaller products run far from the GPU's peak.
LCE_MIN_ROWS = 128


@functools.lru_cache(maxsize=1024)
def row_plan(N: int, C: int, elem: int, sms: int, narrow: int = 0) -> RowPlan:
    """The main kernel's plan for N rows (a hint) of C classes of ``elem``-byte logits. ``narrow``: halve the
    chunk this many times, for kernels that would spill at full width (class weights with label smoothing
    load a weight per logit; rows not 16-byte aligned load element by element, each with its own address; the
    soft cap keeps tanh's terms live; its rows are bound by arithmetic, not by the chunk width)."""
    width = ONE_CHUNK_MAX[elem] >> narrow
    if C <= width:
        # One chunk: nothing is re-read; a program per row lets the GPU balance the rows.
        block = rt.next_pow2(max(C, 1))
        return RowPlan(block, max(1, min(8, block * elem // 512)), STAGES[elem], max(1, N))
    long = C * elem > LONG_ROW_BYTES
    warps = CHUNK_WARPS_LONG if long else CHUNK_WARPS
    block = max(16, (warps * 32 * CHUNK_THREAD_BYTES // elem) >> narrow)
    stages = (STAGES_LONG if long else STAGES)[elem]
    return RowPlan(block, warps, stages, max(1, min(N, WARPS_PER_SM // warps * sms)))


def bwd_rows(N: int, sms: int) -> int:
    """Rows per program of the backward scale kernel (a power of two)."""
    return min(BWD_MAX_ROWS, rt.next_pow2(rt.cdiv(max(N, 1), BWD_PROGRAMS_PER_SM * sms)))


def lce_chunk_rows(N: int, V: int, elem: int) -> int:
    """Rows of logits linear_cross_entropy makes at once (N a hint): as many as LCE_CHUNK_BYTES holds, then
    evened out over the chunks that takes (16384 x 128256 bf16: 21 chunks of 784 rows, the last of 704)."""
    most = max(LCE_MIN_ROWS, LCE_CHUNK_BYTES // max(1, V * elem))
    chunks = rt.cdiv(max(N, 1), most)
    rows = rt.cdiv(rt.cdiv(max(N, 1), chunks), LCE_ROW_MULTIPLE) * LCE_ROW_MULTIPLE
    return max(1, min(N, rows))

"""Launch plans of the cross-entropy family, as named data, with one line of why each (docs/cross-entropy.md).

The knobs are fields of a frozen ``CrossEntropyTable`` (``TABLE``, or another one inside ``using(table)``).
``row_plan``, ``bwd_rows`` and ``lce_chunk_rows`` are the pure functions the launchers call: of the class
count C, the element size, the device's properties and a table, and of the row count N only for speed
(callers pass ``rt.hint(N)``): grids and buffers take N itself.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from ... import _runtime as rt


class RowPlan(NamedTuple):
    """The main kernel over rows of C logits."""

    BLOCK_C: int  # columns per step
    num_warps: int
    stages: int  # chunks in flight per program (software pipelining of the column loops)
    programs: int  # the persistent grid: rows in flight at once


@dataclasses.dataclass(frozen=True, eq=False)
class CrossEntropyTable:
    """The family's knobs, each with one line of why. ``TABLE`` is the tuned one; tests and sweeps pass another
    (``dataclasses.replace(TABLE, ...)``) through ``using``."""

    # Rows of at most this many columns are one chunk: read once, held in registers, no second read at all.
    # 16 (16-bit), 8 (32-bit) or 4 (64-bit) elements a thread over 8 warps: two 16-byte loads per thread and
    # step, and room in registers (16 warps cap a thread at 128 registers, where the options' kernels spill).
    ONE_CHUNK_MAX: dict = dataclasses.field(default_factory=lambda: {2: 4096, 4: 2048, 8: 1024})
    # Longer rows step over chunks of 32 bytes a thread (16 columns of 16-bit logits) ...
    CHUNK_THREAD_BYTES: int = 32
    # ... with programs this small: the kernel is bound by latency, not bytes (a block max per chunk, then its
    # exps), so an SM wants many independent rows in flight. 2 warps a program up to LONG_ROW_BYTES a row, 4
    # beyond (fewer, longer chunk loops per row): the best of 2-16 warps (docs/cross-entropy.md#plans).
    CHUNK_WARPS: int = 2
    CHUNK_WARPS_LONG: int = 4
    LONG_ROW_BYTES: int = 128 << 10
    # Warps of the persistent grid per SM: sixteen resident warps is the lever, although long rows in flight
    # then outgrow L2 (pass 2 may re-read them from HBM); bounding the rows in flight to fit L2 is slower.
    WARPS_PER_SM: int = 16
    # Chunks in flight per program (cp.async into shared memory) for rows up to LONG_ROW_BYTES, and beyond.
    STAGES: dict = dataclasses.field(default_factory=lambda: {2: 6, 4: 4, 8: 4})
    STAGES_LONG: dict = dataclasses.field(default_factory=lambda: {2: 4, 4: 4, 8: 4})
    # The backward scale kernel: rows per program chosen so that about this many programs cover N, each
    # reading its rows' lse gradients in one vector load (all of them exit at once when there is nothing to do).
    BWD_PROGRAMS_PER_SM: int = 4
    BWD_MAX_ROWS: int = 64
    # 16 bytes a thread and step over 8 warps, like the forward.
    BWD_BLOCK_C: dict = dataclasses.field(default_factory=lambda: {2: 4096, 4: 2048, 8: 1024})
    BWD_WARPS: int = 8
    # One program for the cross-row sums (denominator, reduced loss): a few thousand targets per step.
    STATS_BLOCK: int = 2048
    STATS_WARPS: int = 8
    # The flat scale of the linear op's gradients: a persistent grid of this many programs per SM.
    SCALE_BLOCK: int = 4096
    SCALE_PROGRAMS_PER_SM: int = 4
    SCALE_WARPS: int = 4
    # linear_cross_entropy: logits are made in chunks of rows, a chunk's logits no larger than the call's hidden
    # states (N x H: the peak of Liger-Kernel's loss, which a training step's peak includes) ...
    # ... unless that is fewer than this many rows: each chunk adds its product into grad_weight, reading and
    # writing all of it, about 111 / rows of the three products on an H200 (docs/cross-entropy.md#chunk-size) ...
    LCE_EFFICIENT_ROWS: int = 512
    # ... and whatever the rows, at most this many bytes (192 MiB is 4.6% of the 4.2 GB logits of 16384 tokens
    # x 128256 classes in bfloat16) ...
    LCE_CHUNK_BYTES: int = 192 << 20
    # ... of equal size (a ragged last chunk would be a small, inefficient product), a multiple of this many
    # rows ...
    LCE_ROW_MULTIPLE: int = 16
    # ... and at least this many rows, whatever the vocabulary: smaller products run far from the GPU's peak.
    LCE_MIN_ROWS: int = 128


TABLE = CrossEntropyTable()
_table = rt.Scoped("the cross-entropy family's tuning table", TABLE)
using = _table.using  # with plans.using(dataclasses.replace(plans.TABLE, ...)): the launchers plan from that table


def table() -> CrossEntropyTable:
    """The table the launchers plan from now."""
    return _table.value


@functools.lru_cache(maxsize=1024)
def row_plan(N: int, C: int, elem: int, props: rt.DeviceProps, narrow: int = 0, t: CrossEntropyTable = TABLE
             ) -> RowPlan:
    """The main kernel's plan for N rows (a hint) of C classes of ``elem``-byte logits. ``narrow``: halve the
    chunk this many times, for kernels that would spill at full width (class weights with label smoothing
    load a weight per logit; rows not 16-byte aligned load element by element, each with its own address; the
    soft cap keeps tanh's terms live; its rows are bound by arithmetic, not by the chunk width)."""
    width = t.ONE_CHUNK_MAX[elem] >> narrow
    if C <= width:
        # One chunk: nothing is re-read; a program per row lets the GPU balance the rows.
        block = rt.next_pow2(max(C, 1))
        return RowPlan(block, max(1, min(8, block * elem // 512)), t.STAGES[elem], max(1, N))
    long = C * elem > t.LONG_ROW_BYTES
    warps = t.CHUNK_WARPS_LONG if long else t.CHUNK_WARPS
    block = max(16, (warps * 32 * t.CHUNK_THREAD_BYTES // elem) >> narrow)
    stages = (t.STAGES_LONG if long else t.STAGES)[elem]
    return RowPlan(block, warps, stages, max(1, min(N, t.WARPS_PER_SM // warps * props.sm_count)))


def bwd_rows(N: int, props: rt.DeviceProps, t: CrossEntropyTable = TABLE) -> int:
    """Rows per program of the backward scale kernel (a power of two)."""
    return min(t.BWD_MAX_ROWS, rt.next_pow2(rt.cdiv(max(N, 1), t.BWD_PROGRAMS_PER_SM * props.sm_count)))


def scale_programs(n: int, props: rt.DeviceProps, t: CrossEntropyTable = TABLE) -> int:
    """Programs of the flat scale over ``n`` elements: one per block, at most SCALE_PROGRAMS_PER_SM an SM."""
    return max(1, min(rt.cdiv(n, t.SCALE_BLOCK), t.SCALE_PROGRAMS_PER_SM * props.sm_count))


def lce_chunk_rows(N: int, V: int, H: int, elem: int, t: CrossEntropyTable = TABLE) -> int:
    """Rows of logits linear_cross_entropy makes at once for ``[N, H]`` hidden states (N a hint) and V classes:
    as many as the hidden states' size holds, at least LCE_EFFICIENT_ROWS, at most what LCE_CHUNK_BYTES holds,
    then evened out over the chunks that takes (16384 x 2048 or 4096 -> 128256 bf16: 32 chunks of 512 rows;
    65536 x 4096 -> 128256: 84 chunks of 784, the cap's)."""
    cap = t.LCE_CHUNK_BYTES // max(1, V * elem)
    most = max(t.LCE_MIN_ROWS, min(cap, max(t.LCE_EFFICIENT_ROWS, max(N, 1) * H // max(1, V))))
    chunks = rt.cdiv(max(N, 1), most)
    rows = rt.cdiv(rt.cdiv(max(N, 1), chunks), t.LCE_ROW_MULTIPLE) * t.LCE_ROW_MULTIPLE
    return max(1, min(N, rows))

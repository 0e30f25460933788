"""Launch plans of the post-training family, as named data, with one line of why each (docs/post-training.md).

One plan per call: how many rows of logits a chunk holds (the memory), and how each row's program walks its
vocabulary (the kernels). Plans depend on N only for speed (callers pass ``rt.hint(N)``): grids and buffers
take N itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from ... import _runtime as rt


@dataclass(frozen=True)
class Limits:
    """What bounds a chunk. ``LIMITS`` below is the one in force; tests replace it with a smaller one."""

    # One head's logits buffer of a chunk at most this many bytes: 256 MiB is 6.4% of the 4.2 GB logits of 16384
    # tokens x 128256 classes in bfloat16, 1024 rows, which ran faster than 752 (192 MiB: each chunk reads and
    # writes all of grad_weight; docs/post-training.md). Per head: a chunk's cost goes with its rows, so
    # distillation holds the teacher's chunk beside the student's rather than halving both ...
    chunk_bytes: int = 256 << 20
    # ... in chunks of equal size (a ragged last chunk would be a small, inefficient product), a multiple of
    # this many rows ...
    row_multiple: int = 16
    # ... and at least this many rows, whatever the vocabulary: smaller products run far from the GPU's peak.
    min_rows: int = 128
    # A row's program steps over its vocabulary this many bytes at a time (16 bytes a thread over 8 warps for
    # 16-bit logits): one chunk in registers per step, the row itself never.
    block_bytes: int = 8192
    # DPO: a pair's loss needs all its tokens before any gradient, so its chunks hold whole pairs, as many as
    # this many bytes of logits hold (each chunk fewer reads and writes all of grad_weight); a pair over it
    # takes chunks of rows instead, which make the logits twice (five products with the reference's, not four).
    pair_bytes: int = 1 << 30


LIMITS = Limits()


@dataclass(frozen=True)
class ChunkPlan:
    rows: int  # rows of logits made (and held) at once, per head
    BLOCK_V: int  # vocabulary columns per step of a row's program
    num_warps: int

    @classmethod
    def for_shape(cls, N: int, V: int, elem: int, limits: Limits | None = None) -> "ChunkPlan":
        """The plan for N rows (a hint) of V logits of ``elem`` bytes a head: as many rows as the budget holds,
        evened out over the chunks that takes."""
        lim = limits or LIMITS
        most = max(lim.min_rows, lim.chunk_bytes // max(1, V * elem))
        chunks = rt.cdiv(max(N, 1), most)
        rows = rt.cdiv(rt.cdiv(max(N, 1), chunks), lim.row_multiple) * lim.row_multiple
        block = min(rt.next_pow2(max(V, 1)), max(16, lim.block_bytes // elem))
        warps = max(1, min(8, block * elem // 512))  # 16 bytes a thread and step
        return cls(max(1, min(N, rows)), block, warps)


@dataclass(frozen=True)
class PairPlan:
    pairs: int  # DPO pairs whose logits are made (and held) at once: rows = 2 * pairs * T
    BLOCK_V: int
    num_warps: int

    @classmethod
    def for_shape(cls, B: int, T: int, V: int, elem: int, limits: Limits | None = None) -> "PairPlan":
        """The plan for B pairs (a hint) of two sequences of T rows of V logits of ``elem`` bytes: as many
        whole pairs as ``pair_bytes`` holds, at least one, evened out over the chunks."""
        lim = limits or LIMITS
        most = max(1, lim.pair_bytes // pair_bytes(T, V, elem))
        chunks = rt.cdiv(max(B, 1), most)
        rows = ChunkPlan.for_shape(2 * T, V, elem, limits=lim)
        return cls(max(1, min(B, rt.cdiv(max(B, 1), chunks))), rows.BLOCK_V, rows.num_warps)


def pair_bytes(T: int, V: int, elem: int) -> int:
    """The bytes of one DPO pair's logits: its chosen and its rejected sequence, T rows each."""
    return 2 * max(T, 1) * max(V, 1) * elem


def pairs_fit(T: int, V: int, elem: int, limits: Limits | None = None) -> bool:
    """Whether one pair's logits are within ``pair_bytes``: then the fused DPO op (three products); else chunks
    of rows and the logits made twice."""
    return pair_bytes(T, V, elem) <= (limits or LIMITS).pair_bytes

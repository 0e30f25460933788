"""Fixed-order sum over the rows of a partial buffer.

    out[m] = sum_{p < P} part[p, m]          part: [P, M] (float32 or float64), out: [M] in any float dtype

Every column reduction in tritongrad (grad_w of weighted_sum, weight/bias gradients of the norms, the
split-D forward of weighted_sum) runs in two stages: stage one writes one row of partial sums per program
into ``part``; this kernel is stage two. Each program owns a block of columns and walks the P rows in the
same order on every run, so the result is bitwise reproducible (no atomics anywhere).
"""

import triton
import triton.language as tl

from .._tl import round_to


@triton.jit
def _column_sum_kernel(
    part_ptr,
    out_ptr,
    P,
    M,
    stride_part_row,
    stride_out,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    o_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    acc = tl.zeros([BLOCK_P, BLOCK_M], dtype=ACC)
    for p0 in range(0, P, BLOCK_P):
        o_p = p0 + tl.arange(0, BLOCK_P)
        p_part = part_ptr + o_p.to(tl.int64)[:, None] * stride_part_row + o_m[None, :]
        acc += tl.load(p_part, mask=(o_p < P)[:, None] & m_m[None, :], other=0.0).to(ACC)
    # The cast to the output dtype happens once, after the whole sum.
    tl.store(out_ptr + o_m * stride_out, round_to(tl.sum(acc, axis=0), out_ptr.dtype.element_ty), mask=m_m)

"""Fixed-order sum over the rows of a partial buffer.

    out[m] = scale * sum_{p < P} part[p, m]      part: [P, M] (any float dtype), out: [M] in any float dtype

or, with a second output (``HAS_OUT2``), columns m < M1 go to out[m] and the rest to out2[m - M1]: two
reductions whose partial rows share a buffer (layer_norm's weight and bias gradients) in one launch.

Every column reduction in tritongrad (grad_w of weighted_sum, weight/bias gradients of the norms, the
split-D forward of weighted_sum) runs in two stages: stage one writes one row of partial sums per program
into ``part``; this kernel is stage two. Each program owns a block of columns and walks the P rows in the
same order on every run, so the result is bitwise reproducible (no atomics anywhere). The sum accumulates in
ACC (float32, float64 where part or out is float64); the scale (``HAS_SCALE``) multiplies the whole sum once,
before the one rounding to the output dtype.
"""

import triton
import triton.language as tl

from .._tl import float_arg, round_to


@triton.jit
def _column_sum_kernel(
    part_ptr,
    out_ptr,
    out2_ptr,  # columns M1.. of part; None without HAS_OUT2
    P,
    M,
    M1,  # columns that go to out (M without HAS_OUT2)
    stride_part_row,
    stride_out,
    stride_out2,
    scale_hi,  # the scale as float32 ...
    scale_lo,  # ... plus the rest (rt.split_float): a float64 sum gets it to float64
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_OUT2: tl.constexpr,
    HAS_SCALE: tl.constexpr,
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
    b_sum = tl.sum(acc, axis=0)
    if HAS_SCALE:
        b_sum = b_sum * float_arg(scale_hi, scale_lo, ACC)
    tl.store(out_ptr + o_m * stride_out, round_to(b_sum, out_ptr.dtype.element_ty), mask=o_m < M1)
    if HAS_OUT2:
        # A block may straddle M1; the lanes below M1 are masked off here (their offsets are negative).
        o_m2 = o_m - M1
        tl.store(out2_ptr + o_m2 * stride_out2, round_to(b_sum, out2_ptr.dtype.element_ty), mask=m_m & (o_m2 >= 0))

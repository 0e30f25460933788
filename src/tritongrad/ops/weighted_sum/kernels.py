r"""Weighted sum over the last dimension.

Forward, for x: [N, D] (leading dims flattened), w: [D]:

    y[n] = \sum_d x[n, d] * w[d]

Backward, given g = dL/dy: [N]:

    dL/dx[n, d] = g[n] * w[d]                      (an outer product: no reduction)
    dL/dw[d]    = \sum_n x[n, d] * g[n]            (a column reduction across all rows)

Derivation: y is linear in x and in w, and dy[n]/dx[n', d] = w[d] [n = n'], dy[n]/dw[d] = x[n, d];
the chain rule sums g[n] times these over n.

Precision: every load is cast to the accumulation dtype ACC (float32, float64 for float64 inputs)
before any arithmetic, products and sums stay in ACC, and results are rounded once on store.
bfloat16 inputs therefore lose nothing beyond the final rounding (eager PyTorch rounds every product).

Reductions are deterministic: dL/dw is reduced in two stages (each program sums its own contiguous
chunk of rows into one row of a float32 partial buffer, then ``column_sum`` adds the partial rows in a
fixed order). The split-D forward, used when there are too few rows to fill the GPU, works the same way
along D.

The backward kernel computes either gradient or both (HAS_GX, HAS_GW): dL/dx needs no x and dL/dw writes
no [N, D] output, so for large inputs the launcher runs them as two launches, a read-only stream and a
write-only one.
"""

import triton
import triton.language as tl

from .._tl import aligned, round_to


@triton.jit
def _weighted_sum_fwd_kernel(
    x_ptr,
    w_ptr,
    out_ptr,  # y: [N] when the row is not split, else a [SPLIT, N] float partial buffer
    N,
    D,
    stride_x_row,
    stride_x_col,
    stride_w,
    stride_out_split,
    D_PER_SPLIT,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STAGES: tl.constexpr,
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,  # divides D and the row strides (ops/_tl.aligned)
):
    D = aligned(D, ALIGN)
    stride_x_row = aligned(stride_x_row, ALIGN)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    # int64 row offsets: N * stride can pass 2**31 elements.
    p_x = x_ptr + o_n.to(tl.int64)[:, None] * stride_x_row
    d_start = pid_s * D_PER_SPLIT
    d_end = tl.minimum(D, d_start + D_PER_SPLIT)
    # One partial sum per row: reducing each step keeps the accumulator out of the register budget that
    # the loads need (a [BLOCK_N, BLOCK_D] float32 accumulator halved occupancy for 16-bit inputs).
    acc = tl.zeros([BLOCK_N], dtype=ACC)
    for d0 in tl.range(d_start, d_end, BLOCK_D, num_stages=STAGES):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < d_end
        # Masked lanes load 0 so they add nothing to the sum.
        # x is read exactly once: evict it first so w stays in cache.
        b_x = tl.load(
            p_x + o_d.to(tl.int64)[None, :] * stride_x_col, mask=m_n[:, None] & m_d[None, :], other=0.0,
            eviction_policy="evict_first",
        )
        b_w = tl.load(w_ptr + o_d * stride_w, mask=m_d, other=0.0)
        acc += tl.sum(b_x.to(ACC) * b_w.to(ACC)[None, :], axis=1)
    tl.store(out_ptr + pid_s * stride_out_split + o_n, round_to(acc, out_ptr.dtype.element_ty), mask=m_n)


@triton.jit
def _weighted_sum_bwd_kernel(
    x_ptr,
    w_ptr,
    g_ptr,
    gx_ptr,  # grad_x: [N, D], written only when HAS_GX
    gw_ptr,  # grad_w: [D] when one program covers all rows, else a [P, D] float partial buffer
    N,
    D,
    stride_x_row,
    stride_x_col,
    stride_w,
    stride_g,  # 0 for the expanded grad_y that y.sum().backward() produces
    stride_gx_row,
    stride_gw_part,
    ROWS_PER_PROG,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_GX: tl.constexpr,
    HAS_GW: tl.constexpr,
    STAGES: tl.constexpr,
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,  # divides D and the row strides (ops/_tl.aligned)
):
    D = aligned(D, ALIGN)
    stride_x_row = aligned(stride_x_row, ALIGN)
    stride_gx_row = aligned(stride_gx_row, ALIGN)
    stride_gw_part = aligned(stride_gw_part, ALIGN)
    # Grid: (row chunks, column blocks). A program owns ROWS_PER_PROG consecutive rows and BLOCK_D columns,
    # so its grad_w partial stays in registers for the whole chunk.
    pid_p = tl.program_id(0)
    pid_d = tl.program_id(1)
    o_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_d64 = o_d.to(tl.int64)
    if HAS_GX:
        b_w = tl.load(w_ptr + o_d * stride_w, mask=m_d, other=0.0).to(ACC)
    if HAS_GW:
        acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    row_start = pid_p * ROWS_PER_PROG
    row_end = tl.minimum(N, row_start + ROWS_PER_PROG)
    for r0 in tl.range(row_start, row_end, BLOCK_N, num_stages=STAGES):
        o_n = r0 + tl.arange(0, BLOCK_N)
        m_n = o_n < row_end
        o_n64 = o_n.to(tl.int64)
        b_g = tl.load(g_ptr + o_n64 * stride_g, mask=m_n, other=0.0).to(ACC)
        mask = m_n[:, None] & m_d[None, :]
        if HAS_GX:
            p_gx = gx_ptr + o_n64[:, None] * stride_gx_row + o_d64[None, :]
            tl.store(p_gx, round_to(b_g[:, None] * b_w[None, :], gx_ptr.dtype.element_ty), mask=mask)
        if HAS_GW:
            p_x = x_ptr + o_n64[:, None] * stride_x_row + o_d64[None, :] * stride_x_col
            b_x = tl.load(p_x, mask=mask, other=0.0, eviction_policy="evict_first").to(ACC)
            acc += b_x * b_g[:, None]
    if HAS_GW:
        tl.store(gw_ptr + pid_p * stride_gw_part + o_d, round_to(tl.sum(acc, axis=0), gw_ptr.dtype.element_ty), mask=m_d)

r"""Root-mean-square normalisation over the last D elements of each row.

Forward, for x: [N, D] (leading dims flattened, normalised dims flattened into D), w: [D] (optional):

    r[n]       = 1 / sqrt( (1/D) \sum_d x[n, d]^2 + eps )          (saved for the backward: rstd)
    xhat[n, d] = x[n, d] * r[n]
    y[n, d]    = xhat[n, d] * w[d]                                  (y = xhat without a weight)

Backward, given dy = dL/dy: [N, D]. Write g[n, d] = dy[n, d] * w[d] (the gradient reaching xhat; g = dy
without a weight). Then

    dL/dw[d]    = \sum_n dy[n, d] * xhat[n, d]                      (a column reduction across all rows)
    dL/dx[n, d] = r[n] * ( g[n, d] - xhat[n, d] * c[n] ),   c[n] = (1/D) \sum_j g[n, j] * xhat[n, j]

Derivation of dL/dx: x[n, j] enters y[n, :] directly and through r[n]. With ms = (1/D) \sum_i x_i^2,

    dr/dx_j = -1/2 (ms + eps)^{-3/2} * 2 x_j / D = -r^3 x_j / D
    d(x_i r)/dx_j = r [i = j] + x_i dr/dx_j = r [i = j] - r xhat_i xhat_j / D

so dL/dx_j = \sum_i g_i d(x_i r)/dx_j = r (g_j - xhat_j (1/D) \sum_i g_i xhat_i). Rows are independent:
no term couples two rows, so only dL/dw needs a reduction across rows.

The backward recomputes xhat from x and the saved r (one float per row) instead of saving xhat.

Llama variant (``ROUND_XHAT``, Hugging Face's LlamaRMSNorm): xhat is rounded to x's dtype before the
weight multiplies it, ``y = w * xhat.to(x.dtype)``, and y is stored in the promoted dtype of x and w.
dL/dw then sums dy * (rounded xhat), the value the forward multiplied; dL/dx treats the rounding as the
identity, as autograd differentiates a cast.

Precision: every load is cast to ACC (float32, float64 for float64) before any arithmetic; sums of
squares, products and the row sums c stay in ACC; results are rounded once, on store. A zero row gives
r = 1/sqrt(eps), finite for eps > 0, and y = 0.

Shapes of the launch: the forward gives each program BLOCK_N rows; when a row fits one tile
(``ONE_TILE``) it is loaded once and kept in registers, otherwise the program walks it in BLOCK_D-column
chunks twice (sum of squares, then normalise). The backward runs programs over (row chunk, column block):
each program owns a contiguous chunk of rows and BLOCK_D columns, writes dL/dx for them and sums its
dL/dw partial in registers into one row of a float partial buffer, which ``column_sum`` then reduces in a
fixed order (deterministic, no atomics). When a row does not fit one tile, c[n] comes from a separate row
pass (``_rms_norm_bwd_rowsum_kernel``) so that columns can be split across programs.

Few long rows (fewer row tiles than SMs, e.g. 16 x 1M): one program per row would leave most SMs idle, so
the row passes split the columns too. Forward: PHASE 1 programs write the sum of squares of their column
split, PHASE 2 programs add the splits' sums in a fixed order and normalise their split. Backward: each
split writes its part of c[n], and ``column_sum`` adds the parts in a fixed order. Sums of squares and
row sums are additive over columns, so the split changes only the order of float additions.
"""

import triton
import triton.language as tl

from .._tl import round_to


@triton.jit
def _scale(
    b_xhat, w_ptr, o_d, m_d, stride_w,
    HAS_W: tl.constexpr, ROUND_XHAT: tl.constexpr, X_DTYPE: tl.constexpr, ACC: tl.constexpr,
):
    """xhat * w (or xhat), in ACC."""
    if ROUND_XHAT:
        # Llama: the normalised value is rounded to the input dtype before the weight multiplies it.
        b_xhat = round_to(b_xhat, X_DTYPE).to(ACC)
    if HAS_W:
        b_w = tl.load(w_ptr + o_d * stride_w, mask=m_d, other=0.0).to(ACC)
        b_xhat = b_xhat * b_w[None, :]
    return b_xhat


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,  # [N, D], unit column stride
    rstd_ptr,  # [N], ACC
    part_ptr,  # [NUM_SPLITS, N], ACC: each column split's sum of squares (PHASE 1 writes, PHASE 2 reads)
    N,
    D,
    stride_x_row,
    stride_x_col,
    stride_w,
    stride_y_row,
    eps,
    D_SPLIT,  # columns per program along grid axis 1 (a multiple of BLOCK_D; D when rows are not split)
    NUM_SPLITS,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_TILE: tl.constexpr,
    HAS_W: tl.constexpr,
    ROUND_XHAT: tl.constexpr,
    PHASE: tl.constexpr,  # 0: whole rows; 1: partial statistics of a column split; 2: normalise a split
    ACC: tl.constexpr,
):
    # int64 before any multiply by a stride: N * stride can pass 2**31 elements.
    pid = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    o_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_x = x_ptr + o_n[:, None] * stride_x_row
    p_y = y_ptr + o_n[:, None] * stride_y_row
    X_DTYPE = x_ptr.dtype.element_ty
    if ONE_TILE:
        # The whole row in registers: read once, then statistics, normalisation and store.
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        mask = m_n[:, None] & m_d[None, :]
        # Masked lanes load 0, which adds nothing to the sum of squares.
        b_x = tl.load(p_x + o_d.to(tl.int64)[None, :] * stride_x_col, mask=mask, other=0.0).to(ACC)
        b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
        b_y = _scale(b_x * b_rstd[:, None], w_ptr, o_d, m_d, stride_w, HAS_W, ROUND_XHAT, X_DTYPE, ACC)
        tl.store(p_y + o_d[None, :], round_to(b_y, y_ptr.dtype.element_ty), mask=mask)
    else:
        # Rows too long for registers: sum of squares over chunks, then a second read to normalise
        # (for a few rows per SM the second read mostly hits L2). With few rows the columns are split
        # across programs too: PHASE 1 writes each split's sum of squares, PHASE 2 adds them in a fixed
        # order and normalises its split.
        d_lo = pid_s * D_SPLIT
        d_hi = tl.minimum(D, d_lo + D_SPLIT)
        if PHASE == 2:
            b_ss = tl.zeros([BLOCK_N], dtype=ACC)
            for s in range(0, NUM_SPLITS):
                b_ss += tl.load(part_ptr + s * N + o_n, mask=m_n, other=0.0)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
            for d0 in range(d_lo, d_hi, BLOCK_D):
                o_d = d0 + tl.arange(0, BLOCK_D)
                mask = m_n[:, None] & (o_d < d_hi)[None, :]
                b_x = tl.load(p_x + o_d.to(tl.int64)[None, :] * stride_x_col, mask=mask, other=0.0).to(ACC)
                acc += b_x * b_x
            b_ss = tl.sum(acc, axis=1)
        if PHASE == 1:
            tl.store(part_ptr + pid_s * N + o_n, b_ss, mask=m_n)
        else:
            b_rstd = tl.rsqrt(b_ss / D + eps)
            for d0 in range(d_lo, d_hi, BLOCK_D):
                o_d = d0 + tl.arange(0, BLOCK_D)
                m_d = o_d < d_hi
                mask = m_n[:, None] & m_d[None, :]
                b_x = tl.load(p_x + o_d.to(tl.int64)[None, :] * stride_x_col, mask=mask, other=0.0).to(ACC)
                b_y = _scale(b_x * b_rstd[:, None], w_ptr, o_d, m_d, stride_w, HAS_W, ROUND_XHAT, X_DTYPE, ACC)
                tl.store(p_y + o_d[None, :], round_to(b_y, y_ptr.dtype.element_ty), mask=mask)
    if PHASE != 1:
        if pid_s == 0:  # one split of a row writes its statistics
            tl.store(rstd_ptr + o_n, b_rstd, mask=m_n)


@triton.jit
def _rms_norm_bwd_rowsum_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    rstd_ptr,
    c_ptr,  # [N], ACC: c[n] = (1/D) sum_d g[n, d] * xhat[n, d]; or [NUM_SPLITS, N] partials of it
    N,
    D,
    stride_x_row,
    stride_x_col,
    stride_w,
    stride_dy_row,
    stride_dy_col,
    D_SPLIT,  # columns per program along grid axis 1 (D when rows are not split)
    stride_c_split,  # between the partial rows of column splits
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_W: tl.constexpr,
    ACC: tl.constexpr,
):
    # Only for rows longer than one tile: the row sums dL/dx needs, so that the main backward kernel can
    # split columns across programs. With few rows the columns are split here too; the splits' partial
    # sums are then added by column_sum.
    pid = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    o_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    d_lo = pid_s * D_SPLIT
    d_hi = tl.minimum(D, d_lo + D_SPLIT)
    b_rstd = tl.load(rstd_ptr + o_n, mask=m_n, other=0.0).to(ACC)
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < d_hi
        o_d64 = o_d.to(tl.int64)
        mask = m_n[:, None] & m_d[None, :]
        b_x = tl.load(x_ptr + o_n[:, None] * stride_x_row + o_d64[None, :] * stride_x_col, mask=mask, other=0.0)
        b_dy = tl.load(dy_ptr + o_n[:, None] * stride_dy_row + o_d64[None, :] * stride_dy_col, mask=mask, other=0.0)
        b_g = b_dy.to(ACC)
        if HAS_W:
            b_g = b_g * tl.load(w_ptr + o_d * stride_w, mask=m_d, other=0.0).to(ACC)[None, :]
        acc += b_g * b_x.to(ACC)
    # sum_d g * xhat = r * sum_d g * x
    tl.store(c_ptr + pid_s * stride_c_split + o_n, tl.sum(acc, axis=1) * b_rstd / D, mask=m_n)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    rstd_ptr,
    c_ptr,  # [N] row sums from _rms_norm_bwd_rowsum_kernel; read only when not ONE_TILE
    dx_ptr,  # [N, D], unit column stride; written only when HAS_DX
    dw_ptr,  # dL/dw: [D] when one program covers all rows, else a [P, D] float partial buffer
    N,
    D,
    stride_x_row,
    stride_x_col,
    stride_w,
    stride_dy_row,  # 0 for the expanded dy that y.sum().backward() produces
    stride_dy_col,
    stride_dx_row,
    stride_dw_part,
    ROWS_PER_PROG,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_TILE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_DX: tl.constexpr,
    HAS_DW: tl.constexpr,
    ROUND_XHAT: tl.constexpr,
    ACC: tl.constexpr,
):
    # Grid: (row chunks, column blocks). One pass: x and dy are read once, dx written once, and the dw
    # partial of the program's rows stays in registers until the single store at the end.
    pid_p = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    o_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_d64 = o_d.to(tl.int64)
    if HAS_W:
        b_w = tl.load(w_ptr + o_d * stride_w, mask=m_d, other=0.0).to(ACC)
    if HAS_DW:
        acc_dw = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    row_start = pid_p * ROWS_PER_PROG
    row_end = tl.minimum(N, row_start + ROWS_PER_PROG)
    # Software pipelining by hand: the next row tile's loads are issued before the current tile is
    # processed, so HBM latency overlaps the row reductions (a program of this size holds most of an SM's
    # registers, so other programs cannot hide the latency). Registers, not shared memory, hold the next
    # tile: no shared-memory limit to hit for float64 or long rows.
    # Masked lanes load 0: their xhat and dy are 0, so they add nothing to the row sums or the partials.
    o_n = row_start + tl.arange(0, BLOCK_N)
    mask = (o_n < row_end)[:, None] & m_d[None, :]
    b_x_next = tl.load(x_ptr + o_n[:, None] * stride_x_row + o_d64[None, :] * stride_x_col, mask=mask, other=0.0)
    b_dy_next = tl.load(dy_ptr + o_n[:, None] * stride_dy_row + o_d64[None, :] * stride_dy_col, mask=mask, other=0.0)
    for r0 in range(row_start, row_end, BLOCK_N):
        o_n = r0 + tl.arange(0, BLOCK_N)
        m_n = o_n < row_end
        mask = m_n[:, None] & m_d[None, :]
        b_x = b_x_next
        b_dy = b_dy_next.to(ACC)
        o_nn = o_n + BLOCK_N
        mask_next = (o_nn < row_end)[:, None] & m_d[None, :]
        b_x_next = tl.load(x_ptr + o_nn[:, None] * stride_x_row + o_d64[None, :] * stride_x_col, mask=mask_next, other=0.0)
        b_dy_next = tl.load(
            dy_ptr + o_nn[:, None] * stride_dy_row + o_d64[None, :] * stride_dy_col, mask=mask_next, other=0.0
        )
        b_rstd = tl.load(rstd_ptr + o_n, mask=m_n, other=0.0).to(ACC)
        b_xhat = b_x.to(ACC) * b_rstd[:, None]
        if HAS_DX:
            b_g = b_dy
            if HAS_W:
                b_g = b_dy * b_w[None, :]
            if ONE_TILE:
                b_c = tl.sum(b_g * b_xhat, axis=1) / D
            else:
                b_c = tl.load(c_ptr + o_n, mask=m_n, other=0.0).to(ACC)
            b_dx = (b_g - b_xhat * b_c[:, None]) * b_rstd[:, None]
            tl.store(dx_ptr + o_n[:, None] * stride_dx_row + o_d64[None, :], round_to(b_dx, dx_ptr.dtype.element_ty), mask=mask)
        if HAS_DW:
            if ROUND_XHAT:
                # The forward multiplied w by xhat rounded to x's dtype; its gradient is that value.
                b_xhat = round_to(b_xhat, x_ptr.dtype.element_ty).to(ACC)
            acc_dw += b_dy * b_xhat
    if HAS_DW:
        tl.store(dw_ptr + pid_p * stride_dw_part + o_d, round_to(tl.sum(acc_dw, axis=0), dw_ptr.dtype.element_ty), mask=m_d)

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
chunks twice (sum of squares, then normalise). Rows of an odd number (3 to 13) of power-of-two chunks
(5120 = 5 x 1024) take the parted forward that both norms share instead (``_norm_fwd_parts_kernel`` in
ops/_norm_kernels.py): one row per program, held without masked lanes. The backward kernels are
layer_norm's without its mean terms (ops/_norm_kernels.py): programs over (row chunk, column block), each
writing dL/dx for its rows and columns and summing its dL/dw partial in registers into one row of a float
partial buffer, which ``column_sum`` then reduces in a fixed order (deterministic, no atomics). When a row
does not fit one tile, c[n] comes from a separate row pass so that columns can be split across programs.

Few long rows (fewer row tiles than SMs, e.g. 16 x 1M): one program per row would leave most SMs idle, so
the row passes split the columns too. Forward: PHASE 1 programs write the sum of squares of their column
split, PHASE 2 programs add the splits' sums in a fixed order and normalise their split. Backward: each
split writes its part of c[n], and ``column_sum`` adds the parts in a fixed order. Sums of squares and
row sums are additive over columns, so the split changes only the order of float additions.
"""

import triton
import triton.language as tl

from .._tl import aligned, round_to


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
    eps,  # float32 (Triton passes a Python float so) ...
    eps_lo,  # ... plus the rest of the float64 eps (rt.split_float)
    D_SPLIT,  # columns per program along grid axis 1 (a multiple of BLOCK_D; D when rows are not split)
    NUM_SPLITS,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_TILE: tl.constexpr,
    HAS_W: tl.constexpr,
    ROUND_XHAT: tl.constexpr,
    PHASE: tl.constexpr,  # 0: whole rows; 1: partial statistics of a column split; 2: normalise a split
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,  # divides D and the row strides (ops/_tl.aligned)
):
    D = aligned(D, ALIGN)
    stride_x_row = aligned(stride_x_row, ALIGN)
    stride_y_row = aligned(stride_y_row, ALIGN)
    D_SPLIT = aligned(D_SPLIT, ALIGN)
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
        b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps + eps_lo)
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
            b_rstd = tl.rsqrt(b_ss / D + eps + eps_lo)
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

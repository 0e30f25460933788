r"""Layer normalisation over the last D elements of each row.

Forward, for x: [N, D] (leading dims flattened, normalised dims flattened into D), w, b: [D] (optional):

    mu[n]      = (1/D) \sum_d x[n, d]                                         (saved: mean)
    var[n]     = (1/D) \sum_d (x[n, d] - mu[n])^2                              (biased, as PyTorch)
    r[n]       = 1 / sqrt(var[n] + eps)                                        (saved: rstd)
    xhat[n, d] = (x[n, d] - mu[n]) * r[n]
    y[n, d]    = xhat[n, d] * w[d] + b[d]                (w = 1 and b = 0 when absent)

Backward, given dy = dL/dy: [N, D]. Write g[n, d] = dy[n, d] * w[d] (the gradient reaching xhat). Then

    dL/db[d]    = \sum_n dy[n, d]                                              (column reductions
    dL/dw[d]    = \sum_n dy[n, d] * xhat[n, d]                                  across all rows)
    dL/dx[n, d] = r[n] * ( g[n, d] - c2[n] - xhat[n, d] * c1[n] ),
                  c1[n] = (1/D) \sum_j g[n, j] * xhat[n, j],   c2[n] = (1/D) \sum_j g[n, j]

Derivation of dL/dx (one row, indices over d): d mu/dx_j = 1/D. d var/dx_j = (2/D)(x_j - mu), the term
through mu vanishing because \sum_i (x_i - mu) = 0. So dr/dx_j = -1/2 r^3 (2/D)(x_j - mu) = -r^2 xhat_j / D
and

    d xhat_i/dx_j = r ([i = j] - 1/D) + (x_i - mu) dr/dx_j = r ([i = j] - 1/D - xhat_i xhat_j / D)

hence dL/dx_j = \sum_i g_i d xhat_i/dx_j = r (g_j - (1/D) \sum_i g_i - xhat_j (1/D) \sum_i g_i xhat_i).

The backward recomputes xhat from x and the saved mu and r (two floats per row).

Precision: every load is cast to ACC (float32, float64 for float64) before any arithmetic, and results are
rounded once, on store. The variance is never formed as E[x^2] - mu^2 (which cancels catastrophically and
can go negative). Statistics are taken of x - K, K the row's first element (shifted data), so a constant
row has deviations of exactly 0 and mean exactly K. A row held in registers subtracts its mean before
squaring; a row walked in chunks combines each chunk's (mean, sum of squared deviations) with Chan et
al.'s pairwise update,

    mean = mean_a + delta * n_b / n,   M2 = M2_a + M2_b + delta^2 * n_a * n_b / n,   delta = mean_b - mean_a

where every term is non-negative. A constant row thus gets var = 0, r = 1/sqrt(eps) (finite for eps > 0)
and y = b.

Shapes of the launch are those of rms_norm (see ops/rms_norm/kernels.py): forward one read of a row held
in registers (two when the row is walked in chunks). The backward kernels, shared with rms_norm, are in
ops/_norm_kernels.py: over (row chunk, column block) with the dw and db partials summed in registers
into rows of float partial buffers that ``column_sum`` reduces in a fixed order; for long rows c1 and c2
come from a separate row pass. Few long rows split the row passes
across columns as rms_norm's do; the forward's splits write (mean, M2) of x - K over their columns, and
PHASE 2 merges them with Chan's update in a fixed order (a split merges like a chunk, so the statistics
stay free of cancellation).
"""

import triton
import triton.language as tl

from .._tl import aligned, round_to


@triton.jit
def _affine(b_xhat, w_ptr, b_ptr, o_d, m_d, stride_w, stride_b, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
            ACC: tl.constexpr):
    """xhat * w + b in ACC; the missing parts are skipped."""
    if HAS_W:
        b_xhat = b_xhat * tl.load(w_ptr + o_d * stride_w, mask=m_d, other=0.0).to(ACC)[None, :]
    if HAS_B:
        b_xhat = b_xhat + tl.load(b_ptr + o_d * stride_b, mask=m_d, other=0.0).to(ACC)[None, :]
    return b_xhat


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,  # [N, D], unit column stride
    mean_ptr,  # [N], ACC
    rstd_ptr,  # [N], ACC
    part_ptr,  # [2, NUM_SPLITS, N], ACC: each column split's mean and M2 of x - K (PHASE 1 writes, 2 reads)
    N,
    D,
    stride_x_row,
    stride_x_col,
    stride_w,
    stride_b,
    stride_y_row,
    eps,  # float32 (Triton passes a Python float so) ...
    eps_lo,  # ... plus the rest of the float64 eps (rt.split_float)
    D_SPLIT,  # columns per program along grid axis 1 (a multiple of BLOCK_D; D when rows are not split)
    NUM_SPLITS,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_TILE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
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
    # Statistics of x - K with K = the row's first element (shifted data): a constant row then has
    # deviations of exactly 0 and a mean of exactly K, as in eager PyTorch, instead of the rounding noise
    # of sum(x)/D amplified by r ~ 1/sqrt(eps); it also shrinks the sums' rounding for offset rows.
    b_k = tl.load(x_ptr + o_n * stride_x_row, mask=m_n, other=0.0).to(ACC)
    if ONE_TILE:
        # The whole row in registers: read once; mean, then the deviations, then the variance from them.
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        mask = m_n[:, None] & m_d[None, :]
        b_x = tl.load(p_x + o_d.to(tl.int64)[None, :] * stride_x_col, mask=mask, other=0.0).to(ACC)
        # Masked lanes would contribute (0 - K) and (0 - mean)^2: zero them.
        b_x = tl.where(mask, b_x - b_k[:, None], 0.0)
        b_mean = tl.sum(b_x, axis=1) / D
        b_xc = tl.where(mask, b_x - b_mean[:, None], 0.0)
        b_rstd = tl.rsqrt(tl.sum(b_xc * b_xc, axis=1) / D + eps + eps_lo)
        b_mean += b_k
        b_y = _affine(b_xc * b_rstd[:, None], w_ptr, b_ptr, o_d, m_d, stride_w, stride_b, HAS_W, HAS_B, ACC)
        tl.store(p_y + o_d[None, :], round_to(b_y, y_ptr.dtype.element_ty), mask=mask)
    else:
        # Rows too long for registers: per-chunk mean and M2 of x - K, merged with Chan's update (stable),
        # then a second read to normalise. With few rows the columns are split across programs too:
        # PHASE 1 writes each split's (mean, M2), PHASE 2 merges them in a fixed order, the same update
        # with a split for a chunk, and normalises its split.
        d_lo = pid_s * D_SPLIT
        d_hi = tl.minimum(D, d_lo + D_SPLIT)
        b_mean = tl.zeros([BLOCK_N], dtype=ACC)
        b_m2 = tl.zeros([BLOCK_N], dtype=ACC)
        if PHASE == 2:
            for s in range(0, NUM_SPLITS):
                n_a = tl.zeros([BLOCK_N], dtype=ACC) + s * D_SPLIT
                n_b = tl.minimum(n_a * 0 + (D - s * D_SPLIT), D_SPLIT)
                c_mean = tl.load(part_ptr + s * N + o_n, mask=m_n, other=0.0)
                c_m2 = tl.load(part_ptr + (NUM_SPLITS + s) * N + o_n, mask=m_n, other=0.0)
                delta = c_mean - b_mean
                f_b = n_b / (n_a + n_b)
                b_mean += delta * f_b
                b_m2 += c_m2 + delta * delta * (n_a * f_b)
        else:
            for d0 in range(d_lo, d_hi, BLOCK_D):
                o_d = d0 + tl.arange(0, BLOCK_D)
                mask = m_n[:, None] & (o_d < d_hi)[None, :]
                b_x = tl.load(p_x + o_d.to(tl.int64)[None, :] * stride_x_col, mask=mask, other=0.0).to(ACC)
                b_x = tl.where(mask, b_x - b_k[:, None], 0.0)
                # Column counts in ACC (float32 would cap a float64 merge at float32 accuracy): n_a before
                # this chunk, n_b valid in it.
                n_a = tl.zeros([BLOCK_N], dtype=ACC) + (d0 - d_lo)
                n_b = tl.minimum(n_a * 0 + (d_hi - d0), BLOCK_D)
                c_mean = tl.sum(b_x, axis=1) / n_b
                b_xc = tl.where(mask, b_x - c_mean[:, None], 0.0)
                delta = c_mean - b_mean
                f_b = n_b / (n_a + n_b)
                b_mean += delta * f_b
                b_m2 += tl.sum(b_xc * b_xc, axis=1) + delta * delta * (n_a * f_b)
        if PHASE == 1:
            tl.store(part_ptr + pid_s * N + o_n, b_mean, mask=m_n)
            tl.store(part_ptr + (NUM_SPLITS + pid_s) * N + o_n, b_m2, mask=m_n)
        else:
            b_rstd = tl.rsqrt(b_m2 / D + eps + eps_lo)
            for d0 in range(d_lo, d_hi, BLOCK_D):
                o_d = d0 + tl.arange(0, BLOCK_D)
                m_d = o_d < d_hi
                mask = m_n[:, None] & m_d[None, :]
                b_x = tl.load(p_x + o_d.to(tl.int64)[None, :] * stride_x_col, mask=mask, other=0.0).to(ACC)
                b_xhat = ((b_x - b_k[:, None]) - b_mean[:, None]) * b_rstd[:, None]
                b_y = _affine(b_xhat, w_ptr, b_ptr, o_d, m_d, stride_w, stride_b, HAS_W, HAS_B, ACC)
                tl.store(p_y + o_d[None, :], round_to(b_y, y_ptr.dtype.element_ty), mask=mask)
            b_mean += b_k
    if PHASE != 1:
        if pid_s == 0:  # one split of a row writes its statistics
            tl.store(mean_ptr + o_n, b_mean, mask=m_n)
            tl.store(rstd_ptr + o_n, b_rstd, mask=m_n)

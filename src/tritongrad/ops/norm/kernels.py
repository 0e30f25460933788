r"""The norm family's Triton kernels: RMSNorm and LayerNorm, forward and backward.

Forward, for x: [N, D] (leading dims flattened, normalised dims flattened into D), w, b: [D] (optional;
w = 1 and b = 0 when absent), r = rstd:

    rms_norm:    r[n] = 1 / sqrt( (1/D) \sum_d x[n, d]^2 + eps ),     xhat = x * r,           y = xhat * w
    layer_norm:  mu[n] = (1/D) \sum_d x[n, d],
                 r[n] = 1 / sqrt( (1/D) \sum_d (x[n, d] - mu[n])^2 + eps ),
                                                                        xhat = (x - mu) * r,   y = xhat * w + b

Backward, given dy = dL/dy. With g = dy * w (the gradient reaching xhat) and the row sums
c1[n] = (1/D) \sum_j g[n, j] * xhat[n, j], c2[n] = (1/D) \sum_j g[n, j]:

    dL/dw[d] = \sum_n dy[n, d] * xhat[n, d],      dL/db[d] = \sum_n dy[n, d]      (column reductions)
    rms_norm:    dL/dx = r * (g - xhat * c1)
    layer_norm:  dL/dx = r * (g - c2 - xhat * c1)

Derivation (one row, indices over d). rms_norm: dr/dx_j = -r^3 x_j / D, so d(x_i r)/dx_j = r [i = j] -
r xhat_i xhat_j / D and dL/dx_j = \sum_i g_i d(x_i r)/dx_j = r (g_j - xhat_j c1). layer_norm: d mu/dx_j = 1/D
and d var/dx_j = (2/D)(x_j - mu) (the term through mu vanishes since \sum_i (x_i - mu) = 0), so
dr/dx_j = -r^2 xhat_j / D and d xhat_i/dx_j = r ([i = j] - 1/D - xhat_i xhat_j / D), which gives the c2 term.
RMSNorm is LayerNorm without the mean: the shared kernels take ``CENTERED`` for layer_norm's terms.

Gemma's offset weight (``W_OFFSET`` = 1, Gemma's RMSNorm ``xhat * (1 + w)``): w is W_OFFSET + w, added in ACC
after the load, as Gemma's code adds in float32; the formulas above hold with it, and dL/dw is unchanged (the
offset's derivative is 0).

Llama variant (``ROUND_XHAT``, Hugging Face's LlamaRMSNorm): ``y = w * xhat.to(x.dtype)``, stored in the
promoted dtype of x and w. dL/dw sums dy * (rounded xhat), the value the forward multiplied; dL/dx treats the
rounding as the identity, as autograd differentiates a cast.

Precision: loads are cast to ACC (float32, float64 for float64) before any arithmetic; results are rounded
once, on store. layer_norm never forms E[x^2] - mu^2: it takes statistics of x - K, K the row's first element
(a constant row gets deviations of exactly 0), and a row walked in chunks merges each chunk's (mean, M2)
with Chan et al.'s update, mean = mean_a + delta n_b / n, M2 = M2_a + M2_b + delta^2 n_a n_b / n, every term
non-negative. A constant row gives r = 1/sqrt(eps), finite for eps > 0. eps arrives as float32 plus the
rest (``eps_lo``): Triton passes a Python float as float32, and float64 norms need more.

Kernels (which launch shape serves which rows: plans.py and docs/norms.md):

- ``_norm_fwd_kernel`` (``CENTERED`` for layer_norm): BLOCK_N rows per program; a row that fits one tile
  (``ONE_TILE``) is read once and kept in registers, a longer one is walked in chunks twice. With fewer
  row tiles than SMs the columns are split too: PHASE 1 writes each split's statistics, PHASE 2 merges them
  in a fixed order and normalises its split. Each norm's specializations compile to the same code as two
  separate kernels did (docs/norms.md).
- ``_norm_fwd_parts_kernel``: rows of an odd number (3 to 13) of power-of-two chunks (5120 = 5 x 1024), one
  row per program, held in parts of 8, 4, 2 and 1 chunks so that no lane is masked.
- ``_norm_bwd_kernel``: programs over (row chunk, column block); each writes dL/dx for its rows and columns
  and sums its dL/dw (dL/db) partials in registers into one row of a float partial buffer, which
  ``column_sum`` reduces in a fixed order (deterministic, no atomics). Rows longer than a tile get c1, c2
  from ``_norm_bwd_rowsum_kernel`` first.
- ``_norm_bwd_long_kernel``: rows of a few chunks with a row per SM; programs own rows and all columns (or,
  with SPLIT, a few adjacent programs share rows and split the columns) and read each row twice, the second
  time from L2.
"""

import triton
import triton.language as tl

from .._tl import aligned, float_arg, round_to


@triton.jit
def _weight(w_ptr, o_d, m_d, stride_w, W_OFFSET: tl.constexpr, ACC: tl.constexpr):
    """The weight's columns in ACC, plus W_OFFSET (Gemma's 1 + w, added in ACC as its code adds in float32)."""
    b_w = tl.load(w_ptr + o_d * stride_w, mask=m_d, other=0.0).to(ACC)
    if W_OFFSET != 0.0:
        b_w = b_w + W_OFFSET
    return b_w


@triton.jit
def _norm_affine(b_xhat, w_ptr, b_ptr, o_d, m_d, stride_w, stride_b, HAS_W: tl.constexpr, W_OFFSET: tl.constexpr,
                 HAS_B: tl.constexpr,
                 ROUND_XHAT: tl.constexpr, X_DTYPE: tl.constexpr, ACC: tl.constexpr):
    """xhat * w + b in ACC (the missing parts skipped); Llama rounds xhat to x's dtype before the weight."""
    if ROUND_XHAT:
        b_xhat = round_to(b_xhat, X_DTYPE).to(ACC)
    if HAS_W:
        b_xhat = b_xhat * _weight(w_ptr, o_d, m_d, stride_w, W_OFFSET, ACC)[None, :]
    if HAS_B:
        b_xhat = b_xhat + tl.load(b_ptr + o_d * stride_b, mask=m_d, other=0.0).to(ACC)[None, :]
    return b_xhat


@triton.jit
def _norm_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,  # None unless HAS_B
    y_ptr,  # [N, D], unit column stride
    mean_ptr,  # [N], ACC; None unless CENTERED
    rstd_ptr,  # [N], ACC
    part_ptr,  # column splits' statistics: [NUM_SPLITS, N] sums of squares, or CENTERED [2, NUM_SPLITS, N] (mean, M2)
    N,
    D,
    stride_x_row,
    stride_x_col,
    stride_w,
    stride_b,
    stride_y_row,
    eps,  # eps rounded to float32 ...
    eps_lo,  # ... plus the rest (rt.split_float; _tl.float_arg)
    D_SPLIT,  # columns per program along grid axis 1 (a multiple of BLOCK_D; D when rows are not split)
    NUM_SPLITS,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_TILE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    CENTERED: tl.constexpr,  # layer_norm: subtract the mean (and save it)
    ROUND_XHAT: tl.constexpr,
    PHASE: tl.constexpr,  # 0: whole rows; 1: partial statistics of a column split; 2: normalise a split
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,  # divides D and the row strides (ops/_tl.aligned)
    W_OFFSET: tl.constexpr = 0.0,  # y = xhat * (W_OFFSET + w): Gemma's 1 + w, exact in ACC
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
    if CENTERED:
        # Statistics of x - K with K = the row's first element (shifted data): a constant row then has
        # deviations of exactly 0 and a mean of exactly K, instead of the rounding noise of sum(x)/D amplified
        # by r ~ 1/sqrt(eps); it also shrinks the sums' rounding for offset rows.
        b_k = tl.load(x_ptr + o_n * stride_x_row, mask=m_n, other=0.0).to(ACC)
    if ONE_TILE:
        # The whole row in registers: read once, then statistics, normalisation and store.
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        mask = m_n[:, None] & m_d[None, :]
        # Masked lanes load 0, which adds nothing to a sum of squares.
        b_x = tl.load(p_x + o_d.to(tl.int64)[None, :] * stride_x_col, mask=mask, other=0.0).to(ACC)
        if CENTERED:
            # Masked lanes would contribute (0 - K) and (0 - mean)^2: zero them.
            b_x = tl.where(mask, b_x - b_k[:, None], 0.0)
            b_mean = tl.sum(b_x, axis=1) / D
            b_x = tl.where(mask, b_x - b_mean[:, None], 0.0)
            b_mean += b_k
        b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + float_arg(eps, eps_lo, ACC))
        b_y = _norm_affine(b_x * b_rstd[:, None], w_ptr, b_ptr, o_d, m_d, stride_w, stride_b, HAS_W, W_OFFSET, HAS_B,
                           ROUND_XHAT, X_DTYPE, ACC)
        tl.store(p_y + o_d[None, :], round_to(b_y, y_ptr.dtype.element_ty), mask=mask)
    else:
        # Rows too long for registers: statistics over chunks (rms_norm: the sum of squares; layer_norm: each
        # chunk's mean and M2 of x - K, merged with Chan's update), then a second read to normalise. With few
        # rows the columns are split across programs too: PHASE 1 writes each split's statistics, PHASE 2
        # merges them in a fixed order (a split merges like a chunk) and normalises its split.
        d_lo = pid_s * D_SPLIT
        d_hi = tl.minimum(D, d_lo + D_SPLIT)
        b_mean = tl.zeros([BLOCK_N], dtype=ACC)
        b_m2 = tl.zeros([BLOCK_N], dtype=ACC)  # rms_norm: the sum of squares
        if PHASE == 2:
            for s in range(0, NUM_SPLITS):
                if CENTERED:
                    n_a = tl.zeros([BLOCK_N], dtype=ACC) + s * D_SPLIT
                    n_b = tl.minimum(n_a * 0 + (D - s * D_SPLIT), D_SPLIT)
                    c_mean = tl.load(part_ptr + s * N + o_n, mask=m_n, other=0.0)
                    c_m2 = tl.load(part_ptr + (NUM_SPLITS + s) * N + o_n, mask=m_n, other=0.0)
                    delta = c_mean - b_mean
                    f_b = n_b / (n_a + n_b)
                    b_mean += delta * f_b
                    b_m2 += c_m2 + delta * delta * (n_a * f_b)
                else:
                    b_m2 += tl.load(part_ptr + s * N + o_n, mask=m_n, other=0.0)
        elif CENTERED:
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
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
            for d0 in range(d_lo, d_hi, BLOCK_D):
                o_d = d0 + tl.arange(0, BLOCK_D)
                mask = m_n[:, None] & (o_d < d_hi)[None, :]
                b_x = tl.load(p_x + o_d.to(tl.int64)[None, :] * stride_x_col, mask=mask, other=0.0).to(ACC)
                acc += b_x * b_x
            b_m2 = tl.sum(acc, axis=1)
        if PHASE == 1:
            if CENTERED:
                tl.store(part_ptr + pid_s * N + o_n, b_mean, mask=m_n)
                tl.store(part_ptr + (NUM_SPLITS + pid_s) * N + o_n, b_m2, mask=m_n)
            else:
                tl.store(part_ptr + pid_s * N + o_n, b_m2, mask=m_n)
        else:
            b_rstd = tl.rsqrt(b_m2 / D + float_arg(eps, eps_lo, ACC))
            for d0 in range(d_lo, d_hi, BLOCK_D):
                o_d = d0 + tl.arange(0, BLOCK_D)
                m_d = o_d < d_hi
                mask = m_n[:, None] & m_d[None, :]
                b_x = tl.load(p_x + o_d.to(tl.int64)[None, :] * stride_x_col, mask=mask, other=0.0).to(ACC)
                if CENTERED:
                    b_x = (b_x - b_k[:, None]) - b_mean[:, None]
                b_y = _norm_affine(b_x * b_rstd[:, None], w_ptr, b_ptr, o_d, m_d, stride_w, stride_b,
                                   HAS_W, W_OFFSET, HAS_B,
                                   ROUND_XHAT, X_DTYPE, ACC)
                tl.store(p_y + o_d[None, :], round_to(b_y, y_ptr.dtype.element_ty), mask=mask)
            if CENTERED:
                b_mean += b_k
    if PHASE != 1:
        if pid_s == 0:  # one split of a row writes its statistics
            if CENTERED:
                tl.store(mean_ptr + o_n, b_mean, mask=m_n)
            tl.store(rstd_ptr + o_n, b_rstd, mask=m_n)


@triton.jit
def _aligned_rows(D, sx, sdy, sdx, sdw, sdb, ALIGN: tl.constexpr):
    # The row length and the row strides of x, dy, dx and the dw/db partial buffers, hinted (ops/_tl.aligned).
    return (aligned(D, ALIGN), aligned(sx, ALIGN), aligned(sdy, ALIGN), aligned(sdx, ALIGN), aligned(sdw, ALIGN),
            aligned(sdb, ALIGN))


@triton.jit
def _db_base(dw_ptr, db_ptr, db_off, DB_IN_DW: tl.constexpr, ALIGN: tl.constexpr):
    # Where db's partials go: their own buffer, or db_off elements into dw's. A buffer a kernel writes is passed
    # once: torch.compile gives each written argument its own copy, so two views (or two references) of one
    # buffer would come back as two buffers, one overwriting the other.
    if DB_IN_DW:
        base = dw_ptr + aligned(db_off, ALIGN)
    else:
        base = db_ptr
    return base


@triton.jit
def _add_pair(a1, a2, b1, b2):
    return a1 + b1, a2 + b2


@triton.jit
def _add_param_grads(acc_dw, acc_db, b_dy, b_xhat, x_dtype: tl.constexpr, HAS_DW: tl.constexpr,
                     HAS_DB: tl.constexpr, ROUND_XHAT: tl.constexpr, ACC: tl.constexpr):
    # This tile's share of dL/dw = sum_n dy * xhat and dL/db = sum_n dy, added lane-wise to the partials.
    if HAS_DW:
        if ROUND_XHAT:
            # The forward multiplied w by xhat rounded to x's dtype; its gradient is that value.
            b_xhat = round_to(b_xhat, x_dtype).to(ACC)
        acc_dw += b_dy * b_xhat
    if HAS_DB:
        acc_db += b_dy
    return acc_dw, acc_db


@triton.jit
def _norm_bwd_rowsum_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    mean_ptr,  # [N], ACC; None unless CENTERED
    rstd_ptr,
    c_ptr,  # [N], ACC: c1; CENTERED: [2, N], c1 then c2 at stride_c. Or [NUM_SPLITS, ...] partials of it
    N,
    D,
    stride_x_row,
    stride_x_col,
    stride_w,
    stride_dy_row,
    stride_dy_col,
    stride_c,
    D_SPLIT,  # columns per program along grid axis 1 (D when rows are not split)
    stride_c_split,  # between the partial blocks of column splits
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_W: tl.constexpr,
    CENTERED: tl.constexpr,
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,  # divides D and the row strides (ops/_tl.aligned)
    W_OFFSET: tl.constexpr = 0.0,  # y = xhat * (W_OFFSET + w): Gemma's 1 + w, exact in ACC
):
    D = aligned(D, ALIGN)
    stride_x_row = aligned(stride_x_row, ALIGN)
    stride_dy_row = aligned(stride_dy_row, ALIGN)
    D_SPLIT = aligned(D_SPLIT, ALIGN)
    # Only for rows longer than one tile: the row sums dL/dx needs, so that the main backward kernel can
    # split columns across programs. With few rows the columns are split here too; the splits' partial
    # sums are then added by column_sum.
    pid = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    o_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    d_lo = pid_s * D_SPLIT
    d_hi = tl.minimum(D, d_lo + D_SPLIT)
    if CENTERED:
        b_mean = tl.load(mean_ptr + o_n, mask=m_n, other=0.0).to(ACC)
    b_rstd = tl.load(rstd_ptr + o_n, mask=m_n, other=0.0).to(ACC)
    acc1 = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    if CENTERED:
        acc2 = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < d_hi
        o_d64 = o_d.to(tl.int64)
        mask = m_n[:, None] & m_d[None, :]
        b_x = tl.load(x_ptr + o_n[:, None] * stride_x_row + o_d64[None, :] * stride_x_col, mask=mask, other=0.0)
        b_dy = tl.load(dy_ptr + o_n[:, None] * stride_dy_row + o_d64[None, :] * stride_dy_col, mask=mask, other=0.0)
        b_g = b_dy.to(ACC)
        if HAS_W:
            b_g = b_g * _weight(w_ptr, o_d, m_d, stride_w, W_OFFSET, ACC)[None, :]
        if CENTERED:
            # g is 0 on masked lanes, so (0 - mean) there adds nothing.
            acc1 += b_g * (b_x.to(ACC) - b_mean[:, None])
            acc2 += b_g
        else:
            acc1 += b_g * b_x.to(ACC)
    # sum_d g * xhat = r * sum_d g * (x - mu)   (mu = 0 for rms_norm)
    p_c = c_ptr + pid_s * stride_c_split + o_n
    tl.store(p_c, tl.sum(acc1, axis=1) * b_rstd / D, mask=m_n)
    if CENTERED:
        tl.store(p_c + stride_c, tl.sum(acc2, axis=1) / D, mask=m_n)


@triton.jit
def _norm_bwd_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    mean_ptr,  # [N], ACC; None unless CENTERED
    rstd_ptr,
    c_ptr,  # row sums from _norm_bwd_rowsum_kernel (c1; CENTERED: c1, c2 at stride_c); unless ONE_TILE
    dx_ptr,  # [N, D], unit column stride; written only when HAS_DX
    dw_ptr,  # dL/dw: [D] when one program covers all rows, else a [P, D] float partial buffer
    db_ptr,  # dL/db: likewise; None unless HAS_DB, or when DB_IN_DW
    N,
    D,
    stride_x_row,
    stride_x_col,
    stride_w,
    stride_dy_row,  # 0 for the expanded dy that y.sum().backward() produces
    stride_dy_col,
    stride_c,
    stride_dx_row,
    stride_dw_part,
    stride_db_part,
    db_off,  # with DB_IN_DW, db's partials start db_off elements into dw's partial buffer
    ROWS_PER_PROG,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_TILE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_DX: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    DB_IN_DW: tl.constexpr,  # db's partials share dw's buffer (one kernel argument, db_off in)
    CENTERED: tl.constexpr,
    ROUND_XHAT: tl.constexpr,  # rms_norm's Llama variant: dw sums dy * xhat rounded to x's dtype
    ACC: tl.constexpr,
    STAGES: tl.constexpr,  # pipelining depth of the row loop (1: none)
    ALIGN: tl.constexpr,  # divides D and the row strides (ops/_tl.aligned)
    W_OFFSET: tl.constexpr = 0.0,  # y = xhat * (W_OFFSET + w): Gemma's 1 + w, exact in ACC
):
    D, stride_x_row, stride_dy_row, stride_dx_row, stride_dw_part, stride_db_part = _aligned_rows(
        D, stride_x_row, stride_dy_row, stride_dx_row, stride_dw_part, stride_db_part, ALIGN)
    # Grid: (row chunks, column blocks). One pass: x and dy are read once, dx written once, and the dw/db
    # partials of the program's rows stay in registers until the single store at the end.
    pid_p = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    o_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_d64 = o_d.to(tl.int64)
    if HAS_W:
        b_w = _weight(w_ptr, o_d, m_d, stride_w, W_OFFSET, ACC)
    acc_dw = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)  # dropped by the compiler without HAS_DW
    acc_db = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    row_start = pid_p * ROWS_PER_PROG
    row_end = tl.minimum(N, row_start + ROWS_PER_PROG)
    # The row loop is software-pipelined by Triton (STAGES - 1 row tiles of x and dy in flight, copied
    # asynchronously into shared memory while the current tile is processed): a program of this size holds
    # most of an SM's registers, so other programs cannot hide HBM latency.
    for r0 in tl.range(row_start, row_end, BLOCK_N, num_stages=STAGES):
        o_n = r0 + tl.arange(0, BLOCK_N)
        m_n = o_n < row_end
        mask = m_n[:, None] & m_d[None, :]
        b_x = tl.load(x_ptr + o_n[:, None] * stride_x_row + o_d64[None, :] * stride_x_col, mask=mask, other=0.0)
        b_dy = tl.load(dy_ptr + o_n[:, None] * stride_dy_row + o_d64[None, :] * stride_dy_col, mask=mask,
                       other=0.0).to(ACC)
        if CENTERED:
            b_mean = tl.load(mean_ptr + o_n, mask=m_n, other=0.0).to(ACC)
        b_rstd = tl.load(rstd_ptr + o_n, mask=m_n, other=0.0).to(ACC)
        if CENTERED:
            # Masked lanes: xhat forced to 0 (x - mean is not), dy loads 0.
            b_xhat = tl.where(mask, (b_x.to(ACC) - b_mean[:, None]) * b_rstd[:, None], 0.0)
        else:
            b_xhat = b_x.to(ACC) * b_rstd[:, None]
        if HAS_DX:
            b_g = b_dy
            if HAS_W:
                b_g = b_dy * b_w[None, :]
            if CENTERED:
                if ONE_TILE:
                    # Both row sums in one reduction: one round of cross-warp exchange instead of two.
                    b_c1, b_c2 = tl.reduce((b_g * b_xhat, b_g), 1, _add_pair)
                    b_c1 = b_c1 / D
                    b_c2 = b_c2 / D
                else:
                    b_c1 = tl.load(c_ptr + o_n, mask=m_n, other=0.0).to(ACC)
                    b_c2 = tl.load(c_ptr + stride_c + o_n, mask=m_n, other=0.0).to(ACC)
                b_dx = (b_g - b_c2[:, None] - b_xhat * b_c1[:, None]) * b_rstd[:, None]
            else:
                if ONE_TILE:
                    b_c1 = tl.sum(b_g * b_xhat, axis=1) / D
                else:
                    b_c1 = tl.load(c_ptr + o_n, mask=m_n, other=0.0).to(ACC)
                b_dx = (b_g - b_xhat * b_c1[:, None]) * b_rstd[:, None]
            tl.store(dx_ptr + o_n[:, None] * stride_dx_row + o_d64[None, :], round_to(b_dx, dx_ptr.dtype.element_ty), mask=mask)
        acc_dw, acc_db = _add_param_grads(acc_dw, acc_db, b_dy, b_xhat, x_ptr.dtype.element_ty, HAS_DW, HAS_DB,
                                          ROUND_XHAT, ACC)
    if HAS_DW:
        tl.store(dw_ptr + pid_p * stride_dw_part + o_d, round_to(tl.sum(acc_dw, axis=0), dw_ptr.dtype.element_ty), mask=m_d)
    if HAS_DB:
        db_base = _db_base(dw_ptr, db_ptr, db_off, DB_IN_DW, ALIGN)
        tl.store(db_base + pid_p * stride_db_part + o_d, round_to(tl.sum(acc_db, axis=0), db_base.dtype.element_ty),
                 mask=m_d)


@triton.jit
def _long_row_sums(x_row, dy_row, w_ptr, stride_x_col, stride_dy_col, stride_w, d0, D, mean, s1, s2,
                   CHUNK: tl.constexpr, HAS_W: tl.constexpr, W_OFFSET: tl.constexpr, CENTERED: tl.constexpr,
                   ACC: tl.constexpr):
    # One chunk's share of the row sums: s1 += g * (x - mean), s2 += g (lane-wise; reduced once per row).
    o_d = d0 + tl.arange(0, CHUNK)
    m_d = o_d < D
    o_d64 = o_d.to(tl.int64)
    b_x = tl.load(x_row + o_d64 * stride_x_col, mask=m_d, other=0.0).to(ACC)
    b_g = tl.load(dy_row + o_d64 * stride_dy_col, mask=m_d, other=0.0).to(ACC)
    if HAS_W:
        b_g = b_g * _weight(w_ptr, o_d, m_d, stride_w, W_OFFSET, ACC)
    if CENTERED:
        s1 += b_g * (b_x - mean)  # g is 0 on masked lanes
        s2 += b_g
    else:
        s1 += b_g * b_x
    return s1, s2


@triton.jit
def _long_row_grads(x_row, dy_row, dx_row, w_ptr, stride_x_col, stride_dy_col, stride_w, d0, D, mean, rstd,
                    c1, c2, acc_dw, acc_db, CHUNK: tl.constexpr, HAS_W: tl.constexpr, W_OFFSET: tl.constexpr,
                    HAS_DX: tl.constexpr,
                    HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, CENTERED: tl.constexpr,
                    ROUND_XHAT: tl.constexpr, ACC: tl.constexpr):
    # One chunk of a row: dL/dx stored, dw/db partials added to this chunk's accumulators.
    o_d = d0 + tl.arange(0, CHUNK)
    m_d = o_d < D
    o_d64 = o_d.to(tl.int64)
    b_x = tl.load(x_row + o_d64 * stride_x_col, mask=m_d, other=0.0)
    b_dy = tl.load(dy_row + o_d64 * stride_dy_col, mask=m_d, other=0.0).to(ACC)
    if CENTERED:
        b_xhat = tl.where(m_d, (b_x.to(ACC) - mean) * rstd, 0.0)
    else:
        b_xhat = b_x.to(ACC) * rstd
    if HAS_DX:
        b_g = b_dy
        if HAS_W:
            b_g = b_dy * _weight(w_ptr, o_d, m_d, stride_w, W_OFFSET, ACC)
        if CENTERED:
            b_dx = (b_g - c2 - b_xhat * c1) * rstd
        else:
            b_dx = (b_g - b_xhat * c1) * rstd
        tl.store(dx_row + o_d64, round_to(b_dx, dx_row.dtype.element_ty), mask=m_d)
    return _add_param_grads(acc_dw, acc_db, b_dy, b_xhat, x_row.dtype.element_ty, HAS_DW, HAS_DB, ROUND_XHAT, ACC)


@triton.jit
def _norm_bwd_long_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    mean_ptr,  # [N], ACC; None unless CENTERED
    rstd_ptr,
    dx_ptr,  # [N, D], unit column stride; written only when HAS_DX
    dw_ptr,  # [P, D] float partial buffer (one row per program), or [D] with one program
    db_ptr,  # likewise; None unless HAS_DB, or when DB_IN_DW
    N,
    D,
    stride_x_row,
    stride_x_col,
    stride_w,
    stride_dy_row,
    stride_dy_col,
    stride_dx_row,
    stride_dw_part,
    stride_db_part,
    db_off,
    ROWS_PER_PROG,
    COLS,  # columns per program with SPLIT > 1 (the last one's may be fewer), else D
    CHUNK: tl.constexpr,
    NCH: tl.constexpr,  # chunks of a program's columns, 2 to 4: COLS <= NCH * CHUNK
    SPLIT: tl.constexpr,  # programs per row group, each owning NCH chunks of columns
    HAS_W: tl.constexpr,
    HAS_DX: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    DB_IN_DW: tl.constexpr,
    CENTERED: tl.constexpr,
    ROUND_XHAT: tl.constexpr,
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,  # divides D and the row strides (ops/_tl.aligned)
    W_OFFSET: tl.constexpr = 0.0,  # y = xhat * (W_OFFSET + w): Gemma's 1 + w, exact in ACC
):
    D, stride_x_row, stride_dy_row, stride_dx_row, stride_dw_part, stride_db_part = _aligned_rows(
        D, stride_x_row, stride_dy_row, stride_dx_row, stride_dw_part, stride_db_part, ALIGN)
    # Rows too long for one register tile, but short enough for their dw/db partials to stay in registers
    # (NCH chunk accumulators per program). Each program walks its rows one at a time: a first pass over
    # the row's chunks for the row sums, a second over the same chunks for dL/dx and the partials. The
    # second pass re-reads a row the program has just read (D * (sx + sdy) bytes per program in flight),
    # so it comes from L2: HBM sees x and dy once, where the row-sum kernel plus _norm_bwd_kernel read them
    # twice. Chunks are unrolled with one accumulator each, because a register tensor cannot be indexed
    # by a loop variable.
    # SPLIT > 1 (rows whose dw and db accumulators would spill): SPLIT adjacent programs share a group of
    # rows; each computes the row sums over the whole row, but dL/dx and the partials for its own NCH
    # chunks only. They run side by side, so the row is read from HBM once and the rest from L2.
    pid = tl.program_id(0).to(tl.int64)
    group = pid // SPLIT
    if SPLIT == 1:  # all columns (known at compile time: the masks stay those of a plain row)
        c0 = 0
        c_end = D
    else:  # this program's columns: [c0, c_end)
        c0 = (pid % SPLIT) * COLS
        c_end = tl.minimum(D, c0 + COLS)
    zero = tl.zeros([CHUNK], dtype=ACC)
    dw0, db0, dw1, db1, dw2, db2, dw3, db3 = zero, zero, zero, zero, zero, zero, zero, zero
    row_start = group * ROWS_PER_PROG
    row_end = tl.minimum(N, row_start + ROWS_PER_PROG)
    for row in range(row_start, row_end):
        x_row = x_ptr + row * stride_x_row
        dy_row = dy_ptr + row * stride_dy_row
        dx_row = dx_ptr
        if HAS_DX:
            dx_row = dx_ptr + row * stride_dx_row
        mean = 0.0
        if CENTERED:
            mean = tl.load(mean_ptr + row).to(ACC)
        rstd = tl.load(rstd_ptr + row).to(ACC)
        c1 = 0.0
        c2 = 0.0
        if HAS_DX:
            s1, s2 = zero, zero
            for k in tl.static_range(SPLIT * NCH):  # SPLIT * NCH * CHUNK >= D
                s1, s2 = _long_row_sums(x_row, dy_row, w_ptr, stride_x_col, stride_dy_col, stride_w, k * CHUNK, D,
                                        mean, s1, s2, CHUNK, HAS_W, W_OFFSET, CENTERED, ACC)
            c1 = tl.sum(s1, axis=0) * rstd / D
            if CENTERED:
                c2 = tl.sum(s2, axis=0) / D
        dw0, db0 = _long_row_grads(x_row, dy_row, dx_row, w_ptr, stride_x_col, stride_dy_col, stride_w, c0, c_end,
                                   mean, rstd, c1, c2, dw0, db0, CHUNK,
                                   HAS_W, W_OFFSET, HAS_DX, HAS_DW, HAS_DB, CENTERED,
                                   ROUND_XHAT, ACC)
        dw1, db1 = _long_row_grads(x_row, dy_row, dx_row, w_ptr, stride_x_col, stride_dy_col, stride_w, c0 + CHUNK,
                                   c_end, mean, rstd, c1, c2, dw1, db1, CHUNK,
                                   HAS_W, W_OFFSET, HAS_DX, HAS_DW, HAS_DB, CENTERED,
                                   ROUND_XHAT, ACC)
        if NCH > 2:
            dw2, db2 = _long_row_grads(x_row, dy_row, dx_row, w_ptr, stride_x_col, stride_dy_col, stride_w,
                                       c0 + 2 * CHUNK, c_end, mean, rstd, c1, c2, dw2, db2, CHUNK,
                                       HAS_W, W_OFFSET, HAS_DX,
                                       HAS_DW, HAS_DB, CENTERED, ROUND_XHAT, ACC)
        if NCH > 3:
            dw3, db3 = _long_row_grads(x_row, dy_row, dx_row, w_ptr, stride_x_col, stride_dy_col, stride_w,
                                       c0 + 3 * CHUNK, c_end, mean, rstd, c1, c2, dw3, db3, CHUNK,
                                       HAS_W, W_OFFSET, HAS_DX,
                                       HAS_DW, HAS_DB, CENTERED, ROUND_XHAT, ACC)
    if HAS_DW:
        _long_store_part(dw_ptr + group * stride_dw_part + c0, c_end - c0, dw0, dw1, dw2, dw3, CHUNK, NCH)
    if HAS_DB:
        _long_store_part(_db_base(dw_ptr, db_ptr, db_off, DB_IN_DW, ALIGN) + group * stride_db_part + c0, c_end - c0,
                         db0, db1, db2, db3, CHUNK, NCH)


@triton.jit
def _long_store_part(p, D, a0, a1, a2, a3, CHUNK: tl.constexpr, NCH: tl.constexpr):
    o_d = tl.arange(0, CHUNK)
    ty = p.dtype.element_ty
    tl.store(p + o_d, round_to(a0, ty), mask=o_d < D)
    tl.store(p + CHUNK + o_d, round_to(a1, ty), mask=CHUNK + o_d < D)
    if NCH > 2:
        tl.store(p + 2 * CHUNK + o_d, round_to(a2, ty), mask=2 * CHUNK + o_d < D)
    if NCH > 3:
        tl.store(p + 3 * CHUNK + o_d, round_to(a3, ty), mask=3 * CHUNK + o_d < D)


@triton.jit
def _parts_offsets(c0, R: tl.constexpr, CHUNK: tl.constexpr):
    # Columns of chunks c0 .. c0 + R - 1 of a row as an [R, CHUNK] tile, one chunk per tile row.
    return (c0 + tl.arange(0, R))[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]


@triton.jit
def _parts_load(x_row, stride_x_col, c0, R: tl.constexpr, CHUNK: tl.constexpr, ACC: tl.constexpr):
    return tl.load(x_row + _parts_offsets(c0, R, CHUNK).to(tl.int64) * stride_x_col).to(ACC)


@triton.jit
def _parts_store(y_row, w_ptr, b_ptr, b_xhat, c0, stride_w, stride_b, R: tl.constexpr, CHUNK: tl.constexpr,
                 HAS_W: tl.constexpr, W_OFFSET: tl.constexpr, HAS_B: tl.constexpr, ROUND_XHAT: tl.constexpr,
                 X_DTYPE: tl.constexpr,
                 ACC: tl.constexpr):
    # y = xhat * w + b over one part of the row (w, b optional), rounded once on store.
    o = _parts_offsets(c0, R, CHUNK)
    if ROUND_XHAT:
        b_xhat = round_to(b_xhat, X_DTYPE).to(ACC)
    if HAS_W:
        b_w = tl.load(w_ptr + o * stride_w).to(ACC)
        if W_OFFSET != 0.0:
            b_w = b_w + W_OFFSET
        b_xhat = b_xhat * b_w
    if HAS_B:
        b_xhat = b_xhat + tl.load(b_ptr + o * stride_b).to(ACC)
    tl.store(y_row + o, round_to(b_xhat, y_row.dtype.element_ty))


@triton.jit
def _parts_lanes(a8, a4, a2, a1, NCH: tl.constexpr):
    # The parts present (NCH's bits) summed over their chunks, lane by lane: one [CHUNK] vector.
    s = tl.sum(a1, axis=0)
    if NCH & 8:
        s += tl.sum(a8, axis=0)
    if NCH & 4:
        s += tl.sum(a4, axis=0)
    if NCH & 2:
        s += tl.sum(a2, axis=0)
    return s


@triton.jit
def _norm_fwd_parts_kernel(
    x_ptr,
    w_ptr,
    b_ptr,  # None unless HAS_B
    y_ptr,  # [N, D], unit column stride
    mean_ptr,  # [N], ACC; None unless CENTERED
    rstd_ptr,  # [N], ACC
    stride_x_row,
    stride_x_col,
    stride_w,
    stride_b,
    stride_y_row,
    eps,  # eps rounded to float32 ...
    eps_lo,  # ... plus the rest (rt.split_float; _tl.float_arg)
    CHUNK: tl.constexpr,  # a power of two
    NCH: tl.constexpr,  # odd, 3 to 15 (the plan takes up to 13): D = NCH * CHUNK
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    CENTERED: tl.constexpr,  # layer_norm: subtract the mean (and save it)
    ROUND_XHAT: tl.constexpr,
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,  # divides the row strides (ops/_tl.aligned)
    W_OFFSET: tl.constexpr = 0.0,  # y = xhat * (W_OFFSET + w): Gemma's 1 + w, exact in ACC
):
    # The forward of either norm over one row per program, for rows of an odd number of power-of-two chunks
    # (5120 = 5 x 1024). One register tile of next_pow2(D) lanes would leave up to half of them masked there,
    # and the masked lanes take registers too (layer_norm bf16 at 5120: 80 a thread, three programs per SM).
    # Here the row is held in parts of 8, 4, 2 and 1 chunks, one for each bit of NCH, in that order:
    # [R, CHUNK] tiles that lay out the columns alike (each thread holds the same columns of every chunk),
    # so no lane is masked; the parts are summed lane-wise first, then reduced across the program once per
    # statistic, as one tile would be.
    D: tl.constexpr = NCH * CHUNK
    O4: tl.constexpr = NCH & 8  # chunks before the part of 4, of 2, of 1
    O2: tl.constexpr = NCH & 12
    O1: tl.constexpr = NCH & 14
    stride_x_row = aligned(stride_x_row, ALIGN)
    stride_y_row = aligned(stride_y_row, ALIGN)
    X_DTYPE = x_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x_row
    y_row = y_ptr + row * stride_y_row
    x1 = _parts_load(x_row, stride_x_col, O1, 1, CHUNK, ACC)
    x8, x4, x2 = x1, x1, x1  # stand-ins for the parts NCH lacks (never used)
    if NCH & 8:
        x8 = _parts_load(x_row, stride_x_col, 0, 8, CHUNK, ACC)
    if NCH & 4:
        x4 = _parts_load(x_row, stride_x_col, O4, 4, CHUNK, ACC)
    if NCH & 2:
        x2 = _parts_load(x_row, stride_x_col, O2, 2, CHUNK, ACC)
    if CENTERED:
        # Statistics of x - K, K the row's first element (shifted data, as layer_norm's own kernel).
        b_k = tl.load(x_row).to(ACC)
        x8, x4, x2, x1 = x8 - b_k, x4 - b_k, x2 - b_k, x1 - b_k
        b_mean = tl.sum(_parts_lanes(x8, x4, x2, x1, NCH), axis=0) / D
        x8, x4, x2, x1 = x8 - b_mean, x4 - b_mean, x2 - b_mean, x1 - b_mean
    q = _parts_lanes(x8 * x8, x4 * x4, x2 * x2, x1 * x1, NCH)
    b_rstd = tl.rsqrt(tl.sum(q, axis=0) / D + float_arg(eps, eps_lo, ACC))
    if NCH & 8:
        _parts_store(y_row, w_ptr, b_ptr, x8 * b_rstd, 0, stride_w, stride_b, 8, CHUNK,
                     HAS_W, W_OFFSET, HAS_B, ROUND_XHAT,
                     X_DTYPE, ACC)
    if NCH & 4:
        _parts_store(y_row, w_ptr, b_ptr, x4 * b_rstd, O4, stride_w, stride_b, 4, CHUNK,
                     HAS_W, W_OFFSET, HAS_B, ROUND_XHAT,
                     X_DTYPE, ACC)
    if NCH & 2:
        _parts_store(y_row, w_ptr, b_ptr, x2 * b_rstd, O2, stride_w, stride_b, 2, CHUNK,
                     HAS_W, W_OFFSET, HAS_B, ROUND_XHAT,
                     X_DTYPE, ACC)
    _parts_store(y_row, w_ptr, b_ptr, x1 * b_rstd, O1, stride_w, stride_b, 1, CHUNK, HAS_W, W_OFFSET, HAS_B, ROUND_XHAT,
                 X_DTYPE, ACC)
    if CENTERED:
        tl.store(mean_ptr + row, b_mean + b_k)
    tl.store(rstd_ptr + row, b_rstd)

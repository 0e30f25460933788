r"""Rotary position embedding for q and k in one launch: Hugging Face's ``rotate_half`` convention (Llama; with
partial rotary GPT-NeoX, Phi-3, StableLM, Persimmon) and the interleaved one (GPT-J, GLM, Helium).

Forward, per token (b, t) and head, over a head vector x of D elements. cos and sin give the token's rows
c = cos[b, t] and s = sin[b, t] of R elements (R even, 2 <= R <= D): the first R features rotate, features
R .. D-1 pass through unchanged (partial rotary; R = D rotates the whole head).

    y[:R] = x[:R] * c + rot(x[:R]) * s,    y[R:] = x[R:]

rot pairs each feature a with a partner b; with pairs (a_i, b_i), i = 0 .. R/2 - 1:

    rotate_half (interleaved=False): a_i = i,      b_i = R/2 + i      rot([x1, x2]) = [-x2, x1]
    interleaved (interleaved=True):  a_i = 2i,     b_i = 2i + 1       rot(x)[2i] = -x[2i+1], rot(x)[2i+1] = x[2i]

and in either convention, writing x1 = x[a_i], x2 = x[b_i], c1 = c[a_i], c2 = c[b_i], s1 = s[a_i], s2 = s[b_i]:

    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2

Backward, given dy (dy1 = dy[a_i], dy2 = dy[b_i]):

    dx[:R] = dy[:R] * c + rot^T(dy[:R] * s),   dx[R:] = dy[R:]
    dx1 = dy1 * c1 + dy2 * s2
    dx2 = dy2 * c2 - dy1 * s1

Derivation: rot is a linear map Q on the R rotated features (Q x = rot(x); for rotate_half
Q = [[0, -I], [I, 0]], for interleaved the same block on each pair), and the forward is y = C x + S Q x with
C = diag(c), S = diag(s), plus the identity on the passed features. Its adjoint is dx = C dy + Q^T S dy on
the rotated features and dx = dy on the passed ones (their gradient is the upstream gradient itself).
Q^T = -Q, so Q^T v = -rot(v): on a pair, Q^T [v1, v2] = [v2, -v1]; with v = s * dy = [s1 dy1, s2 dy2] that is
[s2 dy2, -s1 dy1], which gives dx1 and dx2 above. Note s2 pairs with the first element of a pair and s1 with
the second: Hugging Face's tables repeat the frequencies (s1 = s2), but that is not assumed here. cos and sin
are used per feature as passed: the op does not rewrite them (GLM's code repeat-interleaves the first half of
its tables before the rotation; its caller does that).

The backward is the forward with s replaced by s' = [-s2, -s1] on each pair (then y1 = dy1 c1 + dy2 s2 and
y2 = dy2 c2 - dy1 s1), so one kernel serves both (``BACKWARD``); the passed features are copied either way.
cos and sin get no gradient.

Precision: loads are cast to ACC (float32, float64 when any input or output is float64); each output is
rounded once, on store, to its dtype (eager PyTorch in bfloat16 rounds x * c, rot(x) * s and their sum).
Passed features are copied exactly where the output dtype holds every value of the input's (the promoted
dtype does; an ``out_dtype`` narrower than x rounds them once too).

Layout: q and k are read in place as [B, T, H, D] through four strides each (the transposed views of
[B, T, H, D] projections, contiguous [B, H, T, D], or any other strides, e.g. an expanded upstream gradient);
cos and sin [Bc, T, R] with Bc = 1 broadcast over the batch (batch stride 0). Grid: (token blocks x head
blocks, B). A program covers BLOCK_T tokens of one sequence and BLOCK_HQ heads of q or BLOCK_HK heads of k
(head blocks of q, then of k, fastest, so that neighbouring programs cover neighbouring memory), loads its
tokens' cos and sin rows, rotates its heads' first R features and copies the rest. Interleaved pairs are
loaded as contiguous rows of R features, reshaped to [..., R/2, 2] and split (a pair's two elements are
adjacent in memory).
"""

import triton
import triton.language as tl

from .._tl import aligned, round_to


@triton.jit
def _rotate_heads(
    x_ptr, y_ptr, cos_ptr, sin_ptr, h0, H, row_x, row_y, row_c, row_s, m_t,
    stride_x_h, stride_x_d, stride_y_h, stride_y_d, stride_c_d, stride_s_d,
    HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
    ACC: tl.constexpr,
):
    """y = rope(x) (or its adjoint) for heads h0 .. h0 + BLOCK_H of the tokens whose rows start at row_x (x),
    row_y (y), row_c (cos) and row_s (sin), [BLOCK_T] offsets each: the first 2 * HALF features rotate, the
    next PASS are copied."""
    o_h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
    o_d = tl.arange(0, BLOCK_HALF).to(tl.int64)
    m_th = m_t[:, None, None] & (o_h < H)[None, :, None]
    Y = y_ptr.dtype.element_ty
    # cos and sin are loaded with the heads' shape (head stride 0): in the layout of x, so that no layout
    # conversion through shared memory is needed (a [BLOCK_T, 1, BLOCK_HALF] load broadcast over the heads
    # takes one); threads of a warp that read one address share one transaction, and the block's other
    # warps find the rows in L1.
    zero_h = tl.zeros([1, BLOCK_H, 1], dtype=tl.int64)
    x_rows = row_x[:, None, None] + (o_h * stride_x_h)[None, :, None]
    y_rows = row_y[:, None, None] + (o_h * stride_y_h)[None, :, None]
    if INTERLEAVED:
        # Pairs (2i, 2i + 1): the head's first 2 * BLOCK_HALF features loaded as one row (vector loads),
        # reshaped to [..., BLOCK_HALF, 2] and split into the pairs' first and second elements; the result
        # joined and stored the same way. (Loads through a [..., BLOCK_HALF, 2] pointer tile compiled for
        # sm_90 without 16-byte vectors.)
        o_w = tl.arange(0, 2 * BLOCK_HALF).to(tl.int64)
        m_w = (o_w < 2 * HALF)[None, None, :]
        mask = m_th & m_w
        m_cs = m_t[:, None, None] & m_w & (zero_h == 0)
        p_c = cos_ptr + row_c[:, None, None] + zero_h + (o_w * stride_c_d)[None, None, :]
        p_s = sin_ptr + row_s[:, None, None] + zero_h + (o_w * stride_s_d)[None, None, :]
        b_c = tl.load(p_c, mask=m_cs, other=0.0).to(ACC)
        b_s = tl.load(p_s, mask=m_cs, other=0.0).to(ACC)
        c1, c2 = tl.split(tl.reshape(b_c, [BLOCK_T, BLOCK_H, BLOCK_HALF, 2]))
        s1, s2 = tl.split(tl.reshape(b_s, [BLOCK_T, BLOCK_H, BLOCK_HALF, 2]))
        if BACKWARD:
            # The adjoint is the forward with s -> [-s2, -s1] (module docstring).
            s1, s2 = -s2, -s1
        b_x = tl.load(x_ptr + x_rows + (o_w * stride_x_d)[None, None, :], mask=mask, other=0.0).to(ACC)
        b_x1, b_x2 = tl.split(tl.reshape(b_x, [BLOCK_T, BLOCK_H, BLOCK_HALF, 2]))
        b_y = tl.join(b_x1 * c1 - b_x2 * s1, b_x2 * c2 + b_x1 * s2)
        b_y = tl.reshape(b_y, [BLOCK_T, BLOCK_H, 2 * BLOCK_HALF])
        tl.store(y_ptr + y_rows + (o_w * stride_y_d)[None, None, :], round_to(b_y, Y), mask=mask)
    else:
        # Masked: tokens past T, heads past H, and columns past the half (when R/2 is not a power of two).
        m_d = (o_d < HALF)[None, None, :]
        mask = m_th & m_d
        m_cs = m_t[:, None, None] & m_d & (zero_h == 0)
        p_c = cos_ptr + row_c[:, None, None] + zero_h + (o_d * stride_c_d)[None, None, :]
        p_s = sin_ptr + row_s[:, None, None] + zero_h + (o_d * stride_s_d)[None, None, :]
        c1 = tl.load(p_c, mask=m_cs, other=0.0).to(ACC)
        c2 = tl.load(p_c + HALF * stride_c_d, mask=m_cs, other=0.0).to(ACC)
        s1 = tl.load(p_s, mask=m_cs, other=0.0).to(ACC)
        s2 = tl.load(p_s + HALF * stride_s_d, mask=m_cs, other=0.0).to(ACC)
        if BACKWARD:
            # The adjoint is the forward with s -> [-s2, -s1] (module docstring).
            s1, s2 = -s2, -s1
        # No eviction hint: evict-first loads were slower on an H200 (docs/swiglu-rope.md).
        p_x = x_ptr + x_rows + (o_d * stride_x_d)[None, None, :]
        b_x1 = tl.load(p_x, mask=mask, other=0.0).to(ACC)
        b_x2 = tl.load(p_x + HALF * stride_x_d, mask=mask, other=0.0).to(ACC)
        p_y = y_ptr + y_rows + (o_d * stride_y_d)[None, None, :]
        tl.store(p_y, round_to(b_x1 * c1 - b_x2 * s1, Y), mask=mask)
        tl.store(p_y + HALF * stride_y_d, round_to(b_x2 * c2 + b_x1 * s2, Y), mask=mask)
    if PASS > 0:
        # Features 2 * HALF .. 2 * HALF + PASS - 1 pass through: y = x (dx = dy), exact in Y.
        o_q = tl.arange(0, BLOCK_PASS).to(tl.int64)
        m_q = m_th & (o_q < PASS)[None, None, :]
        b_p = tl.load(x_ptr + x_rows + ((2 * HALF + o_q) * stride_x_d)[None, None, :], mask=m_q, other=0.0)
        tl.store(y_ptr + y_rows + ((2 * HALF + o_q) * stride_y_d)[None, None, :], round_to(b_p.to(ACC), Y),
                 mask=m_q)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr,  # x: q and k (forward), or the gradients of q_embed and k_embed (backward)
    qo_ptr, ko_ptr,  # y: q_embed and k_embed, or the gradients of q and k; None when not wanted
    cos_ptr, sin_ptr,  # [Bc, T, R]
    T, HQ, HK,
    stride_q_b, stride_q_t, stride_q_h, stride_q_d,
    stride_k_b, stride_k_t, stride_k_h, stride_k_d,
    stride_qo_b, stride_qo_t, stride_qo_h, stride_qo_d,
    stride_ko_b, stride_ko_t, stride_ko_h, stride_ko_d,
    stride_c_b, stride_c_t, stride_c_d,  # stride_c_b = 0 when cos is [1, T, R]
    stride_s_b, stride_s_t, stride_s_d,
    Q_BLOCKS, H_BLOCKS,  # head blocks of q (0 without q), of q and k together
    HALF: tl.constexpr,  # R / 2: pairs per head
    PASS: tl.constexpr,  # D - R: features passed through
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,  # heads per program of q ...
    BLOCK_HK: tl.constexpr,  # ... and of k
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
    BLOCK_PASS: tl.constexpr,  # next power of two >= PASS (1 when PASS = 0)
    INTERLEAVED: tl.constexpr,  # pairs (2i, 2i + 1), else (i, HALF + i)
    HAS_Q: tl.constexpr,
    HAS_K: tl.constexpr,
    BACKWARD: tl.constexpr,
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,  # divides the token and head strides (ops/_tl.aligned)
):
    stride_q_b = aligned(stride_q_b, ALIGN)
    stride_q_t = aligned(stride_q_t, ALIGN)
    stride_q_h = aligned(stride_q_h, ALIGN)
    stride_k_b = aligned(stride_k_b, ALIGN)
    stride_k_t = aligned(stride_k_t, ALIGN)
    stride_k_h = aligned(stride_k_h, ALIGN)
    stride_qo_b = aligned(stride_qo_b, ALIGN)
    stride_qo_t = aligned(stride_qo_t, ALIGN)
    stride_qo_h = aligned(stride_qo_h, ALIGN)
    stride_ko_b = aligned(stride_ko_b, ALIGN)
    stride_ko_t = aligned(stride_ko_t, ALIGN)
    stride_ko_h = aligned(stride_ko_h, ALIGN)
    stride_c_b = aligned(stride_c_b, ALIGN)
    stride_c_t = aligned(stride_c_t, ALIGN)
    stride_s_b = aligned(stride_s_b, ALIGN)
    stride_s_t = aligned(stride_s_t, ALIGN)
    # Grid: (token blocks x head blocks, batch); head blocks fastest, so that neighbouring programs cover
    # neighbouring heads of the same tokens.
    pid = tl.program_id(0)
    pid_t = pid // H_BLOCKS
    pid_h = pid - pid_t * H_BLOCKS
    pid_b = tl.program_id(1).to(tl.int64)  # int64: B * stride_b can pass 2**31 elements
    o_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < T
    o_t = o_t.to(tl.int64)
    row_c = pid_b * stride_c_b + o_t * stride_c_t
    row_s = pid_b * stride_s_b + o_t * stride_s_t
    if HAS_Q:
        if pid_h < Q_BLOCKS:
            _rotate_heads(
                q_ptr, qo_ptr, cos_ptr, sin_ptr, pid_h * BLOCK_HQ, HQ, pid_b * stride_q_b + o_t * stride_q_t,
                pid_b * stride_qo_b + o_t * stride_qo_t, row_c, row_s, m_t, stride_q_h, stride_q_d, stride_qo_h,
                stride_qo_d, stride_c_d, stride_s_d, HALF, PASS, BLOCK_T, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS,
                INTERLEAVED, BACKWARD, ACC,
            )
    if HAS_K:
        if pid_h >= Q_BLOCKS:
            _rotate_heads(
                k_ptr, ko_ptr, cos_ptr, sin_ptr, (pid_h - Q_BLOCKS) * BLOCK_HK, HK,
                pid_b * stride_k_b + o_t * stride_k_t, pid_b * stride_ko_b + o_t * stride_ko_t, row_c, row_s, m_t,
                stride_k_h, stride_k_d, stride_ko_h, stride_ko_d, stride_c_d, stride_s_d, HALF, PASS, BLOCK_T, BLOCK_HK,
                BLOCK_HALF, BLOCK_PASS, INTERLEAVED, BACKWARD, ACC,
            )

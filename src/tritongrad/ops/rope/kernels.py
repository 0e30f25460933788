r"""Rotary position embedding with Hugging Face's ``rotate_half`` convention, for q and k in one launch.

Forward, per token (b, t) and head, over a head vector x of Dh (even) elements split in halves x = [x1, x2],
with the token's rows c = cos[b, t] = [c1, c2] and s = sin[b, t] = [s1, s2]:

    y = x * c + rotate_half(x) * s,   rotate_half([x1, x2]) = [-x2, x1]
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2

Backward, given dy = [dy1, dy2]:

    dx = dy * c - rotate_half(dy * s)
    dx1 = dy1 * c1 + dy2 * s2
    dx2 = dy2 * c2 - dy1 * s1

Derivation: rotate_half is the linear map R = [[0, -I], [I, 0]] (R [x1, x2] = [-x2, x1]), and the forward
rotates first, then multiplies by s: y = C x + S R x with C = diag(c), S = diag(s). Its adjoint is
dx = C^T dy + (S R)^T dy = C dy + R^T S dy. R^T = [[0, I], [-I, 0]] = -R, so R^T v = -rotate_half(v) =
[v2, -v1]; with v = s * dy = [s1 dy1, s2 dy2] that is [s2 dy2, -s1 dy1], which gives dx1 and dx2 above.
Note s2 pairs with the first half and s1 with the second: Hugging Face's tables repeat one half of
frequencies (s1 = s2), but that is not assumed here.

The backward is the forward with s replaced by s' = [-s2, -s1] (then y1 = dy1 c1 + dy2 s2 and
y2 = dy2 c2 - dy1 s1), so one kernel serves both (``BACKWARD``). cos and sin get no gradient.

Precision: loads are cast to ACC (float32, float64 when any input is float64); each output is rounded
once, on store (eager PyTorch in bfloat16 rounds x * c, rotate_half(x) * s and their sum).

Layout: q and k are read in place as [B, T, H, Dh] through four strides each (the transposed views of
[B, T, H, Dh] projections, or contiguous [B, H, T, Dh]); cos and sin [Bc, T, Dh] with Bc = 1 broadcast
over the batch (batch stride 0). Grid: (token blocks x head blocks, B). A program covers BLOCK_T tokens of
one sequence and BLOCK_HQ heads of q or BLOCK_HK heads of k (head blocks of q, then of k, fastest, so that
neighbouring programs cover neighbouring memory), loads its tokens' cos and sin rows and rotates its heads.
"""

import triton
import triton.language as tl

from .._tl import aligned, round_to


@triton.jit
def _rotate_heads(
    x_ptr, y_ptr, cos_ptr, sin_ptr, h0, H, row_x, row_y, row_c, row_s, m_t,
    stride_x_h, stride_x_d, stride_y_h, stride_y_d, stride_c_d, stride_s_d,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
    ACC: tl.constexpr,
):
    """y = x * c + rotate_half(x) * s (or its adjoint) for heads h0 .. h0 + BLOCK_H of the tokens whose rows
    start at row_x (x), row_y (y), row_c (cos) and row_s (sin), [BLOCK_T] offsets each."""
    o_h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
    o_d = tl.arange(0, BLOCK_HALF).to(tl.int64)
    # Masked: tokens past T, heads past H, and columns past the half (when Dh/2 is not a power of two).
    m_d = (o_d < HALF)[None, None, :]
    mask = m_t[:, None, None] & (o_h < H)[None, :, None] & m_d
    # cos and sin are loaded with the heads' shape (head stride 0): in the layout of x, so that no layout
    # conversion through shared memory is needed (a [BLOCK_T, 1, BLOCK_HALF] load broadcast over the heads
    # takes one); threads of a warp that read one address share one transaction, and the block's other
    # warps find the rows in L1.
    zero_h = tl.zeros([1, BLOCK_H, 1], dtype=tl.int64)
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
    p_x = x_ptr + row_x[:, None, None] + (o_h * stride_x_h)[None, :, None] + (o_d * stride_x_d)[None, None, :]
    b_x1 = tl.load(p_x, mask=mask, other=0.0).to(ACC)
    b_x2 = tl.load(p_x + HALF * stride_x_d, mask=mask, other=0.0).to(ACC)
    p_y = y_ptr + row_y[:, None, None] + (o_h * stride_y_h)[None, :, None] + (o_d * stride_y_d)[None, None, :]
    Y = y_ptr.dtype.element_ty
    tl.store(p_y, round_to(b_x1 * c1 - b_x2 * s1, Y), mask=mask)
    tl.store(p_y + HALF * stride_y_d, round_to(b_x2 * c2 + b_x1 * s2, Y), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr,  # x: q and k (forward), or the gradients of q_embed and k_embed (backward)
    qo_ptr, ko_ptr,  # y: q_embed and k_embed, or the gradients of q and k; None when not wanted
    cos_ptr, sin_ptr,  # [Bc, T, Dh]
    T, HQ, HK,
    stride_q_b, stride_q_t, stride_q_h, stride_q_d,
    stride_k_b, stride_k_t, stride_k_h, stride_k_d,
    stride_qo_b, stride_qo_t, stride_qo_h, stride_qo_d,
    stride_ko_b, stride_ko_t, stride_ko_h, stride_ko_d,
    stride_c_b, stride_c_t, stride_c_d,  # stride_c_b = 0 when cos is [1, T, Dh]
    stride_s_b, stride_s_t, stride_s_d,
    Q_BLOCKS, H_BLOCKS,  # head blocks of q (0 without q), of q and k together
    HALF: tl.constexpr,  # Dh / 2
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,  # heads per program of q ...
    BLOCK_HK: tl.constexpr,  # ... and of k
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
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
                stride_qo_d, stride_c_d, stride_s_d, HALF, BLOCK_HQ, BLOCK_HALF, BACKWARD, ACC,
            )
    if HAS_K:
        if pid_h >= Q_BLOCKS:
            _rotate_heads(
                k_ptr, ko_ptr, cos_ptr, sin_ptr, (pid_h - Q_BLOCKS) * BLOCK_HK, HK,
                pid_b * stride_k_b + o_t * stride_k_t, pid_b * stride_ko_b + o_t * stride_ko_t, row_c, row_s, m_t,
                stride_k_h, stride_k_d, stride_ko_h, stride_ko_d, stride_c_d, stride_s_d, HALF, BLOCK_HK,
                BLOCK_HALF, BACKWARD, ACC,
            )

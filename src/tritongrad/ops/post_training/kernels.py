r"""The post-training family's Triton kernels: per-token log-probabilities and entropy, and the divergence of a
student's distribution from a teacher's, on chunks of logits rows made by the launchers (launch.py).

Token log-probabilities. For one row n of stored logits x [V] (a chunk's row of ``input @ weight.T + bias``),
its target t and logit scale k (``1 / temperature``):

    z_j = k x_j,   lse = log \sum_j exp(z_j),   log p_j = z_j - lse,   logprob_n = z_t - lse

With a soft cap c (Gemma 2's final logits, HAS_CAP), between the scale a before it and k after it:
z_j = k c tanh(a x_j / c), and every dL/dx_j below is multiplied by dz_j/dx_j = k a (1 - tanh^2(a x_j / c))
in place of k.
    H_n = -\sum_j p_j log p_j = lse - \sum_j p_j z_j                      (the entropy)

Gradients, for upstream gradients g_n of logprob_n and e_n of H_n (d lse / dz_j = p_j;
d(\sum_k p_k z_k)/dz_j = p_j (1 + z_j - \sum_k p_k z_k), so dH/dz_j = -p_j (log p_j + H)):

    dL/dx_j = k [ g_n ([j = t] - p_j) - e_n p_j (log p_j + H_n) ]

A row whose target is ``ignore_index`` has logprob 0 and no logprob gradient; its entropy is computed as for
any row. An out-of-range target (neither in [0, V) nor ignore_index) is never read: its logprob and its
gradient are NaN.

Shift invariance, one pass. ``_token_logprobs_fwd_kernel`` reads each row once, in BLOCK_V chunks, with a
running maximum m (one block max per chunk) and per-lane sums s = \sum exp(z - m) and a = \sum exp(z - m)(z - m);
when m grows to m', s' = s exp(m - m') and a' = exp(m - m') (a + s (m - m')). At the end, with mx = m,
ls = log \sum s and A = \sum a:

    logprob = (z_t - mx) - ls,    H = ls - A / \sum s

so no large common offset of the logits is subtracted after rounding (the row's max is taken out first, as in
the cross-entropy family). With HAS_SQ it also sums q = \sum exp(2 (z - m)) (q' = q exp(2 (m - m')) as m
grows), for WPO's weights: log \sum_j p_j^2 = log \sum q - 2 ls, without gradient (TRL's log_sum_sq_probs).
With HAS_STATS the same pass also gives two statistics without gradient, which TRL's
DPO trainer logs: the mean of z over the vocabulary, and whether t is the first argmax of z. ``parts`` [2 or 3, N]
keeps mx, ls (and H) for the backward, which needs no pass over the row to find them:
``_token_logprobs_bwd_kernel`` reads each chunk once and writes dL/dx over it (the launchers then multiply it
into grad_input and grad_weight).

Distillation. For a student row z^s = k x^s and a teacher row z^t = k x^t (the same k = 1 / temperature; a head
with a soft cap c takes k c tanh(x / c) instead, its own c, and dz/dx as above), with
q = softmax(z^s) (the student), p = softmax(z^t) (the teacher) and beta in [0, 1], TRL's generalized JSD:

    beta = 0:   D = KL(p || q) = \sum p (log p - log q)              dD/dz^s_j = q_j - p_j
    beta = 1:   D = KL(q || p) = \sum q (log q - log p)              dD/dz^s_j = q_j (d_j - D),  d = log q - log p
    otherwise:  log m = log((1 - beta) q + beta p)   (a log-add-exp of log q + log(1 - beta) and log p + log beta)
                D = beta \sum p (log p - log m) + (1 - beta) \sum q (log q - log m)
                dD/dz^s_j = (1 - beta) q_j (d_j - K),   d = log q - log m,  K = \sum q d

(the JSD's gradient: with c_k = dD/dq_k = (1 - beta)(log q_k - log m_k) — the terms in 1/m_k cancel — and
dq_k/dz_j = q_k([k = j] - q_j)). The teacher gets no gradient. Each row carries a weight w_n (the mask and the
normaliser: launch.py); the kernel writes w_n D_n and, with STORE_GRAD, w_n dD/dz^s dz^s/dx^s over the
student's logits. ``_distill_fwd_kernel``: pass 1 the two log-sum-exps (online, as above), pass 2 the
divergence (and K), pass 3 the gradient.

Precision: loads are cast to ACC (float32; float64 for float64 logits) before any arithmetic, sums are taken in
ACC, results rounded once on store (gradients into the logits' dtype).
"""

import triton
import triton.language as tl

from .._tl import float_arg, round_to


@triton.jit
def _head_logit(x, scale, cap, post, HAS_CAP: tl.constexpr):
    """A stored logit ``x`` (ACC) as the row's z: ``scale x``, or with HAS_CAP ``post cap tanh(scale x / cap)``
    (the soft cap between two scales; module docstring)."""
    z = x * scale
    if HAS_CAP:
        u = z / cap
        e = tl.exp(-2.0 * tl.abs(u))  # tanh(|u|) = (1 - e) / (1 + e): no overflow
        z = post * cap * tl.where(u < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
    return z


@triton.jit
def _head_slope(x, scale, cap, post, HAS_CAP: tl.constexpr):
    """dz/dx of :func:`_head_logit`: ``scale``, or ``post scale (1 - tanh^2)`` with 1 - tanh^2 = 4 e / (1 + e)^2
    (no cancellation near saturation)."""
    slope = scale
    if HAS_CAP:
        e = tl.exp(-2.0 * tl.abs(x * scale / cap))
        slope = post * scale * 4.0 * e / ((1.0 + e) * (1.0 + e))
    return slope


@triton.jit
def _online_step(z, m, s_vec, a_vec, q_vec, mask, WITH_A: tl.constexpr, WITH_Q: tl.constexpr):
    """One chunk ``z`` (masked lanes -inf) into the running max ``m`` and the per-lane sums
    ``s = sum exp(z - m)``, ``a = sum exp(z - m) (z - m)`` (WITH_A) and ``q = sum exp(2 (z - m))`` (WITH_Q)
    (module docstring)."""
    m_new = tl.maximum(m, tl.max(z, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no inf - inf
    alpha = tl.exp(m - m_safe)
    e = tl.exp(z - m_safe)
    if WITH_A:
        shift = tl.where(m == float("-inf"), 0.0, m - m_safe)  # s is 0 there: no 0 * inf
        a_vec = alpha * (a_vec + s_vec * shift) + e * tl.where(mask, z - m_safe, 0.0)  # masked: 0, not 0 * -inf
    if WITH_Q:
        q_vec = q_vec * (alpha * alpha) + e * e
    s_vec = s_vec * alpha + e
    return m_new, s_vec, a_vec, q_vec


@triton.jit
def _token_logprobs_fwd_kernel(
    x_ptr,  # [R, V] one chunk's logits, unit column stride
    target_ptr,  # [N] targets of all rows (the chunk's start at row0)
    logp_ptr,  # [N] ACC out
    ent_ptr,  # [N] ACC out; None without HAS_ENTROPY
    parts_ptr,  # [2 or 3, N] ACC out: mx, ls (and H with HAS_ENTROPY)
    stats_ptr,  # [2+, N] ACC out: the mean of z, and 1.0 where the target is the first argmax; None without HAS_STATS
    sq_ptr,  # [N] ACC out: log sum_j p_j^2 (WPO's weights); None without HAS_SQ
    V,
    N,
    row0,
    stride_x_row,
    stride_t,
    ignore_index,
    scale_hi,  # the logit scale as float32 ...
    scale_lo,  # ... plus the rest of a float64 value (rt.split_float)
    cap_hi,  # the soft cap and the scale after it, split as the scale; read with HAS_CAP only
    cap_lo,
    post_hi,
    post_lo,
    BLOCK_V: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_STATS: tl.constexpr,
    HAS_CAP: tl.constexpr,
    ACC: tl.constexpr,
    HAS_SQ: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    n = row0 + pid
    p_x = x_ptr + pid * stride_x_row
    scale = float_arg(scale_hi, scale_lo, ACC)
    cap, post = float_arg(cap_hi, cap_lo, ACC), float_arg(post_hi, post_lo, ACC)
    t = tl.load(target_ptr + n * stride_t)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    o_v = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), dtype=ACC)
    s_vec = tl.zeros([BLOCK_V], dtype=ACC)
    a_vec = tl.zeros([BLOCK_V], dtype=ACC)
    q_vec = tl.zeros([BLOCK_V], dtype=ACC)
    zsum = tl.zeros([BLOCK_V], dtype=ACC)
    before = tl.full([BLOCK_V], float("-inf"), dtype=ACC)  # the largest z_j with j < t
    for k in range(0, V, BLOCK_V):
        o = k + o_v
        m_v = o < V
        z = _head_logit(tl.load(p_x + o, mask=m_v, other=0.0).to(ACC), scale, cap, post, HAS_CAP)
        if HAS_STATS:
            zsum += z  # masked lanes loaded as 0
            before = tl.maximum(before, tl.where(m_v & (o < t), z, float("-inf")))
        z = tl.where(m_v, z, float("-inf"))
        m, s_vec, a_vec, q_vec = _online_step(z, m, s_vec, a_vec, q_vec, m_v, HAS_ENTROPY, HAS_SQ)
    mx = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(s_vec, 0)
    ls = tl.log(s)

    tl.device_assert(in_range | (t == ignore_index), "linear_token_logprobs: target out of [0, V)")
    z_t = _head_logit(tl.load(p_x + tl.where(in_range, t, 0), mask=valid & in_range, other=0.0).to(ACC), scale,
                      cap, post, HAS_CAP)
    lp = (z_t - mx) - ls
    lp = tl.where(valid, tl.where(in_range, lp, float("nan")), 0.0)
    tl.store(logp_ptr + n, lp)
    tl.store(parts_ptr + n, mx)
    tl.store(parts_ptr + N + n, ls)
    if HAS_SQ:  # sum p^2 = sum exp(2 (z - mx)) / s^2
        tl.store(sq_ptr + n, tl.log(tl.sum(q_vec, 0)) - 2.0 * ls)
    if HAS_ENTROPY:
        h = ls - tl.sum(a_vec, 0) / s
        tl.store(ent_ptr + n, h)
        tl.store(parts_ptr + 2 * N + n, h)
    if HAS_STATS:
        # argmax's first maximum: a tie with an earlier token is not the target's (TRL's is_top1)
        top = (z_t >= m) & (z_t > tl.max(before, 0)) & valid & in_range
        tl.store(stats_ptr + n, tl.sum(zsum, 0) / V)
        tl.store(stats_ptr + N + n, tl.where(top, 1.0, 0.0))


@triton.jit
def _token_logprobs_bwd_kernel(
    x_ptr,  # [R, V] one chunk's logits; dL/dx is written over them (each chunk read, then written, by its program)
    target_ptr,  # [N]
    parts_ptr,  # [2 or 3, N] ACC: the forward's mx, ls (and H)
    dlogp_ptr,  # [N] upstream gradient of the logprobs (any stride, 0 for an expanded one)
    dent_ptr,  # [N] upstream gradient of the entropy; None without HAS_DENT
    V,
    N,
    row0,
    stride_x_row,
    stride_t,
    stride_dlogp,
    stride_dent,
    ignore_index,
    scale_hi,
    scale_lo,
    cap_hi,
    cap_lo,
    post_hi,
    post_lo,
    BLOCK_V: tl.constexpr,
    HAS_DENT: tl.constexpr,
    HAS_CAP: tl.constexpr,
    ACC: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    n = row0 + pid
    p_x = x_ptr + pid * stride_x_row
    scale = float_arg(scale_hi, scale_lo, ACC)
    cap, post = float_arg(cap_hi, cap_lo, ACC), float_arg(post_hi, post_lo, ACC)
    mx = tl.load(parts_ptr + n).to(ACC)
    ls = tl.load(parts_ptr + N + n).to(ACC)
    t = tl.load(target_ptr + n * stride_t)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    g = tl.load(dlogp_ptr + n * stride_dlogp).to(ACC)
    g = tl.where(valid, g, 0.0)  # an ignored row's logprob is the constant 0
    g = tl.where(valid & ~in_range, float("nan"), g)  # poison the row of a bad index
    e = tl.zeros([], dtype=ACC)
    h = tl.zeros([], dtype=ACC)
    if HAS_DENT:
        e = tl.load(dent_ptr + n * stride_dent).to(ACC)
        h = tl.load(parts_ptr + 2 * N + n).to(ACC)
    o_v = tl.arange(0, BLOCK_V)
    for k in range(0, V, BLOCK_V):
        o = k + o_v
        m_v = o < V
        x = tl.load(p_x + o, mask=m_v, other=0.0).to(ACC)
        z = _head_logit(x, scale, cap, post, HAS_CAP)
        lp = (z - mx) - ls  # the max out before ls: nothing large cancels
        p = tl.exp(lp)
        d = tl.where(o == t, g, 0.0) - g * p
        if HAS_DENT:
            d -= e * p * (lp + h)
        tl.store(p_x + o, round_to(d * _head_slope(x, scale, cap, post, HAS_CAP), x_ptr.dtype.element_ty), mask=m_v)


@triton.jit
def _distill_logs(zs, zt, mask, mx_s, ls_s, mx_t, ls_t, log_a, log_b):
    """(log q, log p, log m) of one chunk's z (module docstring); ``log_a = log(1 - beta)``, ``log_b = log beta``.
    The row's max out before ls: nothing large cancels."""
    lq = (zs - mx_s) - ls_s
    lp = (zt - mx_t) - ls_t
    lq = tl.where(mask, lq, 0.0)
    lp = tl.where(mask, lp, 0.0)
    u = lq + log_a
    v = lp + log_b
    top = tl.maximum(u, v)
    lm = top + tl.log(tl.exp(u - top) + tl.exp(v - top))
    return lq, lp, lm


@triton.jit
def _distill_fwd_kernel(
    s_ptr,  # [R, V] the student's logits for one chunk; with STORE_GRAD, w dD/dx^s is written over them
    t_ptr,  # [R, V] the teacher's logits for the same rows
    w_ptr,  # [N] row weights (mask / normaliser)
    loss_ptr,  # [N] ACC out: w_n D_n
    V,
    row0,
    stride_s_row,
    stride_t_row,
    stride_w,
    s_scale_hi,  # each head's transform (_head_logit), split (rt.split_float): the scale (1 / temperature) ...
    s_scale_lo,
    s_cap_hi,  # ... and, with HAS_CAP_S / HAS_CAP_T, the soft cap and the scale after it
    s_cap_lo,
    s_post_hi,
    s_post_lo,
    t_scale_hi,
    t_scale_lo,
    t_cap_hi,
    t_cap_lo,
    t_post_hi,
    t_post_lo,
    beta_hi,
    beta_lo,
    MODE: tl.constexpr,  # 0: KL(p || q) (beta = 0); 1: KL(q || p) (beta = 1); 2: the generalized JSD
    STORE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
    HAS_CAP_S: tl.constexpr,
    HAS_CAP_T: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    n = row0 + pid
    p_s = s_ptr + pid * stride_s_row
    p_t = t_ptr + pid * stride_t_row
    s_scale, s_cap = float_arg(s_scale_hi, s_scale_lo, ACC), float_arg(s_cap_hi, s_cap_lo, ACC)
    s_post = float_arg(s_post_hi, s_post_lo, ACC)
    t_scale, t_cap = float_arg(t_scale_hi, t_scale_lo, ACC), float_arg(t_cap_hi, t_cap_lo, ACC)
    t_post = float_arg(t_post_hi, t_post_lo, ACC)
    beta = float_arg(beta_hi, beta_lo, ACC)
    log_a = tl.zeros([], dtype=ACC)
    log_b = tl.zeros([], dtype=ACC)
    if MODE == 2:
        log_a = tl.log(1.0 - beta)
        log_b = tl.log(beta)
    w = tl.load(w_ptr + n * stride_w).to(ACC)
    o_v = tl.arange(0, BLOCK_V)

    # ---- pass 1: both log-sum-exps
    m_s = tl.full([], float("-inf"), dtype=ACC)
    m_t = tl.full([], float("-inf"), dtype=ACC)
    s_s = tl.zeros([BLOCK_V], dtype=ACC)
    s_t = tl.zeros([BLOCK_V], dtype=ACC)
    for k in range(0, V, BLOCK_V):
        o = k + o_v
        m_v = o < V
        zs = _head_logit(tl.load(p_s + o, mask=m_v, other=0.0).to(ACC), s_scale, s_cap, s_post, HAS_CAP_S)
        zt = _head_logit(tl.load(p_t + o, mask=m_v, other=0.0).to(ACC), t_scale, t_cap, t_post, HAS_CAP_T)
        zs = tl.where(m_v, zs, float("-inf"))
        zt = tl.where(m_v, zt, float("-inf"))
        m_s, s_s, _, _ = _online_step(zs, m_s, s_s, s_s, s_s, m_v, False, False)
        m_t, s_t, _, _ = _online_step(zt, m_t, s_t, s_t, s_t, m_v, False, False)
    mx_s = tl.where(m_s == float("-inf"), 0.0, m_s)
    mx_t = tl.where(m_t == float("-inf"), 0.0, m_t)
    ls_s = tl.log(tl.sum(s_s, 0))
    ls_t = tl.log(tl.sum(s_t, 0))

    # ---- pass 2: the divergence, and K (the gradient's centring term)
    d_vec = tl.zeros([BLOCK_V], dtype=ACC)
    k_vec = tl.zeros([BLOCK_V], dtype=ACC)
    for k in range(0, V, BLOCK_V):
        o = k + o_v
        m_v = o < V
        zs = _head_logit(tl.load(p_s + o, mask=m_v, other=0.0).to(ACC), s_scale, s_cap, s_post, HAS_CAP_S)
        zt = _head_logit(tl.load(p_t + o, mask=m_v, other=0.0).to(ACC), t_scale, t_cap, t_post, HAS_CAP_T)
        lq, lp, lm = _distill_logs(zs, zt, m_v, mx_s, ls_s, mx_t, ls_t, log_a, log_b)
        q = tl.where(m_v, tl.exp(lq), 0.0)
        p = tl.where(m_v, tl.exp(lp), 0.0)
        if MODE == 0:
            d_vec += p * (lp - lq)
        elif MODE == 1:
            d_vec += q * (lq - lp)
        else:
            kq = q * (lq - lm)
            d_vec += beta * p * (lp - lm) + (1.0 - beta) * kq
            k_vec += kq
    div = tl.sum(d_vec, 0)
    kk = div
    if MODE == 2:
        kk = tl.sum(k_vec, 0)
    tl.store(loss_ptr + n, w * div)

    # ---- pass 3: the student's gradient over its logits
    if STORE_GRAD:
        for k in range(0, V, BLOCK_V):
            o = k + o_v
            m_v = o < V
            xs = tl.load(p_s + o, mask=m_v, other=0.0).to(ACC)
            zs = _head_logit(xs, s_scale, s_cap, s_post, HAS_CAP_S)
            zt = _head_logit(tl.load(p_t + o, mask=m_v, other=0.0).to(ACC), t_scale, t_cap, t_post, HAS_CAP_T)
            lq, lp, lm = _distill_logs(zs, zt, m_v, mx_s, ls_s, mx_t, ls_t, log_a, log_b)
            q = tl.exp(lq)
            if MODE == 0:
                g = q - tl.exp(lp)
            elif MODE == 1:
                g = q * ((lq - lp) - kk)
            else:
                g = (1.0 - beta) * q * ((lq - lm) - kk)
            c = w * _head_slope(xs, s_scale, s_cap, s_post, HAS_CAP_S)  # dz/dx: the scale, or the cap's slope
            tl.store(p_s + o, round_to(g * c, s_ptr.dtype.element_ty), mask=m_v)

r"""The cross-entropy family's Triton kernels.

For one row n of stored logits x [C], its class index t, class weights w [C] (all 1 without ``weight``), label
smoothing eps, z-loss scale s, logit scale k and soft cap c:

    z_j = k x_j                      (k = 1 by default: Granite divides its logits, Cohere multiplies them)
    u_j = c tanh(z_j / c)            (u = z without a cap)
    lse = log \sum_j exp(u_j),         p_j = exp(u_j - lse),        W = \sum_j w_j
    loss_n = (1 - eps) w_t (lse - u_t) + (eps / C) \sum_j w_j (lse - u_j) + s lse^2
           = (1 - eps) w_t (lse - u_t) + (eps / C) (W lse - \sum_j w_j u_j) + s lse^2

for rows whose target is not ``ignore_index`` (an ignored row's loss is 0). This is
``torch.nn.functional.cross_entropy``'s loss with label smoothing and class weights, plus PaLM's z-loss.
Reductions: ``none`` returns loss_n; ``sum`` returns \sum_n loss_n; ``mean`` returns \sum_n loss_n / D with
F's denominator D = \sum_{n not ignored} w_{t_n} (the count of non-ignored rows without weights; the mean is
NaN where D = 0, as in F: every row ignored, or every non-ignored target's weight 0).

Gradient. d lse / du_j = p_j, so for a non-ignored row

    dloss_n / du_j = p_j A_n - (1 - eps) w_t [j = t] - (eps / C) w_j,   A_n = (1 - eps) w_t + (eps / C) W + 2 s lse

(the three terms: d((1 - eps) w_t (lse - u_t)) = (1 - eps) w_t (p_j - [j = t]); d((eps/C)(W lse - \sum w_k u_k))
= (eps/C)(W p_j - w_j); d(s lse^2) = 2 s lse p_j). Without weights or smoothing this is the familiar
p_j - [j = t]. The cap's chain rule multiplies by du_j/dz_j = 1 - tanh^2(z_j / c) = 4 e / (1 + e)^2 with
e = exp(-2 |z_j| / c), a form that stays accurate where tanh saturates; the scale's by dz_j/dx_j = k. The loss's upstream gradient g (a
scalar for sum and mean, g_n per row for none) and the mean's 1/D scale the row: with S_n = g_n / D (mean)
or g_n, and an upstream gradient d_n of the returned lse (which also flows through ignored rows),

    dL/dx_j = [ p_j (S_n A_n + d_n) - S_n (1 - eps) w_t [j = t] - S_n (eps / C) w_j ] du_j/dz_j k.

Precision: loads are cast to ACC (float32, float64 when the logits or the class weights are float64) before
any arithmetic; every sum over a row or over rows is taken in ACC, and results are rounded once, on store.
lse uses the online form m_k = max(m_{k-1}, max chunk_k), s_k = s_{k-1} exp(m_{k-1} - m_k) + \sum exp(u - m_k),
with the running sum kept per lane (one block reduction per chunk, for the max). A row that is all -inf so far
uses 0 in place of m, so exp never sees inf - inf. Shift invariance: lse is kept in two parts, the row max mx
and ls = log \sum_j exp(u_j - mx), and every formula takes mx out before it subtracts anything large:

    lse - u_t = (mx - u_t) + ls,     p_j = exp((u_j - mx) - ls),
    \sum_j w_j (lse - u_j) = W ((mx - r) + ls) - \sum_j w_j (u_j - r)   (r = u_t, or 0 where u_t = -inf)

so a large common offset of the logits (1e6, or bfloat16's 3e38) costs no precision, as in F's log_softmax
(lse itself, rounded, would carry half an ulp of mx into every difference). ``parts`` [2, N] keeps mx and ls
for the backward.

Kernels:

- ``_cross_entropy_fwd_kernel``: a persistent grid walks rows. Pass 1 reads a row in BLOCK_C chunks for lse
  (and the target logit, the smoothing sum), keeping the last chunk in registers; it writes the row's loss
  (and lse). Pass 2, with STORE_GRAD, writes the row's gradient: the chunk held in registers first, then the
  other chunks in reverse order, so that the re-read finds the most recently read chunks likeliest still in L2
  (long rows in flight outgrow L2: plans.py trades that for occupancy). The same kernel with LSE_KNOWN skips pass 1 (the
  backward of rows whose gradient was not computed in the forward), and may write the gradient over the
  logits (the linear op's chunks: each chunk is read before it is written, by the program that writes it).
  An ignored row is not read at all unless LSE_ALL asks for its lse (or its lse has a gradient): its
  gradient is written as zeros.
- ``_cross_entropy_stats_kernel``: one program: the mean's denominator D (and W for weighted smoothing),
  over all targets in a fixed order, before the main kernel, so that the gradient can include 1/D.
- ``_cross_entropy_sum_kernel``: one program: \sum_n loss_n in a fixed order (times 1/D for the mean; NaN
  where D = 0, as in F, even where smoothing makes the sum nonzero).
- ``_cross_entropy_bwd_kernel``: the backward when the forward already wrote the gradient for an upstream
  gradient of 1: it scales the gradient rows by g, and adds d_n p_j du_j/dz_j (re-reading the logits) for rows
  with d_n != 0 (without LSE_ALL, only non-ignored rows: the others' lse is the constant 0). Written in place
  (the backward that frees the graph), programs with nothing to do (g == 1, every d_n == 0) exit after
  reading g and their d_n: the common ``loss.backward()`` costs one tiny launch. In place or into a fresh
  tensor, the arithmetic is the same, so every backward through one graph gives the same bits.
- ``_scale_kernel``: y = g x over flat buffers, skipped when in place and g == 1 (the linear op's gradients).

Out-of-range class indices (neither in [0, C) nor ignore_index) are never read: their row's loss and gradient
are NaN (and so is the mean's denominator), which poisons the reduced loss; with TRITON_DEBUG=1 a device-side
assert fires as well.
"""

import triton
import triton.language as tl

from .._tl import aligned, float_arg, round_to


@triton.jit
def _softcap(z, cap, HAS_SOFTCAP: tl.constexpr):
    """``(u, du/dz)`` of ``u = cap * tanh(z / cap)`` (``(z, 1)`` without a cap)."""
    if HAS_SOFTCAP:
        e = tl.exp(-2.0 * tl.abs(z / cap))  # in (0, 1]: no overflow for any z
        r = 1.0 / (1.0 + e)
        th = (1.0 - e) * r
        return cap * tl.where(z < 0, -th, th), 4.0 * e * r * r
    else:
        return z, 1.0


@triton.jit
def _logits(x, scale, cap, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """``(u, du/dx)`` of ``u = cap * tanh(scale x / cap)`` (``z = scale x``; module docstring)."""
    z = x
    if HAS_SCALE:
        z = x * scale
    u, du = _softcap(z, cap, HAS_SOFTCAP)
    if HAS_SCALE:
        du = du * scale
    return u, du


@triton.jit
def _grad_chunk(x, o, t, mx, ls, a, b_t, b_s, w_ptr, stride_w, mask, scale, cap, HAS_WEIGHT: tl.constexpr,
                HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr):
    """dL/dx on one chunk of a row: ``(p a - b_t [o = t] - b_s w_o) du/dx`` (module docstring), with
    ``p = exp((u - mx) - ls)``: the row's max out before ls, so that nothing large cancels."""
    u, du = _logits(x, scale, cap, HAS_SCALE, HAS_SOFTCAP)
    g = tl.exp((u - mx) - ls) * a - tl.where(o == t, b_t, 0.0)
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            g -= b_s * tl.load(w_ptr + o * stride_w, mask=mask, other=0.0).to(g.dtype)
        else:
            g -= b_s
    if HAS_SOFTCAP or HAS_SCALE:
        g *= du
    return g


@triton.jit
def _row_max_sum(p_x, o_c, o_last, m_last, K, r, weight_ptr, stride_w, scale, cap, BLOCK_C: tl.constexpr,
                 STAGES: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, SMOOTH_SUM: tl.constexpr, ACC: tl.constexpr):
    """Pass 1 over a row of K chunks: ``(mx, ls, su, x_last)``, the shift mx (the row's max, 0 if all -inf),
    ``ls = log sum_j exp(u_j - mx)``, with SMOOTH_SUM the smoothing sum ``su = sum_j w_j (u_j - r)`` (else 0),
    and the last (ragged) chunk as loaded, kept in registers for pass 2."""
    neg_inf = float("-inf")
    m = tl.full([], neg_inf, dtype=ACC)
    s_vec = tl.zeros([BLOCK_C], dtype=ACC)
    su_vec = tl.zeros([BLOCK_C], dtype=ACC)
    for k in tl.range(0, K - 1, num_stages=STAGES):
        o = k * BLOCK_C + o_c
        u, _ = _logits(tl.load(p_x + o).to(ACC), scale, cap, HAS_SCALE, HAS_SOFTCAP)
        m_new = tl.maximum(m, tl.max(u, 0))
        m_safe = tl.where(m_new == neg_inf, 0.0, m_new)  # all -inf so far: no inf - inf
        s_vec = s_vec * tl.exp(m - m_safe) + tl.exp(u - m_safe)
        m = m_new
        if SMOOTH_SUM:
            if HAS_WEIGHT:
                su_vec += (u - r) * tl.load(weight_ptr + o * stride_w).to(ACC)
            else:
                su_vec += u - r
    x_last = tl.load(p_x + o_last, mask=m_last, other=0.0)
    u_c, _ = _logits(x_last.to(ACC), scale, cap, HAS_SCALE, HAS_SOFTCAP)
    u = tl.where(m_last, u_c, neg_inf)  # masked lanes after the cap (which maps -inf to -cap)
    m_new = tl.maximum(m, tl.max(u, 0))
    m_safe = tl.where(m_new == neg_inf, 0.0, m_new)
    s_vec = s_vec * tl.exp(m - m_safe) + tl.exp(u - m_safe)
    mx = m_safe
    ls = tl.log(tl.sum(s_vec, 0))
    su = tl.zeros([], dtype=ACC)
    if SMOOTH_SUM:
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + o_last * stride_w, mask=m_last, other=0.0).to(ACC)
            su_vec += tl.where(m_last, (u_c - r) * w, 0.0)
        else:
            su_vec += tl.where(m_last, u_c - r, 0.0)
        su = tl.sum(su_vec, 0)
    return mx, ls, su, x_last


@triton.jit
def _grad_row(p_x, p_g, x_last, o_c, o_last, m_last, K, C, t, mx, ls, a, b_t, b_s, weight_ptr, stride_w, scale,
              cap, BLOCK_C: tl.constexpr, STAGES: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, ACC: tl.constexpr):
    """Pass 2 over a row: dL/dx chunk by chunk (:func:`_grad_chunk`), the last chunk from registers first."""
    g = _grad_chunk(x_last.to(ACC), o_last, t, mx, ls, a, b_t, b_s, weight_ptr, stride_w, m_last, scale,
                    cap, HAS_WEIGHT, HAS_SCALE, HAS_SOFTCAP, HAS_SMOOTHING)
    tl.store(p_g + o_last, round_to(g, p_g.dtype.element_ty), mask=m_last)
    for i in tl.range(0, K - 1, num_stages=STAGES):
        o = (K - 2 - i) * BLOCK_C + o_c  # newest chunks first: they are likeliest still in L2
        z = tl.load(p_x + o).to(ACC)
        g = _grad_chunk(z, o, t, mx, ls, a, b_t, b_s, weight_ptr, stride_w, o < C, scale, cap,
                        HAS_WEIGHT, HAS_SCALE, HAS_SOFTCAP, HAS_SMOOTHING)
        tl.store(p_g + o, round_to(g, p_g.dtype.element_ty))


@triton.jit
def _zero_row(p_g, o_c, o_last, m_last, K, BLOCK_C: tl.constexpr):
    """A row of K chunks of zeros (an ignored row's gradient)."""
    zero = tl.zeros([BLOCK_C], dtype=p_g.dtype.element_ty)
    for k in range(0, K - 1):
        tl.store(p_g + k * BLOCK_C + o_c, zero)
    tl.store(p_g + o_last, zero, mask=m_last)


@triton.jit
def _cross_entropy_fwd_kernel(
    x_ptr,  # [N, C] logits, unit column stride
    target_ptr,  # [N] class indices
    weight_ptr,  # [C] class weights; None without HAS_WEIGHT
    stats_ptr,  # [2] ACC: D (read with MEAN), then W (read with HAS_WEIGHT and HAS_SMOOTHING); else None
    loss_ptr,  # [N] per-row loss (ACC buffer, or the output for reduction="none"); None without STORE_LOSS
    lse_ptr,  # [N] ACC: written with STORE_LSE
    parts_ptr,  # [2, N] ACC: each row's max (the shift) mx, then ls: written with STORE_LSE, read with LSE_KNOWN
    grad_ptr,  # [N, C] dL/dx; may be x_ptr itself (written after being read); None without STORE_GRAD
    dloss_ptr,  # the loss's upstream gradient: a scalar (DLOSS == 1) or one per row (DLOSS == 2)
    dlse_ptr,  # [N] the lse's upstream gradient; None without HAS_DLSE
    N,
    C,
    stride_x_row,
    stride_g_row,
    stride_t,
    stride_w,
    stride_dloss,
    stride_dlse,
    ignore_index,
    eps_hi,  # label smoothing as float32 ...
    eps_lo,  # ... plus the rest of a float64 value (rt.split_float): float64 rows need more than 24 bits
    z_hi,  # the z-loss scale, likewise
    z_lo,
    cap_hi,  # the soft cap, likewise
    cap_lo,
    scale_hi,  # the logit scale, likewise
    scale_lo,
    BLOCK_C: tl.constexpr,
    STAGES: tl.constexpr,  # loads in flight in the column loops (software pipelining)
    HAS_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    MEAN: tl.constexpr,  # the gradient carries 1/D
    STORE_LOSS: tl.constexpr,
    STORE_LSE: tl.constexpr,
    LSE_ALL: tl.constexpr,  # lse of every row; else of non-ignored rows only (0 and no gradient for the others)
    STORE_GRAD: tl.constexpr,
    LSE_KNOWN: tl.constexpr,  # lse is read, not computed: no pass 1 (and no loss)
    DLOSS: tl.constexpr,  # 0: upstream gradient 1; 1: a scalar; 2: one per row
    HAS_DLSE: tl.constexpr,
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,
):
    stride_x_row = aligned(stride_x_row, ALIGN)
    stride_g_row = aligned(stride_g_row, ALIGN)
    o_c = tl.arange(0, BLOCK_C)
    K = tl.cdiv(C, BLOCK_C)
    # Only the last chunk of a row can be ragged: the loops below run unmasked over full chunks.
    o_last = (K - 1) * BLOCK_C + o_c
    m_last = o_last < C
    eps = float_arg(eps_hi, eps_lo, ACC)
    z_loss = float_arg(z_hi, z_lo, ACC)
    cap = float_arg(cap_hi, cap_lo, ACC)
    scale = float_arg(scale_hi, scale_lo, ACC)
    inv_denom = 1.0
    if MEAN:
        inv_denom = 1.0 / tl.load(stats_ptr).to(ACC)
    w_sum = tl.zeros([], dtype=ACC) + C
    if HAS_WEIGHT and HAS_SMOOTHING:
        w_sum = tl.load(stats_ptr + 1).to(ACC)
    gl = 1.0
    if DLOSS == 1:
        gl = tl.load(dloss_ptr).to(ACC)
    neg_inf = float("-inf")
    for row in range(tl.program_id(0), N, tl.num_programs(0)):
        row64 = tl.cast(row, tl.int64)
        p_x = x_ptr + row64 * stride_x_row
        t = tl.load(target_ptr + row64 * stride_t)
        valid = t != ignore_index
        in_range = (t >= 0) & (t < C)
        tl.device_assert(in_range | (t == ignore_index), "cross_entropy: target out of [0, C)")
        t_safe = tl.where(in_range, t, 0)  # a bad index is never read
        d_n = 0.0
        if HAS_DLSE:
            d_n = tl.load(dlse_ptr + row64 * stride_dlse).to(ACC)
            if not LSE_ALL:
                d_n = tl.where(valid, d_n, 0.0)
        g_n = gl
        if DLOSS == 2:
            g_n = tl.load(dloss_ptr + row64 * stride_dloss).to(ACC)

        u_t = tl.zeros([], dtype=ACC)
        r = tl.zeros([], dtype=ACC)  # the smoothing sum's reference: u_t, or 0 where u_t is -inf
        if STORE_LOSS:
            x_t = tl.load(p_x + t_safe, mask=valid & in_range, other=0.0).to(ACC)
            u_t, du_t = _logits(x_t, scale, cap, HAS_SCALE, HAS_SOFTCAP)  # not "_": pass 1 binds it
            r = tl.where(u_t == neg_inf, 0.0, u_t)

        # ---- pass 1: mx and ls (and the smoothing sum); the last chunk stays in registers
        x_last = tl.zeros([BLOCK_C], dtype=x_ptr.dtype.element_ty)  # kept as loaded: half the registers
        mx = tl.zeros([], dtype=ACC)
        ls = tl.zeros([], dtype=ACC)
        su = tl.zeros([], dtype=ACC)  # sum_j w_j (u_j - r)
        if LSE_KNOWN:
            mx = tl.load(parts_ptr + row64).to(ACC)
            ls = tl.load(parts_ptr + N + row64).to(ACC)
        else:
            if valid | LSE_ALL | (d_n != 0.0):  # an ignored row needs no read unless its lse is asked for
                mx, ls, su, x_last = _row_max_sum(p_x, o_c, o_last, m_last, K, r, weight_ptr, stride_w, scale, cap,
                                                  BLOCK_C, STAGES, HAS_WEIGHT, HAS_SCALE, HAS_SOFTCAP,
                                                  HAS_SMOOTHING and STORE_LOSS, ACC)
        lse = mx + ls

        w_t = 1.0
        if HAS_WEIGHT:
            w_t = tl.load(weight_ptr + t_safe * stride_w, mask=valid & in_range, other=0.0).to(ACC)
        if STORE_LOSS:
            # lse - u_t as (mx - u_t) + ls, and sum_j w_j (lse - u_j) as W ((mx - r) + ls) - su: no large
            # common offset of the logits is ever subtracted after rounding
            loss = (1.0 - eps) * w_t * ((mx - u_t) + ls) + z_loss * lse * lse
            if HAS_SMOOTHING:
                loss += eps / C * (w_sum * ((mx - r) + ls) - su)
            loss = tl.where(valid, tl.where(in_range, loss, float("nan")), 0.0)
            tl.store(loss_ptr + row64, round_to(loss, loss_ptr.dtype.element_ty))
        if STORE_LSE:
            tl.store(lse_ptr + row64, lse)
            tl.store(parts_ptr + row64, mx)
            tl.store(parts_ptr + N + row64, ls)

        # ---- pass 2: the gradient
        if STORE_GRAD:
            p_g = grad_ptr + row64 * stride_g_row
            s_n = g_n * inv_denom
            a = tl.where(valid, s_n * ((1.0 - eps) * w_t + eps / C * w_sum + 2.0 * z_loss * lse), 0.0) + d_n
            a = tl.where(valid & ~in_range, float("nan"), a)  # poison the row of a bad index
            b_t = tl.where(valid, s_n * (1.0 - eps) * w_t, 0.0)
            b_s = tl.where(valid, s_n * eps / C, 0.0)
            if valid | (d_n != 0.0):
                if LSE_KNOWN:
                    x_last = tl.load(p_x + o_last, mask=m_last, other=0.0)
                _grad_row(p_x, p_g, x_last, o_c, o_last, m_last, K, C, t, mx, ls, a, b_t, b_s, weight_ptr, stride_w,
                          scale, cap, BLOCK_C, STAGES, HAS_WEIGHT, HAS_SCALE, HAS_SOFTCAP, HAS_SMOOTHING, ACC)
            else:  # an ignored row: zeros, nothing read
                _zero_row(p_g, o_c, o_last, m_last, K, BLOCK_C)


@triton.jit
def _cross_entropy_stats_kernel(
    target_ptr,
    weight_ptr,  # None without HAS_WEIGHT
    stats_ptr,  # out: [2] ACC: D, W
    N,
    C,
    stride_t,
    stride_w,
    ignore_index,
    BLOCK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ACC: tl.constexpr,
):
    o = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=ACC)
    for n0 in range(0, N, BLOCK):
        o_n = n0 + o
        t = tl.load(target_ptr + o_n.to(tl.int64) * stride_t, mask=o_n < N, other=ignore_index)
        valid = (o_n < N) & (t != ignore_index)
        in_range = (t >= 0) & (t < C)
        w = tl.full([BLOCK], 1.0, dtype=ACC)
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + tl.where(in_range, t, 0) * stride_w, mask=valid & in_range, other=0.0).to(ACC)
        # A bad index makes D NaN: the mean (and every gradient scaled by 1/D) is poisoned, never a wrong read.
        acc += tl.where(valid, tl.where(in_range, w, float("nan")), 0.0)
    tl.store(stats_ptr, tl.sum(acc, 0))
    if HAS_WEIGHT:
        acc = tl.zeros([BLOCK], dtype=ACC)
        for c0 in range(0, C, BLOCK):
            o_w = c0 + o
            acc += tl.load(weight_ptr + o_w * stride_w, mask=o_w < C, other=0.0).to(ACC)
        tl.store(stats_ptr + 1, tl.sum(acc, 0))


@triton.jit
def _cross_entropy_sum_kernel(
    rows_ptr,  # [N] ACC per-row losses
    stats_ptr,  # [2] ACC: D first; None without MEAN
    out_ptr,  # [] the reduced loss, in the logits' dtype
    N,
    BLOCK: tl.constexpr,
    MEAN: tl.constexpr,
    ACC: tl.constexpr,
):
    o = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=ACC)
    for n0 in range(0, N, BLOCK):
        acc += tl.load(rows_ptr + n0 + o, mask=n0 + o < N, other=0.0)
    total = tl.sum(acc, 0)
    if MEAN:
        # D = 0 (every row ignored, or every target's class weight 0) is NaN, as in PyTorch, even where the
        # smoothing term makes the sum nonzero (F's nll part is 0 / 0 there)
        d = tl.load(stats_ptr)
        total = tl.where(d == 0.0, float("nan"), total / d)
    tl.store(out_ptr, round_to(total, out_ptr.dtype.element_ty))


@triton.jit
def _cross_entropy_bwd_kernel(
    g_ptr,  # [N, C] the gradient the forward wrote for an upstream gradient of 1
    dx_ptr,  # [N, C] out; g_ptr itself with IN_PLACE
    x_ptr,  # [N, C] logits (read for rows with d_n != 0)
    parts_ptr,  # [2, N] ACC: each row's mx, then ls
    dloss_ptr,  # [] upstream gradient of the (reduced) loss
    dlse_ptr,  # [N] upstream gradient of lse
    target_ptr,  # [N] class indices (read without LSE_ALL)
    N,
    C,
    stride_x_row,
    stride_g_row,
    stride_dlse,
    stride_t,
    ignore_index,
    cap_hi,
    cap_lo,
    scale_hi,
    scale_lo,
    ROWS: tl.constexpr,  # rows per program
    BLOCK_C: tl.constexpr,
    IN_PLACE: tl.constexpr,
    LSE_ALL: tl.constexpr,  # as in the forward kernel: without it, ignored rows' lse has no gradient
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,
):
    stride_x_row = aligned(stride_x_row, ALIGN)
    stride_g_row = aligned(stride_g_row, ALIGN)
    r0 = tl.program_id(0) * ROWS
    o_r = r0 + tl.arange(0, ROWS)
    d = tl.load(dlse_ptr + o_r.to(tl.int64) * stride_dlse, mask=o_r < N, other=0.0)
    if not LSE_ALL:
        t = tl.load(target_ptr + o_r.to(tl.int64) * stride_t, mask=o_r < N, other=ignore_index)
        d = tl.where(t != ignore_index, d, 0.0)
    any_d = tl.sum((d != 0.0).to(tl.int32), 0) > 0
    gl = tl.load(dloss_ptr).to(ACC)
    cap = float_arg(cap_hi, cap_lo, ACC)
    scale = float_arg(scale_hi, scale_lo, ACC)
    if IN_PLACE:
        work = (gl != 1.0) | any_d  # the gradient is already right: nothing to read or write
    else:
        work = True
    o_c = tl.arange(0, BLOCK_C)
    if work:
        for i in range(0, ROWS):
            row = r0 + i
            if row < N:
                row64 = tl.cast(row, tl.int64)
                p_g = g_ptr + row64 * stride_g_row
                p_dx = dx_ptr + row64 * stride_g_row
                d_n = tl.load(dlse_ptr + row64 * stride_dlse).to(ACC)
                if not LSE_ALL:
                    d_n = tl.where(tl.load(target_ptr + row64 * stride_t) != ignore_index, d_n, 0.0)
                if d_n != 0.0:
                    mx = tl.load(parts_ptr + row64).to(ACC)
                    ls = tl.load(parts_ptr + N + row64).to(ACC)
                    p_x = x_ptr + row64 * stride_x_row
                    for c0 in range(0, C, BLOCK_C):
                        o = c0 + o_c
                        u, du = _logits(tl.load(p_x + o, mask=o < C, other=0.0).to(ACC), scale, cap, HAS_SCALE,
                                        HAS_SOFTCAP)
                        g = tl.load(p_g + o, mask=o < C, other=0.0).to(ACC) * gl + d_n * tl.exp((u - mx) - ls) * du
                        tl.store(p_dx + o, round_to(g, dx_ptr.dtype.element_ty), mask=o < C)
                elif (gl != 1.0) | (not IN_PLACE):
                    for c0 in range(0, C, BLOCK_C):
                        o = c0 + o_c
                        g = tl.load(p_g + o, mask=o < C, other=0.0).to(ACC) * gl
                        tl.store(p_dx + o, round_to(g, dx_ptr.dtype.element_ty), mask=o < C)


@triton.jit
def _scale_kernel(
    src_ptr,  # flat, contiguous
    dst_ptr,  # flat, contiguous; src_ptr itself with IN_PLACE
    s_ptr,  # [] the scale
    numel,
    BLOCK: tl.constexpr,
    IN_PLACE: tl.constexpr,
    ACC: tl.constexpr,
):
    s = tl.load(s_ptr).to(ACC)
    if IN_PLACE:
        work = s != 1.0
    else:
        work = True
    if work:
        o_b = tl.arange(0, BLOCK)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for b0 in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, step):
            o = b0 + o_b
            v = tl.load(src_ptr + o, mask=o < numel, other=0.0).to(ACC) * s
            tl.store(dst_ptr + o, round_to(v, dst_ptr.dtype.element_ty), mask=o < numel)

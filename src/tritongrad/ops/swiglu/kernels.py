r"""Gated products, elementwise over gate and up of one shape, viewed as rows [N, D]: ``act(g) * u`` for the
activations of gated MLPs. One pair of kernels serves them all, the activation a constexpr (``ACT``):
SiLU (SwiGLU, Llama-style MLPs), GELU (GeGLU) and GELU's tanh approximation (Gemma's ``gelu_pytorch_tanh``).

Forward and backward, given dout = dL/dout:

    out   = act(g) * u
    dL/du = dout * act(g)
    dL/dg = dout * u * act'(g)

out is linear in u, hence dL/du. Nothing is reduced: every element is independent, and the kernels are one
pass over memory.

SiLU (swiglu), with s = sigmoid(g) = 1 / (1 + e^-g):

    act(g)  = silu(g) = g * s
    act'(g) = s * (1 + g * (1 - s))

The logistic function's derivative is ds/dg = e^-g / (1 + e^-g)^2 = s * (1 - s), so d(g * s)/dg =
s + g * s * (1 - s) = s * (1 + g * (1 - s)).

GELU (geglu, approximate="none"), with Phi the standard normal CDF and phi its density:

    act(g)  = g * Phi(g),   Phi(g) = (1 + erf(g / sqrt(2))) / 2
    act'(g) = Phi(g) + g * phi(g),   phi(g) = e^(-g^2 / 2) / sqrt(2 pi)

by the product rule, since Phi' = phi (d erf(z)/dz = 2 e^(-z^2) / sqrt(pi), times dz/dg = 1 / sqrt(2)).
These are PyTorch's formulas (erf, not erfc), so the left tail rounds as ``F.gelu`` does.

GELU's tanh approximation (geglu, approximate="tanh"), with k = sqrt(2 / pi), c = 0.044715:

    act(g) = 0.5 * g * (1 + tanh(z)),   z = k * (g + c * g^3)

computed as act(g) = g * s with s = sigmoid(2z), since 1 + tanh(z) = 2 e^(2z) / (1 + e^(2z)) = 2 sigmoid(2z)
(no cancellation in 1 + tanh(z) for negative g, and no tanh instruction needed). Its derivative:

    act'(g) = 0.5 * (1 + tanh(z)) + 0.5 * g * (1 - tanh(z)^2) * dz/dg,   dz/dg = k * (1 + 3 c g^2)
            = s + 2 * g * s * (1 - s) * k * (1 + 3 c g^2)
            = s * (1 + 2 k g (1 - s) (1 + 3 c g^2))

using 1 - tanh(z)^2 = (1 - tanh(z)) (1 + tanh(z)) = 2 (1 - s) * 2 s.

In the tanh form's backward, 1 - s is computed as e * s (e = e^-2z) where s is near 1: 1 - s itself would
cancel, and g (1 - s) (1 + 3 c g^2) carry tens of ulps (float64 act'(g) within 2 eps of the truth for
|g| < 8, where F.gelu's own, through 1 - tanh^2, is off by up to 22). SiLU's keeps PyTorch's 1 - s.

Precision: loads are cast to ACC (float32, float64 when an input is float64) before any arithmetic; each
result is rounded once, on store (eager ``F.silu(g) * u`` or ``F.gelu(g) * u`` in bfloat16 rounds the
activation first). Constants are Python floats, which Triton materializes in the type they meet (float64
under ACC float64, never a float32-rounded k). Tails: for g below about -88 (float32), e^-g overflows to inf
and s = 1 / inf = 0 exactly: silu(g) = -0 and silu'(g) = 0, no NaN, as PyTorch's own silu; the tanh form
saturates the same way (s = 0 or 1), and erf to -1 or 1. Like PyTorch's, GELU's derivatives turn NaN only
where g^2 itself overflows (|g| > 1.8e19 in float32).

Inputs are read in place through both strides (row and column), so the two halves of one fused
``[..., 2I]`` projection need no copy; outputs are contiguous, and so are gradients, except where the
launcher has them written over those two halves (with the projection's row stride). Programs cover
[BLOCK_N, BLOCK_D] tiles on a 1-D grid, the column block fastest, so that neighbouring programs read
neighbouring memory.
"""

import triton
import triton.language as tl

from .._tl import aligned, round_to

# The activations (the kernels' ACT): plain ints for the launchers, constexprs for the kernels.
SILU, GELU, GELU_TANH = 0, 1, 2
_SILU, _GELU, _GELU_TANH = tl.constexpr(SILU), tl.constexpr(GELU), tl.constexpr(GELU_TANH)
# GELU's constants, as Python floats (full precision under ACC float64). Kernels put them right of a tensor:
# Triton's interpreter cannot multiply a constexpr by a tensor.
_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_C = tl.constexpr(0.044715)
_C3 = tl.constexpr(3 * 0.044715)
_K2 = tl.constexpr(2 * 0.7978845608028654)  # 2 k = 2 sqrt(2 / pi)


@triton.jit
def _sigmoid(g):
    # 1 / (1 + e^-g): e^-g overflows to inf for very negative g, and the quotient is then exactly 0.
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _act(g, ACT: tl.constexpr):
    """act(g) in g's type (module docstring)."""
    if ACT == _SILU:
        a = g * _sigmoid(g)
    elif ACT == _GELU:
        a = g * (0.5 * (1.0 + tl.math.erf(g * _SQRT1_2)))
    else:
        a = g * _sigmoid((g + g * g * g * _C) * _K2)
    return a


@triton.jit
def _sigmoid_pair(x):
    """(sigmoid(x), 1 - sigmoid(x)), the second without cancellation: e s where s is near 1 (x > 0), with
    e = e^-x; 1 - s itself elsewhere, where e may be inf and s is 0."""
    e = tl.exp(-x)
    s = 1.0 / (1.0 + e)
    return s, tl.where(e < 1.0, tl.minimum(e, 1.0) * s, 1.0 - s)  # min: no inf * 0 in the unused lanes


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in g's type, sharing their common terms (module docstring)."""
    if ACT == _SILU:
        s = _sigmoid(g)
        a = g * s
        d = s * (1.0 + g * (1.0 - s))  # PyTorch's formula and rounding (its float64 silu' is the reference)
    elif ACT == _GELU:
        cdf = 0.5 * (1.0 + tl.math.erf(g * _SQRT1_2))
        a = g * cdf
        d = cdf + g * (tl.exp(-0.5 * g * g) * _INV_SQRT_2PI)
    else:
        g2 = g * g
        s, one_minus_s = _sigmoid_pair((g + g2 * g * _C) * _K2)
        a = g * s
        d = s * (1.0 + g * one_minus_s * (1.0 + g2 * _C3) * _K2)
    return a, d


@triton.jit
def _tile(pid, N, D, D_BLOCKS, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row and column offsets of program ``pid``'s tile (int64 rows: N * stride can pass 2**31), and its
    mask."""
    pid_n = pid // D_BLOCKS
    pid_d = pid - pid_n * D_BLOCKS
    o_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (o_n < N)[:, None] & (o_d < D)[None, :]
    return o_n[:, None], o_d.to(tl.int64)[None, :], mask


@triton.jit
def _gated_fwd_kernel(
    g_ptr,
    u_ptr,
    out_ptr,  # [N, D], contiguous
    N,
    D,
    stride_g_row,
    stride_g_col,
    stride_u_row,
    stride_u_col,
    D_BLOCKS,  # column blocks per row block: cdiv(D, BLOCK_D)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACT: tl.constexpr,  # SILU, GELU or GELU_TANH
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,  # divides D and the row strides (ops/_tl.aligned)
):
    D = aligned(D, ALIGN)
    stride_g_row = aligned(stride_g_row, ALIGN)
    stride_u_row = aligned(stride_u_row, ALIGN)
    o_n, o_d, mask = _tile(tl.program_id(0), N, D, D_BLOCKS, BLOCK_N, BLOCK_D)
    # Masked lanes load 0 and store nothing. No eviction hint: evict-first loads were slower on an H200.
    b_g = tl.load(g_ptr + o_n * stride_g_row + o_d * stride_g_col, mask=mask, other=0.0).to(ACC)
    b_u = tl.load(u_ptr + o_n * stride_u_row + o_d * stride_u_col, mask=mask, other=0.0).to(ACC)
    b_out = _act(b_g, ACT) * b_u
    tl.store(out_ptr + o_n * D + o_d, round_to(b_out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(
    g_ptr,
    u_ptr,  # read only when HAS_DG
    dout_ptr,
    dg_ptr,  # [N, D], unit column stride; written when HAS_DG
    du_ptr,  # [N, D], unit column stride; written when HAS_DU
    N,
    D,
    stride_g_row,
    stride_g_col,
    stride_u_row,
    stride_u_col,
    stride_dout_row,  # 0 for an expanded dout (out.sum().backward())
    stride_dout_col,
    stride_dg_row,  # D, or 2 D where the gradients go over the halves of one fused projection
    stride_du_row,
    D_BLOCKS,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_DG: tl.constexpr,
    HAS_DU: tl.constexpr,
    ACT: tl.constexpr,  # SILU, GELU or GELU_TANH
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,  # divides D and the row strides (ops/_tl.aligned)
):
    D = aligned(D, ALIGN)
    stride_g_row = aligned(stride_g_row, ALIGN)
    stride_u_row = aligned(stride_u_row, ALIGN)
    stride_dout_row = aligned(stride_dout_row, ALIGN)
    stride_dg_row = aligned(stride_dg_row, ALIGN)
    stride_du_row = aligned(stride_du_row, ALIGN)
    o_n, o_d, mask = _tile(tl.program_id(0), N, D, D_BLOCKS, BLOCK_N, BLOCK_D)
    b_g = tl.load(g_ptr + o_n * stride_g_row + o_d * stride_g_col, mask=mask, other=0.0).to(ACC)
    b_dout = tl.load(dout_ptr + o_n * stride_dout_row + o_d * stride_dout_col, mask=mask, other=0.0).to(ACC)
    if HAS_DG:
        b_u = tl.load(u_ptr + o_n * stride_u_row + o_d * stride_u_col, mask=mask, other=0.0).to(ACC)
    # act'(g) is dead code where only du is asked for: the compiler drops it.
    b_a, b_da = _act_and_grad(b_g, ACT)
    if HAS_DU:
        tl.store(du_ptr + o_n * stride_du_row + o_d, round_to(b_dout * b_a, du_ptr.dtype.element_ty), mask=mask)
    if HAS_DG:
        b_dg = b_dout * b_u * b_da
        tl.store(dg_ptr + o_n * stride_dg_row + o_d, round_to(b_dg, dg_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _experts_bwd_kernel(
    pre_ptr,  # [N, 2D]: [gate | up] (the experts' gate-and-up product), unit column stride
    G_ptr,  # [N, D], unit column stride: d out B_d^T, post's upstream before the routing weight
    w_ptr,  # [N]: each row's routing weight
    dpre_ptr,  # [N, 2D]: [dgate | dup], unit column stride (pre itself where written over it); HAS_DPRE
    dw_ptr,  # [N]: the routing weight's gradient sum_d G * post; HAS_DW
    N,
    D,
    stride_pre_row,
    stride_G_row,
    stride_dpre_row,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_DPRE: tl.constexpr,
    HAS_DW: tl.constexpr,
    ACT: tl.constexpr,  # SILU, GELU or GELU_TANH
    ACC: tl.constexpr,
):
    """The MoE experts' backward between its products (experts.py): per row r, post = act(gate) * up rounded
    as it was stored, dw_r = sum_d G post, dpost = G w_r rounded to post's dtype, and the gated product's
    gradients from dpost; a row's columns in BLOCK_D chunks, the row sum in ACC."""
    o_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = o_n < N
    b_w = tl.load(w_ptr + o_n, mask=row, other=0.0).to(ACC)
    acc = tl.zeros((BLOCK_N,), dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        mask = row[:, None] & (o_d < D)[None, :]
        p_pre = pre_ptr + o_n[:, None] * stride_pre_row + o_d[None, :]
        b_g = tl.load(p_pre, mask=mask, other=0.0).to(ACC)
        b_u = tl.load(p_pre + D, mask=mask, other=0.0).to(ACC)
        b_G = tl.load(G_ptr + o_n[:, None] * stride_G_row + o_d[None, :], mask=mask, other=0.0).to(ACC)
        b_a, b_da = _act_and_grad(b_g, ACT)
        if HAS_DW:
            b_post = round_to(b_a * b_u, pre_ptr.dtype.element_ty).to(ACC)
            acc += tl.sum(b_G * b_post, axis=1)
        if HAS_DPRE:
            b_dpost = round_to(b_G * b_w[:, None], pre_ptr.dtype.element_ty).to(ACC)
            p_dpre = dpre_ptr + o_n[:, None] * stride_dpre_row + o_d[None, :]
            tl.store(p_dpre, round_to(b_dpost * b_u * b_da, dpre_ptr.dtype.element_ty), mask=mask)
            tl.store(p_dpre + D, round_to(b_dpost * b_a, dpre_ptr.dtype.element_ty), mask=mask)
    if HAS_DW:
        tl.store(dw_ptr + o_n, round_to(acc, dw_ptr.dtype.element_ty), mask=row)


@triton.jit
def _rows_sum_kernel(
    src_ptr,  # [N K, D], unit column stride
    idx_ptr,  # [N K]: the row of src each (row, k) sums
    out_ptr,  # [N, D], contiguous
    N,
    D,
    stride_src_row,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
):
    """out_n = sum_k src[idx[n K + k]], k in order, in ACC, rounded once: a gather and a sum in one pass."""
    pid_d = tl.program_id(1)
    o_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    row = o_n < N
    mask = row[:, None] & (o_d < D)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
    for k in tl.static_range(K):
        r = tl.load(idx_ptr + o_n * K + k, mask=row, other=0).to(tl.int64)
        acc += tl.load(src_ptr + r[:, None] * stride_src_row + o_d[None, :], mask=mask, other=0.0).to(ACC)
    tl.store(out_ptr + o_n[:, None] * D + o_d[None, :], round_to(acc, out_ptr.dtype.element_ty), mask=mask)

r"""SwiGLU's gated product, elementwise over gate and up of one shape, viewed as rows [N, D].

Forward, with s = sigmoid(g) = 1 / (1 + e^-g):

    out = silu(g) * u = g * s * u

Backward, given dout = dL/dout:

    dL/du = dout * silu(g)     = dout * g * s
    dL/dg = dout * u * silu'(g),  silu'(g) = s * (1 + g * (1 - s))

Derivation: out is linear in u, so dL/du = dout * silu(g). The logistic function's derivative is
ds/dg = e^-g / (1 + e^-g)^2 = s * (1 - s), so d(g * s)/dg = s + g * s * (1 - s) = s * (1 + g * (1 - s)).
Nothing is reduced: every element is independent, and the kernels are one pass over memory.

Precision: loads are cast to ACC (float32, float64 when an input is float64) before any arithmetic; each
result is rounded once, on store (eager ``F.silu(g) * u`` in bfloat16 rounds silu first). For g below about
-88 (float32), e^-g overflows to inf and s = 1 / inf = 0 exactly: silu(g) = -0 and silu'(g) = 0, no NaN, as
PyTorch's own silu.

Inputs are read in place through both strides (row and column), so the two halves of one fused
``[..., 2I]`` projection need no copy; outputs and gradients are contiguous. Programs cover
[BLOCK_N, BLOCK_D] tiles on a 1-D grid, the column block fastest, so that neighbouring programs read
neighbouring memory.
"""

import triton
import triton.language as tl

from .._tl import aligned, round_to


@triton.jit
def _sigmoid(g):
    # 1 / (1 + e^-g): e^-g overflows to inf for very negative g, and the quotient is then exactly 0.
    return 1.0 / (1.0 + tl.exp(-g))


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
def _swiglu_fwd_kernel(
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
    b_out = b_g * _sigmoid(b_g) * b_u
    tl.store(out_ptr + o_n * D + o_d, round_to(b_out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    g_ptr,
    u_ptr,  # read only when HAS_DG
    dout_ptr,
    dg_ptr,  # [N, D], contiguous; written when HAS_DG
    du_ptr,  # [N, D], contiguous; written when HAS_DU
    N,
    D,
    stride_g_row,
    stride_g_col,
    stride_u_row,
    stride_u_col,
    stride_dout_row,  # 0 for an expanded dout (out.sum().backward())
    stride_dout_col,
    D_BLOCKS,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_DG: tl.constexpr,
    HAS_DU: tl.constexpr,
    ACC: tl.constexpr,
    ALIGN: tl.constexpr,  # divides D and the row strides (ops/_tl.aligned)
):
    D = aligned(D, ALIGN)
    stride_g_row = aligned(stride_g_row, ALIGN)
    stride_u_row = aligned(stride_u_row, ALIGN)
    stride_dout_row = aligned(stride_dout_row, ALIGN)
    o_n, o_d, mask = _tile(tl.program_id(0), N, D, D_BLOCKS, BLOCK_N, BLOCK_D)
    b_g = tl.load(g_ptr + o_n * stride_g_row + o_d * stride_g_col, mask=mask, other=0.0).to(ACC)
    b_dout = tl.load(dout_ptr + o_n * stride_dout_row + o_d * stride_dout_col, mask=mask, other=0.0).to(ACC)
    if HAS_DG:
        b_u = tl.load(u_ptr + o_n * stride_u_row + o_d * stride_u_col, mask=mask, other=0.0).to(ACC)
    b_s = _sigmoid(b_g)
    if HAS_DU:
        tl.store(du_ptr + o_n * D + o_d, round_to(b_dout * b_g * b_s, du_ptr.dtype.element_ty), mask=mask)
    if HAS_DG:
        b_dg = b_dout * b_u * b_s * (1.0 + b_g * (1.0 - b_s))
        tl.store(dg_ptr + o_n * D + o_d, round_to(b_dg, dg_ptr.dtype.element_ty), mask=mask)

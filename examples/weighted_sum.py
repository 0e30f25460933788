"""The seed, written as a user would on tritongrad's public API: the weighted sum over the last dim,

    y[n]        = sum_d x[n, d] w[d]          x: [..., D] (leading dims flattened into N rows), w: [D]
    dL/dx[n, d] = g[n] w[d]                   an outer product: no reduction
    dL/dw[d]    = sum_n x[n, d] g[n]          a reduction over rows, in two stages:

each backward program sums its own chunk of rows into one row of a partial buffer (store_partial), and
tritongrad.reduce_partials adds those rows in a fixed order: grad_w is bitwise reproducible, with no atomics.
y comes back in x's dtype; math in float32 (float64 for float64). Run: ``python examples/weighted_sum.py``;
benchmark: ``tritongrad bench --op examples.weighted_sum:weighted_sum``. (tritongrad.weighted_sum is the tuned
built-in: mixed dtypes, any strides without copies, launch plans per shape.)
"""

import torch
import triton
import triton.language as tl

import tritongrad
from tritongrad.language import store_partial, upcast


@triton.jit
def _ws_fwd_kernel(x_ptr, w_ptr, y_ptr, N, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per BLOCK_N rows, each row summed along D; masked lanes load 0 and add nothing.
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    acc = upcast(tl.zeros([BLOCK_N], dtype=x_ptr.dtype.element_ty))
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        x = tl.load(x_ptr + o_n.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0)
        w = tl.load(w_ptr + o_d, mask=m_d, other=0.0)
        acc += tl.sum(upcast(x) * upcast(w)[None, :], axis=1)
    tl.store(y_ptr + o_n, acc.to(y_ptr.dtype.element_ty), mask=m_n)


@triton.jit
def _ws_bwd_kernel(x_ptr, w_ptr, g_ptr, gx_ptr, part_ptr, N, D, stride_g, ROWS,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (p, j): rows [p * ROWS, (p + 1) * ROWS) of column block j. ROWS is a multiple of BLOCK_N
    # (partial_rows), so a row step never reaches the next program's rows: masking rows past N is enough.
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    w = upcast(tl.load(w_ptr + o_d, mask=m_d, other=0.0))
    acc = upcast(tl.zeros([BLOCK_N, BLOCK_D], dtype=x_ptr.dtype.element_ty))
    start = tl.program_id(0) * ROWS
    for r0 in range(start, tl.minimum(start + ROWS, N), BLOCK_N):
        o_n = r0 + tl.arange(0, BLOCK_N)
        mask = (o_n < N)[:, None] & m_d[None, :]
        g = upcast(tl.load(g_ptr + o_n * stride_g, mask=o_n < N, other=0.0))  # stride 0: y.sum()'s gradient
        o = o_n.to(tl.int64)[:, None] * D + o_d[None, :]
        tl.store(gx_ptr + o, (g[:, None] * w[None, :]).to(gx_ptr.dtype.element_ty), mask=mask)
        acc += upcast(tl.load(x_ptr + o, mask=mask, other=0.0)) * g[:, None]
    store_partial(part_ptr, acc, o_d, D)  # row p of the partial buffer: this program's sum over its rows


def weighted_sum_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch, in float32 (float64 for float64), returned in x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(acc) * w.to(acc)).sum(-1).to(x.dtype)


# ---- the glue: validation, the op's declaration and its two launchers
BLOCK_N, BLOCK_D = 16, 128
fwd, bwd = tritongrad.kernel(_ws_fwd_kernel), tritongrad.kernel(_ws_bwd_kernel)


def _validate(x, w):
    if x.dim() == 0 or w.dim() != 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"weighted_sum: x [..., D] and w [D], got {tuple(x.shape)} and {tuple(w.shape)}")


@tritongrad.op("mylib::weighted_sum", reference=weighted_sum_reference, validate=_validate)
def weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    fwd[(triton.cdiv(x2.shape[0], BLOCK_N),)](x2, w.contiguous(), y, *x2.shape, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
    return y


@weighted_sum.backward
def _(ctx, grad_y):
    x2 = ctx.x.reshape(-1, ctx.x.shape[-1]).contiguous()
    N, D = x2.shape
    gx, g = torch.empty_like(x2), grad_y.reshape(N)
    part, rows = tritongrad.partial_rows(N, D, x2.device, dtype=x2.dtype, block_n=BLOCK_N)
    bwd[(part.shape[0], triton.cdiv(D, BLOCK_D))](x2, ctx.w.contiguous(), g, gx, part, N, D, g.stride(0), rows,
                                                  BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
    return gx.view(ctx.x.shape), tritongrad.reduce_partials(part, ctx.w.dtype)


# Its inputs for a size N x D (the test kit's samples and `tritongrad bench --op` both make them here)
@weighted_sum.inputs(fwd_bytes=lambda N, D, s: N * D * s + D * s + N * s,  # read x + read w + write y
                     bwd_bytes=lambda N, D, s: 2 * N * D * s + 2 * D * s + N * s)  # read x, w, g; write gx, gw
def _(N, D, dtype, device):
    return torch.randn(N, D, device=device).to(dtype), torch.randn(D, device=device).to(dtype)


if __name__ == "__main__":
    device = tritongrad.testing.default_device()
    torch.manual_seed(0)
    x = torch.randn(2, 64, 300, device=device, requires_grad=True)
    w = torch.randn(300, device=device, requires_grad=True)
    y = weighted_sum(x, w)
    y.backward(g := torch.randn_like(y))
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    weighted_sum_reference(xr, wr).backward(g)

    def rel(a, b):  # float32 rounding of a sum is relative to its size (a few ulps of values near 50)
        return ((a - b).abs().max() / b.abs().max()).item()
    print(f"{y.grad_fn=}")
    print(f"max |y - reference| / max |reference| = {rel(y, weighted_sum_reference(x.detach(), w.detach())):.2e}")
    print(f"max |grad_x - reference| / max |reference| = {rel(x.grad, xr.grad):.2e}")
    print(f"max |grad_w - reference| / max |reference| = {rel(w.grad, wr.grad):.2e}")

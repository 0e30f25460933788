"""A user's own differentiable Triton op on tritongrad's public API: logit soft-capping (Gemma 2),

    y = cap * tanh(x / cap),        dL/dx = dL/dy * (1 - (y / cap)^2)

The backward needs only the output, so the op saves y (not x). Run: ``python examples/softcap.py``; benchmark:
``tritongrad bench --op examples.softcap:softcap``.
"""

import torch
import triton
import triton.language as tl

import tritongrad
from tritongrad.language import upcast


@triton.jit
def _softcap_fwd_kernel(x_ptr, y_ptr, n, cap, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = upcast(tl.load(x_ptr + o, mask=o < n))  # float32 math, float64 for float64; cap is float32
    t = tl.exp(-2.0 * tl.abs(x / cap))  # tanh(|u|) = (1 - e^-2|u|) / (1 + e^-2|u|): no overflow
    y = cap * tl.where(x < 0, -1.0, 1.0) * (1.0 - t) / (1.0 + t)
    tl.store(y_ptr + o, y.to(y_ptr.dtype.element_ty), mask=o < n)


@triton.jit
def _softcap_bwd_kernel(y_ptr, dy_ptr, dx_ptr, n, cap, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    y = upcast(tl.load(y_ptr + o, mask=o < n)) / cap
    dy = tl.load(dy_ptr + o, mask=o < n).to(y.dtype)
    tl.store(dx_ptr + o, (dy * (1.0 - y * y)).to(dx_ptr.dtype.element_ty), mask=o < n)


def softcap_reference(x: torch.Tensor, cap: float = 30.0) -> torch.Tensor:
    """Plain PyTorch, in float32 (float64 for float64)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (cap * torch.tanh(x.to(acc) / cap)).to(x.dtype)


# ---- the glue: the op's declaration and its two launchers
BLOCK = 1024
fwd, bwd = tritongrad.kernel(_softcap_fwd_kernel), tritongrad.kernel(_softcap_bwd_kernel)


@tritongrad.op("mylib::softcap", reference=softcap_reference, outputs=("y",), save=("y",))
def softcap(x: torch.Tensor, cap: float = 30.0) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    fwd[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), cap, BLOCK=BLOCK)
    return y


@softcap.backward
def _(ctx, dy):
    dx = torch.empty_like(ctx.y)
    bwd[(triton.cdiv(dx.numel(), BLOCK),)](ctx.y, dy.contiguous(), dx, dx.numel(), ctx.cap, BLOCK=BLOCK)
    return dx


# Its inputs for a size N x D (the test kit's samples and `tritongrad bench --op` both make them here)
@softcap.inputs(fwd_bytes=lambda N, D, s: 2 * N * D * s,  # read x + write y
                bwd_bytes=lambda N, D, s: 3 * N * D * s)  # read y + read dy + write dx
def _(N, D, dtype, device):
    return {"x": 8 * torch.randn(N, D, device=device).to(dtype), "cap": 5.0}


if __name__ == "__main__":
    device = tritongrad.testing.default_device()
    torch.manual_seed(0)
    x = torch.randn(4, 1000, device=device, requires_grad=True)
    y = softcap(x, cap=2.0)
    y.sum().backward()
    # the reference in float64: PyTorch's float32 tanh on CPU varies run to run in the 4th digit here and there
    xr = x.detach().double().requires_grad_()
    softcap_reference(xr, 2.0).sum().backward()

    def rel(a, b):  # float32 rounding is relative to the values' size
        return ((a.double() - b).abs().max() / b.abs().max()).item()
    print(f"{y.grad_fn=}")
    print(f"max |y - reference| / max |reference| = {rel(y, softcap_reference(xr.detach(), 2.0)):.2e}")
    print(f"max |grad - reference| / max |reference| = {rel(x.grad, xr.grad):.2e}")

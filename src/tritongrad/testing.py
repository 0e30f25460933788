"""Checks shared by the test suites and the benchmarks.

Tolerances are earned, not guessed: an op passes when its error against a float64 reference is at most
``factor`` times the error of plain eager PyTorch in the same dtype, plus a small ``atol``.
"""

from __future__ import annotations

import torch

from . import _runtime as rt

def make_rows(shape: tuple[int, ...], dtype: torch.dtype, device, layout: str = "contiguous", scale=1.0):
    """Random ``shape`` tensor ([..., D]) stored in ``layout``, filled with fresh normal values.

    - transposed:  the memory is [D, ...]: the last dim has the largest stride (x.t() of a contiguous tensor)
    - row-sliced:  rows are a slice of wider rows (row stride > D), as ``big[..., :D]``
    - col-strided: every other column of a wider tensor (column stride 2)
    - permuted:    leading dims swapped, so they cannot be merged into one stride (forces a copy)
    """
    shape = tuple(shape)
    D = shape[-1] if shape else 1
    if layout == "contiguous":
        t = torch.randn(shape, dtype=torch.float32, device=device)
    elif layout == "transposed":
        t = torch.randn(shape[::-1], dtype=torch.float32, device=device).permute(*range(len(shape) - 1, -1, -1))
    elif layout == "row-sliced":
        t = torch.randn((*shape[:-1], D + 7), dtype=torch.float32, device=device)[..., :D]
    elif layout == "col-strided":
        t = torch.randn((*shape[:-1], 2 * D), dtype=torch.float32, device=device)[..., ::2]
    elif layout == "permuted":
        if len(shape) < 3:
            raise ValueError("permuted layout needs at least 3 dims")
        t = torch.randn((shape[1], shape[0], *shape[2:]), dtype=torch.float32, device=device).transpose(0, 1)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    t = (t * scale).to(dtype)
    assert t.shape == shape
    return t


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - ref.double()).abs().max().item()


def assert_close_earned(
    what: str, got: torch.Tensor, ref64: torch.Tensor, baseline: torch.Tensor, factor: float = 2.0, atol: float = 1e-5
) -> None:
    """``|got - ref64|_max <= factor * |baseline - ref64|_max + atol``; also checks shape and finiteness."""
    assert got.shape == ref64.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(ref64.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err, base = max_err(got, ref64), max_err(baseline, ref64)
    if got.dtype == torch.bfloat16 and rt.INTERPRET and got.numel():
        # Triton's interpreter converts float32 -> bfloat16 by truncation (a GPU rounds to nearest even):
        # up to one bfloat16 ulp (2**-7 relative) more than a GPU's half ulp.
        atol += 2.0**-7 * ref64.abs().max().item()
    assert err <= factor * base + atol, f"{what}: error {err:.3e} > {factor} x eager PyTorch's {base:.3e} + {atol:g}"

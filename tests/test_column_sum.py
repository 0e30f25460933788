"""The second stage of every column reduction, on its own: ``out = part.sum(0)`` in a fixed order."""

import pytest
import torch
from conftest import DEVICE

from tritongrad.ops.column_sum import launch as cs


# (P, M): why each is here
SHAPES = [
    (1, 1),        # one partial row, one column
    (7, 33),       # M just past two 16-column blocks: a masked third block
    (264, 48),     # a norm's partial buffer's height (2 programs x 132 SMs): several 64-row steps, the last
                   # one ragged; 3 full column blocks
    (300, 100),    # P not a multiple of the 64-row step: masked rows in the last step
    (3, 1000),     # wide: dozens of programs
]


@pytest.mark.parametrize("P,M", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_float64_sum(P, M, out_dtype):
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    part = torch.randn(P, M, dtype=acc, device=DEVICE)
    out = torch.empty(M, dtype=out_dtype, device=DEVICE)
    cs.column_sum(part, out)
    want = part.double().sum(0)
    # float32 accumulation of P terms of size ~1, then one rounding to out_dtype.
    tol = {torch.float64: 1e-12, torch.float32: 1e-5 * P**0.5, torch.bfloat16: 2 ** -7}[out_dtype]
    torch.testing.assert_close(out.double(), want, atol=tol * max(1.0, P**0.5), rtol=tol)


def test_bitwise_reproducible_and_strided_out():
    part = torch.randn(264, 100, device=DEVICE)
    wide = torch.empty(100, 2, device=DEVICE)
    cs.column_sum(part, wide[:, 0])  # out with stride 2
    again = torch.empty(100, device=DEVICE)
    cs.column_sum(part, again)
    assert torch.equal(wide[:, 0], again)


@pytest.mark.parametrize("M1,M2", [(48, 64), (33, 70), (1, 1)], ids=str)  # blocks of 16 end at M1, or straddle it
def test_two_outputs(M1, M2):
    """Two reductions sharing one partial buffer (layer_norm's weight and bias gradients): columns before
    M1 go to the first output, the rest to the second, each rounded once to its own dtype; a 16-column
    block straddles M1 when M1 is not a multiple of 16. Nothing past either output is written, and a
    second run gives the same bits."""
    part = torch.randn(264, M1 + M2, device=DEVICE)
    # Each output is followed by a guard element that must stay untouched.
    g1, g2 = torch.full((M1 + 1,), 7.0, device=DEVICE), torch.full((M2 + 1,), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out, out2 = g1[:M1], g2[:M2]
    cs.column_sum(part, out, out2)
    assert g1[-1] == 7.0 and g2[-1] == 7.0
    want = part.double().sum(0)
    torch.testing.assert_close(out.double(), want[:M1], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out2.double(), want[M1:], atol=2 ** -7 * 16, rtol=2 ** -7)
    again, again2 = torch.empty_like(out), torch.empty_like(out2)
    cs.column_sum(part, again, again2)
    assert torch.equal(out, again) and torch.equal(out2, again2)


def test_outputs_must_cover_the_columns():
    part = torch.zeros(4, 10, device=DEVICE)
    with pytest.raises(ValueError, match="4 \\+ 5 elements for a partial buffer of 10 columns"):
        cs.column_sum(part, torch.empty(4, device=DEVICE), torch.empty(5, device=DEVICE))


# ---------------------------------------------------------------- the public reduction: tritongrad.reduce_partials
@pytest.mark.parametrize("P,D", [(1, 5), (300, 40)], ids=str)  # one row; several 64-row steps, ragged
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reduce_partials(P, D, dtype):
    """``scale * partials.sum(0)`` in the requested dtype, accumulated in float32 (float64 for float64),
    scaled once before the one rounding; bitwise equal on a second run."""
    import tritongrad

    part = torch.randn(P, D, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=DEVICE)
    got = tritongrad.reduce_partials(part, dtype, scale=1 / 3)
    assert got.dtype == dtype and got.shape == (D,)
    want = part.double().sum(0) / 3
    tol = {torch.float64: 1e-12, torch.float32: 1e-5 * P**0.5, torch.bfloat16: 2 ** -7}[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol * max(1.0, P**0.5), rtol=tol)
    assert torch.equal(got, tritongrad.reduce_partials(part, dtype, scale=1 / 3))


def test_reduce_partials_out_strides_and_refusals():
    import tritongrad

    part = torch.randn(70, 30, device=DEVICE)
    wide = torch.zeros(30, 2, device=DEVICE)
    assert tritongrad.reduce_partials(part.t().contiguous().t(), out=wide[:, 0]) is not None  # column stride 70
    torch.testing.assert_close(wide[:, 0], part.sum(0), atol=1e-5, rtol=1e-5)
    assert torch.equal(wide[:, 1], torch.zeros(30, device=DEVICE))
    assert torch.equal(tritongrad.reduce_partials(part[:0]), torch.zeros(30, device=DEVICE))  # no rows: zeros
    with pytest.raises(ValueError, match="2-D float tensor"):
        tritongrad.reduce_partials(torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match=r"out must be \[30\]"):
        tritongrad.reduce_partials(part, out=torch.empty(29, device=DEVICE))


@pytest.mark.parametrize("N,block_n", [(1, 16), (1000, 16), (37, 1)], ids=str)
def test_partial_rows_cover_every_row_once(N, block_n):
    import tritongrad

    part, rows = tritongrad.partial_rows(N, 8, DEVICE, block_n=block_n, programs=5)
    P = part.shape[0]
    assert part.dtype == torch.float32 and part.shape == (P, 8) and P <= 5
    assert rows % block_n == 0 and (P - 1) * rows < N <= P * rows  # no empty program, every row covered
    assert tritongrad.partial_rows(N, 8, DEVICE, dtype=torch.float64)[0].dtype == torch.float64

"""The forward launcher both norms share for rows of an odd number of power-of-two chunks (5120 = 5 x 1024).

One register tile of ``next_pow2(D)`` lanes would leave up to half of them masked at such lengths (5120 of
8192), and masked lanes take registers like the others. ``_norm_fwd_parts_kernel`` holds the row in parts of
8, 4, 2 and 1 chunks instead (ops/_norm_kernels.py). Which rows take it: ``nc.fwd_parts``.
"""

from __future__ import annotations

from .. import _runtime as rt
from . import _norm_kernels

_parts_kernel = rt.Kernel(_norm_kernels._norm_fwd_parts_kernel)


def forward_parts(x2, w, b, y2, mean, rstd, eps: float, plan, centered: bool, round_xhat: bool, acc) -> None:
    """Normalise the rows of x2 [N, D] into y2 (contiguous), saving rstd (and mean when ``centered``);
    ``plan``: ``nc.fwd_parts``'s (CHUNK, NCH, warps) for D."""
    chunk, nch, warps = plan
    N, D = x2.shape
    _parts_kernel[(N,)](
        x2, w, b, y2, mean, rstd, x2.stride(0), x2.stride(1), w.stride(0) if w is not None else 0,
        b.stride(0) if b is not None else 0, D, *rt.split_float(eps), CHUNK=chunk, NCH=nch, HAS_W=w is not None,
        HAS_B=b is not None, CENTERED=centered, ROUND_XHAT=round_xhat, ACC=rt.tl_acc_dtype(acc),
        ALIGN=rt.align(D, x2.stride(0)), num_warps=warps,
    )

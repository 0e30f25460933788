"""The backward launcher both norms share (kernels in ops/_norm_kernels.py, plans in ops/_norm_common.py).

layer_norm passes its mean and bias (``centered``); rms_norm passes neither. One of three launch shapes:

- rows that fit one tile: ``_norm_bwd_kernel`` alone, the row sums from the tile itself;
- rows of a few chunks with a row group per SM (``long_bwd_plan``): ``_norm_bwd_long_kernel``;
- other long rows: the row-sum pass (``_norm_bwd_rowsum_kernel``; with few rows its column splits' parts
  added by ``column_sum``), then ``_norm_bwd_kernel`` over column blocks.

Then, with more than one row chunk, ``column_sum`` reduces the dw (and db) partial rows, side by side in one
float buffer, in one launch.
"""

from __future__ import annotations

import torch

from .. import _pattern
from .. import _runtime as rt
from . import _norm_common as nc
from . import _norm_kernels
from .column_sum import column_sum

_rowsum_kernel = rt.Kernel(_norm_kernels._norm_bwd_rowsum_kernel)
_kernel = rt.Kernel(_norm_kernels._norm_bwd_kernel)
_long_kernel = rt.Kernel(_norm_kernels._norm_bwd_long_kernel)


def _empty_like(t: torch.Tensor | None, need: bool) -> torch.Tensor | None:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device) if need else None


def norm_backward(dy, x, k: int, weight, bias, mean, rstd, needs, centered: bool, round_xhat: bool, tile: int):
    """``(dx, dw, db)`` of a norm over x's last ``k`` dims; ``needs`` = (x, weight, bias) gradients wanted
    (bias: False for rms_norm). ``mean`` is None unless ``centered``; ``tile``: elements a program handles
    per step when rows are short."""
    need_x, need_w, need_b = needs
    dx, dw, db = _empty_like(x, need_x), _empty_like(weight, need_w), _empty_like(bias, need_b)
    if rt.is_fake(x) or not (need_x or need_w or need_b):
        return dx, dw, db
    x2 = _pattern.as_rows(x, k)
    N, D = x2.shape
    if N == 0 or D == 0:
        return dx, (dw.zero_() if need_w else None), (db.zero_() if need_b else None)
    dy2 = _pattern.as_rows(dy, k)  # a view for contiguous or expanded (stride 0) dy
    w = nc.flat(weight)
    stride_w = w.stride(0) if w is not None else 0
    acc = rstd.dtype
    ACC = rt.tl_acc_dtype(acc)
    sms = rt.sm_count(x.device)
    t, d_blocks, chunks, rows_per_prog = nc.bwd_plan(N, D, sms, tile, x.element_size())
    # dx is contiguous (row stride D); the dw/db partial rows are D or 2D apart.
    align = rt.align(D, x2.stride(0), dy2.stride(0))
    lp = None if t.ONE_TILE else nc.long_bwd_plan(
        N, D, sms, centered, x.element_size(), w.element_size() if w is not None else 0, rstd.element_size(),
        align,
    )
    if lp is not None:
        chunks = lp.groups
    part_w, part_b = (dw.view(-1) if need_w else None), (db.view(-1) if need_b else None)  # one chunk
    part = None
    if chunks > 1 and (need_w or need_b):
        # The dw and db partials side by side in one float buffer: one column_sum launch reduces both.
        part = torch.empty((chunks, (need_w + need_b) * D), dtype=acc, device=x.device)
        part_w, part_b = (part[:, :D] if need_w else None), (part[:, -D:] if need_b else None)
    stride_pw = part_w.stride(0) if (need_w and chunks > 1) else 0
    stride_pb = part_b.stride(0) if (need_b and chunks > 1) else 0
    align = rt.align(align, stride_pw, stride_pb)
    depth = nc.BWD_MASKED_16BIT[1] if nc.masked_16bit(t, D, x.element_size()) else nc.BWD_STAGES
    flags = dict(HAS_W=w is not None, CENTERED=centered, ACC=ACC, ALIGN=align)
    if lp is not None:
        _long_kernel[(lp.programs,)](
            x2, w, dy2, mean, rstd, dx, part_w, part_b, N, D, x2.stride(0), x2.stride(1), stride_w,
            dy2.stride(0), dy2.stride(1), D, stride_pw, stride_pb, lp.rows_per_prog, lp.COLS,
            CHUNK=lp.CHUNK, NCH=lp.NCH, SPLIT=lp.SPLIT, HAS_DX=need_x, HAS_DW=need_w, HAS_DB=need_b,
            ROUND_XHAT=round_xhat, num_warps=lp.num_warps, **flags,
        )
    else:
        c = None
        if need_x and not t.ONE_TILE:
            # The row sums: c1 (and c2 when centered), one row each.
            c = torch.empty((1 + centered, N), dtype=acc, device=x.device)
            splits, d_split = nc.column_split(N, D, t, sms)
            # Column-split rows: a block of partial row sums per split, added by column_sum.
            c_part = c if splits == 1 else torch.empty((splits, c.numel()), dtype=acc, device=x.device)
            _rowsum_kernel[(rt.cdiv(N, t.BLOCK_N), splits)](
                x2, w, dy2, mean, rstd, c_part, N, D, x2.stride(0), x2.stride(1), stride_w, dy2.stride(0),
                dy2.stride(1), N, d_split, c_part.stride(0) if splits > 1 else 0,
                BLOCK_N=t.BLOCK_N, BLOCK_D=t.BLOCK_D, num_warps=t.num_warps,
                **dict(flags, ALIGN=rt.align(align, d_split)),
            )
            if splits > 1:
                column_sum(c_part, c.view(-1))
        _kernel[(chunks, d_blocks)](
            x2, w, dy2, mean, rstd, c, dx, part_w, part_b, N, D, x2.stride(0), x2.stride(1), stride_w,
            dy2.stride(0), dy2.stride(1), N, D, stride_pw, stride_pb, rows_per_prog,
            BLOCK_N=t.BLOCK_N, BLOCK_D=t.BLOCK_D, ONE_TILE=t.ONE_TILE, HAS_DX=need_x, HAS_DW=need_w,
            HAS_DB=need_b, ROUND_XHAT=round_xhat,
            STAGES=nc.bwd_stages(t, x.element_size() + dy.element_size(), rt.shared_mem_per_sm(x.device), depth),
            num_warps=t.num_warps, **flags,
        )
    if part is not None:
        column_sum(part, *[g.view(-1) for g in (dw, db) if g is not None])
    return dx, dw, db

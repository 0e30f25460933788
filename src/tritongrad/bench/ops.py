"""The ops ``tritongrad bench`` knows: how to make their inputs, what they compute in plain PyTorch, and the
fewest bytes each pass must move through device memory (the bandwidth floor GB/s is computed from).

Bytes are counted for ``x: [N, D]`` and every other tensor in the same dtype of ``s`` bytes per element:

- forward : read the inputs + write the output;
- backward: read the saved inputs + read the output's gradient ``g`` + write every input's gradient;
- fwdbwd  : the sum of the two.

Row statistics a kernel may save for its backward (rstd, mean: ``N`` floats) are not counted: they are a
choice of the implementation, not something the op must move.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..testing import make_rows

EPS = 1e-6

# Latency regime; medium; bandwidth regime (x >= 256 MB in bf16, several times any L2) with D from 128 to
# 16384; skinny rows both ways; last, a hidden size between powers of two (5120: a row leaves 3/8 of its
# power-of-two tile masked, the norms' weakest common case).
ROW_SWEEP = (
    (4, 64),
    (4096, 4096),
    (1048576, 128),
    (131072, 1024),
    (32768, 4096),
    (16384, 16384),
    (16, 1048576),
    (4194304, 32),
    (26214, 5120),
)
QUICK_SHAPES = ((4, 64), (4096, 4096), (32768, 4096))
# Without a GPU the kernels run in Triton's interpreter (milliseconds per launch): enough to exercise the
# harness, nothing to read speed from.
SMOKE_SHAPES = ((4, 64), (16, 256))


def _x_and_vectors(count: int):
    """``x: [N, D]`` and ``count`` vectors ``[D]`` (weight, bias), fresh normal values, all requiring grad."""

    def make(N: int, D: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        x = make_rows((N, D), dtype, device)
        vectors = [torch.randn(D, dtype=dtype, device=device) for _ in range(count)]
        return tuple(t.requires_grad_() for t in (x, *vectors))

    return make


def _weighted_sum_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum(-1)


@dataclass(frozen=True)
class OpSpec:
    """One op. ``torch_fn`` has the op's public signature (that of ``tritongrad.<name>``) and is the eager
    baseline and what torch.compile compiles; ``bind`` turns a function of that signature into one taking
    exactly the tensors ``inputs`` makes."""

    name: str
    inputs: Callable[[int, int, torch.dtype, object], tuple[torch.Tensor, ...]]
    torch_fn: Callable
    bind: Callable[[Callable], Callable]
    fwd_bytes: Callable[[int, int, int], int]
    bwd_bytes: Callable[[int, int, int], int]
    shapes: tuple[tuple[int, int], ...] = ROW_SWEEP
    fn: Callable | None = None  # tritongrad's callable; None: ``tritongrad.<name>``

    def bytes(self, mode: str, N: int, D: int, s: int) -> int:
        fwd, bwd = self.fwd_bytes(N, D, s), self.bwd_bytes(N, D, s)
        return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode]


OPS: dict[str, OpSpec] = {
    op.name: op
    for op in (
        OpSpec(
            "weighted_sum",
            _x_and_vectors(1),
            _weighted_sum_torch,
            bind=lambda f: f,
            # read x + read w + write y
            fwd_bytes=lambda N, D, s: N * D * s + D * s + N * s,
            # read x + read w + read g + write gx + write gw
            bwd_bytes=lambda N, D, s: N * D * s + D * s + N * s + N * D * s + D * s,
        ),
        OpSpec(
            "rms_norm",
            _x_and_vectors(1),
            F.rms_norm,
            bind=lambda f: lambda x, w: f(x, (x.shape[-1],), w, EPS),
            # read x + read w + write y
            fwd_bytes=lambda N, D, s: N * D * s + D * s + N * D * s,
            # read x + read w + read g + write gx + write gw
            bwd_bytes=lambda N, D, s: N * D * s + D * s + N * D * s + N * D * s + D * s,
        ),
        OpSpec(
            "layer_norm",
            _x_and_vectors(2),
            F.layer_norm,
            bind=lambda f: lambda x, w, b: f(x, (x.shape[-1],), w, b, EPS),
            # read x + read w + read b + write y
            fwd_bytes=lambda N, D, s: N * D * s + 2 * D * s + N * D * s,
            # read x + read w + read g + write gx + write gw + write gb (b itself is not needed)
            bwd_bytes=lambda N, D, s: N * D * s + D * s + N * D * s + N * D * s + 2 * D * s,
        ),
    )
}


def from_op(op, inputs: Callable | None = None, fwd_bytes: Callable | None = None, bwd_bytes: Callable | None = None,
            shapes: tuple[tuple[int, int], ...] = ROW_SWEEP) -> OpSpec:
    """An :class:`OpSpec` for an op declared with :func:`tritongrad.op` (one output): its reference is the
    eager baseline and what torch.compile compiles.

    Defaults, for ops whose tensor arguments are all ``[N, D]`` (elementwise and row-wise ops): ``inputs``
    makes every tensor argument ``[N, D]`` (requiring grad where the op differentiates it) and gives the other
    arguments their defaults; the bytes are one read of each tensor input and one write of the output
    forward, and one read of each saved tensor and of the output's gradient plus one write of each input
    gradient backward."""
    if op.n_outputs != 1:
        raise ValueError(f"tritongrad bench: {op.label} has {op.n_outputs} outputs; give an OpSpec with a "
                         "function returning one tensor")
    tensors = op.tensor_positions
    if inputs is None:
        missing = [n for i, (n, d) in enumerate(zip(op._names, op._defaults))
                   if i not in tensors and d is inspect.Parameter.empty]
        if missing:
            raise ValueError(f"tritongrad bench: {op.label}'s arguments {missing} have no default; give inputs=")

        def inputs(N, D, dtype, device):
            return tuple(
                make_rows((N, D), dtype, device).requires_grad_(i in op._diff_positions) if i in tensors else d
                for i, d in enumerate(op._defaults)
            )

    n_in, n_diff = len(tensors), len(op._diff_positions)
    fwd_bytes = fwd_bytes or (lambda N, D, s: (n_in + 1) * N * D * s)
    bwd_bytes = bwd_bytes or (lambda N, D, s: (len(op.save) + 1 + n_diff) * N * D * s)
    return OpSpec(op.label, inputs, op.reference, lambda f: f, fwd_bytes, bwd_bytes, shapes, fn=op)


def load(path: str) -> OpSpec:
    """``"package.module:attr"``: an :class:`OpSpec`, or an op declared with :func:`tritongrad.op` (then
    :func:`from_op`'s defaults)."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"tritongrad bench --op: expected MODULE:NAME such as mypkg.ops:softcap, got {path!r}")
    obj = getattr(importlib.import_module(module), attr)
    if isinstance(obj, OpSpec):
        return obj
    from .._pattern import Op

    if isinstance(obj, Op):
        return from_op(obj)
    raise TypeError(f"tritongrad bench --op {path}: {type(obj).__name__} is neither an OpSpec nor a tritongrad op")

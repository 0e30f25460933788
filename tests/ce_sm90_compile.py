"""Compile, for an H100/H200 (sm_90), every kernel specialization that the cross-entropy launchers request for
realistic calls, without a GPU: the launchers run on CPU tensors with kernel launches replaced by a compile.
Run as a script (TRITON_INTERPRET must be off so that triton.jit builds GPU kernels); prints one line per
failure and a final count. Used by tests/test_cross_entropy.py.

    python tests/ce_sm90_compile.py --resources

also prints each specialization's registers, stack, register spills (local-memory stores in the SASS) and
shared memory, read from the cubin by the cuobjdump that Triton ships; more than two spill stores fail the run.
Row counts are small (the specialization does not depend on them: only on dtypes, alignment and the plan,
which depends on the class count, and on the row count the plan is told: 16384); class counts are the real
ones.
"""

import sys

import sm90  # noqa: F401  (first: Triton out of its interpreter)
import torch

from tritongrad import _runtime
from tritongrad.ops.cross_entropy import cross_entropy, launch, linear_cross_entropy

# Local stores a kernel may have without failing: one-off saves, e.g. a predicate register kept in local
# memory from the kernel's entry to its end (seen once, in a soft-capped kernel: P2R then STL, one load
# later), cost nothing per element. Spills in loops come by the dozen.
_ONE_OFF_STORES = 2


def _check(name, shown, compiled) -> list:
    res, spills = sm90.resources(compiled.asm["cubin"])
    return [f"{name} {shown}: {spills} register spill stores ({res})"] if spills > _ONE_OFF_STORES else []


def _ce_calls(dtype, N, C, padded: int = 0):
    """Every launch shape of cross_entropy for logits [N, C] (rows C + padded apart)."""
    big = torch.randn(N, C + padded, dtype=torch.float32).to(dtype)
    t = torch.randint(0, C, (N,))
    t[::7] = -100
    w = torch.rand(C)
    for kw in ({}, {"reduction": "sum"}, {"weight": w.to(dtype), "label_smoothing": 0.1},
               {"logit_softcap": 30.0, "z_loss": 1e-4}, {"weight": w, "label_smoothing": 0.1, "logit_softcap": 30.0}):
        x = big[:, :C].detach().requires_grad_()
        loss = cross_entropy(x, t, **kw)
        loss.backward()  # the fused path: the scale kernel
        x = big[:, :C].detach().requires_grad_()
        loss, lse = cross_entropy(x, t, return_lse=True, **kw)
        (loss + lse.sum()).backward()  # the lse's gradient: the scale kernel re-reads the logits
        x = big[:, :C].detach().requires_grad_()
        cross_entropy(x, t, **{**kw, "reduction": "none"}).sum().backward()  # recompute from lse
        with torch.no_grad():
            cross_entropy(x, t, **kw)  # no gradient


def _lce_calls(dtype, N, H, V, bias: bool, recompute: bool):
    """The linear op's launches; ``recompute``: a forward that computes no gradient (the registered op called
    with ``grads=None``), so that the backward recomputes the logits with a scalar upstream gradient. (Forced
    GONE buffers no longer reach that path: a forward that computed every gradient keeps no hidden states.)"""
    h = torch.randn(N, H, dtype=torch.float32).to(dtype).requires_grad_()
    W = (torch.randn(V, H, dtype=torch.float32) / H**0.5).to(dtype).requires_grad_()
    b = torch.randn(V, dtype=torch.float32).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,))
    for kw in ({}, {"label_smoothing": 0.1, "logit_softcap": 30.0, "z_loss": 1e-4}, {"reduction": "none"}):
        if recompute:
            kw = {"reduction": "mean", "label_smoothing": 0.0, "logit_softcap": None, "z_loss": 0.0, **kw}
            loss = launch.linear_cross_entropy_op(h, W, t, b, -100, kw["reduction"], kw["label_smoothing"],
                                                  kw["logit_softcap"], kw["z_loss"], None, None, 1.0, False)
        else:
            loss = linear_cross_entropy(h, W, t, b, **kw)
        loss.backward(torch.full_like(loss, 0.5))  # an upstream gradient != 1: the scale kernel works


def main() -> int:
    compiler = sm90.Compiler(_check)
    compiler.install()
    # Plans see the row count of the target shapes (the tensors here have few rows, to spare the CPU).
    _runtime.hint = lambda n: 16384
    bf, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    # The three backward paths: the eager first backward (in place), the registered backward op under
    # torch.compile (fresh tensors), a later backward through one graph (recompute from the logits).
    for take in (launch.Buffers.TAKE, launch.Buffers.READ, launch.Buffers.GONE):
        launch._take_buffer = lambda ctx, take=take: take
        # Why each: the two target vocabularies (bf16); a vocabulary held in one chunk; an odd vocabulary
        # (GPT-2, unaligned rows); rows of a padded vocabulary; float16, float32 and float64 logits.
        for dtype, N, C, padded in ((bf, 64, 32000, 0), (bf, 64, 128256, 0), (bf, 64, 4096, 0), (bf, 64, 50257, 0),
                                    (bf, 64, 128256, 256), (f16, 64, 32000, 0), (f32, 64, 32000, 0),
                                    (f32, 64, 128256, 0), (f64, 16, 1000, 0)):
            _ce_calls(dtype, N, C, padded)
        # The linear op's chunks at the target vocabulary (the hidden size does not change the loss kernels).
        for dtype, bias in ((bf, False), (bf, True), (f32, False)):
            _lce_calls(dtype, 96, 32, 128256, bias, recompute=take is launch.Buffers.GONE)
    return compiler.report()


if __name__ == "__main__":
    sys.exit(main())

"""Compile, for an H100/H200 (sm_90), every kernel specialization that the launchers request for a set of
calls, without a GPU: the launchers run on CPU tensors with kernel launches replaced by a compile.
Run as a script (TRITON_INTERPRET must be off so that triton.jit builds GPU kernels); prints one line per
failure and a final count. Used by tests/test_sm90_compile.py.

    python tests/sm90_compile.py --resources

also prints each specialization's registers, stack and shared memory per thread block (from the cubin, by
the cuobjdump that Triton ships): spills and occupancy, read without a GPU.

Rows whose length and strides are multiples of 8 elements but not of 16 are checked for vector loads: Triton
itself marks only integers divisible by 16, so without the kernels' ALIGN hint every load of such a row is
scalar (2-byte loads for bfloat16), about half the bandwidth on an H200 (docs/norms.md)."""

import dataclasses
import re
import sys

import sm90  # noqa: F401  (first: Triton out of its interpreter)
import torch

import tritongrad
from tritongrad.ops.norm import llama_rms_norm
from tritongrad.ops.weighted_sum import plans as ws_plans

_want_vectors = [False]  # the current case's rows are 8-element aligned: every row kernel must vectorise
# A vector load from global memory: ld.global.v2/v4/v8, or an asynchronous copy of 8 or 16 bytes.
_VECTOR_LOAD = re.compile(
    r"ld\.global[\w:.]*\.v[248]\."
    r"|cp\.async\.c[ag]\.shared\.global[\w:.]* \[[^\]]*\], \[[^\]]*\], (0x8|0x10)"
)


def _check(name, shown, compiled) -> list:
    # column_sum's partial rows are L2-resident and unhinted: not a row kernel.
    if _want_vectors[0] and name != "_column_sum_kernel" and not _VECTOR_LOAD.search(compiled.asm["ptx"]):
        return [f"{name} {shown}: no vector load for 8-element aligned rows"]
    return []


def main(cases) -> int:
    compiler = sm90.Compiler(_check)
    compiler.install()
    for xdt, pdt, N, D in cases:
        _want_vectors[0] = D % 8 == 0 and D % 16 != 0
        x = torch.randn(N, D, dtype=xdt, requires_grad=True)
        w = torch.randn(D, dtype=pdt, requires_grad=True)
        b = torch.randn(D, dtype=pdt, requires_grad=True)
        for y in (
            tritongrad.weighted_sum(x, w),
            tritongrad.rms_norm(x, (D,), w, 1e-6),
            tritongrad.layer_norm(x, (D,), w, b),
            tritongrad.layer_norm(x, (D,), None, None),
            llama_rms_norm(x, w, 1e-6),
        ):
            y.backward(torch.randn(y.shape, dtype=y.dtype))
        r = torch.randn(N, D, dtype=xdt, requires_grad=True)
        for norm in ({}, {"weight_offset": 1.0, "cast_before_weight": False}):  # Llama's norm, Gemma's
            y, s = tritongrad.fused_add_rms_norm(x, r, w, 1e-6, **norm)
            torch.autograd.backward((y, s), (torch.randn(y.shape, dtype=y.dtype),
                                             torch.randn(s.shape, dtype=s.dtype)))
        # Large inputs take weighted_sum's backward in two launches (grad_x, then grad_w): compile those too.
        with ws_plans.using(dataclasses.replace(ws_plans.TABLE, SPLIT_BWD_BYTES=0, SPLIT_BWD_ROWS=0)):
            tritongrad.weighted_sum(x, w).backward(torch.randn(N, dtype=torch.promote_types(xdt, pdt)))
    return compiler.report()


if __name__ == "__main__":
    bf, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    # Why each: short rows, several per program; a 4096-wide row held whole (the common hidden size); rows
    # longer than one tile (chunked norms, split-D weighted_sum); few rows, many column blocks; float64
    # accumulation stored to bfloat16; the norms' one-kernel long-row backward (3 and 4 chunks, 16/32-bit,
    # mixed).
    cases = [(bf, bf, 4096, 1024), (bf, bf, 64, 4096), (f32, f32, 300, 20000), (bf, f32, 16, 70000), (bf, f64, 64, 512),
             (bf, bf, 300, 12288), (f32, f32, 300, 16384), (bf, f32, 200, 10000), (bf, f32, 200, 16384),
             # 8-element aligned rows, not 16 (vector loads asserted): rows in registers, 3 chunks (the
             # long-row backward), 5 chunks (row-sum pass and column blocks); float32 and bfloat16.
             (bf, bf, 4096, 1000), (bf, bf, 300, 13000), (f32, f32, 300, 13000), (bf, bf, 300, 20008),
             # the norms' parted forward: 7 and 11 power-of-two chunks in three parts, mixed and bf16 (12288
             # above: 3 chunks in two parts)
             (bf, f32, 64, 7168), (bf, bf, 64, 11264)]
    sys.exit(main(cases))

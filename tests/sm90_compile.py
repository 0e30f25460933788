"""Compile, for an H100/H200 (sm_90), every kernel specialization that the launchers request for a set of
calls, without a GPU: the launchers run on CPU tensors with kernel launches replaced by a compile.
Run as a script (TRITON_INTERPRET must be off so that triton.jit builds GPU kernels); prints one line per
failure and a final count. Used by tests/test_sm90_compile.py.

    python tests/sm90_compile.py --resources

also prints each specialization's registers, stack and shared memory per thread block (from the cubin, by
the cuobjdump that Triton ships): spills and occupancy, read without a GPU.

Rows whose length and strides are multiples of 8 elements but not of 16 are checked for vector loads: Triton
itself marks only integers divisible by 16, so without the kernels' ALIGN hint every load of such a row is
scalar (2-byte loads for bfloat16), about half the bandwidth on an H200 (benchmarks/NOTES.md)."""

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import tritongrad  # noqa: E402
from tritongrad import _pattern, _runtime  # noqa: E402
from tritongrad.ops.norm import llama_rms_norm  # noqa: E402
from tritongrad.ops.weighted_sum import launch as ws_launch  # noqa: E402

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
_seen: set = set()
_failures: list = []
_want_vectors = [False]  # the current case's rows are 8-element aligned: every row kernel must vectorise
# A vector load from global memory: ld.global.v2/v4/v8, or an asynchronous copy of 8 or 16 bytes.
_VECTOR_LOAD = re.compile(
    r"ld\.global[\w:.]*\.v[248]\."
    r"|cp\.async\.c[ag]\.shared\.global[\w:.]* \[[^\]]*\], \[[^\]]*\], (0x8|0x10)"
)
_RESOURCES = "--resources" in sys.argv


def _resources(cubin: bytes) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(w for line in out.splitlines() if "REG:" in line for w in line.split()[:3])


def _compile(self, grid, *args, num_warps=4, **constexprs):
    # The specialization Triton makes at run time: integers equal to 1 become constants, pointers aligned
    # to 16 bytes and integers divisible by 16 are marked so (this is what enables 16-byte vector loads).
    names = [p.name for p in self.fn.params]
    signature, constants, attrs = {}, {}, {}
    for i, (name, a) in enumerate(zip(names, args)):
        if isinstance(a, torch.Tensor):
            signature[name] = "*" + _TYPES[a.dtype]
            aligned = a.data_ptr() % 16 == 0
        elif isinstance(a, bool) or a is None or a == 1:
            signature[name], constants[name] = "constexpr", a
            continue
        elif isinstance(a, int):
            signature[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
            aligned = a % 16 == 0
        else:
            signature[name] = "fp32"
            continue
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in names[len(args):]:
        signature[name], constants[name] = "constexpr", constexprs[name]
    key = (self.fn.__name__, tuple(signature.items()), repr(sorted(constants.items())), repr(attrs), num_warps)
    if key in _seen:
        return
    _seen.add(key)
    try:
        compiled = triton.compile(
            ASTSource(self.fn, signature=signature, constexprs=constants, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps},
        )
        # column_sum's partial rows are L2-resident and unhinted: not a row kernel.
        row_kernel = self.fn.__name__ != "_column_sum_kernel"
        if _want_vectors[0] and row_kernel and not _VECTOR_LOAD.search(compiled.asm["ptx"]):
            _failures.append(f"{self.fn.__name__} {constants}: no vector load for 8-element aligned rows")
        if _RESOURCES:
            shown = {k: v for k, v in constants.items() if k.isupper()}
            print(f"{self.fn.__name__:32s} warps={num_warps} {_resources(compiled.asm['cubin'])} {shown}")
    except Exception as e:  # report every failing specialization, not just the first
        _failures.append(f"{self.fn.__name__} {constants}: {type(e).__name__}: {str(e)[:500]}")


def main(cases) -> int:
    _runtime.Kernel._launch = _compile
    _runtime.uses_triton = _pattern.rt.uses_triton = lambda device: True
    _runtime.sm_count = lambda device: 132
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
        # Large inputs take weighted_sum's backward in two launches (grad_x, then grad_w): compile those too.
        split = ws_launch._SPLIT_BWD_BYTES, ws_launch._SPLIT_BWD_ROWS
        ws_launch._SPLIT_BWD_BYTES = ws_launch._SPLIT_BWD_ROWS = 0
        tritongrad.weighted_sum(x, w).backward(torch.randn(N, dtype=torch.promote_types(xdt, pdt)))
        ws_launch._SPLIT_BWD_BYTES, ws_launch._SPLIT_BWD_ROWS = split
    for f in _failures:
        print("FAIL", f)
    print(f"compiled {len(_seen)} specializations, {len(_failures)} failures")
    return 1 if _failures else 0


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

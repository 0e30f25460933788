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

from tritongrad import _pattern, _runtime  # noqa: E402
from tritongrad.ops.cross_entropy import cross_entropy, launch, linear_cross_entropy  # noqa: E402

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32"}
_seen: set = set()
_failures: list = []
_RESOURCES = "--resources" in sys.argv
_SPILL_STORE = re.compile(r"\bSTL(\.\w+)*\s")
# Local stores a kernel may have without failing: one-off saves, e.g. a predicate register kept in local
# memory from the kernel's entry to its end (seen once, in a soft-capped kernel: P2R then STL, one load
# later), cost nothing per element. Spills in loops come by the dozen.
_ONE_OFF_STORES = 2


def _resources(cubin: bytes) -> tuple[str, int]:
    """(registers, stack and shared memory as cuobjdump reports them; register spills: the local-memory
    stores in the SASS). A stack frame alone is not a spill: calls to slow-path subroutines (a division's,
    float64's) take one."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "--dump-sass", f.name], capture_output=True, text=True).stdout
    res = " ".join(w for line in out.splitlines() if "REG:" in line for w in line.split()[:3])
    return res, len(_SPILL_STORE.findall(sass))


def _compile(self, grid, *args, num_warps=4, **constexprs):
    # The specialization Triton makes at run time: integers equal to 1 become constants, pointers aligned to
    # 16 bytes and integers divisible by 16 are marked so (what enables 16-byte vector loads).
    names = [p.name for p in self.fn.params]
    signature, constants, attrs = {}, {}, {}
    for i, (name, a) in enumerate(zip(names, args)):
        if isinstance(a, torch.Tensor):
            signature[name] = "*" + _TYPES[a.dtype]
            aligned = a.data_ptr() % 16 == 0
        elif isinstance(a, bool) or a is None or (type(a) is int and a == 1):
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
    key = (self.fn.__name__, tuple(signature.items()), repr(sorted(constants.items(), key=str)), repr(attrs),
           num_warps)
    if key in _seen:
        return
    _seen.add(key)
    try:
        compiled = triton.compile(
            ASTSource(self.fn, signature=signature, constexprs=constants, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps},
        )
        res, spills = _resources(compiled.asm["cubin"])
        if spills > _ONE_OFF_STORES:
            _failures.append(f"{self.fn.__name__} {constants}: {spills} register spill stores ({res})")
        if _RESOURCES:
            shown = {k: v for k, v in constants.items() if k.isupper()}
            print(f"{self.fn.__name__:30s} warps={num_warps} {res} spills={spills} dyn_smem={compiled.metadata.shared} "
                  f"{shown}")
    except Exception as e:  # report every failing specialization, not just the first
        _failures.append(f"{self.fn.__name__} {constants}: {type(e).__name__}: {str(e)[:500]}")


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


def _lce_calls(dtype, N, H, V, bias: bool):
    h = torch.randn(N, H, dtype=torch.float32).to(dtype).requires_grad_()
    W = (torch.randn(V, H, dtype=torch.float32) / H**0.5).to(dtype).requires_grad_()
    b = torch.randn(V, dtype=torch.float32).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,))
    for kw in ({}, {"label_smoothing": 0.1, "logit_softcap": 30.0, "z_loss": 1e-4}, {"reduction": "none"}):
        loss = linear_cross_entropy(h, W, t, b, **kw)
        loss.backward(torch.full_like(loss, 0.5))  # an upstream gradient != 1: the scale kernel works


def main() -> int:
    _runtime.Kernel._launch = _compile
    _runtime.uses_triton = _pattern.rt.uses_triton = launch.rt.uses_triton = lambda device: True
    _runtime.sm_count = launch.rt.sm_count = lambda device: 132
    # Plans see the row count of the target shapes (the tensors here have few rows, to spare the CPU).
    _runtime.hint = lambda n: 16384
    bf, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    # The three backward paths: the eager first backward (in place), the registered backward op under
    # torch.compile (fresh tensors), a later backward through one graph (recompute from the logits).
    for take in (True, False, None):
        launch._take_buffer = lambda ctx, take=take: take
        # Why each: the two target vocabularies (bf16); a vocabulary held in one chunk; an odd vocabulary
        # (GPT-2, unaligned rows); rows of a padded vocabulary; float16, float32 and float64 logits.
        for dtype, N, C, padded in ((bf, 64, 32000, 0), (bf, 64, 128256, 0), (bf, 64, 4096, 0), (bf, 64, 50257, 0),
                                    (bf, 64, 128256, 256), (f16, 64, 32000, 0), (f32, 64, 32000, 0),
                                    (f32, 64, 128256, 0), (f64, 16, 1000, 0)):
            _ce_calls(dtype, N, C, padded)
        # The linear op's chunks at the target vocabulary (the hidden size does not change the loss kernels).
        for dtype, bias in ((bf, False), (bf, True), (f32, False)):
            _lce_calls(dtype, 96, 32, 128256, bias)
    for f in _failures:
        print("FAIL", f)
    print(f"compiled {len(_seen)} specializations, {len(_failures)} failures")
    return 1 if _failures else 0


if __name__ == "__main__":
    sys.exit(main())

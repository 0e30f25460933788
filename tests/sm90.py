"""Offline compiles for an H100/H200 (sm_90), shared by the compile checks (sm90_compile.py,
sm90_compile_llm_ops.py, ce_sm90_compile.py): the launchers run on CPU tensors with every kernel launch
replaced by ``triton.compile`` of the specialization Triton would make at run time. Import this module before
tritongrad: Triton must not be in its interpreter (it reads TRITON_INTERPRET once, on import).
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

TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
         torch.int64: "i64", torch.int32: "i32"}
SPILL_STORE = re.compile(r"\bSTL(\.\w+)*\s")
SHOW = "--resources" in sys.argv
# The quick tier's check: each kernel with each of its switches (boolean constexprs) on and off, not every
# combination at every block size, dtype and alignment: what fails to compile is usually a code path.
QUICK = "--quick" in sys.argv


def resources(cubin: bytes) -> tuple[str, int]:
    """(registers, stack and shared memory as cuobjdump reports them; register spill stores, the local-memory
    stores in the SASS), by the cuobjdump that Triton ships. A stack frame alone is not a spill: calls to
    slow-path subroutines (a division's, float64's) take one."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "--dump-sass", f.name], capture_output=True, text=True).stdout
    res = " ".join(w for line in out.splitlines() if "REG:" in line for w in line.split()[:4])
    return res, len(SPILL_STORE.findall(sass))


class Compiler:
    """Stands in for ``rt.Kernel._launch``: compiles each new specialization once, runs ``check(name, shown,
    compiled)`` on it (a list of failure strings back), and collects every failure rather than stopping."""

    def __init__(self, check=None):
        self.check = check
        self.seen: set = set()
        self.covered: set = set()  # under QUICK: (kernel, switch, value) compiled at least once
        self.failures: list = []

    def install(self) -> None:
        compiler = self

        def launch(kernel, grid, *args, num_warps=4, **constexprs):
            args = kernel.positional(args, constexprs)  # arguments passed by name, in the kernel's order
            compiler.compile(kernel.fn, args, num_warps, constexprs)

        _runtime.Kernel._launch = launch
        _runtime.uses_triton = _pattern.rt.uses_triton = lambda device: True
        # An H200's plans: 132 SMs, sm_90's shared memory (for the rest of this process).
        _runtime.assume_device(_runtime.DeviceProps(132, 228 * 1024)).__enter__()

    def compile(self, fn, args, num_warps, constexprs) -> None:
        # The specialization Triton makes at run time: integers equal to 1 and None become constants, pointers
        # aligned to 16 bytes and integers divisible by 16 are marked so (what enables 16-byte vector access).
        names = [p.name for p in fn.params]
        signature, constants, attrs = {}, {}, {}
        for i, (name, a) in enumerate(zip(names, args)):
            if isinstance(a, torch.Tensor):
                signature[name] = "*" + TYPES[a.dtype]
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
        key = (fn.__name__, tuple(signature.items()), repr(sorted(constants.items(), key=str)), repr(attrs), num_warps)
        if QUICK:
            switches = {(fn.__name__, k, v) for k, v in constants.items() if isinstance(v, bool)} | {fn.__name__}
            if switches <= self.covered:
                return
            self.covered |= switches
        if key in self.seen:
            return
        self.seen.add(key)
        shown = {k: v for k, v in constants.items() if k.isupper()}
        try:
            compiled = triton.compile(ASTSource(fn, signature=signature, constexprs=constants, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        except Exception as e:  # report every failing specialization, not just the first
            self.failures.append(f"{fn.__name__} {shown}: {type(e).__name__}: {str(e)[:500]}")
            return
        if self.check is not None:
            self.failures += self.check(fn.__name__, shown, compiled)
        if SHOW:
            res, spills = resources(compiled.asm["cubin"])
            print(f"{fn.__name__:32s} warps={num_warps} {res} spills={spills} smem={compiled.metadata.shared} {shown}")

    def report(self) -> int:
        for f in self.failures:
            print("FAIL", f)
        print(f"compiled {len(self.seen)} specializations, {len(self.failures)} failures")
        return 1 if self.failures else 0

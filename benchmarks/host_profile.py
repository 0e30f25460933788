"""Where an eager forward+backward call spends host time, on the GPU machine's host.

Prints, per op (bf16, --shape), the host time of its parts measured in isolation (median of many calls,
microseconds) and a cProfile of the whole call sorted by own time, next to the same figures for PyTorch's op:

- floor: an autograd.Function that allocates its output and gradients and launches nothing;
- torch.empty of the output's shape; one Triton launch of a cached kernel (``rt.Kernel``); the op's checks;
- the whole tritongrad call and PyTorch's, and tritongrad's with its launches stubbed (its Python alone);
- with --compiled, the same forward+backward compiled (fullgraph) with either op, in the default mode and in
  mode="reduce-overhead": host time per call, a cProfile of each, and Inductor's generated code
  (``compiled-<op>-<provider>-<mode>.py``), so that the two providers' host paths can be read side by side.

    python benchmarks/host_profile.py [--shape 4096x4096] [--ops rms_norm layer_norm weighted_sum] [--compiled]

Writes host_profile.txt to $OUT (or --out).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import tritongrad  # noqa: E402
from tritongrad import _runtime as rt  # noqa: E402


def per_call_us(fn, calls: int = 200, rounds: int = 9) -> float:
    """Host time per call: bursts issued after a sync, the GPU never the bottleneck for small work."""
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


class _Floor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w)


def _stubbed(call) -> str:
    """Host time of a call whose ``rt.Kernel`` launches do nothing (the Python around the launches), and the
    number of launches it makes."""
    real, count = rt.Kernel._launch, [0]

    def stub(self, grid, *args, **kw):
        count[0] += 1

    rt.Kernel._launch = stub
    try:
        call()
        n, count[0] = count[0], 0
        return f"{per_call_us(call):8.1f}   ({n} launches a call)"
    finally:
        rt.Kernel._launch = real


def _cprofile(call, n: int, top: int) -> list[str]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return [ln for ln in s.getvalue().splitlines() if ln.strip()][3:]


def compiled_profiles(name: str, tg, pt, inputs, g, out: str) -> list[str]:
    """Host time and cProfile of the forward+backward compiled with either op, default and reduce-overhead."""
    from torch._inductor.utils import run_and_get_code

    lines = []
    for mode in ("default", "reduce-overhead"):
        ro = mode != "default"
        for label, f in (("tritongrad", tg), ("torch", pt)):
            torch._dynamo.reset()
            c = torch.compile(f, fullgraph=True, mode=None if not ro else mode)

            def call(c=c, ro=ro):
                if ro:
                    torch.compiler.cudagraph_mark_step_begin()
                return torch.autograd.grad(c(), inputs, g)

            _, codes = run_and_get_code(call)
            with open(os.path.join(out, f"compiled-{name}-{label}-{mode}.py"), "w") as fh:
                fh.write("\n\n# ---- next graph ----\n\n".join(codes))
            for _ in range(5):
                call()
            lines.append(f"  {name} compiled {mode:15s} {label:10s} fwd+bwd {per_call_us(call, calls=100, rounds=5):8.1f}")
            lines.append(f"\ncProfile of 100 compiled ({mode}) {label} {name} fwd+bwd calls (own time first):")
            lines += _cprofile(call, 100, 22)
    return lines


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="4096x4096")
    p.add_argument("--ops", nargs="+", default=["rms_norm", "layer_norm", "weighted_sum"])
    p.add_argument("--compiled", action="store_true", help="also profile the compiled forward+backward")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    N, D = map(int, a.shape.split("x"))
    tritongrad.set_small_input_threshold(0)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(N, D, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(D, device=dev, dtype=bf, requires_grad=True)
    b = torch.randn(D, device=dev, dtype=bf, requires_grad=True)
    gy = torch.randn(N, D, device=dev, dtype=bf)
    ops = {
        "rms_norm": (lambda: tritongrad.rms_norm(x, (D,), w, 1e-6), lambda: F.rms_norm(x, (D,), w, 1e-6), (x, w), gy),
        "layer_norm": (lambda: tritongrad.layer_norm(x, (D,), w, b), lambda: F.layer_norm(x, (D,), w, b),
                       (x, w, b), gy),
        "weighted_sum": (lambda: tritongrad.weighted_sum(x, w), lambda: (x * w).sum(-1), (x, w), gy[:, 0].contiguous()),
    }
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, shape {N}x{D} bf16; host us per call"]
    parts = {
        "autograd.Function floor (fwd+bwd, allocations, no launch)":
            lambda: torch.autograd.grad(_Floor.apply(x, w), (x, w), gy),
        "torch.empty [N, D]": lambda: torch.empty((N, D), device=dev, dtype=bf),
        "torch.autograd.grad of a mul (one C++ node)": lambda: torch.autograd.grad(x * 2, (x,), gy),
    }
    from tritongrad.ops.column_sum import launch as cs

    part = torch.randn(264, D, device=dev)
    outv = torch.empty(D, device=dev)
    cs.column_sum(part, outv)
    parts["one cached Triton launch (column_sum, with its launcher)"] = lambda: cs.column_sum(part, outv)
    for name, fn in parts.items():
        fn()
        lines.append(f"  {name:60s} {per_call_us(fn):8.1f}")
    for name in a.ops:
        tg, pt, inputs, g = ops[name]
        for label, f in (("tritongrad", tg), ("torch", pt)):
            call = (lambda f=f: torch.autograd.grad(f(), inputs, g))
            for _ in range(5):
                call()
            with torch.no_grad():
                fwd_only = per_call_us(f)
            lines.append(f"  {name} {label:10s} fwd+bwd {per_call_us(call):8.1f}   fwd under no_grad {fwd_only:8.1f}")
        lines.append(f"  {name} tritongrad fwd+bwd, launches stubbed {_stubbed(lambda: torch.autograd.grad(tg(), inputs, g))}")
        lines.append(f"\ncProfile of 300 tritongrad {name} fwd+bwd calls (own time first):")
        lines += _cprofile(lambda: torch.autograd.grad(tg(), inputs, g), 300, 18)
        if a.compiled:
            lines += compiled_profiles(name, tg, pt, inputs, g, a.out)
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "host_profile.txt"), "w") as fh:
        fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

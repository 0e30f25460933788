"""The host path of an op call, in eager mode and compiled: tritongrad's ops against PyTorch's own.

Per forward+backward (``torch.autograd.grad``), bf16, for weighted_sum, rms_norm and layer_norm:

- host issue time: wall time per call of a short burst issued right after a sync, without waiting for the GPU
  (the queue never fills), at the small shape (4096x4096 by default);
- pipelined per call: many calls back to back, one sync at the end, as a training loop runs, against the
  device time of one call (a CUDA graph of the call, replayed), at the large shape (32768x4096);
- per call under torch.compile (default mode, fullgraph): the same function compiled once with tritongrad's op
  and once with PyTorch's, pipelined, at both shapes, with the device time of each compiled call (a CUDA graph
  of it, as above); and with mode="reduce-overhead" (CUDA graphs, a ``cudagraph_mark_step_begin`` per call).

The device's host is noisy (10-20% between runs of one call): providers are interleaved round by round and
the figure is the median over rounds of each round's median. Writes ``host_path.json`` to $OUT (or --out).

    python benchmarks/host_path.py [--small 4096x4096] [--large 32768x4096] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import tritongrad  # noqa: E402

EPS = 1e-6


def ops(D: int):
    """name -> (tritongrad fn, PyTorch fn, number of 1-D params)."""
    return {
        "weighted_sum": (tritongrad.weighted_sum, lambda x, w: (x * w).sum(-1), 1),
        "rms_norm": (lambda x, w: tritongrad.rms_norm(x, (D,), w, EPS), lambda x, w: F.rms_norm(x, (D,), w, EPS), 1),
        "layer_norm": (lambda x, w, b: tritongrad.layer_norm(x, (D,), w, b, EPS),
                       lambda x, w, b: F.layer_norm(x, (D,), w, b, EPS), 2),
    }


def inputs(N: int, D: int, n_params: int):
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    params = [torch.randn(D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(n_params)]
    return (x, *params)


def step(fn, args, g):
    return torch.autograd.grad(fn(*args), args, g)


def issue_us(fn, args, g, calls: int = 20) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        step(fn, args, g)
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / calls * 1e6


def pipelined_us(fn, args, g, calls: int = 30, mark=False) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        step(fn, args, g)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def device_us(fn, args, g, n: int = 20) -> float:
    """One call's GPU time: a CUDA graph of n calls, replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step(fn, args, g)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s, capture_error_mode="thread_local"):
            for _ in range(n):
                step(fn, args, g)
    torch.cuda.current_stream().wait_stream(s)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(times)


def _or_none(f, *args):
    try:
        return f(*args)
    except Exception as e:  # noqa: BLE001 - a figure that cannot be taken is recorded as missing
        print(f"not measured: {type(e).__name__}: {str(e)[:200]}")
        return None


def interleaved(measures: dict, rounds: int) -> dict:
    """{name: callable -> us}: median over rounds of each, providers alternating within a round."""
    got = {k: [] for k in measures}
    for _ in range(rounds):
        for k, m in measures.items():
            got[k].append(m())
    return {k: statistics.median(v) for k, v in got.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--small", default="4096x4096")
    p.add_argument("--large", default="32768x4096")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--ops", nargs="+", default=["weighted_sum", "rms_norm", "layer_norm"])
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--compile-shapes", nargs="+", default=["small", "large"], choices=["small", "large"],
                   help="shapes at which the compiled figures are taken (each costs 4 compilations per op)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    a = p.parse_args()
    tritongrad.set_small_input_threshold(0)  # these shapes are above it anyway; the kernels are measured
    shapes = {"small": tuple(map(int, a.small.split("x"))), "large": tuple(map(int, a.large.split("x")))}
    rows, started = [], time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in a.ops:
        for size, (N, D) in shapes.items():
            tg, pt, n_params = ops(D)[name]
            args = inputs(N, D, n_params)
            g = torch.randn(N if name == "weighted_sum" else (N, D), device="cuda", dtype=torch.bfloat16)
            if name == "weighted_sum":
                g = g.reshape(N)
            for fn in (tg, pt):  # warm-up: kernels compiled, allocator warm
                for _ in range(3):
                    step(fn, args, g)
            row = {"op": name, "shape": f"{N}x{D}", "dtype": "bf16"}
            row["device_us"] = {"tritongrad": device_us(tg, args, g), "eager": device_us(pt, args, g)}
            row["issue_us"] = interleaved({"tritongrad": lambda: issue_us(tg, args, g),
                                           "eager": lambda: issue_us(pt, args, g)}, a.rounds)
            row["pipelined_us"] = interleaved({"tritongrad": lambda: pipelined_us(tg, args, g),
                                               "eager": lambda: pipelined_us(pt, args, g)}, a.rounds)
            if not a.no_compile and size in a.compile_shapes:
                for mode in ("default", "reduce-overhead"):
                    compiled = {}
                    for prov, fn in (("tritongrad", tg), ("torch", pt)):
                        torch._dynamo.reset()
                        c = torch.compile(fn, fullgraph=True, mode=None if mode == "default" else mode)
                        for _ in range(4):
                            if mode != "default":
                                torch.compiler.cudagraph_mark_step_begin()
                            step(c, args, g)
                        compiled[prov] = c
                    mark = mode != "default"
                    if not mark:  # whether the compiled call is host- or device-bound
                        row["compiled_device_us"] = {k: _or_none(device_us, c, args, g) for k, c in compiled.items()}
                    row[f"compiled_{mode}_us"] = interleaved(
                        {k: (lambda c=c: pipelined_us(c, args, g, mark=mark)) for k, c in compiled.items()},
                        max(3, a.rounds // 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'op':13s} {'shape':11s} {'issue tg/eager':>16s} {'pipelined tg/device':>20s} "
          f"{'compiled tg/torch':>18s} {'reduce-overhead tg/torch':>25s}")
    for r in rows:
        i, pl, dv = r["issue_us"], r["pipelined_us"], r["device_us"]
        c = r.get("compiled_default_us", {})
        ro = r.get("compiled_reduce-overhead_us", {})
        fmt = lambda d, a, b: f"{d.get(a, float('nan')):.0f}/{d.get(b, float('nan')):.0f}"  # noqa: E731
        print(f"{r['op']:13s} {r['shape']:11s} {fmt(i, 'tritongrad', 'eager'):>16s} "
              f"{pl['tritongrad']:.0f}/{dv['tritongrad']:.0f} ({pl['tritongrad'] / dv['tritongrad']:.2f}x) "
              f"{fmt(c, 'tritongrad', 'torch'):>18s} {fmt(ro, 'tritongrad', 'torch'):>25s}")
    os.makedirs(a.out, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "git_sha": os.environ.get("TRITONGRAD_GIT_SHA", "unknown"), "command": " ".join(sys.argv),
            "elapsed_s": round(time.time() - started, 1)}
    with open(os.path.join(a.out, "host_path.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Device time of every built-in op, forward+backward, in two source trees, measured in the same run.

    python benchmarks/ab_device.py --tree new=src --tree old=/path/to/old/src --rounds 3 --out ab.json

Each round measures every tree once, in a child process whose ``PYTHONPATH`` is that tree, so the trees never
share an import; the rounds alternate the order. Device time: CUDA-graph replays with an L2 flush before each
call, minus the flushes (:func:`device_ms`), the same code for both trees. Only the public API is used, so
any two commits that have it compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def cases():
    import torch
    import tritongrad as tg

    bf16, dev = torch.bfloat16, "cuda"

    def rand(*shape, grad=True, scale=1.0):
        return (scale * torch.randn(*shape, device=dev)).to(bf16).requires_grad_(grad)

    def rows(N, D):
        return rand(N, D), rand(D)

    def ws(N, D):
        x, w = rows(N, D)
        return lambda: tg.weighted_sum(x, w), (x, w)

    def rms(N, D):
        x, w = rows(N, D)
        return lambda: tg.rms_norm(x, (D,), w, 1e-6), (x, w)

    def ln(N, D):
        x, w = rows(N, D)
        b = rand(D)
        return lambda: tg.layer_norm(x, (D,), w, b, 1e-5), (x, w, b)

    def ce(N, V):
        x = rand(N, V, scale=2.0)
        t = torch.randint(0, V, (N,), device=dev)
        return lambda: tg.cross_entropy(x, t), (x,)

    def lce(N, H, V):
        x, w = rand(N, H), rand(V, H, scale=H ** -0.5)
        t = torch.randint(0, V, (N,), device=dev)
        return lambda: tg.linear_cross_entropy(x, w, t), (x, w)

    def glu(N, D):
        g, u = rand(N, D), rand(N, D)
        return lambda: tg.swiglu(g, u), (g, u)

    def rope(B, H, Hk, T, Dh):
        q, k = rand(B, T, H, Dh).transpose(1, 2), rand(B, T, Hk, Dh).transpose(1, 2)  # the projections' layout
        ang = torch.randn(B, T, Dh // 2, device=dev)
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(bf16), torch.cat([ang.sin()] * 2, -1).to(bf16)
        return lambda: tg.apply_rotary_pos_emb(q, k, cos, sin), (q, k)

    return {
        "weighted_sum 32768x4096": lambda: ws(32768, 4096),
        "weighted_sum 16x1048576": lambda: ws(16, 1048576),
        "rms_norm 32768x4096": lambda: rms(32768, 4096),
        "rms_norm 4096x4096": lambda: rms(4096, 4096),
        "layer_norm 32768x4096": lambda: ln(32768, 4096),
        "layer_norm 4096x4096": lambda: ln(4096, 4096),
        "cross_entropy 16384x32000": lambda: ce(16384, 32000),
        "cross_entropy 8192x128256": lambda: ce(8192, 128256),
        "linear_cross_entropy 4096x2048->128256": lambda: lce(4096, 2048, 128256),
        "swiglu 16384x14336": lambda: glu(16384, 14336),
        "rotary 4x32/8x4096x128": lambda: rope(4, 32, 8, 4096, 128),
    }


def device_ms(step, stream, n: int = 20, replays: int = 15) -> float:
    """Median over replays of (a CUDA graph of n x (flush L2, step)) minus (a graph of n flushes), over n: the
    method of ``tritongrad bench``, written out here so that both trees are timed by the same code."""
    import torch
    import triton

    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()

    def capture(body):
        body()
        graph = torch.cuda.CUDAGraph()
        # a backward runs on autograd's device thread, which a global capture mode would forbid
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for _ in range(n):
                body()
        return graph

    def replay(graph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        graph.replay()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end)

    def flush_and_step():
        cache.zero_()
        step()

    flushes, runs = capture(cache.zero_), capture(flush_and_step)
    replay(runs), replay(flushes)
    times = sorted((replay(runs) - replay(flushes)) / n for _ in range(replays))
    return times[len(times) // 2]


def measure(names) -> dict:
    import torch

    torch.manual_seed(0)
    out = {}
    stream = torch.cuda.Stream()
    # inputs, warm-up and capture on one side stream: the leaves then live on the capturing stream, and no
    # backward makes the legacy stream wait on it
    with torch.cuda.stream(stream):
        for name, make in cases().items():
            if names and name not in names:
                continue
            f, inputs = make()
            outs = f()
            outs = outs if isinstance(outs, tuple) else (outs,)
            grads = [torch.randn_like(o) for o in outs]  # never zeros; the same in every tree (seeded)

            def step():
                for x in inputs:
                    x.grad = None
                o = f()
                torch.autograd.backward(o if isinstance(o, tuple) else (o,), grads)

            step()
            torch.cuda.synchronize()
            out[name] = device_ms(step, stream, n=5 if "linear" in name else 20)
            for x in inputs:
                x.grad = None  # they point into the graph's pool
            del f, inputs, outs, grads
            torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], help="label=path to a src directory")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--out")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.only)))
        return
    trees = dict(t.split("=", 1) for t in a.tree)
    runs = {label: [] for label in trees}
    for r in range(a.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for label in order:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(trees[label]))
            p = subprocess.run([sys.executable, __file__, "--measure", "--only", *a.only], env=env,
                               capture_output=True, text=True)
            if p.returncode:
                sys.exit(f"{label}: {p.stderr[-3000:]}")
            runs[label].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(label, r, runs[label][-1], flush=True)
    labels = list(trees)
    table = {}
    for name in runs[labels[0]][0]:
        med = {lb: sorted(x[name] for x in runs[lb])[len(runs[lb]) // 2] for lb in labels}
        table[name] = {**{f"{lb}_ms": med[lb] for lb in labels}, "ratio": med[labels[0]] / med[labels[-1]]}
        print(f"{name:42s} " + " ".join(f"{lb} {med[lb]:.4f}" for lb in labels)
              + f"  {labels[0]}/{labels[-1]} {table[name]['ratio']:.4f}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"trees": trees, "rounds": runs, "median": table,
                       "command": " ".join(sys.argv)}, fh, indent=1)


if __name__ == "__main__":
    main()

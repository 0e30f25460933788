"""Forward+backward device time with and without an L2 flush between the forward and the backward.

`tritongrad bench` times ``f(x).backward(g)`` back to back, after one L2 flush: whatever of x the forward
leaves in L2 (50 MB on an H200) the backward may read again from there. In a model other layers run
between a layer's forward and its backward, so that reuse does not happen. This script measures how much
of each provider's forward+backward time it accounts for:

    PYTHONPATH=src python3 benchmarks/l2_between.py [--op weighted_sum] [--shapes 131072x1024] [--dtypes fp32]

Device time: a CUDA graph of 20 iterations of (flush, forward+backward), or (flush, forward, flush,
backward), minus a graph of the flushes alone, over 20; the median of 5 replays.
"""

import argparse

import torch
import torch.nn.functional as F
import triton

import tritongrad

# op: (tritongrad's function, PyTorch's, number of per-feature parameters), called as fn(x, *params)
OPS = {
    "weighted_sum": (lambda x, w: tritongrad.weighted_sum(x, w), lambda x, w: (x * w).sum(-1), 1),
    "rms_norm": (
        lambda x, w: tritongrad.rms_norm(x, x.shape[-1:], w),
        lambda x, w: F.rms_norm(x, x.shape[-1:], w),
        1,
    ),
    "layer_norm": (
        lambda x, w, b: tritongrad.layer_norm(x, x.shape[-1:], w, b),
        lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
        2,
    ),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ITERS, REPLAYS = 20, 5


def graph_us(bodies) -> float:
    """Median over replays of one iteration of ``bodies`` (called in order), captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for body in bodies:  # warm-up on the capturing stream
            body()
        graph = torch.cuda.CUDAGraph()
        # "thread_local": the backward runs on autograd's device thread.
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for _ in range(ITERS):
                for body in bodies:
                    body()
        graph.replay()
        times = []
        for _ in range(REPLAYS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / ITERS)
    torch.cuda.current_stream().wait_stream(stream)
    return sorted(times)[REPLAYS // 2]


def measure(fn, x, params, g, flush, one_flush: float, two_flushes: float) -> tuple[float, float]:
    """(forward+backward, the same with an L2 flush between forward and backward), us."""
    kept = {}

    def clear():
        for t in (x, *params):
            t.grad = None

    def fwd():
        clear()
        kept["y"] = fn(x, *params)

    def bwd():
        kept.pop("y").backward(g)

    def fwdbwd():
        clear()
        fn(x, *params).backward(g)

    together = graph_us([flush, fwdbwd]) - one_flush
    apart = graph_us([flush, fwd, flush, bwd]) - two_flushes
    clear()
    return together, apart


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", default="weighted_sum", choices=sorted(OPS))
    p.add_argument("--shapes", default="131072x1024,32768x4096")
    p.add_argument("--dtypes", default="fp32,bf16")
    a = p.parse_args()
    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()

    def flush():
        cache.zero_()

    one_flush, two_flushes = graph_us([flush]), graph_us([flush, flush])
    ours, torch_fn, n_params = OPS[a.op]
    print(f"{a.op}, us: forward+backward | with an L2 flush between forward and backward")
    for dtype_name in a.dtypes.split(","):
        for shape in a.shapes.split(","):
            N, D = map(int, shape.split("x"))
            torch._dynamo.reset()  # a fresh static compile for each shape, as the bench does
            dtype = DTYPES[dtype_name]
            x = torch.randn(N, D, device="cuda", dtype=dtype, requires_grad=True)
            params = [torch.randn(D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(n_params)]
            with torch.no_grad():
                g = torch.randn_like(torch_fn(x, *params))
            cells = []
            for name, fn in (("tritongrad", ours), ("torch.compile", torch.compile(torch_fn))):
                together, apart = measure(fn, x, params, g, flush, one_flush, two_flushes)
                cells.append(f"{name} {together:.1f} | {apart:.1f}")
            print(f"{dtype_name} {shape}: " + "; ".join(cells), flush=True)
            x = params = g = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

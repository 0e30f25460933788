"""Forward+backward device time of tritongrad.swiglu and tritongrad.apply_rotary_pos_emb at Llama-3-8B shapes,
against eager PyTorch, torch.compile and Liger-Kernel (when installed), each timed as a CUDA graph replay.

    python benchmarks/llm_ops_bench.py [--sweep] [--reps 30]

Prints a table (median device time of a replay, bandwidth over each op's minimal bytes, share of this GPU's
measured copy bandwidth) and writes it as JSON to $OUT/llm_ops_bench.json (or ./llm_ops_bench.json).
``--sweep`` also times tritongrad's plan knobs (tile bytes and warps) at the same shapes. Byte floors:
src/tritongrad/ops/swiglu/launch.py and ops/rope/launch.py; design and predictions: docs/swiglu-rope.md.

Shapes: 16384 tokens (4 x 4096); swiglu over intermediate 14336 as LlamaMLP feeds it (separate gate and up
projections) and as the two halves of one fused [N, 2 x 14336] projection; rope with 32 query and 8 key/value
heads of 128, q and k as transposed views of [B, T, H, 128] projections, tables [1, T, 128] (shared position
ids) and [B, T, 128].
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import tritongrad  # noqa: E402
from tritongrad.ops.rope import plans as rope_plans  # noqa: E402
from tritongrad.ops.swiglu import plans as swiglu_plans  # noqa: E402

N_TOKENS, B, T = 16384, 4, 4096
INTER = 14336
HQ, HK, DH = 32, 8, 128
DTYPE = torch.bfloat16


# ---------------------------------------------------------------- timing
def graph_ms(fn, reps: int) -> float:
    """Median device time of one CUDA-graph replay of ``fn`` (warmed up first, outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    del g
    return statistics.median(times)


def copy_bandwidth(reps: int) -> float:
    """GB/s of a device-to-device copy of 2 GiB, counting bytes read and written."""
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = graph_ms(lambda: y.copy_(x), reps)
    return 2 * x.numel() * x.element_size() / ms / 1e6


# ---------------------------------------------------------------- swiglu
def swiglu_inputs(fused: bool):
    """``(halves, leaves, dout)``: ``halves(*leaves)`` gives gate and up. The halves of a fused projection are
    sliced inside the timed function: a slice made outside would put its backward on the stream it was made
    on, which a CUDA-graph capture refuses to wait for."""
    if fused:
        x = torch.randn(N_TOKENS, 2 * INTER, device="cuda", dtype=DTYPE, requires_grad=True)
        halves, leaves = (lambda x: (x[:, :INTER], x[:, INTER:])), (x,)
    else:
        g = torch.randn(N_TOKENS, INTER, device="cuda", dtype=DTYPE, requires_grad=True)
        u = torch.randn(N_TOKENS, INTER, device="cuda", dtype=DTYPE, requires_grad=True)
        halves, leaves = (lambda g, u: (g, u)), (g, u)
    dout = torch.randn(N_TOKENS, INTER, device="cuda", dtype=DTYPE)
    return halves, leaves, dout


def eager_swiglu(g, u):
    return F.silu(g) * u


def swiglu_providers():
    out = {"tritongrad": tritongrad.swiglu, "eager": eager_swiglu,
           "torch.compile": torch.compile(eager_swiglu, fullgraph=True, dynamic=False)}
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        out["liger"] = lambda g, u: LigerSiLUMulFunction.apply(g, u)
    except ImportError:
        pass
    return out


def swiglu_bytes(with_bwd: bool) -> int:
    e = N_TOKENS * INTER * 2
    return e * (3 + (5 if with_bwd else 0))  # fwd: g, u, out; bwd: g, u, dout, dg, du


def bench_swiglu(reps: int, rows: list, providers=None, label="", cases=(False, True)) -> None:
    providers = providers or swiglu_providers()
    for fused in cases:
        halves, leaves, dout = swiglu_inputs(fused)
        for name, f in providers.items():
            if fused and name == "liger":  # Liger copies non-contiguous halves first: not a like-for-like case
                continue
            fwd = lambda: f(*halves(*[t.detach() for t in leaves]))  # noqa: E731
            both = lambda: torch.autograd.grad(f(*halves(*leaves)), leaves, dout)  # noqa: E731
            for what, fn, nbytes in (("fwd", fwd, swiglu_bytes(False)), ("fwd+bwd", both, swiglu_bytes(True))):
                ms = graph_ms(fn, reps)
                rows.append(dict(op="swiglu", case=("fused halves" if fused else "gate, up") + label, provider=name,
                                 what=what, ms=ms, gbps=nbytes / ms / 1e6, bytes=nbytes))
                print_row(rows[-1])
        del halves, leaves, dout


# ---------------------------------------------------------------- rope
def hf_rope(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def rope_inputs(Bc: int):
    q = torch.randn(B, T, HQ, DH, device="cuda", dtype=DTYPE).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, HK, DH, device="cuda", dtype=DTYPE).transpose(1, 2).requires_grad_()
    inv = 1.0 / (500000 ** (torch.arange(0, DH, 2, device="cuda", dtype=torch.float32) / DH))
    pos = torch.arange(T, device="cuda", dtype=torch.float32).expand(Bc, T)
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(DTYPE), emb.sin().to(DTYPE)
    dq = torch.randn(B, T, HQ, DH, device="cuda", dtype=DTYPE).transpose(1, 2)
    dk = torch.randn(B, T, HK, DH, device="cuda", dtype=DTYPE).transpose(1, 2)
    return q, k, cos, sin, dq, dk


def rope_providers():
    out = {"tritongrad": tritongrad.apply_rotary_pos_emb, "eager": hf_rope,
           "torch.compile": torch.compile(hf_rope, fullgraph=True, dynamic=False)}
    try:
        from liger_kernel.ops.rope import LigerRopeFunction

        out["liger"] = lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin)
    except ImportError:
        pass
    return out


def rope_bytes(Bc: int, with_bwd: bool) -> int:
    qk = N_TOKENS * (HQ + HK) * DH * 2
    tables = 2 * Bc * T * DH * 2
    return (2 * qk + tables) * (2 if with_bwd else 1)  # read + write q and k, read cos and sin; the same back


def bench_rope(reps: int, rows: list, providers=None, label="") -> None:
    providers = providers or rope_providers()
    for Bc in (1, B):
        q, k, cos, sin, dq, dk = rope_inputs(Bc)
        for name, f in providers.items():
            fwd = lambda: f(q.detach(), k.detach(), cos, sin)  # noqa: E731
            both = lambda: torch.autograd.grad(f(q, k, cos, sin), (q, k), (dq, dk))  # noqa: E731
            for what, fn, nbytes in (("fwd", fwd, rope_bytes(Bc, False)), ("fwd+bwd", both, rope_bytes(Bc, True))):
                ms = graph_ms(fn, reps)
                rows.append(dict(op="rope", case=f"cos [{Bc}, T, Dh]{label}", provider=name, what=what, ms=ms,
                                 gbps=nbytes / ms / 1e6, bytes=nbytes))
                print_row(rows[-1])
        del q, k, cos, sin, dq, dk


# ---------------------------------------------------------------- plan sweep
def sweep(reps: int, rows: list) -> None:
    # Each variant is a table passed to the launchers for the extent of its runs; the tuned tables stay as they are.
    for tile in (2048, 4096, 8192):
        for warps in (4, 8):
            with swiglu_plans.using(dataclasses.replace(swiglu_plans.TABLE, TILE_BYTES=tile, NUM_WARPS=warps)):
                bench_swiglu(reps, rows, {"tritongrad": tritongrad.swiglu}, f" [tile {tile} B, {warps} warps]",
                             cases=(False,))
    for tile in (4096, 8192, 16384):
        for warps in (2, 4, 8):
            for max_h in (8, 16, 32):
                table = dataclasses.replace(rope_plans.TABLE, TILE_BYTES=tile, NUM_WARPS=warps, MAX_BLOCK_H=max_h)
                with rope_plans.using(table):
                    bench_rope(reps, rows, {"tritongrad": tritongrad.apply_rotary_pos_emb},
                               f" [{tile} B, {warps} w, heads <= {max_h}]")


COPY = [0.0]


def print_row(r) -> None:
    share = f"{100 * r['gbps'] / COPY[0]:5.1f}%" if COPY[0] else ""
    print(f"{r['op']:7s} {r['case']:44s} {r['provider']:14s} {r['what']:8s} {r['ms'] * 1000:9.1f} us "
          f"{r['gbps']:7.0f} GB/s {share}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--only", choices=("swiglu", "rope"), default=None)
    p.add_argument("--copy-gbps", type=float, default=4250.0,
                   help="the copy bandwidth that percentages refer to (an H200's, measured elsewhere)")
    args = p.parse_args()
    torch.manual_seed(0)
    tritongrad.set_small_input_threshold(0)
    copy_bandwidth(args.reps)  # warm-up: clocks rise from idle
    measured = copy_bandwidth(args.reps)
    COPY[0] = args.copy_gbps
    print(f"{torch.cuda.get_device_name()}: tensor.copy_ here {measured:.0f} GB/s (read + write); percentages of "
          f"{COPY[0]:.0f} GB/s; torch {torch.__version__}", flush=True)
    rows: list = []
    if args.only in (None, "swiglu"):
        bench_swiglu(args.reps, rows)
    if args.only in (None, "rope"):
        bench_rope(args.reps, rows)
    if args.sweep:
        sweep(args.reps, rows)
    print(f"copy again at the end: {copy_bandwidth(args.reps):.0f} GB/s", flush=True)
    for r in rows:
        r["copy_share"] = r["gbps"] / COPY[0]
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "llm_ops_bench.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_gbps=COPY[0], copy_measured_gbps=measured,
                       torch=torch.__version__,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

"""weighted_sum's forward plans on few, long rows: device time (CUDA-graph replay, median) of the forward and
of forward+backward at 16x1048576 bf16 for tables that vary the forward's tile and its programs per SM, and
the same tables at 4096x4096 and 32768x4096 (a tile change plans every shape). % of copy against the floor
(forward: read x and w; forward+backward: read x twice, w, write grad_x; docs/weighted-sum.md).

    python benchmarks/ws_sweep.py          (writes ws_sweep.json to $OUT or ./bench-out)
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import triton

import tritongrad
from tritongrad.ops.weighted_sum import plans as P

OUT = os.environ.get("OUT") or os.path.join(os.getcwd(), "bench-out")
TILES = [None, P.FwdTile(8192, 4, 1), P.FwdTile(8192, 4, 2), P.FwdTile(16384, 8, 2), P.FwdTile(32768, 8, 1),
         P.FwdTile(16384, 4, 1)]
PROGS = [2, 4, 8, 16, 32]


def copy_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() * 2 / ms / 1e6


def main():
    tritongrad.set_small_input_threshold(0)
    bw = copy_gbps()
    rows = []
    shapes = [(16, 1 << 20), (4096, 4096), (32768, 4096)]
    for N, D in shapes:
        g = torch.Generator(device="cuda").manual_seed(N)
        x = torch.randn(N, D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
        w = torch.randn(D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
        fwd_gb, all_gb = (N * D * 2 + D * 2) / 1e9, (3 * N * D * 2 + 2 * D * 2) / 1e9
        variants = [(t, p) for t in TILES for p in PROGS] if N == 16 else [(t, 8) for t in TILES]
        for tile, progs in variants:
            table = dataclasses.replace(P.TABLE, FWD_PROGS_PER_SM=progs,
                                        FWD_TILES={**P.TABLE.FWD_TILES, **({2: tile} if tile else {})})
            with P.using(table):
                def fwd():
                    with torch.no_grad():
                        tritongrad.weighted_sum(x, w)

                def both():
                    tritongrad.weighted_sum(x, w).backward(dy)

                fwd(), both()
                f_ms = triton.testing.do_bench_cudagraph(fwd, return_mode="median")
                b_ms = triton.testing.do_bench_cudagraph(both, grad_to_none=[x, w], return_mode="median")
            r = dict(N=N, D=D, tile=dataclasses.asdict(tile) if tile else "default", progs_per_sm=progs,
                     fwd_us=f_ms * 1e3, fwdbwd_us=b_ms * 1e3, fwd_pct=100 * fwd_gb / f_ms / bw * 1e3,
                     fwdbwd_pct=100 * all_gb / b_ms / bw * 1e3)
            rows.append(r)
            print(f"{N}x{D} tile {tile or 'default'} progs/SM {progs}: fwd {r['fwd_us']:.1f} us ({r['fwd_pct']:.0f}%),"
                  f" fwd+bwd {r['fwdbwd_us']:.1f} us ({r['fwdbwd_pct']:.0f}%)", flush=True)
        del x, w
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "ws_sweep.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       copy_gbps=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

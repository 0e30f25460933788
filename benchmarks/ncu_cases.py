"""One op's forward+backward on a GPU, three times, the third inside the NVTX range "prof", for Nsight Compute:

    ncu --clock-control none --cache-control all --nvtx --nvtx-include "prof/" \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python benchmarks/ncu_cases.py CASE

CASE: ce32k (cross_entropy 16384x32000), ce128k (8192x128256), rms4k (rms_norm 4096x4096), rms32k and ln32k
(rms_norm, layer_norm 32768x4096), ws16 (weighted_sum 16x1048576); bf16. The range covers the launching thread:
kernels the autograd engine launches from its own thread (the norms' and weighted_sum's backward) fall outside
it, so those take a kernel-name filter instead of the range (each of the three steps' launches is profiled):

    ncu --clock-control none --cache-control all --kernel-name regex:"_bwd|column_sum" --section ... \
        python benchmarks/ncu_cases.py rms32k

cross_entropy's gradient is written by its forward kernel.
"""

import sys

import torch

import tritongrad as tg

CASES = ("ce32k", "ce128k", "rms4k", "rms32k", "ln32k", "ws16")


def main(case: str) -> None:
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    if case in ("ce32k", "ce128k"):
        N, V = {"ce32k": (16384, 32000), "ce128k": (8192, 128256)}[case]
        x = torch.randn(N, V, device=dev, dtype=bf16, requires_grad=True)
        t = torch.randint(0, V, (N,), device=dev)

        def step():
            tg.cross_entropy(x, t).backward()
    elif case == "rms4k":
        x = torch.randn(4096, 4096, device=dev, dtype=bf16, requires_grad=True)
        w = torch.randn(4096, device=dev, dtype=bf16, requires_grad=True)
        g = torch.randn_like(x)

        def step():
            tg.rms_norm(x, (4096,), w).backward(g)
    elif case in ("rms32k", "ln32k"):
        x = torch.randn(32768, 4096, device=dev, dtype=bf16, requires_grad=True)
        w = torch.randn(4096, device=dev, dtype=bf16, requires_grad=True)
        b = torch.randn(4096, device=dev, dtype=bf16, requires_grad=True)
        g = torch.randn_like(x)

        def step():
            if case == "rms32k":
                tg.rms_norm(x, (4096,), w).backward(g)
            else:
                tg.layer_norm(x, (4096,), w, b).backward(g)
    elif case == "ws16":
        x = torch.randn(16, 1 << 20, device=dev, dtype=bf16, requires_grad=True)
        w = torch.randn(1 << 20, device=dev, dtype=bf16, requires_grad=True)
        g = torch.randn(16, device=dev, dtype=bf16)

        def step():
            tg.weighted_sum(x, w).backward(g)
    else:
        raise SystemExit(f"unknown case {case!r}: one of {', '.join(CASES)}")
    for i in range(3):
        x.grad = None
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("prof")
        step()
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1])

"""grouped_experts' backward, its two Triton kernels against the PyTorch ops they replace, in one process.

    python benchmarks/experts_backward_ab.py

The path is switched through ``experts._one_pass`` (eager on Triton's path: the kernels; else the PyTorch
ops), the inputs the bench's (``tritongrad bench grouped_experts``: top-2 of 8, I = 2D/3, bf16). Prints each
path's forward+backward time (``triton.testing.do_bench``, pipelined per call), the forward's alone, and how
far apart the gradients are (all equal bit for bit but the routing weights', a float32 row sum in another
order).
"""

import torch
import triton

from tritongrad.bench.ops import _experts_inputs
from tritongrad.ops.swiglu import experts as X


def main():
    one_pass = X._one_pass
    for N, D in ((8192, 1536), (16384, 2048)):
        torch.manual_seed(0)
        x, idx, w, gu, dn = _experts_inputs(N, D, torch.bfloat16, "cuda")
        g = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        res = {}
        for name, on in (("kernels", True), ("torch_ops", False)):
            X._one_pass = lambda device, on=on: on and one_pass(device)

            def step():
                for t in (x, w, gu, dn):
                    t.grad = None
                X.grouped_experts(x, idx, w, gu, dn).backward(g)

            step()
            grads = [t.grad.float().clone() for t in (x, w, gu, dn)]
            ms = triton.testing.do_bench(step, warmup=50, rep=300)
            fwd = triton.testing.do_bench(
                lambda: X.grouped_experts(x.detach(), idx, w.detach(), gu.detach(), dn.detach()), warmup=25, rep=200)
            res[name] = (ms, grads)
            print(f"N={N} D={D} {name}: fwd+bwd {ms:.3f} ms (fwd alone {fwd:.3f} ms)", flush=True)
        for n, a, b in zip(("x", "w", "gate_up", "down"), res["kernels"][1], res["torch_ops"][1]):
            rel = ((a - b).abs().max() / b.abs().max()).item()
            print(f"  grad {n}: max|a-b|/max|b| = {rel:.3e}, equal={torch.equal(a, b)}")
        print(f"  ratio torch_ops/kernels = {res['torch_ops'][0] / res['kernels'][0]:.3f}")
    X._one_pass = one_pass


if __name__ == "__main__":
    main()

"""Float32 accuracy of the ops' GPU kernels against eager PyTorch's, both measured against float64, at input
scales 1, 8 and 32 (inputs above the small-input path's 2**22 elements, so the kernels run).

    python benchmarks/fp32_ulps.py

One line per op and scale; per tensor (#0 the first output, then the other outputs, then the gradients of
the inputs, upstream gradients random): ``max`` the largest error in float32 eps at the reference's largest
magnitude (testing.eps_err), ``q75`` the 0.75 quantile of each element's error in eps of its own magnitude
(testing.typical_eps_err), each as ours/eager's.
"""
import torch

import tritongrad
from tritongrad.ops.norm.reference import llama_rms_norm_reference as llama_norm
from tritongrad.ops.norm.residual import fused_add_rms_norm_reference
from tritongrad.ops.rope.reference import apply_rotary_pos_emb_reference as rope_ref
from tritongrad.ops.swiglu.reference import swiglu_reference
from tritongrad.testing import eps_err, typical_eps_err

torch.manual_seed(0)
dev = "cuda"
N, D = 8192, 1024


CASES = {
    "llama_rms_norm": (lambda s: [torch.randn(N, D) * s, 1 + 0.3 * torch.randn(D)],
                       lambda x, w: tritongrad.llama_rms_norm(x, w, 1e-6), llama_norm),
    "fused_add_rms_norm": (lambda s: [torch.randn(N, D) * s, torch.randn(N, D) * s, 1 + 0.3 * torch.randn(D)],
                           lambda x, r, w: tritongrad.fused_add_rms_norm(x, r, w, 1e-6)[:2],
                           lambda x, r, w: fused_add_rms_norm_reference(x, r, w, 1e-6)[:2]),
    "swiglu": (lambda s: [torch.randn(N, 4 * D) * s, torch.randn(N, 4 * D) * s],
               lambda g, u: tritongrad.swiglu(g, u), swiglu_reference),
    "rope": (lambda s: [torch.randn(4, 16, 2048, 128) * s, torch.randn(4, 16, 2048, 128) * s,
                        torch.cos(torch.randn(4, 2048, 128) * 3), torch.sin(torch.randn(4, 2048, 128) * 3)],
             lambda q, k, c, s_: tritongrad.apply_rotary_pos_emb(q, k, c, s_), rope_ref),
}

for name, (make, ours, ref) in CASES.items():
    for scale in (1.0, 8.0, 32.0):
        base = [t.to(dev) for t in make(scale)]
        outs = {}
        for who, fn, dt in (("ours", ours, torch.float32), ("torch", ref, torch.float32), ("f64", ref, torch.float64)):
            ins = [t.to(dt).requires_grad_(name != "rope" or i < 2) for i, t in enumerate(base)]
            out = fn(*ins)
            out = out if isinstance(out, tuple) else (out,)
            g = torch.Generator(device=dev).manual_seed(1)
            ups = [torch.randn(o.shape, device=dev, generator=g).to(dt) for o in out]
            grads = torch.autograd.grad(out, [t for t in ins if t.requires_grad], ups)
            outs[who] = [o.detach() for o in out] + list(grads)
        row = []
        for i, (a, b, r) in enumerate(zip(outs["ours"], outs["torch"], outs["f64"])):
            row.append(f"#{i} max {eps_err(a, r):6.2f}/{eps_err(b, r):6.2f} q75 {typical_eps_err(a, r):.2f}/{typical_eps_err(b, r):.2f}")
        print(f"{name:20s} x{scale:<4g} ours/torch (eps at max|ref|): " + " | ".join(row), flush=True)

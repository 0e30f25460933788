"""Host time of one eager forward+backward call of the LLM ops, on the GPU machine's host: tritongrad's
apply_rotary_pos_emb, llama_rms_norm (above the small-input threshold), swiglu and linear_cross_entropy (16
chunks of 128 rows, and one) against Liger-Kernel's (when installed) and Hugging Face's eager code, at tiny
shapes where the GPU is never the bottleneck.

    python benchmarks/host_calls.py [--calls 300] [--rounds 15] [--cases lce_16_chunks,...] [--providers ...]

Each figure is the median over rounds of a burst of calls issued after a synchronize, divided by the calls:
pipelined host time per call (microseconds). Prints a table and writes host_calls.json to $OUT (or --out).
Figures compare only within one run: hosts of the pool differ by up to 1.6x. docs/host-path.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

# TRITONGRAD_SRC: another checkout's src/ (an A/B of two commits on one host).
sys.path.insert(0, os.environ.get("TRITONGRAD_SRC") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import tritongrad  # noqa: E402
from host_profile import per_call_us  # noqa: E402 (after tritongrad: its own src/ is then not imported)
from tritongrad.ops.cross_entropy import plans as ce_plans  # noqa: E402


def cases(dev="cuda", dtype=torch.bfloat16):
    """name -> {provider: forward+backward closure}: Llama's layouts, 1 x 64 tokens."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope
    B, T, HQ, HK, D, H, I = 1, 64, 12, 4, 128, 1536, 4096
    qp = torch.randn(B, T, HQ * D, device=dev, dtype=dtype, requires_grad=True)
    kp = torch.randn(B, T, HK * D, device=dev, dtype=dtype, requires_grad=True)
    q, k = qp.view(B, T, HQ, D).transpose(1, 2), kp.view(B, T, HK, D).transpose(1, 2)
    cos, sin = torch.randn(1, T, D, device=dev, dtype=dtype), torch.randn(1, T, D, device=dev, dtype=dtype)
    gq, gk = torch.randn(B, HQ, T, D, device=dev, dtype=dtype), torch.randn(B, HK, T, D, device=dev, dtype=dtype)
    # rms_norm above the small-input threshold (2**22 elements) takes the kernels: a [N, 64] view of more rows.
    x = torch.randn(2 ** 16 + 64, 64, device=dev, dtype=dtype, requires_grad=True)
    w = torch.ones(64, device=dev, dtype=dtype, requires_grad=True)
    gx = torch.randn_like(x)
    g, u = (torch.randn(B * T, I, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    go = torch.randn(B * T, I, device=dev, dtype=dtype)

    def bw(outs, grads):
        torch.autograd.backward(outs, grads)

    def hf_norm(x, w, eps=1e-6):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    # The linear loss over 16 chunks of 128 rows, Liger's chunks too (next_pow2(N / ceil(V / H)) rows), and over
    # one: the difference is the host's cost of a chunk.
    hl = torch.randn(2048, 64, device=dev, dtype=dtype, requires_grad=True)
    wl = (torch.randn(1024, 64, device=dev, dtype=dtype) / 8).requires_grad_()
    tl_ = torch.randint(0, 1024, (2048,), device=dev)
    small = dataclasses.replace(ce_plans.TABLE, LCE_EFFICIENT_ROWS=128, LCE_MIN_ROWS=128)
    assert ce_plans.lce_chunk_rows(2048, 1024, 64, 2, small) == 128

    def tg_lce(n):
        with ce_plans.using(small):
            torch.autograd.backward(tritongrad.linear_cross_entropy(hl[:n], wl, tl_[:n]))

    def hf_lce(n):
        torch.autograd.backward(torch.nn.functional.cross_entropy((hl[:n] @ wl.t()).float(), tl_[:n]))

    out = {
        "lce_16_chunks": {"tritongrad": lambda: tg_lce(2048), "hf": lambda: hf_lce(2048)},
        "lce_1_chunk": {"tritongrad": lambda: tg_lce(128), "hf": lambda: hf_lce(128)},
        "rope": {"tritongrad": lambda: bw(tritongrad.apply_rotary_pos_emb(q, k, cos, sin), (gq, gk)),
                 "hf": lambda: bw(hf_rope(q, k, cos, sin), (gq, gk))},
        "llama_rms_norm": {"tritongrad": lambda: bw(tritongrad.llama_rms_norm(x, w, 1e-6), gx),
                           "hf": lambda: bw(hf_norm(x, w), gx)},
        "swiglu": {"tritongrad": lambda: bw(tritongrad.swiglu(g, u), go),
                   "hf": lambda: bw(torch.nn.functional.silu(g) * u, go)},
    }
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError as e:
        print(f"Liger-Kernel not importable ({e}): its rows are left out")
    else:
        out["rope"]["liger"] = lambda: bw(LigerRopeFunction.apply(q, k, cos, sin), (gq, gk))
        out["llama_rms_norm"]["liger"] = lambda: bw(LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False), gx)
        out["swiglu"]["liger"] = lambda: bw(LigerSiLUMulFunction.apply(g, u), go)
        for name, n in (("lce_16_chunks", 2048), ("lce_1_chunk", 128)):
            out[name]["liger"] = (lambda n=n: torch.autograd.backward(
                LigerFusedLinearCrossEntropyFunction.apply(hl[:n], wl, tl_[:n])[0]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--providers", default=None, help="comma-separated providers (default: all)")
    a = p.parse_args()
    rows = {}
    for name, providers in cases().items():
        if a.cases and name not in a.cases.split(","):
            continue
        if a.providers:
            providers = {k: v for k, v in providers.items() if k in a.providers.split(",")}
        for fn in providers.values():
            for _ in range(20):
                fn()
        rows[name] = {prov: per_call_us(fn, a.calls, a.rounds) for prov, fn in providers.items()}
        print(f"{name:16s} " + "  ".join(f"{prov} {us:7.1f} us" for prov, us in rows[name].items()), flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, git=os.environ.get("TRITONGRAD_GIT_SHA"),
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), calls=a.calls, rounds=a.rounds,
                tritongrad_src=os.path.dirname(os.path.dirname(tritongrad.__file__)))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "host_calls.json"), "w") as f:
        json.dump(dict(meta=meta, us_per_call=rows), f, indent=1)


if __name__ == "__main__":
    main()

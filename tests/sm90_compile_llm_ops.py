"""Compile, for an H100/H200 (sm_90), every kernel specialization that the swiglu, geglu and rotary-embedding
launchers request at realistic shapes, without a GPU, and check that 16-byte aligned rows get vector loads
and stores. The launchers run on CPU tensors (never filled: nothing executes) with kernel launches
replaced by ``triton.compile``. Run as a script, without TRITON_INTERPRET:

    python tests/sm90_compile_llm_ops.py swiglu|geglu|rope [--resources]

prints one line per failure and a final count (``--resources``: each specialization's registers, spills
and shared memory, from the cubin by the cuobjdump that Triton ships). tests/test_swiglu.py and
tests/test_rope.py run it.
"""

import re
import sys

import sm90  # noqa: F401  (first: Triton out of its interpreter)
import torch

import tritongrad

# 16-byte vector accesses to global memory: four 32-bit words (two for 64-bit elements).
_VECTOR_LOAD = re.compile(r"ld\.global[\w:.]*\.(v4\.(b|f|u|s)32|v2\.(b|f|u|s)64)")
_VECTOR_STORE = re.compile(r"st\.global[\w:.]*\.(v4\.(b|f|u|s)32|v2\.(b|f|u|s)64)")


def _check(name, shown, compiled) -> list:
    ptx = compiled.asm["ptx"]
    if not (_VECTOR_LOAD.search(ptx) and _VECTOR_STORE.search(ptx)):
        return [f"{name} {shown}: no 16-byte vector load/store for 16-byte aligned rows"]
    return []


def _empty(*shape, dtype):
    return torch.empty(shape, dtype=dtype)


def swiglu_cases():
    bf, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    # Rows of (why): 14336 Llama-3-8B (7 x 2048), 11008 Llama-2-7B (43 x 256), 13824 Llama-2-13B (27 x 512),
    # 8192 one power of two, 1000 (8-element aligned, no 256-wide divisor: a masked block). dtypes: bf16, fp16,
    # fp32, fp64 and bf16 gate with fp32 up (float32 out). Layouts: separate projections and the two halves
    # of one fused [N, 2I] projection.
    for D in (14336, 11008, 13824, 8192, 1000):
        for gdt, udt in ((bf, bf), (f16, f16), (f32, f32), (f64, f64), (bf, f32)):
            for fused in (False, True):
                if fused and gdt is not udt:
                    continue
                if fused:
                    x = _empty(64, 2 * D, dtype=gdt)
                    g, u = x[:, :D], x[:, D:]
                else:
                    g, u = _empty(64, D, dtype=gdt), _empty(64, D, dtype=udt)
                yield f"swiglu D={D} {gdt} {udt} fused={fused}", g, u


def run_swiglu() -> None:
    for name, g, u in swiglu_cases():
        for need in ((True, True), (False, True), (True, False)):
            gg, uu = g.detach().requires_grad_(need[0]), u.detach().requires_grad_(need[1])
            out = tritongrad.swiglu(gg, uu)
            out.backward(_empty(*out.shape, dtype=out.dtype))


def geglu_cases():
    bf, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    # Rows of (why): 16384 Gemma-2B, 24576 Gemma-7B (3 x 8192), 14336 Gemma-2-9B (7 x 2048), 9216 Gemma-2-2B
    # (9 x 1024), 1000 (a masked block). dtypes and layouts as swiglu's; the kernels are swiglu's with another
    # activation, so fewer rows suffice.
    for D in (16384, 24576, 14336, 9216, 1000):
        for gdt, udt in ((bf, bf), (f16, f16), (f32, f32), (f64, f64), (bf, f32)):
            for fused in (False, True):
                if fused and (gdt is not udt or D not in (16384, 1000)):
                    continue
                if fused:
                    x = _empty(64, 2 * D, dtype=gdt)
                    g, u = x[:, :D], x[:, D:]
                else:
                    g, u = _empty(64, D, dtype=gdt), _empty(64, D, dtype=udt)
                yield f"geglu D={D} {gdt} {udt} fused={fused}", g, u


def run_geglu() -> None:
    for name, g, u in geglu_cases():
        for approximate in ("tanh", "none"):
            for need in ((True, True), (False, True), (True, False)):
                gg, uu = g.detach().requires_grad_(need[0]), u.detach().requires_grad_(need[1])
                out = tritongrad.geglu(gg, uu, approximate=approximate)
                out.backward(_empty(*out.shape, dtype=out.dtype))


def rope_cases():
    bf, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    # (HQ, HK, Dh), why: Llama-3-8B (GQA 4:1), Llama-2-7B (MHA), Qwen2-7B (28/4: head blocks of 4), Qwen2.5-0.5B
    # (14/2, Dh 64), Phi-3-mini (Dh 96: a masked half of 48), Gemma-2B (8/1, Dh 256).
    for HQ, HK, Dh in ((32, 8, 128), (32, 32, 128), (28, 4, 128), (14, 2, 64), (32, 32, 96), (8, 1, 256)):
        for qdt, cdt in ((bf, bf), (f16, f16), (f32, f32), (f64, f64), (bf, f32)):
            for dim, Bc in ((1, 1), (1, 2), (2, 2)):
                B, T = 2, 64
                q = _empty(B, T, HQ, Dh, dtype=qdt)  # the [B, T, H, Dh] projection
                k = _empty(B, T, HK, Dh, dtype=qdt)
                if dim == 1:
                    q, k = q.transpose(1, 2), k.transpose(1, 2)
                cos, sin = _empty(Bc, T, Dh, dtype=cdt), _empty(Bc, T, Dh, dtype=cdt)
                yield f"rope {HQ}/{HK}x{Dh} {qdt} {cdt} dim={dim} Bc={Bc}", q, k, cos, sin, dim


def run_rope() -> None:
    for name, q, k, cos, sin, dim in rope_cases():
        for need in ((True, True), (False, True)):
            qq, kk = q.detach().requires_grad_(need[0]), k.detach().requires_grad_(need[1])
            qe, ke = tritongrad.apply_rotary_pos_emb(qq, kk, cos, sin, dim)
            grads = [_empty(*t.shape, dtype=t.dtype).transpose(1, 2) if dim == 1 else _empty(*t.shape, dtype=t.dtype)
                     for t in (qe.transpose(1, 2) if dim == 1 else qe, ke.transpose(1, 2) if dim == 1 else ke)]
            torch.autograd.backward([qe, ke], grads)


def main(which: str) -> int:
    compiler = sm90.Compiler(_check)
    compiler.install()
    {"swiglu": run_swiglu, "geglu": run_geglu, "rope": run_rope}[which]()
    return compiler.report()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

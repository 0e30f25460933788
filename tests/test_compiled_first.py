"""Every public op's first call compiled, in a fresh process: an op that resolves something lazily on its first
call (a module, a table, a kernel) does it inside Dynamo's trace there, where an import can break the graph or
fail Dynamo's own guards (grouped_experts did: an internal error on torch 2.13, a graph break on 2.11). Each op
runs compiled (fullgraph) before any eager call of it, then eagerly: values and gradients equal, no graph break."""

import os
import subprocess
import sys

import pytest
from conftest import DEVICE

_SCRIPT = r'''
import sys, torch
from torch._dynamo.utils import counters
import tritongrad

dev = sys.argv[1]
g = torch.Generator().manual_seed(0)


def r(*shape, scale=1.0, grad=True):
    return (scale * torch.randn(*shape, generator=g)).to(dev).requires_grad_(grad)


def i(high, *shape):
    return torch.randint(0, high, shape, generator=g).to(dev)


t6, idx, t24 = i(50, 6), i(4, 13, 2), i(50, 2, 3)
adv, ref = torch.randn(2, generator=g).to(dev), -torch.rand(1, generator=g).to(dev)


def cos_sin(T, R):
    t = torch.arange(T, dtype=torch.float32)[:, None] * torch.arange(R // 2)[None] / R
    e = torch.cat([t, t], -1)[None]
    return e.cos().to(dev), e.sin().to(dev)


cos, sin = cos_sin(5, 8)
CASES = {  # name: (function of the tensors, tensors)
    "weighted_sum": (lambda x, w: tritongrad.weighted_sum(x, w), (r(6, 40), r(40))),
    "rms_norm": (lambda x, w: tritongrad.rms_norm(x, [40], w, 1e-6), (r(6, 40), r(40))),
    "llama_rms_norm": (lambda x, w: tritongrad.llama_rms_norm(x, w, 1e-6), (r(6, 40), r(40))),
    "layer_norm": (lambda x, w, b: tritongrad.layer_norm(x, [40], w, b), (r(6, 40), r(40), r(40))),
    "fused_add_rms_norm": (lambda x, s, w: tritongrad.fused_add_rms_norm(x, s, w, 1e-6), (r(6, 40), r(6, 40), r(40))),
    "swiglu": (lambda a, b: tritongrad.swiglu(a, b), (r(6, 40), r(6, 40))),
    "geglu": (lambda a, b: tritongrad.geglu(a, b, approximate="tanh"), (r(6, 40), r(6, 40))),
    "gated_linear": (lambda a, b, w: tritongrad.gated_linear(a, b, w), (r(6, 40), r(6, 40), r(24, 40))),
    "apply_rotary_pos_emb": (lambda q, k: tritongrad.apply_rotary_pos_emb(q, k, cos, sin),
                             (r(2, 4, 5, 8), r(2, 2, 5, 8))),
    "cross_entropy": (lambda x: tritongrad.cross_entropy(x, t6), (r(6, 50),)),
    "linear_cross_entropy": (lambda x, w: tritongrad.linear_cross_entropy(x, w, t6), (r(6, 16), r(50, 16))),
    "linear_token_logprobs": (lambda x, w: tritongrad.linear_token_logprobs(x, w, t6), (r(6, 16), r(50, 16))),
    "linear_grpo_loss": (lambda x, w: tritongrad.linear_grpo_loss(x, w, t24, adv), (r(2, 3, 16), r(50, 16))),
    "linear_dpo_loss": (lambda x, w: tritongrad.linear_dpo_loss(x, w, t24, ref_chosen_logps=ref,
                                                                  ref_rejected_logps=ref), (r(2, 3, 16), r(50, 16))),
    "linear_jsd": (lambda x, w, t, tw: tritongrad.linear_jsd(x, w, t, tw), (r(6, 16), r(50, 16), r(6, 16, grad=False), r(50, 16, grad=False))),
    "linear_kl_div": (lambda x, w, t, tw: tritongrad.linear_kl_div(x, w, t, tw),
                      (r(6, 16), r(50, 16), r(6, 16, grad=False), r(50, 16, grad=False))),
    "grouped_experts": (lambda x, w, gu, dn: tritongrad.grouped_experts(x, idx, w, gu, dn),
                        (r(13, 32), r(13, 2), r(4, 32, 32, scale=0.2), r(4, 32, 16, scale=0.2))),
}
if sys.argv[2:] == ["--names"]:
    print(" ".join(CASES))
    sys.exit(0)
names = sys.argv[2:] or list(CASES)
failed = []
for name in names:
    fn, ts = CASES[name]
    counters.clear()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)

        def run(f):
            outs = f(*ts)
            outs = outs if isinstance(outs, tuple) else (outs,)
            outs = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
            loss = sum((o.double() * torch.linspace(-1, 1, o.numel(), device=dev, dtype=torch.float64)
                        .view(o.shape)).sum() for o in outs)
            return outs, torch.autograd.grad(loss, [t for t in ts if t.requires_grad])

        got = run(compiled)
        want = run(fn)
        for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert not counters["graph_break"], dict(counters["graph_break"])
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:400]}")
print("\n".join(failed) if failed else "ok")
'''


def _script(*args, timeout=600):
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(tests, "..", "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", _SCRIPT, DEVICE, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_cases_are_every_public_op():
    import tritongrad

    not_ops = {"reduce_partials", "partial_rows", "patch_trl", "unpatch_trl"}  # the pattern's helpers, TRL's patch
    public = {n for n, where in tritongrad._WHERE.items() if where.startswith(".ops.")} - not_ops
    out = _script("--names", timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert set(out.stdout.split()) == public


def test_every_op_compiled_before_its_first_eager_call():
    out = _script()
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok"), out.stdout[-3000:]

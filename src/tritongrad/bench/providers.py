"""Who can run an op: one table, one entry per provider.

An entry has a ``probe`` (the provider's version; raises :class:`Unavailable` with the reason when it cannot
run here), a ``build`` (a fresh callable over the op's input tensors, or :class:`Unavailable` when the
provider lacks the op) and a ``guard`` entered around the timed runs, after warm-up.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import shutil
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from .ops import EPS, OpSpec


class Unavailable(Exception):
    """The provider cannot run here, or does not have the op; the message says why."""


@dataclass(frozen=True)
class Provider:
    name: str
    probe: Callable[[], str]
    build: Callable[[OpSpec], Callable]
    guard: Callable[[], ContextManager] = contextlib.nullcontext


def _import(module: str, dist: str):
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # a library can fail to import for reasons other than being absent
        raise Unavailable(f"{dist} is not importable ({type(e).__name__}: {e})") from None
    try:
        return mod, importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:  # importable from a source tree, no metadata
        return mod, getattr(mod, "__version__", "unknown")


def _needs_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise Unavailable(f"{what} needs a CUDA GPU (its kernels do not run in Triton's interpreter)")


def _tritongrad_probe() -> str:
    import tritongrad
    from tritongrad import _runtime

    return tritongrad.__version__ + (" (Triton interpreter)" if _runtime.INTERPRET else "")


def _tritongrad_build(op: OpSpec) -> Callable:
    import tritongrad

    fn = op.fn if op.fn is not None and not isinstance(op.fn, str) else getattr(tritongrad, op.fn or op.name, None)
    if fn is None:
        raise Unavailable(f"tritongrad.{op.fn or op.name} does not exist in this version")
    return op.bind(fn)


def _compile_probe() -> str:
    if not torch.cuda.is_available() and not (shutil.which("c++") or shutil.which("g++")):
        raise Unavailable("torch.compile on CPU needs a C++ compiler")
    return torch.__version__


def _compile_build(op: OpSpec, backend: str = "inductor") -> Callable:
    # Compiled afresh for every shape: dynamo keys its cache on the function's code object, so shapes
    # compiled one after another under one cache would pass the recompile limit and then run eager.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(op.bind(op.torch_fn), dynamic=False, fullgraph=True, backend=backend)


@contextlib.contextmanager
def _compiled_only():
    """After warm-up a graph must exist, and from then on a recompile raises instead of falling back to
    eager: what is timed is the compiled code."""
    if not torch._dynamo.utils.counters["stats"]["unique_graphs"]:
        raise RuntimeError("torch.compile compiled no graph: the timed runs would be eager")
    with torch.compiler.set_stance("fail_on_recompile"):
        yield


def _liger_probe() -> str:
    _, version = _import("liger_kernel.ops.rms_norm", "liger-kernel")
    _needs_cuda("liger-kernel")
    return version


def _liger_build(op: OpSpec) -> Callable:
    def rms_norm():
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # offset 0, casting_mode "llama" (its default); in_place=False because the harness replays one
        # backward with one grad tensor, which in_place=True would overwrite with grad_x.
        return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)

    def fused_add_rms_norm():
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        return lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)

    def layer_norm():
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)

    def cross_entropy():
        from liger_kernel.transformers.functional import liger_cross_entropy

        return lambda x, t: liger_cross_entropy(x, t)

    def linear_cross_entropy():
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return lambda h, W, t: liger_fused_linear_cross_entropy(h, W, t)

    def linear_grpo_loss():
        return liger_grpo_loss(compiled=True)

    def linear_dpo_loss():
        return liger_dpo_loss(compiled=True)

    def linear_jsd():
        return liger_jsd_loss(compiled=True)

    def swiglu():
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply

    def grouped_experts():
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        # Liger's fused MoE (its LigerExperts' function): the same weights' layout, int32 expert ids
        return lambda x, idx, w, gu, dn: LigerFusedMoEFunction.apply(x, gu, dn, idx.to(torch.int32), w)

    def rotary():
        from liger_kernel.ops.rope import LigerRopeFunction

        return lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin)

    fns = {f.__name__: f for f in (rms_norm, fused_add_rms_norm, layer_norm, cross_entropy, linear_cross_entropy,
                                   linear_grpo_loss, linear_dpo_loss, linear_jsd, swiglu, grouped_experts, rotary)}
    if op.name not in fns:
        raise Unavailable(f"liger-kernel has no {op.name}")
    try:
        return fns[op.name]()
    except ImportError as e:
        raise Unavailable(f"liger-kernel {op.name} is not importable ({e})") from None


def liger_grpo_loss(compiled: bool) -> Callable:
    """Liger's chunked GRPO loss on the bench's GRPO inputs, configured as tritongrad's row (dapo, beta
    ``GRPO_BETA``, old log-probabilities the detached current ones, every token in the mask): the same
    function, which tests/test_bench.py checks on CPU."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    from .ops import GRPO_BETA, grpo_layout

    loss = LigerFusedLinearGRPOLoss(beta=GRPO_BETA, loss_type="dapo", use_ref_model=True, compiled=compiled)

    def run(h, W, t, a, ref):
        B, T = grpo_layout(h.shape[0])
        mask = torch.ones(B, T, device=h.device)
        return loss(h.view(B, T, -1), W, t.view(B, T), mask, a, ref_per_token_logps=ref.view(B, T))[0]
    return run


def liger_dpo_loss(compiled: bool) -> Callable:
    """Liger's chunked DPO loss on the bench's DPO inputs (sigmoid, beta ``DPO_BETA``, the reference model's
    hidden states and head, sequence log-probabilities summed): the same function, which tests/test_bench.py
    checks on CPU."""
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    from .ops import DPO_BETA, dpo_layout

    loss = LigerFusedLinearDPOLoss(beta=DPO_BETA, loss_type="sigmoid", use_ref_model=True, compiled=compiled)

    def run(h, W, t, ref_h, ref_W):
        S, T = dpo_layout(h.shape[0])
        return loss(W, h.view(S, T, -1), t.view(S, T), None, ref_h.view(S, T, -1), ref_W)[0]
    return run


def liger_jsd_loss(compiled: bool) -> Callable:
    """Liger's chunked JSD loss on the bench's JSD inputs, its distillation term alone (no hard loss), beta
    ``JSD_BETA``, every token in the mean: the same function, which tests/test_bench.py checks on CPU."""
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    from .ops import JSD_BETA

    loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=JSD_BETA, compiled=compiled)

    def run(hs, Ws, ht, Wt):
        labels = torch.zeros(hs.shape[0], dtype=torch.long, device=hs.device)  # none ignored; no hard loss
        return loss(hs, Ws, ht, Wt, labels)
    return run


def _quack_probe() -> str:
    _, version = _import("quack", "quack-kernels")
    _needs_cuda("quack")
    return version


def _quack_build(op: OpSpec) -> Callable:
    import quack

    if op.name != "rms_norm":
        raise Unavailable(f"quack has no differentiable {op.name}")
    return lambda x, w: quack.rmsnorm(x, w, eps=EPS)


def _cce_probe() -> str:
    _, version = _import("cut_cross_entropy", "cut-cross-entropy")
    _needs_cuda("cut-cross-entropy")
    return version


def _cce_build(op: OpSpec) -> Callable:
    if op.name != "linear_cross_entropy":
        raise Unavailable(f"cut-cross-entropy has no {op.name}")
    from cut_cross_entropy import linear_cross_entropy

    return lambda h, W, t: linear_cross_entropy(h, W, t)


# tritongrad first: every other provider's speedup is measured against it.
PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        Provider("tritongrad", _tritongrad_probe, _tritongrad_build),
        Provider("eager", lambda: torch.__version__, lambda op: op.bind(op.torch_fn)),
        Provider("torch.compile", _compile_probe, _compile_build, guard=_compiled_only),
        Provider("liger", _liger_probe, _liger_build),
        Provider("quack", _quack_probe, _quack_build),
        Provider("cce", _cce_probe, _cce_build),
    )
}


def probe_all(names) -> dict[str, tuple[str | None, str | None]]:
    """``{name: (version, None)}`` for providers that can run here, ``{name: (None, reason)}`` otherwise."""
    found = {}
    for name in names:
        try:
            found[name] = (PROVIDERS[name].probe(), None)
        except Unavailable as e:
            found[name] = (None, str(e))
    return found

"""Hugging Face ``transformers`` models for :mod:`tritongrad.patch`: what each class computes, and the forwards
that replace theirs.

A class is matched by what it computes, not by its name: each candidate (an ``*RMSNorm``, an ``*MLP``, a
module's ``apply_rotary_pos_emb``) runs once on a small CPU probe and is compared, bit for bit, with the
formula its replacement implements. So a copy of Llama's RMSNorm in any family is recognised, and a class
whose math differs (a future ``transformers`` that changes Gemma's norm, say) is left alone, with the reason
in the report. The causal-LM classes are recognised by their layout (``model``, ``lm_head``, a forward with
``labels`` and ``logits_to_keep``).

The replacements:

- RMSNorm, three semantics (``x`` the input, ``xhat = x / sqrt(mean(x**2) + eps)`` in float32):
  ``llama``: ``weight * xhat.to(x.dtype)`` (:func:`tritongrad.llama_rms_norm`);
  ``gemma``: ``(xhat * (1 + weight.float())).to(x.dtype)`` (:func:`tritongrad.rms_norm` with
  ``weight_offset=1.0``: the kernels add 1 to the weight in float32);
  ``olmo2``: ``(weight * xhat).to(x.dtype)`` (:func:`tritongrad.rms_norm`, which multiplies in float32 and
  rounds once).
- The gated MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with a SiLU ``act_fn``:
  ``down_proj(tritongrad.swiglu(gate_proj(x), up_proj(x)))`` (a GELU one: :func:`tritongrad.geglu`); with gate
  and up in one projection (Phi3, GLM), ``down_proj(swiglu(*gate_up_proj(x).chunk(2, -1)))``.
- ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``: :func:`tritongrad.apply_rotary_pos_emb`.
- The causal-LM loss: ``loss_function`` (:func:`tritongrad.cross_entropy` on the logits), or the forward, whose
  training step with ``labels`` computes :func:`tritongrad.linear_cross_entropy` from the last hidden states
  and the LM head's weight, without logits.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import re
import warnings

import torch
import torch.nn.functional as F

import tritongrad

from ._pattern import eager_autograd
from ._runtime import PLAIN_TENSORS
from .ops.swiglu.experts import _moe as _experts_moe

# ---------------------------------------------------------------- shared
# What class-level patches and the module-wide rope replaced: (owner, attribute) -> (original, source), the
# source "class" (patch_transformers) or "instance" (patch). Originals are found here, never in a probe.
SAVED: dict[tuple, tuple] = {}
# The classes' saved forwards again, keyed by the class alone: read while dynamo traces (original_forward_of),
# which in torch 2.11 cannot hash SAVED's module keys. Written by save() and forget() only.
SAVED_FORWARDS: dict[type, object] = {}


def save(owner, attr: str, original, source: str) -> None:
    """Keep ``owner.attr``'s original (the first one saved stays)."""
    SAVED.setdefault((owner, attr), (original, source))
    if isinstance(owner, type) and attr == "forward":
        SAVED_FORWARDS.setdefault(owner, SAVED[(owner, attr)][0])


def forget(owner, attr: str) -> None:
    del SAVED[(owner, attr)]
    if isinstance(owner, type) and attr == "forward":
        SAVED_FORWARDS.pop(owner, None)


def marked(fn, op: str):
    """Tag a replacement so that later calls recognise it (idempotence, reports, unpatching)."""
    fn._tritongrad = op
    return fn


def patched_op(obj) -> str | None:
    """The op name a replacement was tagged with, or None for a function of the model's own."""
    return getattr(obj, "_tritongrad", None)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A parameter as the ops take it. FSDP2 all-gathers its sharded parameters into plain tensors before a
    module's forward, so the ops normally see those. A DTensor still sharded here (a module called outside its
    FSDP unit) is gathered; its gradient, different on each rank, is averaged over the ranks on the way back
    (a reduce-scatter), as FSDP2 averages the gradients it reduces."""
    if type(t) in PLAIN_TENSORS or t is None or not hasattr(t, "full_tensor"):
        return t
    from torch.distributed.tensor import Partial

    return t.full_tensor(grad_placements=[Partial("avg")] * t.device_mesh.ndim)


# A patched path that reads a module's weights instead of calling it (the LM head under the fused loss, the
# norm under fused_add_rms_norm), stands for its call (act_fn under swiglu) or writes gradients over a module's
# output (inplace_backward) is exact only where the call runs the class's forward alone:
# docs/models.md#module-calls.
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = tuple((name, getattr(torch.nn.modules.module, name, {})) for name in (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks"))
# The attribute that marks a hook as an observer that may go uncalled where a patched path bypasses its
# module (the family matrix's layout recorder): it does not make the path fall back.
OBSERVER = "_tritongrad_observer"


def _hooks(d) -> bool:
    return any(not getattr(h, OBSERVER, False) for h in d.values()) if d else False


def _class_name(c: type) -> str:
    return f"torch.nn.{c.__name__}" if getattr(torch.nn, c.__name__, None) is c else f"{c.__module__}.{c.__qualname__}"


def call_why_not(m, name: str, cls: type | None = None) -> str | None:
    """None when calling the module ``m`` (the model's ``name``) runs its class's ``forward`` and nothing else:
    no module hooks of its own or global ones, no ``forward`` set on the instance (accelerate's offloading
    wraps it so), and, given ``cls``, ``m`` a ``cls`` exactly (a wrapper set in its place after patch, such as
    a LoRA layer, is not); else why not."""
    if cls is not None and type(m) is not cls:
        return f"{name} is a {_class_name(type(m))}, not a {_class_name(cls)}"
    if "forward" in m.__dict__:
        return f"{name} has a forward of its own on the instance (a wrapper, such as accelerate's hooks)"
    for attr in _MODULE_HOOKS:
        if _hooks(m.__dict__.get(attr)):
            return f"{name} has module hooks ({attr.strip('_').replace('_', ' ')}), which its call would run"
    for attr, hooks in _GLOBAL_HOOKS:  # torch registers global hooks into these very dicts
        if _hooks(hooks):
            return (f"global module hooks ({attr.strip('_').replace('_', ' ')}) are registered, which {name}'s call "
                    "would run")
    return None


# Calls that a module-wide replacement handed back to the original function, by (op, function), since the
# process began or the caller cleared it: the report says what was replaced; this says which calls still ran
# the original (inputs the replacement was not established for). zoo notes them per family.
KEPT: dict[tuple[str, str], int] = {}


def kept(op: str, fn) -> None:
    """Count a call that ``op``'s replacement handed to the original ``fn`` (not while compiling: a compiled
    graph records the original's ops, and the count would be a side effect to trace)."""
    if not torch.compiler.is_compiling():
        key = (op, f"{getattr(fn, '__module__', '?').rsplit('.', 1)[-1]}.{getattr(fn, '__qualname__', '?')}")
        KEPT[key] = KEPT.get(key, 0) + 1


def _equal(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _probe_rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


# ---------------------------------------------------------------- per-instance decisions
# patch() establishes each instance it replaces and keeps the outcome on it under an attribute (NORM_ATTR,
# GATE_ATTR, SPEC_ATTR). A class patched by patch_transformers establishes each instance on its first call,
# with the decider registered for that attribute: kept on the instance in eager mode; under torch.compile,
# computed when the call is traced, as a constant of the graph guarded on the instance (no graph break), where
# dynamo's assume_constant_result takes a module argument (torch 2.13); before that, the traced call is not
# established and runs the instance's own forward (docs/models.md#torchcompile).
DECIDERS: dict = {}


@torch.compiler.assume_constant_result
def _decided_in_trace(m, attr: str, arg):
    # Runs eagerly while dynamo traces; nothing is stored on the instance, whose dict the graph's guards read.
    return DECIDERS[attr](m, arg)


@torch.compiler.assume_constant_result
def _trace_decides() -> bool:
    """Whether dynamo calls an assume_constant_result function with a module (an object, guarded by identity).
    Called while tracing only, where dynamo is loaded: it runs then, eagerly, as a constant of the graph."""
    try:
        from torch._dynamo.variables import functions

        return "UserDefinedObjectVariable" in inspect.getsource(functions.invoke_and_store_as_constant)
    except Exception:  # noqa: BLE001 - any doubt: not established while tracing
        return False


_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def decided(m, attr: str, arg=None):
    """What ``DECIDERS[attr](m, arg)`` establishes for the instance ``m``, set by patch or on its first call;
    None (not established) when that call is traced other than by dynamo (non-strict torch.export, whose fake
    tensors hold no data for a probe) or by a dynamo that :func:`_trace_decides` says cannot take a module."""
    v = getattr(m, attr, None)  # a plain attribute read: no graph break
    if v is None:
        if torch.compiler.is_compiling():
            return _decided_in_trace(m, attr, arg) if _dynamo_compiling() and _trace_decides() else None
        v = m.__dict__[attr] = DECIDERS[attr](m, arg)
    return v


# ---------------------------------------------------------------- RMSNorm
def _xhat(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.float32)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


# Each semantics in plain PyTorch, written as Hugging Face's code runs it (the probe compares bit for bit).
_NORM_FORMULAS = {
    "llama": lambda x, w, eps: w * _xhat(x, eps).to(x.dtype),
    "gemma": lambda x, w, eps: (_xhat(x, eps) * (1.0 + w.float())).to(x.dtype),
    "olmo2": lambda x, w, eps: (w * _xhat(x, eps)).to(x.dtype),
}
NORM_DETAIL = {
    "llama": "llama_rms_norm (weight * normalised.to(dtype))",
    "gemma": "rms_norm with weight_offset 1 (Gemma: (normalised * (1 + w)).to(dtype))",
    "olmo2": "rms_norm (Olmo2: (weight * normalised).to(dtype))",
}
_EPS_ATTRS = ("variance_epsilon", "eps")


def eps_attr(m: torch.nn.Module) -> str | None:
    for name in _EPS_ATTRS:
        if type(getattr(m, name, None)) is float:
            return name
    return None


def looks_like_rms_norm(m: torch.nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return ("rmsnorm" in type(m).__name__.lower() and isinstance(w, torch.Tensor) and w.dim() == 1
            and eps_attr(m) is not None)


def _simple_state(m: torch.nn.Module) -> tuple:
    """The plain attributes of a module instance (``group_size``, flags, ...): they can change its math."""
    return tuple(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and k != "training"
                        and type(v) in (int, float, str, bool, type(None))))


def _norm_probe(cls: type, probe, D: int) -> tuple[str | None, str]:
    # A forward that takes more than its input (a gated norm's ``gate=None``) is called with it: the norm of the
    # input alone, established here, would never run (the calls with more run the norm's own forward).
    try:
        params = list(inspect.signature(original_forward_of(cls)).parameters.values())[2:]
    except (TypeError, ValueError):
        params = []
    extra = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if extra:
        return None, (f"{cls.__name__}.forward takes {', '.join(extra)} beyond its input (a gated norm): rms_norm "
                      "computes the norm of the input alone")
    eps_name = eps_attr(probe)
    if eps_name is None or not isinstance(getattr(probe, "weight", None), torch.nn.Parameter):
        return None, f"{cls.__name__} has no 1-D weight and float eps"
    g = _probe_rng()
    x = torch.randn(3, D, generator=g) * 3
    w = torch.randn(D, generator=g) * 0.5 + 0.5
    kinds = set(_NORM_FORMULAS)
    for xdt, wdt in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)):
        with torch.no_grad():
            probe.weight.data = w.to(wdt)
            try:
                got = original_forward_of(cls)(probe, x.to(xdt))
            except Exception as e:  # noqa: BLE001
                return None, f"{cls.__name__}.forward failed on a probe ({type(e).__name__}: {e})"
            eps = getattr(probe, eps_name)
            kinds = {k for k in kinds if _equal(got, _NORM_FORMULAS[k](x.to(xdt), w.to(wdt), eps))}
    if len(kinds) != 1:
        return None, f"{cls.__name__}.forward computes none of the known RMSNorm semantics (Llama, Gemma, Olmo2)"
    return kinds.pop(), eps_name


@functools.cache
def norm_kind(cls: type) -> tuple[str | None, str]:
    """``(kind, eps attribute)`` of an RMSNorm class, built as ``cls(16)``, or ``(None, why not)``."""
    try:
        probe = cls(16)
    except Exception as e:  # noqa: BLE001 - any constructor failure means: not a class we can check
        return None, f"cannot build {cls.__name__}(16) to check its math ({type(e).__name__}: {e})"
    return _norm_probe(cls, probe, 16)


@functools.lru_cache(maxsize=1024)
def _instance_norm_kind(cls: type, D: int, state: tuple) -> tuple[str | None, str]:
    probe = cls.__new__(cls)
    torch.nn.Module.__init__(probe)
    probe.__dict__.update(dict(state))
    probe.weight = torch.nn.Parameter(torch.zeros(D))
    return _norm_probe(cls, probe, D)


def instance_norm_kind(m: torch.nn.Module, cls: type | None = None) -> tuple[str | None, str]:
    """:func:`norm_kind` for this instance: its width and plain attributes (a grouped RMSNorm's
    ``group_size`` normalises groups, not the row), on a probe of its class."""
    return _instance_norm_kind(cls or type(m), int(m.weight.shape[0]), _simple_state(m))


NORM_ATTR = "_tritongrad_norm"  # True where the instance computes the forward's kind of norm
DECIDERS[NORM_ATTR] = lambda m, kind: instance_norm_kind(m)[0] == kind


@functools.cache
def norm_forward(kind: str, eps_name: str):
    def established(self) -> bool:
        return bool(decided(self, NORM_ATTR, kind))

    # A norm whose forward takes more than its input (a gated norm's ``gate``) was established on the input
    # alone: called with more, it runs its own forward (counted in KEPT: the report said replaced).
    def original(self, x, args, kwargs):
        if (args or kwargs) and established(self):
            kept("rms_norm", type(self))
        return original_forward_of(type(self))(self, x, *args, **kwargs)

    if kind == "llama":
        def forward(self, hidden_states, *args, **kwargs):
            if args or kwargs or not established(self):
                return original(self, hidden_states, args, kwargs)
            return tritongrad.llama_rms_norm(hidden_states, _plain(self.weight), getattr(self, eps_name))
    elif kind == "gemma":
        def forward(self, x, *args, **kwargs):
            if args or kwargs or not established(self):
                return original(self, x, args, kwargs)
            w = _plain(self.weight)
            return tritongrad.rms_norm(x, w.shape, w, getattr(self, eps_name), weight_offset=1.0)
    else:
        def forward(self, hidden_states, *args, **kwargs):
            if args or kwargs or not established(self):
                return original(self, hidden_states, args, kwargs)
            w = _plain(self.weight)
            return tritongrad.rms_norm(hidden_states, w.shape, w, getattr(self, eps_name))
    forward.__qualname__ = forward.__name__ = f"{kind}_rms_norm_forward"
    return marked(forward, "rms_norm")


# ---------------------------------------------------------------- gated MLP
class _SiluTypes:
    """The activation classes that are SiLU: torch's, and transformers' SiLUActivation once :func:`silu_types`
    ran (at patch time: importing transformers here would make every import of tritongrad pay for it)."""

    types: tuple = (torch.nn.SiLU,)


SILU = _SiluTypes()


def silu_types() -> tuple:
    if len(SILU.types) == 1:
        try:
            from transformers.activations import SiLUActivation

            SILU.types = (torch.nn.SiLU, SiLUActivation)
        except ImportError:
            pass
    return SILU.types


def looks_like_gated_mlp(m: torch.nn.Module) -> bool:
    # Any modules as the projections (a LoRA layer wrapping a Linear): the patched forward calls them as the
    # class's does; only a Linear's output may take its gradient (_owned).
    return all(isinstance(getattr(m, n, None), torch.nn.Module) for n in ("gate_proj", "up_proj", "down_proj")) \
        and callable(getattr(m, "act_fn", None))


# The names a gated MLP's activation goes by (Phi3's and GLM's is activation_fn).
ACT_NAMES = ("act_fn", "activation_fn")


def gate_act_name(m: torch.nn.Module) -> str:
    """The attribute holding ``m``'s activation: ``act_fn`` where callable, else ``activation_fn``."""
    return "act_fn" if callable(getattr(m, "act_fn", None)) else "activation_fn"


def gate_act(m: torch.nn.Module):
    return getattr(m, gate_act_name(m), None)


def _gated_why_not(cls: type, layers: dict, act_name: str, want, layout: str, formula: str,
                   state: tuple = ()) -> str | None:
    """Run ``cls``'s forward on a probe holding the instance's plain attributes ``state`` (a clipping limit
    changes the math), the bias-free Linear ``layers`` (name: (in, out)) and a SiLU under ``act_name``, every
    other activation name the identity (a forward reading another shows); None when it equals ``want(probe,
    x)`` bit for bit, else why not."""
    probe = cls.__new__(cls)
    torch.nn.Module.__init__(probe)
    probe.__dict__.update(dict(state))
    g = _probe_rng()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for name, (n_in, n_out) in layers.items():
            setattr(probe, name, torch.nn.Linear(n_in, n_out, bias=False))
    for name in ACT_NAMES:
        setattr(probe, name, torch.nn.SiLU() if name == act_name else torch.nn.Identity())
    x = torch.randn(2, 8, generator=g)
    with torch.no_grad():
        try:
            got = original_forward_of(cls)(probe, x)
        except Exception as e:  # noqa: BLE001
            return f"{cls.__name__}.forward is not the {layout} layout ({type(e).__name__}: {e})"
        expected = want(probe, x)
    return None if _equal(got, expected) else f"{cls.__name__}.forward is not {formula}"


@functools.lru_cache(maxsize=1024)
def gated_mlp_why_not(cls: type, state: tuple = ()) -> str | None:
    """None when ``cls``'s forward, on an instance with the plain attributes ``state``
    (:func:`_simple_state`), is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, else why not."""
    return _gated_why_not(
        cls, {"gate_proj": (8, 12), "up_proj": (8, 12), "down_proj": (12, 8)}, "act_fn",
        lambda p, x: p.down_proj(F.silu(p.gate_proj(x)) * p.up_proj(x)), "gate/up/down",
        "down_proj(act_fn(gate_proj(x)) * up_proj(x))", state)


GATE_OPS = {"silu": "swiglu", "tanh": "geglu", "none": "geglu"}
# Compiled, gated_linear stands for down_proj's call where it is a plain Linear without bias (_down_weight).
DOWN_DETAIL = "; compiled, down_proj through gated_linear where it is a plain Linear without bias"
GATE_DETAIL = {"silu": "down_proj(swiglu(gate_proj(x), up_proj(x)))" + DOWN_DETAIL,
               "tanh": "down_proj(geglu(gate_proj(x), up_proj(x), approximate='tanh'))" + DOWN_DETAIL,
               "none": "down_proj(geglu(gate_proj(x), up_proj(x)))" + DOWN_DETAIL}
GATE_ATTR = "_tritongrad_gate"
GATE_ACT_ATTR = "_tritongrad_gate_act"  # the activation patch established the gate with (set by patch)


def gate_kind(act) -> tuple[str | None, str | None]:
    """``(kind, None)``: ``act`` computes SiLU (``"silu"``), GELU's tanh approximation (``"tanh"``) or the exact
    GELU (``"none"``), checked on a probe that reaches far into both tails (a clipped GELU fails it); else
    ``(None, what the gate is)``."""
    if isinstance(act, silu_types()):
        return "silu", None
    name = type(act).__name__
    t = torch.cat((torch.linspace(-30, 30, 121), torch.linspace(-3, 3, 97)))
    try:
        with torch.no_grad():
            got = act(t)
        for kind, want in (("silu", F.silu(t)), ("tanh", F.gelu(t, approximate="tanh")), ("none", F.gelu(t))):
            if isinstance(got, torch.Tensor) and got.shape == t.shape and torch.allclose(got, want, rtol=1e-6,
                                                                                          atol=1e-6):
                return kind, None
    except Exception:  # noqa: BLE001 - an activation that fails on a probe is not one of these
        pass
    return None, f"act_fn is {name}: neither SiLU nor GELU (exact or tanh), so neither swiglu nor geglu"


# The gate ("silu", "tanh", "none") where the instance, its plain attributes included, is a gated MLP; else False.
def _decide_gate(m, _):
    kind = (gated_mlp_why_not(type(m), _simple_state(m)) is None and gate_kind(m.act_fn)[0]) or False
    if kind and not torch.compiler.is_compiling():  # kept beside the decision (eager only, as decided keeps it)
        m.__dict__[GATE_ACT_ATTR] = gate_act(m)
    return kind


DECIDERS[GATE_ATTR] = _decide_gate


def _owned(*projections) -> bool:
    """The projections' outputs feed the gate alone, so their storage may take their gradients: each is a
    torch.nn.Linear whose call nothing else sees (a hook could keep its output; another module, return one it
    keeps)."""
    return all(call_why_not(p, "", torch.nn.Linear) is None for p in projections)


def _act_why_not(m) -> str | None:
    """Why the gate's activation module cannot be bypassed (swiglu/geglu stand for its call), else None."""
    mods = m._modules  # gate_act's choice, without Module.__getattr__ (this runs at every call)
    name = "act_fn" if "act_fn" in mods or callable(m.__dict__.get("act_fn")) else "activation_fn"
    act = mods.get(name, m.__dict__.get(name))
    established = m.__dict__.get(GATE_ACT_ATTR, act)
    if act is not established:
        return f"{name} was replaced after patch established the gate with another"
    return call_why_not(act, name) if isinstance(act, torch.nn.Module) else None


def _gated_forward(self, x):
    kind = decided(self, GATE_ATTR)
    if kind and _act_why_not(self) is not None:
        kind = None
    if kind:
        mods = self._modules
        gate_proj, up_proj, down_proj = mods["gate_proj"], mods["up_proj"], mods["down_proj"]
        owned = _owned(gate_proj, up_proj)
    if kind in ("silu", "tanh", "none"):
        return _gated_down(kind, gate_proj(x), up_proj(x), down_proj, owned)
    # A class patched for a gate, built here with another activation.
    return original_forward_of(type(self))(self, x)


def _gated_down(kind: str, gate, up, down_proj, owned: bool):
    """``down_proj(act(gate) * up)``: compiled, through gated_linear, which keeps gate and up but not their
    product for the backward, where down_proj's call is its weight's product alone (:func:`_down_weight`);
    else the gated op and down_proj's own call (docs/swiglu-rope.md#the-down-projection)."""
    w = _down_weight(down_proj, gate, up)
    if w is not None:
        return tritongrad.gated_linear(gate, up, w, approximate=None if kind == "silu" else kind,
                                       inplace_backward=owned)
    if kind == "silu":
        return down_proj(tritongrad.swiglu(gate, up, inplace_backward=owned))
    return down_proj(tritongrad.geglu(gate, up, approximate=kind, inplace_backward=owned))


def _down_weight(down_proj, gate, up):
    """down_proj's weight where the call is traced and ``F.linear(h, weight)`` is its whole call: a
    torch.nn.Linear without bias whose call runs its forward alone (no hooks or wrapper: call_why_not), a plain
    weight (not a DTensor or a quantized one) in the gated product's dtype, and autocast off (which would cast
    h and the weight); else None. Eager steps keep down_proj's own call: measured slower through gated_linear
    on Phi3 (docs/swiglu-rope.md#the-down-projection)."""
    if not torch.compiler.is_compiling():
        return None
    w = down_proj._parameters.get("weight") if type(down_proj) is torch.nn.Linear else None
    if w is None or down_proj._parameters.get("bias") is not None or type(w) not in PLAIN_TENSORS \
            or w.dtype != torch.promote_types(gate.dtype, up.dtype) or torch.is_autocast_enabled(gate.device.type):
        return None
    return w if call_why_not(down_proj, "") is None else None


swiglu_forward = marked(_gated_forward, "swiglu")
geglu_forward = marked(functools.wraps(_gated_forward)(lambda self, x: _gated_forward(self, x)), "geglu")


# ---------------------------------------------------------------- gated MLP, gate and up in one projection
def looks_like_fused_gated_mlp(m: torch.nn.Module) -> bool:
    p = getattr(m, "gate_up_proj", None)
    return isinstance(p, torch.nn.Linear) and p.out_features % 2 == 0 \
        and isinstance(getattr(m, "down_proj", None), torch.nn.Linear) and callable(gate_act(m))


def _fused_want(p, x):
    gate, up = p.gate_up_proj(x).chunk(2, dim=-1)
    return p.down_proj(F.silu(gate) * up)


@functools.lru_cache(maxsize=1024)
def fused_gated_mlp_why_not(cls: type, act_name: str, state: tuple = ()) -> str | None:
    """None when ``cls``'s forward, on an instance with the plain attributes ``state``, is ``down_proj(act(gate)
    * up)`` with ``gate, up = gate_up_proj(x).chunk(2, -1)`` and ``act`` the module's ``act_name`` attribute,
    else why not."""
    return _gated_why_not(cls, {"gate_up_proj": (8, 24), "down_proj": (12, 8)}, act_name, _fused_want, "gate_up/down",
                          f"down_proj({act_name}(gate) * up) with gate, up = gate_up_proj(x).chunk(2, -1)", state)


FUSED_GATE_DETAIL = {"silu": "down_proj(swiglu(*gate_up_proj(x).chunk(2, -1)))" + DOWN_DETAIL,
                     "tanh": "down_proj(geglu(*gate_up_proj(x).chunk(2, -1), approximate='tanh'))" + DOWN_DETAIL,
                     "none": "down_proj(geglu(*gate_up_proj(x).chunk(2, -1)))" + DOWN_DETAIL}


class _Halves(torch.autograd.Function):
    """``x.chunk(2, -1)`` whose backward hands on, without a copy, the gradient the gated op's in-place
    backward wrote over x's halves; chunk's backward would concatenate the two into a new ``[..., 2D]``
    tensor (docs/swiglu-rope.md#semantics). Other gradients are concatenated as chunk's are."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape, ctx.stride = x.shape, x.stride()
        return x.chunk(2, dim=-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dg, du):
        # The halves of one buffer laid out as x: side by side, as x's halves are.
        if dg.stride() == du.stride() == ctx.stride and dg.shape == du.shape and dg.dtype == du.dtype \
                and dg.untyped_storage().data_ptr() == du.untyped_storage().data_ptr() \
                and du.storage_offset() == dg.storage_offset() + dg.shape[-1] * ctx.stride[-1]:
            return dg.as_strided(ctx.shape, ctx.stride, dg.storage_offset())
        return torch.cat([dg, du], dim=-1)


def _fused_gated_forward(self, x):
    kind = getattr(self, GATE_ATTR, None)  # set by patch on each instance it replaced
    if kind in ("silu", "tanh", "none") and _act_why_not(self) is None:
        # Where owned, the projection's output takes its halves' gradients: eager, _Halves hands them on as
        # that output's gradient, as they lie; traced, chunk's backward concatenates them, which Inductor
        # writes in place.
        owned = _owned(self.gate_up_proj)
        gate_up = self.gate_up_proj(x)
        if owned and eager_autograd(gate_up):  # where the gated op's in-place backward can run
            gate, up = _Halves.apply(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        return _gated_down(kind, gate, up, self.down_proj, owned)
    return original_forward_of(type(self))(self, x)


fused_swiglu_forward = marked(functools.wraps(_fused_gated_forward)(lambda self, x: _fused_gated_forward(self, x)),
                              "swiglu")
fused_geglu_forward = marked(functools.wraps(_fused_gated_forward)(lambda self, x: _fused_gated_forward(self, x)),
                             "geglu")


# ---------------------------------------------------------------- MoE experts
def looks_like_experts(m: torch.nn.Module) -> bool:
    return isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and callable(getattr(m, "act_fn", None)) \
        and hasattr(type(m), "_apply_gate")


def experts_why_not(m: torch.nn.Module, base: type) -> str | None:
    """None when ``base``'s gate is transformers' default ``act_fn(gate) * up`` over the concatenated
    ``[gate; up]`` projection (``integrations.moe._default_apply_gate``), which the grouped_mm and batched_mm
    experts implementations call; else why not."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return "this transformers has no integrations.moe"
    if getattr(base, "_apply_gate", None) is not moe._default_apply_gate:
        return f"{base.__name__} gates its experts with its own _apply_gate"
    if not getattr(m, "is_concatenated", False) or not getattr(m, "has_gate", False):
        return f"{base.__name__}'s gate_up_proj is not the concatenated [gate; up] layout"
    return None


def _experts_gate(self, gate_up_out):
    gate, up = gate_up_out.chunk(2, dim=-1)
    kind = getattr(self, GATE_ATTR, None) if _act_why_not(self) is None else None
    # The experts' [gate; up] product feeds the gate alone: it takes the halves' gradients (as the fused MLP).
    if kind == "silu":
        return tritongrad.swiglu(gate, up, inplace_backward=True)
    if kind in ("tanh", "none"):
        return tritongrad.geglu(gate, up, approximate=kind, inplace_backward=True)
    return self.act_fn(gate) * up


@functools.cache
def _experts_dispatch_code():
    """The code of the forward that transformers' ``use_experts_implementation`` gives an experts class (it
    calls the implementation ``config._experts_implementation`` names), or None."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None

    class _Probe(torch.nn.Module):
        def forward(self, *args):
            return None

    try:
        return moe.use_experts_implementation(_Probe).forward.__code__
    except Exception:  # noqa: BLE001  (a transformers whose decorator takes other arguments)
        return None


def experts_lean(base: type) -> bool:
    """Whether ``base``'s forward is transformers' dispatch over experts implementations through
    ``ALL_EXPERTS_FUNCTIONS``: then its ``grouped_mm`` one can be served by ``grouped_experts``."""
    code = _experts_dispatch_code()
    fn = base.__dict__.get("forward") or getattr(base, "forward", None)
    if code is None or getattr(fn, "__code__", None) is not code:
        return False
    moe = _experts_moe()
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    return cells.get("experts_interface") is moe.ALL_EXPERTS_FUNCTIONS


def _experts_lean_why_not(self, x) -> str | None:
    """Why this call cannot take ``grouped_experts`` (None: it can): it must be the ``grouped_mm``
    implementation as transformers defines it, without expert parallelism, biases or a post-expert norm, on the
    concatenated [gate; up] layout with the activation patch established."""
    moe = _experts_moe()  # resolved at patch time: no import inside a compiled trace

    if getattr(self.config, "_experts_implementation", None) != "grouped_mm":
        return "not grouped_mm"
    if moe.ALL_EXPERTS_FUNCTIONS.get("grouped_mm") is not moe.grouped_mm_experts_forward:
        return "grouped_mm re-registered"
    if getattr(self, "_is_expert_parallel", False) or getattr(self, "has_post_expert_norm", False) \
            or getattr(self, "has_bias", True) or not getattr(self, "has_gate", False) \
            or not getattr(self, "is_concatenated", False) or x.dim() != 2 \
            or getattr(self, "num_experts", None) != self.gate_up_proj.shape[0]:
        return "layout"
    if type(self)._apply_gate is not experts_gate[GATE_OPS[self.__dict__[GATE_ATTR]]] \
            or "_apply_gate" in self.__dict__ or _act_why_not(self) is not None:
        return "gate"
    return None


def _experts_forward(self, *args, **kwargs):
    kind = self.__dict__.get(GATE_ATTR)
    if kind is not None and len(args) == 3 and not kwargs and _experts_lean_why_not(self, args[0]) is None:
        hidden_states, top_k_index, top_k_weights = args
        return tritongrad.grouped_experts(
            hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
            approximate=None if kind == "silu" else kind, is_transposed=bool(self.is_transposed))
    return original_forward_of(type(self))(self, *args, **kwargs)


experts_forward = {"swiglu": marked(_experts_forward, "swiglu"),
                   "geglu": marked(functools.wraps(_experts_forward)(
                       lambda self, *a, **k: _experts_forward(self, *a, **k)), "geglu")}
experts_gate = {"swiglu": marked(_experts_gate, "swiglu"),
                "geglu": marked(functools.wraps(_experts_gate)(lambda self, g: _experts_gate(self, g)), "geglu")}
EXPERTS_LEAN_DETAIL = ("; grouped_mm experts -> tritongrad.grouped_experts (its backward keeps the gate-and-up "
                       "product alone)")
EXPERTS_DETAIL = {"silu": "experts' act_fn(gate) * up -> swiglu (grouped_mm and batched_mm experts; eager keeps its loop)",
                  "tanh": "experts' act_fn(gate) * up -> geglu tanh (grouped_mm and batched_mm experts; eager keeps its loop)",
                  "none": "experts' act_fn(gate) * up -> geglu (grouped_mm and batched_mm experts; eager keeps its loop)"}


# ---------------------------------------------------------------- rotary embeddings
def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rope_formula(kind: str, x, cos, sin):
    """Hugging Face's rotary embeddings, as written in their modeling files: ``llama`` (rotate_half over the
    whole head), ``partial`` (GPT-NeoX, Phi3, StableLM: the first ``cos.shape[-1]`` features rotate, the rest
    pass), ``glm`` (GLM: cos/sin's first half repeat-interleaved, feature pairs rotate, partial as ``partial``;
    ``glm_full``: the same over the whole head only, Helium's and Ernie 4.5's), ``interleaved`` (Cohere: feature
    pairs rotate), ``flipped`` (NanoChat: rotate_half with its signs flipped, ``[x2, -x1]``) and ``half``
    (gpt-oss: tables of half the head's width, each half of the head rotated with them:
    ``[x1 c - x2 s, x2 c + x1 s]``, Llama's with the tables written twice); ``gptj`` (GPT-J, CodeGen: one
    table entry per feature pair, repeat-interleaved, pairs rotated over the whole width of what it is given;
    ``complex_bhtd`` and ``complex_bthd``, Llama 4's and DeepSeek-V2's ``apply_rotary_emb(xq, xk, freqs_cis)``:
    the same, the tables being ``freqs_cis``'s real and imaginary parts, in the two layouts);
    ``deinterleave`` (DeepSeek's ``apply_rotary_pos_emb_interleave``: the head's features reordered evens first,
    then odds, then Llama's, over the whole head; ``deinterleave_half``: the same with the tables' first half
    for both halves, as transformers 5.25 computes it, on the even and odd features directly);
    ``trailing_pairs`` (DeepSeek-V4's: one table entry per feature pair, repeat-interleaved, pairs rotated over
    the head's last ``2 cos.shape[-1]`` features, the leading ones passed)."""
    if kind == "deinterleave_half":
        half = cos.shape[-1] // 2
        cos, sin = torch.cat((cos[..., :half],) * 2, -1), torch.cat((sin[..., :half],) * 2, -1)
    if kind in ("deinterleave", "deinterleave_half"):
        x = x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)
    if kind in ("complex_bhtd", "complex_bthd"):  # PyTorch's complex product, in float32, rounded once
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.complex(cos.float(), sin.float())).flatten(-2).to(x.dtype)
    if kind in ("gptj", "trailing_pairs"):
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    if kind == "trailing_pairs":  # the last 2 cos.shape[-1] features rotate, in pairs; the leading ones pass
        r = cos.shape[-1]
        rest, rot = x[..., :x.shape[-1] - r], x[..., x.shape[-1] - r:]
        return torch.cat((rest, rot * cos + _rotate_pairs(rot) * sin), dim=-1)
    if kind == "half":
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    if kind in ("glm", "glm_full"):
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    if kind in ("glm", "glm_full", "interleaved", "gptj"):
        turned = _rotate_pairs(rot)
    else:
        turned = -_rotate_half(rot) if kind == "flipped" else _rotate_half(rot)
    return torch.cat((rot * cos + turned * sin, rest), dim=-1)


ROPE_DETAIL = {"llama": "rotate_half over the whole head (Llama)",
               "partial": "rotate_half over cos.shape[-1] features, the rest passed (partial rotary)",
               "glm": "interleaved pairs over cos.shape[-1] features (GLM)",
               "glm_full": "interleaved pairs over the whole head, cos/sin's first half repeat-interleaved "
                           "(Helium, Ernie 4.5)",
               "interleaved": "interleaved pairs over the whole head (Cohere)",
               "flipped": "rotate_half with its signs flipped over the whole head (NanoChat): sin negated",
               "half": "cos/sin of half the head's width for each half of it (gpt-oss): the tables written twice",
               "gptj": "apply_rotary_pos_emb(tensor, sin, cos), one table entry per feature pair (GPT-J, CodeGen): "
                       "the tables repeat-interleaved, pairs rotated",
               "complex_bhtd": "apply_rotary_emb(xq, xk, freqs_cis) on [B, H, T, D] (DeepSeek-V2): pairs rotated by "
                               "the complex table's real and imaginary parts, in float32",
               "complex_bthd": "apply_rotary_emb(xq, xk, freqs_cis) on [B, T, H, D] (Llama 4): pairs rotated by "
                               "the complex table's real and imaginary parts, in float32",
               "deinterleave": "DeepSeek's apply_rotary_pos_emb_interleave: features reordered evens then odds, "
                               "then rotate_half; the kernel's pairs with the tables' halves interleaved, its "
                               "output reordered",
               "deinterleave_half": "DeepSeek's apply_rotary_pos_emb_interleave on the even and odd features with "
                                    "the tables' first half: the kernel's pairs with that half repeat-interleaved, "
                                    "its output reordered",
               "trailing_pairs": "one table entry per feature pair, pairs rotated over the head's last 2 "
                                 "cos.shape[-1] features, the leading ones passed (DeepSeek-V4): the kernel on "
                                 "that slice"}
# Kinds established for one width of cos/sin only: the whole head (or, for "half", half of it).
_FULL_WIDTH = ("llama", "interleaved", "glm_full", "flipped", "deinterleave", "deinterleave_half")


def _rope_matches(fn, kind: str, r: int, dims=(1, 2)) -> bool:
    """Whether ``fn`` computes ``kind`` on probes with tables of width ``r``, head width 8, in the layouts
    ``dims`` (1: heads before the tokens, 2: after)."""
    g = _probe_rng()
    for dtype in (torch.float32, torch.bfloat16):
        for dim in dims:
            shape_q, shape_k = ((2, 3, 5, 8), (2, 1, 5, 8)) if dim == 1 else ((2, 5, 3, 8), (2, 5, 1, 8))
            q, k = torch.randn(*shape_q, generator=g).to(dtype), torch.randn(*shape_k, generator=g).to(dtype)
            cos, sin = torch.randn(2, 5, r, generator=g).to(dtype), torch.randn(2, 5, r, generator=g).to(dtype)
            try:
                got = fn(q, k, cos, sin, dim)
            except Exception:  # noqa: BLE001 - a function that refuses this width does not compute it
                return False
            c, s = cos.unsqueeze(dim), sin.unsqueeze(dim)
            # In the inputs' dtype, or in float32 rounded once (Cohere's): the kernels compute in float32.
            ways = [(_rope_formula(kind, q, c, s), _rope_formula(kind, k, c, s)),
                    tuple(_rope_formula(kind, x.float(), c.float(), s.float()).to(dtype) for x in (q, k))]
            if not any(_equal(tuple(got), want) for want in ways):
                return False
    return True


def signature(fn) -> inspect.Signature:
    """``fn``'s signature; for a module called as a function (transformers with the ``kernels`` package wraps
    each ``@use_kernel_forward_from_hub`` function in one, whose forward calls the function), its forward's."""
    return inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)


def _rope_single(fn) -> bool:
    """Whether ``fn`` takes one tensor, ``(x, cos, sin, unsqueeze_dim=1)`` (Gemma 3n's and Gemma 4's: q and k
    in two calls), rather than ``(q, k, cos, sin, unsqueeze_dim=1)``."""
    params = list(signature(fn).parameters.values())
    return [p.name for p in params] == ["x", "cos", "sin", "unsqueeze_dim"] and params[3].default == 1


@functools.cache
def rope_kind(fn) -> tuple[str | None, str | None]:
    """``(kind, None)`` when ``fn`` is one of Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin,
    unsqueeze_dim=1)``, or the one-tensor ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)`` (see
    :func:`_rope_formula`), checked bit for bit on probes; else ``(None, why not)``. ``llama`` is established
    for full-width cos/sin only (the replacement leaves other widths to ``fn``)."""
    try:
        sig = signature(fn)
    except (TypeError, ValueError):
        return None, "apply_rotary_pos_emb has no readable signature"
    params = list(sig.parameters.values())
    if [p.name for p in params] == ["q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"]:  # DeepSeek's
        pair = _rope_pair(fn, "deinterleave")[0]
        for kind in ("deinterleave", "deinterleave_half"):
            if params[5].default == 1 and _rope_matches(pair, kind, 8):
                return kind, None
        return None, (f"apply_rotary_pos_emb_interleave{sig} does not compute DeepSeek's interleaved rotary (evens "
                      "then odds, then rotate_half)")
    if [p.name for p in params] == ["xq", "xk", "freqs_cis"]:  # Llama 4's and DeepSeek-V2's complex tables
        pair = lambda q, k, cos, sin, dim: fn(q, k, torch.complex(cos.float(), sin.float()))  # noqa: E731
        for kind, dim in (("complex_bhtd", 1), ("complex_bthd", 2)):
            if _rope_matches(pair, kind, 4, dims=(dim,)):
                return kind, None
        return None, f"apply_rotary_emb{sig} does not compute pairs rotated by its complex table in either layout"
    if [p.name for p in params] == ["tensor", "sin", "cos"]:  # GPT-J's: [B, T, H, R] and per-pair tables
        pair = _rope_pair(fn, "gptj")[0]
        if _rope_matches(pair, "gptj", 4, dims=(2,)):
            return "gptj", None
        return None, f"apply_rotary_pos_emb{sig} does not compute GPT-J's rotary (per-pair tables, pairs rotated)"
    if _rope_single(fn):
        fn = _rope_pair(fn, "llama")[0]  # q and k in two calls
    elif [p.name for p in params] != ["q", "k", "cos", "sin", "unsqueeze_dim"] or params[4].default != 1:
        return None, f"apply_rotary_pos_emb{sig} is not (q, k, cos, sin, unsqueeze_dim=1) nor (x, cos, sin, unsqueeze_dim=1)"
    kind = _pair_kind(fn)
    if kind is None:
        return None, ("apply_rotary_pos_emb computes none of the known rotary embeddings (Llama's rotate_half, "
                      "partial rotary, GLM's or Cohere's interleaved pairs, NanoChat's flipped signs, gpt-oss's "
                      "half-width tables, DeepSeek-V4's pairs over the head's last features)")
    if params[0].name == "q" and params[1].default is None:
        # k=None rotates q alone (Qwen4-exp's indexer calls it so): established as well, or not replaced.
        alone = lambda q, k, cos, sin, dim: (fn(q, None, cos, sin, dim), fn(k, None, cos, sin, dim))  # noqa: E731
        if _pair_kind(alone) != kind:
            return None, f"apply_rotary_pos_emb{sig} called with k=None computes something else than with k"
    return kind, None


def _pair_kind(fn) -> str | None:
    """The kind (:func:`_rope_formula`) that ``fn(q, k, cos, sin, unsqueeze_dim)`` computes on probes, or None."""
    if _rope_matches(fn, "llama", 8):
        return "partial" if _rope_matches(fn, "partial", 4) else "llama"
    if _rope_matches(fn, "glm", 8):
        return "glm" if _rope_matches(fn, "glm", 4) else "glm_full"
    for kind, width in (("interleaved", 8), ("flipped", 8), ("half", 4)):
        if _rope_matches(fn, kind, width):
            return kind
    if _rope_matches(fn, "trailing_pairs", 2) and _rope_matches(fn, "trailing_pairs", 4):  # part, whole head
        return "trailing_pairs"
    return None


# Widths of cos/sin each kind is probed at (head width 8): the whole head, and a part where the kind has one;
# the layouts (1: heads before the tokens, 2: after).
_ROPE_WIDTHS = {"llama": (8,), "partial": (8, 4), "glm": (8, 4), "glm_full": (8,), "interleaved": (8,),
                "flipped": (8,), "half": (4,), "gptj": (4,), "deinterleave": (8,), "deinterleave_half": (8,),
                "trailing_pairs": (2, 4)}


def _rope_pair(fn, kind: str):
    """``fn`` as ``pair(q, k, cos, sin, dim) -> (q_embed, k_embed)`` and the layouts it takes."""
    if kind == "gptj":  # (tensor, sin, cos), [B, T, H, R] only
        return (lambda q, k, cos, sin, dim: (fn(q, sin, cos), fn(k, sin, cos))), (2,)
    if kind in ("deinterleave", "deinterleave_half"):  # (q, k, cos, sin, position_ids, unsqueeze_dim)
        return (lambda q, k, cos, sin, dim: fn(q, k, cos, sin, None, dim)), (1, 2)
    if _rope_single(fn):
        return (lambda q, k, cos, sin, dim: (fn(q, cos, sin, dim), fn(k, cos, sin, dim))), (1, 2)
    return fn, (1, 2)


@functools.cache
def rope_mixed(fn) -> str | None:
    """What ``fn``, of a kind :func:`rope_kind` established, computes for float16/bfloat16 q and k with float32
    cos and sin (Olmo2's and GPT-J's tables, and every family's under bfloat16 autocast), checked bit for bit on
    probes: ``"cast"``, the kind's formula in float32 cast back to q's dtype (Olmo2's ``q_embed.to(q_type)``:
    the op with ``out_dtype=q.dtype``); ``"promote"``, the float32 result (Llama's ``q * cos``: the op's
    promotion); None, neither (the replacement keeps ``fn`` for such inputs)."""
    kind = rope_kind(fn)[0]
    if kind not in _ROPE_WIDTHS:
        return None
    pair, dims = _rope_pair(fn, kind)
    with torch.autocast("cpu", enabled=False), torch.no_grad():  # the dtypes as given, wherever it is asked
        return _rope_mixed_probe(pair, kind, dims)


def _rope_mixed_probe(pair, kind: str, dims: tuple) -> str | None:
    g = _probe_rng()
    found = set()
    for dtype in (torch.bfloat16, torch.float16):
        for r in _ROPE_WIDTHS[kind]:
            for dim in dims:
                shape_q, shape_k = ((2, 3, 5, 8), (2, 1, 5, 8)) if dim == 1 else ((2, 5, 3, 8), (2, 5, 1, 8))
                q, k = torch.randn(*shape_q, generator=g).to(dtype), torch.randn(*shape_k, generator=g).to(dtype)
                cos, sin = torch.randn(2, 5, r, generator=g), torch.randn(2, 5, r, generator=g)
                try:
                    got = tuple(pair(q, k, cos, sin, dim))
                except Exception:  # noqa: BLE001 - a function that refuses mixed dtypes keeps them
                    return None
                c, s = cos.unsqueeze(dim), sin.unsqueeze(dim)
                wide = tuple(_rope_formula(kind, x.float(), c, s) for x in (q, k))
                if _equal(got, tuple(y.to(dtype) for y in wide)):
                    found.add("cast")
                elif _equal(got, wide):
                    found.add("promote")
                else:
                    return None
    return found.pop() if len(found) == 1 else None


def rope_why_not(fn) -> str | None:
    return rope_kind(fn)[1]


def _one_head(x, unsqueeze_dim):
    """One head of x, detached: the k the rope kernel rotates beside a lone x, its result dropped (1/H more of
    the kernel's work, no gradient through it)."""
    return (x[:, :1] if unsqueeze_dim in (1, -3) else x[:, :, :1]).detach()


def rope_function(original):
    """The replacement of a module's ``apply_rotary_pos_emb``, for the kind :func:`rope_kind` established.
    float16/bfloat16 q and k with float32 tables run the op where :func:`rope_mixed` established what the
    original computes for them (Olmo2 casts the float32 result back to q's dtype); other mixed dtypes, cos/sin
    that require grad, layouts other than ``unsqueeze_dim`` 1 or 2, and widths the kind was not established for
    keep the original. The one-tensor form, and q alone where the original's k defaults to None, rotate q
    beside one head of it (:func:`_one_head`)."""
    kind = rope_kind(original)[0]
    mixed_rule = rope_mixed(original)  # probed here, outside the calls' autocast, transforms and tracing

    def mixed(q, k, cos, sin):
        """False: one dtype; "cast" or "promote": float16/bfloat16 q and k with float32 tables, as rope_mixed
        established; None: another mix, which keeps the original (its own promotion rules decide)."""
        if q.dtype == cos.dtype and k.dtype == cos.dtype and sin.dtype == cos.dtype:
            return False
        if q.dtype == k.dtype and q.dtype in (torch.float16, torch.bfloat16) and cos.dtype == sin.dtype == torch.float32:
            return mixed_rule
        return None
    if kind in ("complex_bhtd", "complex_bthd"):
        dim = 1 if kind == "complex_bhtd" else 2

        def apply_rotary_emb(xq, xk, freqs_cis):
            if (not isinstance(freqs_cis, torch.Tensor) or freqs_cis.dtype != torch.complex64
                    or freqs_cis.device != xq.device or freqs_cis.dim() != 3 or xq.dim() != 4 or xk.dim() != 4 or freqs_cis.requires_grad
                    or 2 * freqs_cis.shape[-1] != xq.shape[-1] or xq.dtype not in (torch.float16, torch.bfloat16,
                                                                                  torch.float32)):
                kept("rope", original)
                return original(xq, xk, freqs_cis)
            # The original multiplies in float32 and rounds once to xq's dtype: float32 tables, then the cast.
            cos = freqs_cis.real.repeat_interleave(2, -1)
            sin = freqs_cis.imag.repeat_interleave(2, -1)
            q, k = tritongrad.apply_rotary_pos_emb(xq, xk, cos, sin, dim, interleaved=True)
            return q.type_as(xq), k.type_as(xk)

        apply_rotary_emb._tritongrad_original = original
        return marked(apply_rotary_emb, "rope")
    if kind in ("deinterleave", "deinterleave_half"):
        def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            # position_ids: established as None (transformers' own callers pass none; the function ignores it).
            m = mixed(q, k, cos, sin)
            if (position_ids is not None or q.dim() != 4 or k.dim() != 4 or m is None
                    or cos.requires_grad or sin.requires_grad or cos.dim() != 3
                    or unsqueeze_dim not in (1, 2, -2, -3) or cos.shape[-1] != q.shape[-1]):
                kept("rope", original)
                return original(q, k, cos, sin, position_ids, unsqueeze_dim)
            half = q.shape[-1] // 2
            # out[j] = q[2j] c[j] - q[2j+1] s[j], out[j + D/2] = q[2j+1] c[j'] + q[2j] s[j'] (j' = j + D/2, or j
            # for the half kind): the kernel's pairs with table entries j and j' side by side, its output
            # reordered.
            second = slice(0, half) if kind == "deinterleave_half" else slice(half, None)
            c = torch.stack((cos[..., :half], cos[..., second]), -1).flatten(-2)
            s = torch.stack((sin[..., :half], sin[..., second]), -1).flatten(-2)
            q_embed, k_embed = tritongrad.apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim, interleaved=True,
                                                               out_dtype=q.dtype if m == "cast" else None)
            return tuple(y.unflatten(-1, (half, 2)).transpose(-1, -2).flatten(-2) for y in (q_embed, k_embed))

        apply_rotary_pos_emb_interleave._tritongrad_original = original
        return marked(apply_rotary_pos_emb_interleave, "rope")
    if kind == "gptj":
        def apply_rotary_pos_emb_gptj(tensor, sin, cos):
            m = mixed(tensor, tensor, cos, sin)
            if (tensor.dim() != 4 or cos.dim() != 3 or m is None
                    or cos.requires_grad or sin.requires_grad or 2 * cos.shape[-1] != tensor.shape[-1]):
                kept("rope", original)
                return original(tensor, sin, cos)
            cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
            return tritongrad.apply_rotary_pos_emb(tensor, _one_head(tensor, 2), cos, sin, 2, interleaved=True,
                                                   out_dtype=tensor.dtype if m == "cast" else None)[0]

        apply_rotary_pos_emb_gptj._tritongrad_original = original
        return marked(apply_rotary_pos_emb_gptj, "rope")
    # The original on q alone: the one-tensor form, or a k that defaults to None (rope_kind established both).
    params = signature(original).parameters
    if _rope_single(original):
        alone = original
    elif "k" in params and params["k"].default is None:
        alone = lambda q, cos, sin, dim: original(q, None, cos, sin, dim)  # noqa: E731
    else:
        alone = None

    def apply_rotary_pos_emb(q, k=None, cos=None, sin=None, unsqueeze_dim=1, _original=original):
        if k is None:
            if alone is None:  # k is required: the original's error
                return original(q, k, cos, sin, unsqueeze_dim)
            if cos is None or sin is None or q.dim() != 4 or unsqueeze_dim not in (1, 2, -2, -3):
                kept("rope", original)
                return alone(q, cos, sin, unsqueeze_dim)
            return apply_rotary_pos_emb(q, _one_head(q, unsqueeze_dim), cos, sin, unsqueeze_dim,
                                        _original=lambda q_, k_, c, s, d: (alone(q_, c, s, d), None))[0]
        m = mixed(q, k, cos, sin)
        if (m is None or cos.requires_grad
                or sin.requires_grad or unsqueeze_dim not in (1, 2, -2, -3) or cos.dim() != 3
                or kind in _FULL_WIDTH and cos.shape[-1] != q.shape[-1]
                or kind == "half" and 2 * cos.shape[-1] != q.shape[-1]
                or kind == "trailing_pairs" and (2 * cos.shape[-1] > q.shape[-1] or q.shape[-1] != k.shape[-1])):
            kept("rope", original)
            return _original(q, k, cos, sin, unsqueeze_dim)
        out_dtype = q.dtype if m == "cast" else None
        if kind == "trailing_pairs":  # the kernel on the last r features, read in place; the leading ones pass
            r = 2 * cos.shape[-1]
            cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
            D = q.shape[-1]
            q_rot, k_rot = tritongrad.apply_rotary_pos_emb(q[..., D - r:], k[..., D - r:], cos, sin, unsqueeze_dim,
                                                           interleaved=True, out_dtype=out_dtype)
            return torch.cat((q[..., :D - r], q_rot), -1), torch.cat((k[..., :D - r], k_rot), -1)
        if kind == "half":
            cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        elif kind == "flipped":
            sin = -sin
        elif kind in ("glm", "glm_full"):
            half = cos.shape[-1] // 2
            cos, sin = cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
        return tritongrad.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, out_dtype=out_dtype,
                                               interleaved=kind in ("glm", "glm_full", "interleaved"))

    if _rope_single(original):
        def apply_rotary_pos_emb_one(x, cos, sin, unsqueeze_dim=1):
            return apply_rotary_pos_emb(x, None, cos, sin, unsqueeze_dim)

        apply_rotary_pos_emb_one._tritongrad_original = original
        return marked(apply_rotary_pos_emb_one, "rope")
    apply_rotary_pos_emb._tritongrad_original = original
    return marked(apply_rotary_pos_emb, "rope")


# ---------------------------------------------------------------- the causal mask under torch.compile
class _Unpacked:
    """``value``: True while a patched causal-LM forward runs its base model on positions the model numbers
    itself. One flag per process: forwards running concurrently in threads, one of them on packed sequences,
    need causal_mask=False."""

    def __init__(self):
        self.value = False  # an instance attribute from the start: torch.compile guards on the instance's dict


UNPACKED = _Unpacked()


def packed_why_not(fn) -> str | None:
    """None when ``fn`` reads as transformers' ``masking_utils.find_packed_sequence_indices(position_ids)``."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "find_packed_sequence_indices has no readable signature"
    return None if names == ["position_ids"] else f"find_packed_sequence_indices{inspect.signature(fn)} is not (position_ids)"


def packed_function(original):
    """The replacement of ``masking_utils.find_packed_sequence_indices``, which looks for several sequences
    packed in a row (position ids restarting). Under torch.compile it cannot read the positions, so it always
    returns them, and the mask builder then makes an explicit ``[B, 1, S, S]`` mask instead of SDPA's
    ``is_causal``: attention runs several times slower (docs/models.md#torchcompile). When a patched causal-LM
    forward runs its base model without position_ids and attention_mask, the model numbers every row 0, 1, ...
    itself and nothing is packed: None, as the original finds in eager mode (without its host sync)."""

    def find_packed_sequence_indices(position_ids):
        if UNPACKED.value:
            return None
        return original(position_ids)

    find_packed_sequence_indices._tritongrad_original = original
    return marked(find_packed_sequence_indices, "causal_mask")


def causal_mask_why_not(fn) -> str | None:
    """None when ``fn`` reads as transformers' ``masking_utils._ignore_causal_mask_sdpa(padding_mask,
    q_length (or query_length), kv_length, ...)``."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "_ignore_causal_mask_sdpa has no readable signature"
    if names[:1] != ["padding_mask"] or "kv_length" not in names or not {"q_length", "query_length"} & set(names):
        return f"_ignore_causal_mask_sdpa{inspect.signature(fn)} does not take (padding_mask, q_length, kv_length, ...)"
    return None


def causal_mask_function(original):
    """The replacement of ``masking_utils._ignore_causal_mask_sdpa``, which decides whether SDPA gets
    ``is_causal=True`` instead of an explicit ``[B, 1, S, S]`` mask. Hugging Face skips the mask only outside
    tracing where torch < 2.14, whose Dynamo folds ``torch.compiler.is_exporting()`` to True: compiled
    training then builds the mask and SDPA runs several times slower (docs/models.md#torchcompile). Under
    torch.compile, not export, with no padding mask, ``q_length`` 1 or ``kv_length`` and no sliding window
    reached, this returns True, as the original does in eager mode; every other call goes to the original."""
    names = list(inspect.signature(original).parameters)
    pos = {n: i for i, n in enumerate(names)}
    q_name = "q_length" if "q_length" in pos else "query_length"

    def arg(name, args, kwargs, default=None):
        i = pos.get(name)
        return args[i] if i is not None and i < len(args) else kwargs.get(name, default)

    def _ignore_causal_mask_sdpa(*args, **kwargs):
        # The flag torch.export sets; absent (an older torch): leave every call to the original.
        if torch.compiler.is_compiling() and not getattr(torch.compiler, "_is_exporting_flag", True):
            q, kv = arg(q_name, args, kwargs), arg("kv_length", args, kwargs)
            window = arg("local_attention_size", args, kwargs)
            if (arg("padding_mask", args, kwargs) is None and (q == 1 or q == kv)
                    and (window is None or kv < window)
                    and not isinstance(arg("q_offset", args, kwargs, 0), torch.Tensor)):
                return True
        return original(*args, **kwargs)

    _ignore_causal_mask_sdpa._tritongrad_original = original
    return marked(_ignore_causal_mask_sdpa, "causal_mask")


# ---------------------------------------------------------------- causal-LM loss
def causal_lm_why_not(cls: type) -> str | None:
    if not cls.__name__.endswith("ForCausalLM"):
        return f"{cls.__name__} is not a *ForCausalLM class"
    try:
        params = inspect.signature(original_forward_of(cls)).parameters
    except (TypeError, ValueError):
        return f"{cls.__name__}.forward has no readable signature"
    missing = [n for n in ("labels", "logits_to_keep") if n not in params]
    return f"{cls.__name__}.forward takes no {' or '.join(missing)}" if missing else None


def original_forward_of(cls: type):
    """The forward ``cls`` had before tritongrad: through tritongrad's subclasses and class-level patches."""
    for c in cls.__mro__:
        if c in SAVED_FORWARDS:
            return SAVED_FORWARDS[c]
        fn = c.__dict__.get("forward")
        if fn is None:
            continue
        if patched_op(fn) is None:
            return fn
        original = getattr(fn, "_tritongrad_original", None)
        if original is not None:
            return original
    raise RuntimeError(f"tritongrad: no original forward for {cls.__name__}")


def _shifted(labels, shift_labels, ignore_index):
    """Hugging Face's causal shift: the label of position t is the token at t + 1 (the last one ignored)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _mean_or_per_item(loss, num_items_in_batch):
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                   shift_labels=None, **kwargs):
    """Hugging Face's ``ForCausalLMLoss`` on :func:`tritongrad.cross_entropy`: logits in float32 (as Hugging
    Face upcasts them), the causal shift, mean over the labelled tokens, or their sum divided by
    ``num_items_in_batch`` (gradient accumulation)."""
    logits = logits.float().reshape(-1, vocab_size)
    target = _shifted(labels, shift_labels, ignore_index).to(logits.device)
    loss = tritongrad.cross_entropy(logits, target, ignore_index=ignore_index,
                                    reduction="sum" if num_items_in_batch is not None else "mean")
    return _mean_or_per_item(loss, num_items_in_batch)


# PreTrainedModel.loss_function returns ``self._loss_function`` where there is one: a class attribute.
LOSS_FUNCTION = staticmethod(marked(causal_lm_loss, "cross_entropy"))


def causal_lm_linear_loss(hidden_states, weight, bias, labels, logit_softcap=None, num_items_in_batch=None,
                          ignore_index: int = -100, shift_labels=None, logit_scale: float = 1.0, **kwargs):
    """The loss of :func:`causal_lm_loss` from the hidden states and the LM head, without logits: the logits
    ``logit_scale * (h @ weight.T + bias)``, soft-capped where the model caps them."""
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    target = _shifted(labels, shift_labels, ignore_index).to(h.device)
    extra = {} if logit_scale == 1.0 else {"logit_scale": logit_scale}
    loss = tritongrad.linear_cross_entropy(h, weight, target, bias, ignore_index=ignore_index,
                                           reduction="sum" if num_items_in_batch is not None else "mean",
                                           logit_softcap=logit_softcap, out_dtype=torch.float32, **extra)
    return _mean_or_per_item(loss, num_items_in_batch)


def _slice_last(hidden_states, logits_to_keep):
    """transformers before 5.2x: an int keeps the last positions (0: all), a tensor indexes them."""
    index = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden_states[:, index, :]


def _transformers_parts() -> tuple:
    """What the linear-loss forward takes from the installed transformers, read at patch time (torch.compile
    traces neither dataclasses.fields nor a failing import): the output class, the fields copied from the
    model's output (``cache`` since transformers 5.2x, ``past_key_values`` before), the logits_to_keep slicer."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        slice_logits_to_keep = _slice_last
    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    copied = tuple(n for n in ("cache", "past_key_values", "hidden_states", "attentions") if n in fields)
    return CausalLMOutputWithPast, copied, slice_logits_to_keep


# ---------------------------------------------------------------- what the causal-LM head computes
@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """How a causal LM's training loss comes from its base model, established by :func:`head_spec`: the base
    model's and the LM head's attribute names, and the logits as ``softcap(logit_scale * lm_head(h))``."""

    base: str
    head: str
    logit_scale: float = 1.0
    softcap: float | None = None
    router_logits: bool = False  # a MoE forward whose loss adds the router's aux loss when asked for
    read: tuple = ()  # the values of SCALE_NAMES the probe ran with (head_values): a later change re-establishes
    cast_input: bool = False  # the forward casts h to the head's dtype (Mamba's float32 stream, bfloat16 head)


# What a head's logits depend on beyond its weights, by (on the config or the model, name): the scales
# _named_scales reads and the soft cap.
SCALE_NAMES = (("config", "logits_scaling"), ("model", "logit_scale"), ("config", "logit_scale"),
               ("config", "final_logit_softcapping"))


def head_values(model) -> tuple:
    """The values of :data:`SCALE_NAMES` on ``model`` now."""
    return tuple(getattr(model.config if where == "config" else model, name, None) for where, name in SCALE_NAMES)


class _ProbeOutput(dict):
    """A base model's output carrying only the last hidden states (every other field None)."""

    def __init__(self, h):
        super().__init__(last_hidden_state=h)

    def __getattr__(self, name):
        return self.get(name)

    def __getitem__(self, key):
        return self["last_hidden_state"] if key == 0 else dict.__getitem__(self, key)

    def to_tuple(self):
        return (self["last_hidden_state"],)


class _ProbeBase(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.h = h

    def forward(self, *args, **kwargs):
        return _ProbeOutput(self.h)


def _config_float(obj, name):
    v = getattr(obj, name, None)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0 else None


def head_spec(model: torch.nn.Module) -> HeadSpec | str:
    """What ``model``'s causal-LM forward computes from its base model's last hidden states ``h``, or why
    that is not established.

    The forward the model's class had before tritongrad runs on a probe: a shallow copy of ``model`` whose
    base model returns a fixed random ``h`` and whose LM head is a small random stand-in with the real
    vocabulary. Its logits must equal ``softcap(s * lm_head(h))`` for a scale ``s`` read from the config
    (1, ``1 / logits_scaling``, ``logit_scale``) and the config's ``final_logit_softcapping``; its loss, with
    and without ``num_items_in_batch``, Hugging Face's shifted cross-entropy of those logits. Anything else the
    forward does to the logits or the loss (a scale of another name, an extra term) fails the probe.
    """
    cls = type(model)
    try:
        original = original_forward_of(cls)
    except RuntimeError as e:
        return str(e)
    found = _base_and_head(model)
    if isinstance(found, str):
        return found
    prefix, head_name, head = found
    config = copy.copy(model.config)
    router = getattr(config, "output_router_logits", None) is not None
    if router:
        config.output_router_logits = False  # the aux-loss path keeps the original forward (causal_lm_forward)
    V = head.out_features
    probe, stand_in, h, labels = _probe_model(model, config, prefix, head_name, head)
    params = inspect.signature(original).parameters
    call = {"input_ids": labels.clamp(min=0), "labels": labels}
    if "use_cache" in params:
        call["use_cache"] = False
    try:
        with torch.no_grad():
            out = original(probe, **call)
            out_n = original(probe, **call, num_items_in_batch=3) if "kwargs" in params else None
    except Exception as e:  # noqa: BLE001 - any failure: the forward is not the layout this replaces
        return f"{cls.__name__}.forward failed on a probe with a stand-in base model ({type(e).__name__}: {e})"
    logits, loss = getattr(out, "logits", None), getattr(out, "loss", None)
    if not isinstance(logits, torch.Tensor) or not isinstance(loss, torch.Tensor):
        return f"{cls.__name__}.forward returns no logits and loss"
    raw = stand_in(h).detach()
    scales = _named_scales(model, config)
    found = _logit_form(logits, raw, scales, _config_float(config, "final_logit_softcapping"))
    if found is None:
        return (f"{cls.__name__}.forward computes logits other than softcap(scale * lm_head(h)) for the scales "
                f"its config names ({', '.join(f'{s:g}' for s in scales)})")
    s, c = found
    z = raw * s if c is None else torch.tanh(raw * s / c) * c
    target = _shifted(labels, None, -100)
    want = F.cross_entropy(z.reshape(-1, V).double(), target, reduction="sum")
    count = (target != -100).sum()
    for got, expect in ((loss, want / count), (getattr(out_n, "loss", None), want / 3)):
        if out_n is None and got is None:
            continue
        if not isinstance(got, torch.Tensor) or not torch.allclose(got.double(), expect, rtol=1e-5, atol=0):
            return (f"{cls.__name__}.forward's loss is not Hugging Face's shifted cross-entropy of its logits "
                    "(mean over labelled tokens, or sum / num_items_in_batch)")
    return HeadSpec(prefix, head_name, s, c, router, head_values(model),
                    _casts_to_head(original, probe, head_name, stand_in, h, call, s, c))


def _casts_to_head(original, probe, head_name: str, stand_in, h, call: dict, s: float, c) -> bool:
    """Whether the forward casts float32 ``h`` to a bfloat16 head's dtype (``lm_head(h.to(weight.dtype))``, as
    Mamba's does for its float32 stream): the probe again with the stand-in head in bfloat16. Most forwards
    call the head as it is, and F.linear refuses the two dtypes (as linear_cross_entropy does)."""
    head16 = copy.deepcopy(stand_in).to(torch.bfloat16)
    probe.__dict__["_modules"] = {**probe._modules, head_name: head16}
    try:
        with torch.no_grad():
            logits = original(probe, **call).logits
    except Exception:  # noqa: BLE001 - the head called with two dtypes fails: no cast
        return False
    finally:
        probe.__dict__["_modules"] = {**probe._modules, head_name: stand_in}
    with torch.no_grad():
        raw = head16(h.to(torch.bfloat16)).float()
    z = raw * s if c is None else torch.tanh(raw * s / c) * c
    return isinstance(logits, torch.Tensor) and torch.allclose(logits.float(), z, rtol=2.0**-7, atol=1e-6)


def _base_and_head(model: torch.nn.Module):
    """``(base model attribute, LM head attribute, the head)``, or why the model has no such pair."""
    cls = type(model)
    prefix = getattr(model, "base_model_prefix", None) or "model"
    base = model._modules.get(prefix)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = next((n for n, m in model._modules.items() if m is head and head is not None), None)
    if not isinstance(base, torch.nn.Module):
        return f"{cls.__name__} has no base model at .{prefix} (its base_model_prefix)"
    if head_name is None:
        return f"{cls.__name__}'s output embedding is a {type(head).__name__}, not a torch.nn.Linear attribute"
    why = call_why_not(head, head_name, torch.nn.Linear)
    if why is not None:
        return f"{cls.__name__}'s LM head: {why}"
    return prefix, head_name, head


def _probe_model(model, config, prefix: str, head_name: str, head: torch.nn.Linear) -> tuple:
    """``(probe, stand-in head, h, labels)``: a shallow copy of ``model`` whose base model returns the fixed
    random ``h`` and whose LM head is a small random stand-in with the real vocabulary (and bias)."""
    V, bias = head.out_features, head.bias is not None
    g = _probe_rng()
    h = torch.randn(2, 5, 4, generator=g) * 2
    stand_in = torch.nn.Linear(4, V, bias=bias)
    with torch.no_grad():
        stand_in.weight.copy_(torch.randn(V, 4, generator=g))
        if bias:
            stand_in.bias.copy_(torch.randn(V, generator=g))
    probe = copy.copy(model)
    probe.__dict__["_modules"] = {**model._modules, prefix: _ProbeBase(h), head_name: stand_in}
    probe.__dict__["config"] = config
    labels = torch.randint(0, V, (2, 5), generator=g)
    labels[0, 2] = -100
    return probe, stand_in, h, labels


def _named_scales(model, config) -> list:
    """1 and the logit scales the config or the model names (``1 / logits_scaling``, ``logit_scale``)."""
    scales = [1.0]
    for where, name, invert in ((config, "logits_scaling", True), (model, "logit_scale", False),
                                (config, "logit_scale", False)):
        v = _config_float(where, name)
        if v is not None:
            scales.append(1.0 / v if invert else v)
    return scales


def _logit_form(logits, raw, scales: list, cap):
    """The first ``(scale, cap)`` with ``logits == softcap(scale * raw)`` (cap None: no soft cap), or None."""
    for s in scales:
        for c in ((cap, None) if cap is not None else (None,)):
            z = raw * s
            if c is not None:
                z = torch.tanh(z / c) * c
            if logits.shape == z.shape and torch.allclose(logits.float(), z, rtol=1e-5, atol=1e-5):
                return s, c
    return None


def spec_detail(spec: HeadSpec) -> str:
    parts = [f"training loss from {spec.base}'s hidden states and {spec.head}, no logits"]
    if spec.logit_scale != 1.0:
        parts.append(f"logit scale {spec.logit_scale:g}")
    if spec.softcap is not None:
        parts.append(f"soft cap {spec.softcap:g}")
    if spec.router_logits:
        parts.append("the original forward when router logits are asked for (aux loss)")
    return "; ".join(parts)


def _linear_loss_forward(self, spec: HeadSpec, parts, labels, logits_to_keep=0, return_dict=None, **kwargs):
    out_cls, copied, slice_to_keep = parts
    # No position_ids and no attention_mask: the base model numbers each row 0, 1, ...: nothing is packed.
    outer = UNPACKED.value
    UNPACKED.value = kwargs.get("position_ids") is None and kwargs.get("attention_mask") is None
    try:
        outputs = getattr(self, spec.base)(**kwargs)
    finally:
        UNPACKED.value = outer
    hidden_states = slice_to_keep(outputs[0], logits_to_keep)
    head = getattr(self, spec.head)
    if spec.cast_input and hidden_states.dtype != head.weight.dtype:  # as the forward does (head_spec)
        hidden_states = hidden_states.to(head.weight.dtype)
    loss = causal_lm_linear_loss(hidden_states, head.weight, head.bias, labels, spec.softcap,
                                 logit_scale=spec.logit_scale, **kwargs)
    fields = {name: getattr(outputs, name, None) for name in copied}
    out = out_cls(loss=loss, logits=None, **fields)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if return_dict is not False:
        return out
    # The original's tuple keeps logits at position 1 (never None there): so does this one.
    return (loss, None, *(v for v in fields.values() if v is not None))


SPEC_ATTR = "_tritongrad_head"
WARNED_ATTR = "_tritongrad_warned"


def _warn_once(m, message: str) -> None:
    """``message`` as a warning, once per instance and message (eager only: a traced call stays unbroken)."""
    if torch.compiler.is_compiling():
        return
    seen = m.__dict__.setdefault(WARNED_ATTR, set())
    if message not in seen:
        seen.add(message)
        warnings.warn(f"tritongrad: {message}", stacklevel=3)


DECIDERS[SPEC_ATTR] = lambda m, _: head_spec(m)


@functools.cache
def causal_lm_forward(original):
    """The forward of a ``*ForCausalLM`` class with linear_cross_entropy: in training with ``labels``, the loss
    from the last hidden states and the LM head's weight (``logits`` is None in the output), as established for
    the instance by :func:`head_spec`; otherwise (no labels, eval mode, an LM head whose weight is still
    sharded, router logits asked for, or a head the probe did not establish) the original forward."""
    parts = _transformers_parts()
    names = []
    for p in list(inspect.signature(original).parameters.values())[1:]:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY):
            break
        names.append(p.name)

    def forward(self, *args, **kwargs):
        if args:
            if len(args) > len(names):
                raise TypeError(f"{type(self).__name__}.forward takes {len(names)} positional arguments, "
                                f"got {len(args)}")
            kwargs.update(zip(names, args))
        if not self.training or kwargs.get("labels") is None:
            return original(self, **kwargs)
        spec = decided(self, SPEC_ATTR)
        if isinstance(spec, HeadSpec) and head_values(self) != spec.read:
            # A scale or cap set after patch: the probe runs again (eager); a traced call keeps the model's own.
            spec = None if torch.compiler.is_compiling() else head_spec(self)
            if spec is not None:
                self.__dict__[SPEC_ATTR] = spec
        if (not isinstance(spec, HeadSpec) or type(getattr(self, spec.head).weight) not in PLAIN_TENSORS
                or spec.router_logits and kwargs.get("output_router_logits",
                                                     getattr(self.config, "output_router_logits", False))):
            return original(self, **kwargs)
        why = call_why_not(getattr(self, spec.head), spec.head, torch.nn.Linear)
        if why is not None:  # the head changed since patch (a LoRA layer in its place, hooks): the model's own loss
            _warn_once(self, f"{type(self).__name__}: the loss is the model's own, from its logits, not "
                             f"linear_cross_entropy's: {why}")
            return original(self, **kwargs)
        return _linear_loss_forward(self, spec, parts, **kwargs)

    functools.update_wrapper(forward, original)
    del forward.__wrapped__  # inspect.signature shows the original's parameters through __signature__
    forward.__signature__ = inspect.signature(original)
    forward._tritongrad_original = original
    return marked(forward, "linear_cross_entropy")


# ---------------------------------------------------------------- families
def modeling_module(family: str):
    """``transformers.models.<family>.modeling_<family>``."""
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def classes_of(module) -> list[type]:
    return [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__
            and issubclass(v, torch.nn.Module)]


def config_gate_kind(mlp_cls: type, causal_lm_classes: list[type]) -> tuple[str | None, str | None]:
    """For class-level patching: the gate (:func:`gate_kind`) the family's default config builds ``mlp_cls``
    with, built on the meta device (no memory); ``("silu", None)`` if it cannot be built (the forward then
    checks each instance's activation when it first runs)."""
    for lm in causal_lm_classes:
        config_cls = getattr(lm, "config_class", None)
        if config_cls is None:
            continue
        try:
            with torch.device("meta"):
                mlp = mlp_cls(config_cls())
        except Exception:  # noqa: BLE001
            return "silu", None
        kind, why = gate_kind(mlp.act_fn)
        return kind, None if why is None else f"{why} (the default {config_cls.__name__})"
    return "silu", None


# ---------------------------------------------------------------- the decoder layer's residual add and norm
# The three statements of Llama's decoder layer (and the families that copy it, Gemma's sandwich norms too)
# that fuse, as ast.unparse writes them: <h> any expression (hidden_states; Granite's hidden_states *
# self.residual_multiplier; Phi3's dropout of it), evaluated as the layer does, before the add; the norm an
# attribute named *norm*. The forward is recompiled with them replaced by one call of add_norm.
ADD_NORM_STATEMENTS = ("hidden_states = residual + <h>", "residual = hidden_states",
                       "hidden_states = self.<norm>(hidden_states)")
_ADD_NORM_CALL = re.compile(r"hidden_states = self\.([A-Za-z_]\w*norm\w*)\(hidden_states\)")  # a norm, by name
# The norm kinds the fused op computes, by the patched norm's forward: (kind, weight_offset, cast_before_weight).
ADD_NORM_KINDS = {"llama_rms_norm_forward": ("llama", 0.0, True), "gemma_rms_norm_forward": ("gemma", 1.0, False),
                  "olmo2_rms_norm_forward": ("olmo2", 0.0, False)}


def add_norm_detail(norm: str) -> str:
    return f"residual + h and {norm} -> fused_add_rms_norm (where the norm is patched: Llama's, Gemma's, Olmo2's)"


def norm_args(norm) -> tuple | None:
    """``(weight, eps, weight_offset, cast_before_weight)`` where ``norm`` is an RMSNorm patched to one of
    :data:`ADD_NORM_KINDS` (and established): the fused op then computes what the norm would on the sum. Else
    None."""
    forward = getattr(type(norm), "forward", None)
    found = ADD_NORM_KINDS.get(getattr(forward, "__name__", None))
    if found is None or patched_op(forward) != "rms_norm":
        return None
    kind, offset, cast = found
    ok = decided(norm, NORM_ATTR, kind)
    return (_plain(norm.weight), getattr(norm, eps_attr(norm)), offset, cast) if ok else None


def add_norm(norm, hidden_states, residual):
    """``(norm(residual + hidden_states), residual + hidden_states)``, fused where the norm is patched to a kind
    the fused op computes and its call is its forward alone."""
    args = norm_args(norm)
    if (args is None or type(args[1]) is not float or call_why_not(norm, "the norm") is not None
            or hidden_states.shape != residual.shape or hidden_states.dtype != residual.dtype
            or hidden_states.dim() == 0):
        s = residual + hidden_states
        return norm(s), s
    weight, eps, offset, cast = args
    return tritongrad.fused_add_rms_norm(hidden_states, residual, weight, eps, weight_offset=offset,
                                         cast_before_weight=cast)


def wrappers(fn) -> tuple:
    """The code of each ``functools.wraps`` layer around ``fn``'s innermost function, outermost first."""
    out = []
    while hasattr(fn, "__wrapped__"):
        out.append(getattr(fn, "__code__", None))
        fn = fn.__wrapped__
    return tuple(out)


def add_norm_wrapped_as(cls: type, forward, subclass: bool) -> str | None:
    """None where ``forward``, set on a subclass of ``cls`` (``subclass``, as :func:`tritongrad.patch` does) or
    on ``cls`` itself, runs inside the same wrappers as ``cls.forward`` (a class can wrap its forward when it is
    created: transformers' GradientCheckpointingLayer checkpoints there); else why not."""
    current = wrappers(cls.forward)
    got = wrappers(type(cls.__name__, (cls,), {"forward": forward}).forward if subclass else forward)
    if got == current:
        return None
    return (f"{cls.__name__}.forward runs inside wrappers its source does not write (its class adds them, e.g. "
            f"gradient checkpointing), which {'the subclass' if subclass else 'a class-level patch'} would not keep")


def _added(stmt) -> str | None:
    """``h``'s source where ``stmt`` is ``hidden_states = residual + h``, else None."""
    import ast

    if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == "hidden_states" and isinstance(stmt.value, ast.BinOp)
            and isinstance(stmt.value.op, ast.Add) and isinstance(stmt.value.left, ast.Name)
            and stmt.value.left.id == "residual"):
        return ast.unparse(stmt.value.right)
    return None


@functools.cache
def add_norm_forward(cls: type) -> tuple:
    """``(forward, norm, None)``: ``cls``'s forward recompiled with :data:`ADD_NORM_STATEMENTS` (found once, in
    order, in its body; ``norm`` the attribute the third calls) replaced by ``hidden_states, residual =
    add_norm(self.<norm>, <h>, residual)``, its decorators kept; or ``(None, None, why not)``."""
    import __future__
    import ast
    import linecache
    import textwrap
    import types

    raw = inspect.unwrap(original_forward_of(cls))
    try:
        src = textwrap.dedent(inspect.getsource(raw))
    except (OSError, TypeError):
        return None, None, f"{cls.__name__}.forward has no readable source"
    if raw.__code__.co_freevars:
        return None, None, f"{cls.__name__}.forward reads closure variables ({', '.join(raw.__code__.co_freevars)})"
    tree = ast.parse(src)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef) or any(
            isinstance(n, (ast.Attribute, ast.Name)) and (getattr(n, "attr", None) or getattr(n, "id", "")
                                                         ).startswith("__") for n in ast.walk(fdef)):
        return None, None, f"{cls.__name__}.forward is not a plain function (or uses private names)"
    texts = [ast.unparse(s) for s in fdef.body]
    hits = [(i, m.group(1), h) for i in range(len(texts) - 2) if (h := _added(fdef.body[i])) is not None
            and texts[i + 1] == ADD_NORM_STATEMENTS[1] and (m := _ADD_NORM_CALL.fullmatch(texts[i + 2]))]
    if len(hits) != 1:
        return None, None, (f"{cls.__name__}.forward does not compute `{'; '.join(ADD_NORM_STATEMENTS)}` "
                            f"{'more than once' if hits else 'in that order'}")
    (at, norm, h), = hits
    call = ast.parse(f"hidden_states, residual = _tritongrad_add_norm(self.{norm}, {h}, residual)").body[0]
    fdef.body[at:at + 3] = [call]
    # Compiled inside a factory whose argument is add_norm (a closure, not a global), then rebuilt on the
    # modeling module's live globals and given its decorators back: nothing is added to that module.
    decorators, fdef.decorator_list = fdef.decorator_list, []
    factory = ast.parse("def _factory(_tritongrad_add_norm):\n    pass").body[0]
    factory.body = [fdef, ast.Return(ast.Name(fdef.name, ast.Load()))]
    new_src = ast.unparse(ast.fix_missing_locations(ast.Module([factory], []))) + "\n"
    filename = f"<tritongrad add_norm forward of {cls.__module__}.{cls.__qualname__}>"
    linecache.cache[filename] = (len(new_src), None, new_src.splitlines(True), filename)
    scratch = dict(raw.__globals__)
    exec(compile(new_src, filename, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), scratch)
    inner = scratch["_factory"](add_norm)
    forward = types.FunctionType(inner.__code__, raw.__globals__, raw.__name__, inner.__defaults__, inner.__closure__)
    forward.__kwdefaults__, forward.__annotations__ = inner.__kwdefaults__, dict(raw.__annotations__)
    forward.__qualname__, forward.__module__, forward.__doc__ = raw.__qualname__, raw.__module__, raw.__doc__
    for dec in reversed(decorators):
        try:  # a decorator that inspects where its function lives can fail on the recompiled one
            forward = eval(compile(ast.Expression(dec), filename, "eval"), raw.__globals__)(forward)
        except Exception as e:
            return None, None, (f"{cls.__name__}.forward's decorator @{ast.unparse(dec)} raised "
                                f"{type(e).__name__}: {e} on the recompiled forward")
    return marked(forward, "fused_add_rms_norm"), norm, None

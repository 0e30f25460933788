"""Model patching: make an existing model, or every Hugging Face model of a family, run tritongrad's kernels.

- :func:`patch` (an existing model, in place) and :func:`unpatch`;
- :func:`patch_transformers` (a ``transformers`` family's classes, before or after models are built) and
  :func:`unpatch_transformers`;
- both return a :class:`PatchReport`: what was replaced, what already was, and what was left alone and why.

How each Hugging Face class is recognised and what replaces it: ``_hf.py``; usage and semantics:
docs/models.md.
"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
import importlib
import sys
import warnings
from typing import NamedTuple

import torch

from . import nn as tg_nn

# The public function each op needs (tritongrad.<name>), imported when a candidate for the op is found.
_NEEDS = {"rms_norm": "rms_norm", "layer_norm": "layer_norm", "swiglu": "swiglu", "geglu": "geglu",
          "rope": "apply_rotary_pos_emb", "cross_entropy": "cross_entropy",
          "linear_cross_entropy": "linear_cross_entropy", "fused_add_rms_norm": "fused_add_rms_norm"}

# What patch() looks for in a Hugging Face model, per op (said in the report when none is found).
_CANDIDATES = {"rms_norm": "no *RMSNorm module with a 1-D weight and a float eps",
               "swiglu": "no MLP with gate_proj and up_proj (or one gate_up_proj), down_proj and act_fn",
               "geglu": "no MLP with gate_proj and up_proj (or one gate_up_proj), down_proj and a GELU act_fn",
               "rope": "no *Attention class whose module defines apply_rotary_pos_emb",
               "cross_entropy": "no *ForCausalLM module (or one with lm_head and model)",
               "linear_cross_entropy": "no *ForCausalLM module (or one with lm_head and model)",
               "fused_add_rms_norm": "no *DecoderLayer with a post_attention_layernorm"}
# The module-level rotary functions an attention class calls: DeepSeek's interleaved one is what MLA families
# run where the config sets rope_interleave. Each is established and replaced on its own.
_ROPE_FNS = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave", "apply_rotary_emb")
_MASK_MODULE = "transformers.masking_utils"
# causal_mask's module-wide replacements: function -> (why_not, replacement, detail), names in _hf.
_MASK_FNS = {
    "find_packed_sequence_indices": ("packed_why_not", "packed_function",
                                     "no packed-sequence mask when the model numbers the positions (module-wide)"),
    "_ignore_causal_mask_sdpa": ("causal_mask_why_not", "causal_mask_function",
                                 "SDPA's is_causal under torch.compile when there is no padding mask (module-wide)"),
}
# torch class -> tritongrad subclass overriding forward only.
_TORCH = {torch.nn.RMSNorm: tg_nn.RMSNorm, torch.nn.LayerNorm: tg_nn.LayerNorm}
_TORCH_OP = {torch.nn.RMSNorm: "rms_norm", torch.nn.LayerNorm: "layer_norm"}
# Subclasses made for other classes, by (base, attributes): each made once. _BASE maps them back.
_SUBCLASSES: dict[tuple, type] = {}
_BASE: dict[type, type] = {}


class Entry(NamedTuple):
    op: str      # "rms_norm", "swiglu", ...
    target: str  # a module's name in the model ("" for the model itself) or a qualified class/function name
    detail: str  # what replaced it, or why it was left alone


@dataclasses.dataclass
class PatchReport:
    """What a patch call did. ``replaced``: patched now; ``already``: patched before (patching is
    idempotent); ``skipped``: candidates left alone, each with the reason (e.g. Gemma's GELU-gated MLP)."""

    replaced: list = dataclasses.field(default_factory=list)
    already: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        """How many modules (or classes and functions) were patched by this call."""
        return len(self.replaced)

    def ops(self) -> dict[str, int]:
        """Replaced now or before, per op: ``{"rms_norm": 5, "swiglu": 2, ...}``."""
        out: dict[str, int] = {}
        for e in self.replaced + self.already:
            out[e.op] = out.get(e.op, 0) + 1
        return out

    def targets(self, op: str) -> list[str]:
        """The targets of ``op`` replaced now or before."""
        return [e.target for e in self.replaced + self.already if e.op == op]

    def __str__(self) -> str:
        lines = []
        for title, entries in (("replaced", self.replaced), ("already patched", self.already),
                               ("left alone", self.skipped)):
            groups: dict[tuple, int] = {}
            for e in entries:
                groups[(e.op, e.detail)] = groups.get((e.op, e.detail), 0) + 1
            for (op, detail), n in groups.items():
                lines.append(f"{title:15} {op:20} x{n:<3} {detail}")
        return "\n".join(lines) or "nothing to patch"

    def __repr__(self) -> str:
        return (f"PatchReport({len(self.replaced)} replaced {self.ops()}, {len(self.already)} already patched, "
                f"{len(self.skipped)} left alone)")

    def _add(self, kind: str, op: str, target: str, detail: str) -> None:
        getattr(self, kind).append(Entry(op, target, detail))


def _subclass(base: type, attrs: dict) -> type:
    """``base`` with ``attrs`` (forward, ...) replaced; same name and module doc, so reprs read as before."""
    key = (base, tuple(sorted((k, id(v)) for k, v in attrs.items())))
    sub = _SUBCLASSES.get(key)
    if sub is None:
        sub = type(base.__name__, (base,), {**attrs, "__module__": base.__module__, "__doc__": base.__doc__,
                                            "__reduce_ex__": _reduce_as_base, "__copy__": _copy_patched,
                                            "__deepcopy__": _deepcopy_patched})
        sub.__qualname__ = base.__qualname__
        _SUBCLASSES[key] = sub
        _BASE[sub] = base
    return sub


def _reduce_as_base(self, protocol):
    """Pickle (``torch.save``) as the class ``patch`` found, without tritongrad's per-instance state: the subclass
    is not importable by name, and the loaded model is the unpatched one (patch it again). docs/models.md."""
    fn, args, state, *rest = object.__reduce_ex__(self, protocol)
    if not (fn is copyreg.__newobj__ and args == (type(self),) and isinstance(state, dict)):
        return fn, args, state, *rest
    state = {k: v for k, v in state.items() if not k.startswith("_tritongrad_")}
    return (copyreg._reconstructor, (_BASE[type(self)], object, None), state, *rest)


def _copy_patched(self):
    """``copy.copy`` keeps the patched class (pickling alone drops it)."""
    return copy._reconstruct(self, None, *object.__reduce_ex__(self, 4))


def _deepcopy_patched(self, memo):
    """``copy.deepcopy`` keeps the patched class: a reference model copied from a patched policy stays patched."""
    return copy._reconstruct(self, memo, *object.__reduce_ex__(self, 4))


def _own_attrs(cls: type) -> dict:
    """The attributes a tritongrad subclass overrides."""
    return {k: v for k, v in vars(cls).items() if k in ("forward", "_loss_function", "_apply_gate")} \
        if cls in _BASE else {}


def _require(op: str) -> None:
    """Import the public function ``op`` needs now, so that a missing op fails here, naming itself."""
    import tritongrad

    if op not in _NEEDS:  # causal_mask: no kernel of its own
        return
    try:
        getattr(tritongrad, _NEEDS[op])
    except (ImportError, AttributeError) as e:
        raise ImportError(f"tritongrad.patch: {op} needs tritongrad.{_NEEDS[op]}, which this install lacks "
                          f"({type(e).__name__}: {e}); pass {op}=False to patch without it") from e


def _from_transformers(cls: type) -> bool:
    """Hugging Face's classes and their subclasses (FSDP's among them): the only ones probed."""
    return any(c.__module__.startswith("transformers.") for c in cls.__mro__)


def _flags(kw: dict) -> set:
    on = {op for op, flag in kw.items() if flag}
    if "rms_norm" not in on:  # the fused op stands for the add and the patched norm
        on.discard("fused_add_rms_norm")
    return on


def _nothing(report: PatchReport, what: str, strict: bool) -> None:
    if report.replaced or report.already:
        return
    why = "; ".join(f"{e.op}: {e.detail}" for e in report.skipped[:6]) or "no candidate module"
    msg = f"tritongrad.patch: nothing in {what} was patched ({why})"
    if strict:
        raise ValueError(msg)
    warnings.warn(msg, stacklevel=3)


# ---------------------------------------------------------------- instances
def patch(model: torch.nn.Module, *, rms_norm: bool = True, layer_norm: bool = True, swiglu: bool = True,
          geglu: bool = True, rope: bool = True, cross_entropy: bool = False, linear_cross_entropy: bool = True,
          causal_mask: bool = True, fused_add_rms_norm: bool = True, strict: bool = False) -> PatchReport:
    """Make ``model`` (itself included) run tritongrad's Triton kernels, in place.

    Per op (each a flag):

    - ``rms_norm``: ``torch.nn.RMSNorm`` -> :class:`tritongrad.nn.RMSNorm`; Hugging Face RMSNorms with
      Llama's, Gemma's or Olmo2's exact semantics (recognised by what they compute, in any family);
    - ``layer_norm``: ``torch.nn.LayerNorm`` -> :class:`tritongrad.nn.LayerNorm`;
    - ``swiglu``: Hugging Face gated MLPs (``gate_proj``, ``up_proj``, ``down_proj``) with a SiLU
      activation -> :func:`tritongrad.swiglu`;
    - ``geglu``: the same MLPs with a GELU activation (exact or tanh, Gemma's) -> :func:`tritongrad.geglu`;
    - ``rope``: the modeling module's ``apply_rotary_pos_emb`` (and DeepSeek's ``apply_rotary_pos_emb_interleave``)
      -> :func:`tritongrad.apply_rotary_pos_emb`.
      A module-level function: every model of that family in the process gets it;
    - ``cross_entropy``: the causal-LM loss on the logits -> :func:`tritongrad.cross_entropy`;
    - ``linear_cross_entropy``: in training with ``labels``, the causal-LM loss from the last hidden states
      and the LM head -> :func:`tritongrad.linear_cross_entropy`, no logits (``logits`` is None);
    - ``causal_mask``: under torch.compile, SDPA gets ``is_causal=True`` as in eager mode instead of the
      explicit ``[B, 1, S, S]`` mask transformers builds there when it cannot rule out packed sequences or
      padding: ``transformers.masking_utils``' ``find_packed_sequence_indices`` (for the patched causal-LM
      training forward, called without position_ids and attention_mask) and ``_ignore_causal_mask_sdpa``
      (torch < 2.14), module-wide, every model in the process;
    - ``fused_add_rms_norm``: a decoder layer whose forward computes Llama's ``hidden_states = residual +
      hidden_states; residual = hidden_states; hidden_states = self.post_attention_layernorm(hidden_states)``
      (found in its source, statement by statement) runs those three as one
      :func:`tritongrad.fused_add_rms_norm` where that norm is Llama's RMSNorm, patched with ``rms_norm``.

    Each module stays the same object: its class is switched to a subclass that overrides ``forward`` (and
    the loss) only, so parameters, buffers, hooks, state_dict keys, reprs and ``isinstance`` are unchanged.
    Patching again is a no-op; :func:`unpatch` undoes it. Subclasses of torch's norms are patched only if
    they keep torch's forward; classes with other math are left alone and listed in the report.

    Args:
        strict: raise ``ValueError`` when nothing could be patched (default: a warning).

    Returns:
        a :class:`PatchReport`. ``report.count`` is how many modules were patched by this call.

    Raises:
        ImportError: an op is asked for, a module needs it, and this install lacks it (nothing is patched).
    """
    from . import _hf as hf

    on = _flags(dict(rms_norm=rms_norm, layer_norm=layer_norm, swiglu=swiglu, geglu=geglu, rope=rope,
                     cross_entropy=cross_entropy, linear_cross_entropy=linear_cross_entropy,
                     causal_mask=causal_mask, fused_add_rms_norm=fused_add_rms_norm))
    report = PatchReport()
    plan, modeling_modules, attention = _plan_modules(hf, model, on, report)
    rope_plan = [(mod, attr) for mod in modeling_modules.values() for attr in _ROPE_FNS
                 if attr in vars(mod) and _plan_rope(hf, mod, report, attr)]
    mask_plan = _plan_mask(hf, report) if attention and "causal_mask" in on else []
    if any(_from_transformers(type(m)) for m in model.modules()):
        _report_absent(on, report)
    for op in sorted({e.op for e in report.replaced}):
        _require(op)
    for m, sub in plan:
        m.__class__ = sub
    for mod, attr in rope_plan:
        _apply_function(hf, mod, attr, hf.rope_function, "instance")
    for attr in mask_plan:
        _apply_function(hf, sys.modules[_MASK_MODULE], attr, getattr(hf, _MASK_FNS[attr][1]), "instance")
    _nothing(report, type(model).__name__, strict)
    return report


def _plan_modules(hf, model, on, report) -> tuple[list, dict, bool]:
    """The class switches ``[(module, new class)]`` for ``model``'s modules, the modeling modules whose
    attention applies the rotary embedding (by name), and whether any attention class was seen."""
    plan = []
    modeling_modules = {}
    attention = False
    for name, m in model.named_modules():
        cls = type(m)
        base = _BASE.get(cls, cls)
        if _is_torch_norm(m, base):
            _plan_torch_norm(m, name, on, plan, report)
            continue
        if not _from_transformers(base):
            continue
        mod = sys.modules.get(base.__module__)
        if base.__name__.endswith("Attention"):
            attention = True
            if "rope" in on and any(f in vars(mod or {}) for f in _ROPE_FNS):
                modeling_modules[mod.__name__] = mod  # an attention class whose module applies the rotary embedding
        attrs, ops = _hf_attrs(hf, m, cls, base, name, on, report)
        new = [op for op in ops if not _patched_before(hf, cls, op)]
        for op in ops:
            if op not in new:
                report._add("already", op, name, base.__name__)
        if new:
            plan.append((m, _subclass(base, {**_own_attrs(cls), **attrs})))
            for op in new:
                report._add("replaced", op, name, f"{base.__name__}: {ops[op]}")
    return plan, modeling_modules, attention


def _report_absent(on, report) -> None:
    """A Hugging Face model: each op asked for that found no candidate at all is reported skipped."""
    seen = {e.op for e in report.replaced + report.already + report.skipped}
    if seen & {"swiglu", "geglu"}:  # one kind of candidate: gated MLPs
        seen |= {"swiglu", "geglu"}
    for op in sorted(on - seen - {"layer_norm", "causal_mask", "geglu"}):  # geglu: swiglu's candidates
        report._add("skipped", op, "", _CANDIDATES[op])


def _patched_before(hf, cls: type, op: str, attr: str | None = None) -> bool:
    attr = attr or ("_loss_function" if op == "cross_entropy" else "forward")
    return hf.patched_op(getattr(cls, attr, None)) == op


def _is_torch_norm(m, base) -> bool:
    if base in _TORCH or base in _TORCH.values():
        return True
    # A subclass that keeps torch's forward (e.g. only adds an attribute) has the same math.
    return isinstance(m, tuple(_TORCH)) and base.forward in (torch.nn.RMSNorm.forward, torch.nn.LayerNorm.forward)


def _plan_torch_norm(m, name, on, plan, report) -> None:
    cls = type(m)
    torch_cls = next(c for c in _TORCH if isinstance(m, c))
    op = _TORCH_OP[torch_cls]
    if op not in on:
        return
    if cls in _TORCH.values() or cls in _BASE:
        report._add("already", op, name, cls.__name__)
        return
    plan.append((m, _TORCH[cls] if cls in _TORCH else _subclass(cls, {"forward": _TORCH[torch_cls].forward})))
    report._add("replaced", op, name, f"{cls.__name__} -> tritongrad.{op}")


def _hf_attrs(hf, m, cls, base, name, on, report) -> tuple[dict, dict]:
    """The attributes to override on ``m``'s class (``{"forward": fn}``...), and ``{op: detail}``."""
    if hf.looks_like_rms_norm(m):
        return _norm_attrs(hf, m, cls, base, name, on, report)
    if hf.looks_like_gated_mlp(m):
        return _gate_attrs(hf, m, cls, base, name, on, report, layout="mlp")
    if hf.looks_like_fused_gated_mlp(m):
        return _gate_attrs(hf, m, cls, base, name, on, report, layout="fused")
    if hf.looks_like_experts(m):
        return _gate_attrs(hf, m, cls, base, name, on, report, layout="experts")
    if base.__name__.endswith("DecoderLayer") and hasattr(m, "post_attention_layernorm"):
        return _add_norm_attrs(hf, m, cls, base, name, on, report)
    if base.__name__.endswith("ForCausalLM") or hasattr(m, "lm_head") and hasattr(m, "model"):
        return _causal_lm_attrs(hf, m, base, name, on, report)
    return {}, {}


def _norm_attrs(hf, m, cls, base, name, on, report) -> tuple[dict, dict]:
    if "rms_norm" not in on:
        return {}, {}
    if _patched_before(hf, cls, "rms_norm"):
        return {}, {"rms_norm": ""}
    kind, eps_name = hf.instance_norm_kind(m, base)
    if kind is None:
        report._add("skipped", "rms_norm", name, eps_name)
        return {}, {}
    m.__dict__[hf.NORM_ATTR] = True
    return {"forward": hf.norm_forward(kind, eps_name)}, {"rms_norm": hf.NORM_DETAIL[kind]}


def _add_norm_attrs(hf, m, cls, base, name, on, report) -> tuple[dict, dict]:
    """A decoder layer's forward with its residual add and post-attention norm fused (rms_norm on too: the
    fused op stands for the add and the patched norm)."""
    if not {"fused_add_rms_norm", "rms_norm"} <= on:
        return {}, {}
    if _patched_before(hf, cls, "fused_add_rms_norm"):
        return {}, {"fused_add_rms_norm": ""}
    forward, norm_name, why = hf.add_norm_forward(base)
    if forward is not None:
        norm = getattr(m, norm_name, None)
        kind = hf.instance_norm_kind(norm)[0] if hf.looks_like_rms_norm(norm) else None
        if kind not in {k for k, _, _ in hf.ADD_NORM_KINDS.values()}:
            forward, why = None, (f"its {norm_name} ({type(norm).__name__}) is not an RMSNorm the fused op computes "
                                  "(Llama's, Gemma's, Olmo2's)")
    if forward is not None:
        why = hf.add_norm_wrapped_as(base, forward, subclass=True)
        forward = forward if why is None else None
    if forward is None:
        report._add("skipped", "fused_add_rms_norm", name, why)
        return {}, {}
    return {"forward": forward}, {"fused_add_rms_norm": hf.add_norm_detail(norm_name)}


def _gate_attrs(hf, m, cls, base, name, on, report, *, layout: str) -> tuple[dict, dict]:
    """A gated MLP's forward (``layout`` "mlp": gate_proj and up_proj; "fused": one gate_up_proj), or a MoE
    experts module's ``_apply_gate`` ("experts"), through swiglu or geglu."""
    kind, why = hf.gate_kind(hf.gate_act(m))
    op = hf.GATE_OPS.get(kind, "swiglu")
    if op not in on:
        return {}, {}
    if kind is not None and _patched_before(hf, cls, op, *(("_apply_gate",) if layout == "experts" else ())):
        m.__dict__[hf.GATE_ATTR], m.__dict__[hf.GATE_ACT_ATTR] = kind, hf.gate_act(m)
        return {}, {op: ""}
    state = hf._simple_state(m)  # the instance's plain attributes (a clipping limit) can change its math
    layout_why = {"mlp": lambda: hf.gated_mlp_why_not(base, state), "experts": lambda: hf.experts_why_not(m, base),
                  "fused": lambda: hf.fused_gated_mlp_why_not(base, hf.gate_act_name(m), state)}
    why = layout_why[layout]() or why
    if why is not None:
        report._add("skipped", op, name, f"{base.__name__}: {why}")
        return {}, {}
    m.__dict__[hf.GATE_ATTR], m.__dict__[hf.GATE_ACT_ATTR] = kind, hf.gate_act(m)
    if layout == "experts":
        if hf.experts_lean(base):  # transformers' dispatch: its grouped_mm experts take grouped_experts
            return ({"_apply_gate": hf.experts_gate[op], "forward": hf.experts_forward[op]},
                    {op: hf.EXPERTS_DETAIL[kind] + hf.EXPERTS_LEAN_DETAIL})
        return {"_apply_gate": hf.experts_gate[op]}, {op: hf.EXPERTS_DETAIL[kind]}
    if layout == "fused":
        return ({"forward": hf.fused_swiglu_forward if op == "swiglu" else hf.fused_geglu_forward},
                {op: hf.FUSED_GATE_DETAIL[kind]})
    return ({"forward": hf.swiglu_forward if op == "swiglu" else hf.geglu_forward},
            {op: hf.GATE_DETAIL[kind]})


def _causal_lm_attrs(hf, m, base, name, on, report) -> tuple[dict, dict]:
    """The causal LM's training forward (the loss from the hidden states, where its head is established) and
    its loss function on the logits."""
    wanted = on & {"cross_entropy", "linear_cross_entropy"}
    if not wanted:
        return {}, {}
    why = hf.causal_lm_why_not(base)
    if why is None and not isinstance(m.get_output_embeddings(), torch.nn.Linear):
        why = f"the output embedding is a {type(m.get_output_embeddings()).__name__}, not a torch.nn.Linear"
    spec = hf.head_spec(m) if why is None and "linear_cross_entropy" in wanted else None
    if why is not None:
        for op in sorted(wanted):
            report._add("skipped", op, name, why)
        return {}, {}
    attrs, ops = {}, {}
    if isinstance(spec, str):
        report._add("skipped", "linear_cross_entropy", name, spec)
    elif spec is not None:
        m.__dict__[hf.SPEC_ATTR] = spec
        attrs["forward"] = hf.causal_lm_forward(hf.original_forward_of(base))
        ops["linear_cross_entropy"] = hf.spec_detail(spec)
    if "cross_entropy" in wanted:
        attrs["_loss_function"] = hf.LOSS_FUNCTION
        ops["cross_entropy"] = "loss_function on the logits"
    return attrs, ops


def _plan_function(mod, attr: str, op: str, why_not, detail: str, report) -> bool:
    """Whether the module-level function ``mod.<attr>`` is to be replaced for ``op``; reports it either way."""
    fn = vars(mod)[attr]
    target = f"{mod.__name__}.{attr}"
    from . import _hf as hf

    if hf.patched_op(fn) == op:
        report._add("already", op, target, "module-wide")
        return False
    why = why_not(fn)
    if why is not None:
        report._add("skipped", op, target, why)
        return False
    report._add("replaced", op, target, detail)
    return True


def _plan_rope(hf, mod, report, attr: str = "apply_rotary_pos_emb") -> bool:
    kind = hf.rope_kind(vars(mod)[attr])[0]
    detail = hf.ROPE_DETAIL.get(kind, "")
    return _plan_function(mod, attr, "rope", hf.rope_why_not,
                          f"{attr}, {detail} (module-wide: every model of this family)", report)


def _plan_mask(hf, report) -> list[str]:
    """The functions of transformers' mask builder to replace for ``causal_mask``; reports each."""
    try:
        mod = importlib.import_module(_MASK_MODULE)
    except ImportError:
        mod = None
    todo = []
    for attr, (why_not, _, detail) in _MASK_FNS.items():
        if mod is None or attr not in vars(mod):
            report._add("skipped", "causal_mask", f"{_MASK_MODULE}.{attr}", "this transformers does not define it")
        elif _plan_function(mod, attr, "causal_mask", getattr(hf, why_not), detail, report):
            todo.append(attr)
    return todo


def _apply_function(hf, mod, attr: str, make, source: str) -> None:
    fn = vars(mod)[attr]
    hf.save(mod, attr, fn, source)
    setattr(mod, attr, make(fn))


def unpatch(model: torch.nn.Module) -> int:
    """Undo :func:`patch` on ``model``: each module gets its class back, and the rotary functions (and the
    causal-mask decision) that :func:`patch` replaced in its modules are restored. What :func:`patch_transformers` did stays
    (see :func:`unpatch_transformers`). Returns how many modules changed class."""
    from . import _hf as hf

    back = {v: k for k, v in _TORCH.items()}
    count = 0
    modules = set()
    for m in model.modules():
        cls = type(m)
        modules.add(cls.__module__)
        if _from_transformers(cls):
            modules.add(_MASK_MODULE)
        base = _BASE.get(cls) or back.get(cls)
        m.__dict__.pop(hf.SPEC_ATTR, None)
        m.__dict__.pop(hf.GATE_ATTR, None)
        m.__dict__.pop(hf.GATE_ACT_ATTR, None)
        m.__dict__.pop(hf.NORM_ATTR, None)
        m.__dict__.pop(hf.WARNED_ATTR, None)
        if base is not None:
            m.__class__ = base
            count += 1
    for (owner, attr), (original, source) in list(hf.SAVED.items()):
        if source == "instance" and not isinstance(owner, type) and owner.__name__ in modules:
            setattr(owner, attr, original)
            hf.forget(owner, attr)
    return count


# ---------------------------------------------------------------- transformers families
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "olmo2")


def _patch_class(hf, mod, cls: type, causal: list, on: set, report) -> None:
    """patch_transformers for one class of the family's module: an RMSNorm, a gated MLP, a decoder layer or a
    causal LM."""
    name = cls.__name__
    target = f"{mod.__name__}.{name}"
    if name.lower().endswith("rmsnorm") and "rms_norm" in on:
        kind, eps_name = hf.norm_kind(cls)
        if kind is None:
            report._add("skipped", "rms_norm", target, eps_name)
        else:
            _set(cls, "forward", hf.norm_forward(kind, eps_name), "rms_norm", report, hf.NORM_DETAIL[kind])
    elif name.endswith("MLP") and on & {"swiglu", "geglu"}:
        hf.silu_types()
        kind, why = hf.config_gate_kind(cls, causal)
        op = hf.GATE_OPS.get(kind, "swiglu")
        why = hf.gated_mlp_why_not(cls) or why
        if op not in on:
            return
        if why is not None:
            report._add("skipped", op, target, why)
        else:
            _set(cls, "forward", hf.swiglu_forward if op == "swiglu" else hf.geglu_forward, op, report,
                 f"{hf.GATE_DETAIL[kind]}; act_fn is {'SiLU' if kind == 'silu' else 'GELU'}")
    elif name.endswith("DecoderLayer") and {"fused_add_rms_norm", "rms_norm"} <= on:
        forward, norm_name, why = hf.add_norm_forward(cls)
        if forward is not None:
            why = hf.add_norm_wrapped_as(cls, forward, subclass=False)
            forward = forward if why is None else None
        if forward is None:
            report._add("skipped", "fused_add_rms_norm", target, why)
        else:
            _set(cls, "forward", forward, "fused_add_rms_norm", report, hf.add_norm_detail(norm_name))
    elif cls in causal:
        why = hf.causal_lm_why_not(cls)
        for op in sorted(on & {"cross_entropy", "linear_cross_entropy"}):
            if why is not None:
                report._add("skipped", op, target, why)
            elif op == "linear_cross_entropy":
                _set(cls, "forward", hf.causal_lm_forward(hf.original_forward_of(cls)), op, report,
                     "training loss from hidden states and lm_head, no logits")
            else:
                _set(cls, "_loss_function", hf.LOSS_FUNCTION, op, report, "loss_function on the logits")


def patch_transformers(family: str, *, rms_norm: bool = True, swiglu: bool = True, geglu: bool = True,
                       rope: bool = True,
                       cross_entropy: bool = False, linear_cross_entropy: bool = True, causal_mask: bool = True,
                       fused_add_rms_norm: bool = True, strict: bool = False) -> PatchReport:
    """Patch a Hugging Face ``transformers`` family at the class level: every model of it, built before or
    after (``from_pretrained``, ``from_config``), runs tritongrad's kernels.

    ``family`` names ``transformers.models.<family>.modeling_<family>``: tested are
    ``llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3`` (text) and ``olmo2``; others whose classes
    compute the same things are patched too. The flags are :func:`patch`'s. Each class's ``forward`` (and a
    causal LM's ``loss_function``) is replaced on the class itself; the module's ``apply_rotary_pos_emb``
    is replaced in the module, and ``causal_mask`` replaces functions of ``transformers.masking_utils``, shared
    by every family. :func:`unpatch_transformers` restores them (the shared one only without a family).

    Example::

        tritongrad.patch_transformers("llama")
        model = LlamaForCausalLM.from_pretrained(...)      # or built before: patched all the same
        print(tritongrad.patch_transformers("llama"))      # a second call: everything "already patched"
    """
    from . import _hf as hf

    on = _flags(dict(rms_norm=rms_norm, swiglu=swiglu, geglu=geglu, rope=rope, cross_entropy=cross_entropy,
                     linear_cross_entropy=linear_cross_entropy, causal_mask=causal_mask,
                     fused_add_rms_norm=fused_add_rms_norm))
    try:
        mod = hf.modeling_module(family)
    except ImportError as e:
        raise ValueError(f"tritongrad.patch_transformers: no transformers.models.{family}.modeling_{family} "
                         f"({e}); tested families: {', '.join(FAMILIES)}") from e
    report = PatchReport()
    classes = hf.classes_of(mod)
    causal = [c for c in classes if c.__name__.endswith("ForCausalLM")]
    for cls in classes:
        _patch_class(hf, mod, cls, causal, on, report)
    if "rope" in on:
        for attr in _ROPE_FNS:
            if attr in vars(mod) and _plan_rope(hf, mod, report, attr):
                _require("rope")
                _apply_function(hf, mod, attr, hf.rope_function, "class")
        if "apply_rotary_pos_emb" not in vars(mod):
            report._add("skipped", "rope", mod.__name__, "no module-level apply_rotary_pos_emb")
    if "causal_mask" in on:
        for attr in _plan_mask(hf, report):
            _apply_function(hf, sys.modules[_MASK_MODULE], attr, getattr(hf, _MASK_FNS[attr][1]), "class")
    _nothing(report, f"transformers family {family!r}", strict)
    return report


def _set(cls: type, attr: str, value, op: str, report: PatchReport, detail: str) -> None:
    from . import _hf

    target = f"{cls.__module__}.{cls.__qualname__}.{attr.lstrip('_')}"
    current = cls.__dict__.get(attr)
    fn = current.__func__ if isinstance(current, staticmethod) else current
    if _hf.patched_op(fn) == op:
        report._add("already", op, target, detail)
        return
    _require(op)
    _hf.save(cls, attr, current, "class")
    setattr(cls, attr, value)
    report._add("replaced", op, target, detail)


def unpatch_transformers(family: str | None = None) -> int:
    """Undo :func:`patch_transformers` for ``family`` (None: every family). Returns how many class attributes
    and functions were restored."""
    from . import _hf

    count = 0
    prefix = None if family is None else f"transformers.models.{family}.modeling_{family}"
    for (owner, attr), (original, _) in list(_hf.SAVED.items()):
        where = owner.__module__ if isinstance(owner, type) else owner.__name__
        if prefix is not None and where != prefix:
            continue
        if original is None:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
        _hf.forget(owner, attr)
        count += 1
    return count

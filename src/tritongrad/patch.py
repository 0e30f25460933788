"""``tritongrad.patch(model)``: make the norm layers of an existing model run tritongrad's kernels."""

from __future__ import annotations

import importlib.util
import inspect
import textwrap

import torch

from . import nn as tg_nn
from .ops.norm import llama_rms_norm

# torch class -> tritongrad subclass overriding forward only.
_TORCH = {torch.nn.RMSNorm: tg_nn.RMSNorm, torch.nn.LayerNorm: tg_nn.LayerNorm}
# Subclasses made for other classes (subclasses of torch's norms, Hugging Face's RMSNorms), made once.
_SUBCLASSES: dict[type, type] = {}


def _llama_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return llama_rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _source(fn) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(fn)).strip()
    except (OSError, TypeError):
        return None


_LLAMA_SOURCE: list = []  # [source of LlamaRMSNorm.forward or None], filled on first need


def _llama_source() -> str | None:
    if not _LLAMA_SOURCE:
        src = None
        if importlib.util.find_spec("transformers") is not None:
            try:
                from transformers.models.llama.modeling_llama import LlamaRMSNorm

                src = _source(LlamaRMSNorm.forward)
            except Exception:  # a broken or partial transformers install: patch torch's norms only
                src = None
        _LLAMA_SOURCE.append(src)
    return _LLAMA_SOURCE[0]


def _is_llama_rms_norm(m: torch.nn.Module) -> bool:
    """Hugging Face's LlamaRMSNorm and the classes that copy it verbatim (Mistral, Qwen2, Qwen3, ...):
    a 1-D ``weight``, a float ``variance_epsilon`` and a forward whose source is LlamaRMSNorm's. Classes
    with other math (Gemma's ``1 + weight``, weights applied before the cast, ...) differ in source and
    are left alone."""
    if not hasattr(m, "variance_epsilon") or not isinstance(getattr(m, "weight", None), torch.nn.Parameter):
        return False
    if m.weight.dim() != 1 or not isinstance(m.variance_epsilon, float):
        return False
    src = _llama_source()
    return src is not None and _source(type(m).forward) == src


def _subclass(cls: type, forward) -> type:
    """``cls`` with ``forward`` replaced; same name, so reprs read as before."""
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__, "__doc__": cls.__doc__})
        _SUBCLASSES[cls] = sub
    return sub


def _replacement(m: torch.nn.Module) -> type | None:
    cls = type(m)
    if cls in _TORCH:
        return _TORCH[cls]
    if cls in _SUBCLASSES.values() or cls in _TORCH.values():
        return None  # already patched
    for torch_cls, tg_cls in _TORCH.items():
        # A subclass that keeps torch's forward (e.g. only adds an attribute) has the same math.
        if isinstance(m, torch_cls) and cls.forward is torch_cls.forward:
            return _subclass(cls, tg_cls.forward)
    if _is_llama_rms_norm(m):
        return _subclass(cls, _llama_forward)
    return None


def patch(model: torch.nn.Module) -> int:
    """Make the norm layers of ``model`` (itself included) run tritongrad's Triton kernels, in place.

    Patched:

    - ``torch.nn.RMSNorm`` -> :class:`tritongrad.nn.RMSNorm`, ``torch.nn.LayerNorm`` ->
      :class:`tritongrad.nn.LayerNorm` (and subclasses of them that keep torch's forward);
    - when ``transformers`` is installed, Hugging Face's ``LlamaRMSNorm`` and every class whose forward
      is a verbatim copy of it (Mistral, Qwen2, Qwen3, Phi-3, ... RMSNorms): their forward becomes
      :func:`tritongrad.ops.rms_norm.llama_rms_norm`, with Llama's exact semantics (normalise in float32,
      round to the input dtype, multiply by the weight; output in the promoted dtype of input and
      weight). One difference: float64 inputs are normalised in float64 where Llama's code drops to
      float32.

    Each module stays the same object: its class is switched to a subclass that overrides ``forward``
    only. Parameters (the same Parameter objects), buffers, hooks, device, dtype, training mode, reprs
    and state_dict keys are unchanged, and ``isinstance`` against the original class still holds, so
    optimizers and references held elsewhere keep working. Modules with any other forward are left alone.

    Returns:
        how many modules were patched (0 for an already patched model).
    """
    count = 0
    for m in model.modules():
        cls = _replacement(m)
        if cls is not None:
            m.__class__ = cls
            count += 1
    return count

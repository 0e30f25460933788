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
  ``gemma``: ``(xhat * (1 + weight.float())).to(x.dtype)`` (:func:`tritongrad.rms_norm` with the weight
  ``1 + weight.float()``, whose gradient autograd carries back to ``weight``);
  ``olmo2``: ``(weight * xhat).to(x.dtype)`` (:func:`tritongrad.rms_norm`, which multiplies in float32 and
  rounds once).
- The gated MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with a SiLU ``act_fn``:
  ``down_proj(tritongrad.swiglu(gate_proj(x), up_proj(x)))``.
- ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``: :func:`tritongrad.apply_rotary_pos_emb`.
- The causal-LM loss: ``loss_function`` (:func:`tritongrad.cross_entropy` on the logits), or the forward, whose
  training step with ``labels`` computes :func:`tritongrad.linear_cross_entropy` from the last hidden states
  and the LM head's weight, without logits.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect

import torch
import torch.nn.functional as F

import tritongrad

from ._runtime import PLAIN_TENSORS

# ---------------------------------------------------------------- shared
# What class-level patches and the module-wide rope replaced: (owner, attribute) -> (original, source), the
# source "class" (patch_transformers) or "instance" (patch). Originals are found here, never in a probe.
SAVED: dict[tuple, tuple] = {}


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


def _equal(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _probe_rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


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
    "gemma": "rms_norm with weight 1 + w (Gemma: (normalised * (1 + w)).to(dtype))",
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


@functools.cache
def norm_kind(cls: type) -> tuple[str | None, str]:
    """``(kind, eps attribute)`` of an RMSNorm class, or ``(None, why not)``."""
    try:
        probe = cls(16)
    except Exception as e:  # noqa: BLE001 - any constructor failure means: not a class we can check
        return None, f"cannot build {cls.__name__}(16) to check its math ({type(e).__name__}: {e})"
    eps_name = eps_attr(probe)
    if eps_name is None or not isinstance(getattr(probe, "weight", None), torch.nn.Parameter):
        return None, f"{cls.__name__} has no 1-D weight and float eps"
    g = _probe_rng()
    x = torch.randn(3, 16, generator=g) * 3
    w = torch.randn(16, generator=g) * 0.5 + 0.5
    kinds = set(_NORM_FORMULAS)
    for xdt, wdt in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)):
        with torch.no_grad():
            probe.weight.data = w.to(wdt)
            try:
                got = cls.forward(probe, x.to(xdt))
            except Exception as e:  # noqa: BLE001
                return None, f"{cls.__name__}.forward failed on a probe ({type(e).__name__}: {e})"
            eps = getattr(probe, eps_name)
            kinds = {k for k in kinds if _equal(got, _NORM_FORMULAS[k](x.to(xdt), w.to(wdt), eps))}
    if len(kinds) != 1:
        return None, f"{cls.__name__}.forward computes none of the known RMSNorm semantics (Llama, Gemma, Olmo2)"
    return kinds.pop(), eps_name


@functools.cache
def norm_forward(kind: str, eps_name: str):
    if kind == "llama":
        def forward(self, hidden_states):
            return tritongrad.llama_rms_norm(hidden_states, _plain(self.weight), getattr(self, eps_name))
    elif kind == "gemma":
        def forward(self, x):
            w = _plain(self.weight)
            return tritongrad.rms_norm(x, w.shape, 1.0 + w.float(), getattr(self, eps_name))
    else:
        def forward(self, hidden_states):
            w = _plain(self.weight)
            return tritongrad.rms_norm(hidden_states, w.shape, w, getattr(self, eps_name))
    forward.__qualname__ = forward.__name__ = f"{kind}_rms_norm_forward"
    return marked(forward, "rms_norm")


# ---------------------------------------------------------------- gated MLP
SILU_TYPES: tuple = (torch.nn.SiLU,)  # with transformers' SiLUActivation once silu_types() ran (at patch time)


def silu_types() -> tuple:
    global SILU_TYPES
    if len(SILU_TYPES) == 1:
        try:
            from transformers.activations import SiLUActivation

            SILU_TYPES = (torch.nn.SiLU, SiLUActivation)
        except ImportError:
            pass
    return SILU_TYPES


def looks_like_gated_mlp(m: torch.nn.Module) -> bool:
    return all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")) \
        and callable(getattr(m, "act_fn", None))


@functools.cache
def gated_mlp_why_not(cls: type) -> str | None:
    """None when ``cls.forward`` is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, else why not."""
    probe = cls.__new__(cls)
    torch.nn.Module.__init__(probe)
    g = _probe_rng()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        probe.gate_proj, probe.up_proj = torch.nn.Linear(8, 12, bias=False), torch.nn.Linear(8, 12, bias=False)
        probe.down_proj = torch.nn.Linear(12, 8, bias=False)
    probe.act_fn = torch.nn.SiLU()
    x = torch.randn(2, 8, generator=g)
    with torch.no_grad():
        try:
            got = cls.forward(probe, x)
        except Exception as e:  # noqa: BLE001
            return f"{cls.__name__}.forward is not the gate/up/down layout ({type(e).__name__}: {e})"
        want = probe.down_proj(F.silu(probe.gate_proj(x)) * probe.up_proj(x))
    return None if _equal(got, want) else f"{cls.__name__}.forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"


def activation_why_not(act) -> str | None:
    """None for a SiLU activation, else a description of the gate."""
    if isinstance(act, silu_types()):
        return None
    name = type(act).__name__
    try:
        t = torch.linspace(-4, 4, 33)
        if torch.allclose(act(t), F.gelu(t, approximate="tanh"), atol=1e-6):
            return f"act_fn is {name} (GELU, tanh approximation): a GELU-gated MLP (GeGLU), not SwiGLU"
        if torch.allclose(act(t), F.gelu(t), atol=1e-6):
            return f"act_fn is {name} (GELU): a GELU-gated MLP (GeGLU), not SwiGLU"
    except Exception:  # noqa: BLE001
        pass
    return f"act_fn is {name}, not SiLU: not SwiGLU"


def _swiglu_forward(self, x):
    if isinstance(self.act_fn, SILU_TYPES):  # a plain global read: torch.compile traces it without a break
        # The projections' outputs feed swiglu alone: their storage takes their gradients.
        return self.down_proj(tritongrad.swiglu(self.gate_proj(x), self.up_proj(x), inplace_backward=True))
    # A class patched for SiLU (patch_transformers), built here with another activation.
    return original_forward_of(type(self))(self, x)


swiglu_forward = marked(_swiglu_forward, "swiglu")


# ---------------------------------------------------------------- rotary embeddings
def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_why_not(fn) -> str | None:
    """None when ``fn`` is Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return "apply_rotary_pos_emb has no readable signature"
    if [p.name for p in params] != ["q", "k", "cos", "sin", "unsqueeze_dim"] or params[4].default != 1:
        return f"apply_rotary_pos_emb{inspect.signature(fn)} is not (q, k, cos, sin, unsqueeze_dim=1)"
    g = _probe_rng()
    for dtype in (torch.float32, torch.bfloat16):
        q, k = torch.randn(2, 3, 5, 8, generator=g).to(dtype), torch.randn(2, 1, 5, 8, generator=g).to(dtype)
        cos, sin = torch.randn(2, 5, 8, generator=g).to(dtype), torch.randn(2, 5, 8, generator=g).to(dtype)
        try:
            got = fn(q, k, cos, sin)
        except Exception as e:  # noqa: BLE001
            return f"apply_rotary_pos_emb failed on a probe ({type(e).__name__}: {e})"
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        if not _equal(tuple(got), (q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s)):
            return "apply_rotary_pos_emb does not compute q * cos + rotate_half(q) * sin"
    return None


def rope_function(original):
    """The replacement of a module's ``apply_rotary_pos_emb``. Inputs of mixed dtypes (where the original's own
    promotion rules decide the result) and cos/sin that require grad keep the original."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if q.dtype != cos.dtype or k.dtype != cos.dtype or sin.dtype != cos.dtype or cos.requires_grad \
                or sin.requires_grad:
            return original(q, k, cos, sin, unsqueeze_dim)
        return tritongrad.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._tritongrad_original = original
    return marked(apply_rotary_pos_emb, "rope")


# ---------------------------------------------------------------- the causal mask under torch.compile
# True while a patched causal-LM forward runs its base model on positions the model numbers itself. One flag
# per process: forwards running concurrently in threads, one of them on packed sequences, need causal_mask=False.
_UNPACKED = [False]


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
        if _UNPACKED[0]:
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
        if (c, "forward") in SAVED:
            return SAVED[(c, "forward")][0]
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
                          ignore_index: int = -100, shift_labels=None, **kwargs):
    """The loss of :func:`causal_lm_loss` from the hidden states and the LM head, without logits."""
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    target = _shifted(labels, shift_labels, ignore_index).to(h.device)
    loss = tritongrad.linear_cross_entropy(h, weight, target, bias, ignore_index=ignore_index,
                                           reduction="sum" if num_items_in_batch is not None else "mean",
                                           logit_softcap=logit_softcap, out_dtype=torch.float32)
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


def _linear_loss_forward(self, parts, labels, logits_to_keep=0, return_dict=None, **kwargs):
    out_cls, copied, slice_to_keep = parts
    # No position_ids and no attention_mask: the base model numbers each row 0, 1, ...: nothing is packed.
    outer = _UNPACKED[0]
    _UNPACKED[0] = kwargs.get("position_ids") is None and kwargs.get("attention_mask") is None
    try:
        outputs = self.model(**kwargs)
    finally:
        _UNPACKED[0] = outer
    hidden_states = slice_to_keep(outputs[0], logits_to_keep)
    head = self.lm_head
    loss = causal_lm_linear_loss(hidden_states, head.weight, head.bias, labels,
                                 getattr(self.config, "final_logit_softcapping", None), **kwargs)
    out = out_cls(loss=loss, logits=None, **{name: getattr(outputs, name, None) for name in copied})
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return out if return_dict is not False else out.to_tuple()


@functools.cache
def causal_lm_forward(original):
    """The forward of a ``*ForCausalLM`` class with linear_cross_entropy: in training with ``labels``, the loss
    from the last hidden states and ``lm_head.weight`` (``logits`` is None in the output); otherwise (no labels,
    eval mode, or an LM head whose weight is still sharded) the original forward, logits and all."""
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
        if (not self.training or kwargs.get("labels") is None
                or type(self.lm_head.weight) not in PLAIN_TENSORS):
            return original(self, **kwargs)
        return _linear_loss_forward(self, parts, **kwargs)

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


def config_activation_why_not(mlp_cls: type, causal_lm_classes: list[type]) -> str | None:
    """For class-level patching: does the family's default config build ``mlp_cls`` with a SiLU gate? Built on
    the meta device (no memory). None: yes, or it could not be built (then the forward checks at run time)."""
    for lm in causal_lm_classes:
        config_cls = getattr(lm, "config_class", None)
        if config_cls is None:
            continue
        try:
            with torch.device("meta"):
                mlp = mlp_cls(config_cls())
        except Exception:  # noqa: BLE001
            return None
        why = activation_why_not(mlp.act_fn)
        return None if why is None else f"{why} (the default {config_cls.__name__})"
    return None

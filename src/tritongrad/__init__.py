"""tritongrad: differentiable Triton operators for PyTorch.

- ops: :func:`weighted_sum`, :func:`rms_norm`, :func:`llama_rms_norm`, :func:`layer_norm`, :func:`geglu`, with modules in
  :mod:`tritongrad.nn` and :func:`patch` for existing models;
- the pattern they are built on, public: :func:`op` declares a differentiable operator from a forward
  launcher, a backward launcher and a PyTorch reference; :func:`kernel` launches a ``@triton.jit`` function
  from a launcher; :func:`reduce_partials` and :func:`partial_rows` are the deterministic reduction over rows
  (a weight's gradient), with its Triton side in :mod:`tritongrad.language`; :func:`size_hint` plans with a
  size that may be symbolic; :mod:`tritongrad.testing` is the test kit for such ops.

Names are imported on first use, so that ``tritongrad.testing.use_interpreter()`` can still switch Triton to
its interpreter (a choice Triton reads once, when it is imported).
"""

import importlib

__version__ = "0.1.0"

_WHERE = {
    "op": "._pattern",
    "Op": "._pattern",
    "BackwardContext": "._pattern",
    "kernel": "._pattern",
    "set_small_input_threshold": "._pattern",
    "size_hint": "._pattern",
    "backend": "._runtime",
    "reduce_partials": ".ops.column_sum",
    "partial_rows": ".ops.column_sum",
    "language": ".language",
    "weighted_sum": ".ops.weighted_sum",
    "rms_norm": ".ops.norm",
    "llama_rms_norm": ".ops.norm",
    "layer_norm": ".ops.norm",
    "fused_add_rms_norm": ".ops.norm",
    "cross_entropy": ".ops.cross_entropy",
    "linear_cross_entropy": ".ops.cross_entropy",
    "swiglu": ".ops.swiglu",
    "geglu": ".ops.swiglu",
    "gated_linear": ".ops.swiglu",
    "grouped_experts": ".ops.swiglu",
    "apply_rotary_pos_emb": ".ops.rope",
    "patch": ".patch",
    "unpatch": ".patch",
    "patch_transformers": ".patch",
    "unpatch_transformers": ".patch",
    "PatchReport": ".patch",
    "nn": ".nn",
    "testing": ".testing",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'tritongrad' has no attribute {name!r}")
    module = importlib.import_module(where, __name__)
    value = module if name in ("nn", "testing", "language") else getattr(module, name)
    globals()[name] = value  # later lookups are plain attribute reads
    if where == ".patch":  # importing the submodule set tritongrad.patch to it; the name is its function
        globals()["patch"] = module.patch
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))

# The post-training family: losses from hidden states and the LM head, no [N, V] logits (docs/post-training.md).
_WHERE.update({name: ".ops.post_training" for name in (
    "linear_token_logprobs", "linear_grpo_loss", "linear_dpo_loss", "linear_jsd", "linear_kl_div", "patch_trl",
    "unpatch_trl")})
__all__ = sorted(_WHERE)

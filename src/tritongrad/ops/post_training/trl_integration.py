"""tritongrad's per-token log-probabilities inside TRL's trainers (GRPOTrainer, DPOTrainer, RLOOTrainer,
KTOTrainer, SFTTrainer), exact or refused.

TRL 1.16's trainers compute every log-probability through one fused LM head: ``trl.trainer.utils.
add_fused_lm_head`` wraps the model's forward, and that forward calls ``_ChunkedLogProbFunction.apply(hidden,
weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)``, a name it
looks up in ``trl.trainer.utils`` at each call. :func:`patch_trl` puts a stand-in under that name; TRL's own
loss code (``_compute_loss``: the GRPO and DPO formulas, their normalisations and metrics) is untouched and
receives tritongrad's log-probabilities, entropy and statistics.

The rule. A call is served by tritongrad only where it computes what TRL's function computes, to float32
rounding: the per-token fields asked for are among ``log_probs``, ``entropy``, ``log_sum_sq_probs`` (WPO's),
``mean_logits`` and ``is_top1`` (with a final-logit soft cap too, Gemma 2's, in TRL's order: scale, cap,
temperature), the hidden states are already in the dtype of the products (autocast's, where it is on), and the
head is in that dtype or float32. The products, the logits' dtype, and the float32 accumulation of the weight's
gradient are then TRL's. Any other call goes to TRL's own function, and
:data:`REPORT` counts it under its reason.
:func:`patch_trl` itself refuses a TRL whose version is not in :data:`COVERED` or whose function's signature
is not the one above.
"""

from __future__ import annotations

import collections
import inspect

import torch

from .launch import linear_token_logprobs_op

# TRL versions (major.minor) whose fused head this stand-in was checked against: the same fields, the same
# arguments, the same math (tests/test_post_training.py runs the check on the installed TRL).
COVERED = ("1.16",)
SIGNATURE = ("ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
             "logit_scale", "outputs")
SERVED_FIELDS = frozenset(("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))

# Calls served by tritongrad, and calls handed to TRL's own function by reason.
REPORT: collections.Counter = collections.Counter()

_state: dict = {}


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype TRL's fused head runs its products in: autocast's where it is on, else the hidden states'."""
    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype


def _refusal(hidden, weight, bias, final_logit_softcapping, outputs) -> str | None:
    extra = set(outputs) - SERVED_FIELDS
    if extra:
        return f"fields {sorted(extra)} not computed by tritongrad"
    if final_logit_softcapping is not None and not final_logit_softcapping > 0:
        return f"final logit soft cap {final_logit_softcapping!r}"
    dtype = _compute_dtype(hidden)
    if hidden.dtype != dtype:
        # TRL accumulates the hidden states' gradient in float32 and returns it unrounded; tritongrad's
        # products would round it to the product's dtype first
        return f"{hidden.dtype} hidden states with {dtype} products"
    for t in (weight, bias):
        if t is not None and t.dtype not in (dtype, torch.float32):
            return f"{t.dtype} LM head with {dtype} products"
    return None


class TritongradLogProbFunction:
    """Stands in for TRL's ``ChunkedLogProbFunction`` (only its ``apply`` is called)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
              outputs=("log_probs",)):
        original = _state["original"]
        why = _refusal(hidden, weight, bias, final_logit_softcapping, outputs)
        if why is not None:
            REPORT[f"trl: {why}"] += 1
            return original.apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                                  logit_scale, outputs)
        REPORT["tritongrad"] += 1
        stats = bool({"log_sum_sq_probs", "mean_logits", "is_top1"} & set(outputs))
        # A float32 head with 16-bit products is cast per call, as TRL casts it per tile; the weight's gradient
        # accumulates in float32 and rounds once, as TRL's does (grad_weight_f32).
        with torch.autocast(hidden.device.type, enabled=False):
            if final_logit_softcapping:  # TRL's order: the scale, the cap, then the temperature
                scales = dict(logit_scale=float(logit_scale), logit_softcap=float(final_logit_softcapping),
                              post_scale=1.0 / float(temperature))
            else:
                scales = dict(logit_scale=float(logit_scale) / float(temperature))
            lp, ent, st = linear_token_logprobs_op(hidden, weight, targets, bias, -100,
                                                   return_entropy="entropy" in outputs, return_stats=stats,
                                                   grad_weight_f32=True, **scales)
        return (lp, ent if "entropy" in outputs else None,
                st[2].detach() if "log_sum_sq_probs" in outputs else None,
                st[0].detach() if "mean_logits" in outputs else None,
                st[1].detach() > 0.5 if "is_top1" in outputs else None)


def patch_trl() -> None:
    """Serve TRL's fused LM head (every trainer that uses ``add_fused_lm_head``) with tritongrad's kernels,
    under the rule above. Idempotent; :func:`unpatch_trl` undoes it. Raises RuntimeError for a TRL it does not
    cover."""
    import trl
    import trl.trainer.utils as tu

    version = ".".join(trl.__version__.split(".")[:2])
    if version not in COVERED:
        raise RuntimeError(f"tritongrad.patch_trl: TRL {trl.__version__} is not covered (covered: {', '.join(COVERED)}"
                           "); use the losses directly (tritongrad.linear_grpo_loss, linear_dpo_loss) in your loop")
    current = getattr(tu, "_ChunkedLogProbFunction", None)
    if current is TritongradLogProbFunction:
        return
    params = tuple(inspect.signature(current.forward).parameters) if current is not None else ()
    if params != SIGNATURE:
        raise RuntimeError(f"tritongrad.patch_trl: TRL {trl.__version__}'s fused head takes {params}, not {SIGNATURE}; "
                           "not patched")
    _state["original"] = current
    tu._ChunkedLogProbFunction = TritongradLogProbFunction


def unpatch_trl() -> None:
    """Give TRL its own fused LM head back."""
    import trl.trainer.utils as tu

    if tu._ChunkedLogProbFunction is TritongradLogProbFunction:
        tu._ChunkedLogProbFunction = _state["original"]

"""The post-training family: per-token log-probabilities (and entropy) from hidden states and an LM head, and
the losses built on them — TRL's GRPO and DPO, and distillation between two heads (generalized JSD, KL) —
none of which holds the ``[N, V]`` logits at once (docs/post-training.md)."""

from .launch import (
    linear_distill_op,
    linear_dpo_loss,
    linear_dpo_op,
    linear_grpo_loss,
    linear_grpo_op,
    linear_jsd,
    linear_kl_div,
    linear_token_logprobs,
    linear_token_logprobs_op,
)
from .trl_integration import patch_trl, unpatch_trl
from .reference import (
    dpo_from_logprobs,
    grpo_from_logprobs,
    linear_distill_reference,
    linear_dpo_reference,
    linear_grpo_reference,
    linear_token_logprobs_reference,
    wpo_weights,
)

__all__ = [
    "dpo_from_logprobs", "grpo_from_logprobs", "linear_distill_op", "linear_distill_reference", "linear_dpo_loss",
    "linear_dpo_op", "linear_dpo_reference", "linear_grpo_loss", "linear_grpo_op", "linear_grpo_reference",
    "linear_jsd", "linear_kl_div", "linear_token_logprobs", "linear_token_logprobs_op",
    "linear_token_logprobs_reference", "patch_trl", "unpatch_trl", "wpo_weights",
]

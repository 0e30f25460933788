"""The family matrix: every causal-LM family of the installed ``transformers``, patched against unpatched.

For each family (``model_type``) that transformers' auto mapping lists for causal language modelling, a tiny
random-init model is built from the family's own default config (a multimodal family's text config, where
its causal-LM class takes that), shrunk (:data:`TINY`, with the per-family values of :data:`FAMILY_CONFIG`
where the defaults do not shrink: MLA head sizes, layer patterns, sub-configs, towers), in float32. A family
no such values make buildable and trainable unpatched on CPU says why in :data:`FAMILY_NOTE`. A deep copy is patched with
:func:`tritongrad.patch`; both run the same checks, and the patched model must reproduce the unpatched one:

- the training loss (labels with ignored positions): relative difference at most :data:`LOSS_RTOL`;
- every parameter's gradient: relative difference (max abs over max abs) at most :data:`GRAD_RTOL`;
- eval-mode logits, with padding (a left-padded attention mask), with ``position_ids`` given;
- the loss and gradients with two sequences packed in each row (``position_ids`` restarting);
- ``generate`` of 3 tokens (greedy): the same tokens;
- gradient checkpointing; a second backward through the retained graph (twice the gradients);
- every gradient through ``torch.func.grad`` over ``functional_call``, and the loss's derivative along a fixed
  direction of the parameters through ``torch.func.jvp`` (a patched path must run under the transforms, where
  tritongrad's ops run their references);
- the loss with a forward hook on every module that scales its output: a hook on a module that a patched
  path bypasses (the LM head under the fused loss, a gate's activation) must count;
- a training step of a bfloat16 copy, and one under bfloat16 autocast: the median error of the loss and
  gradients against the float64 model at most twice the unpatched model's (the family's own casts, which
  float32 cannot show);
- :func:`tritongrad.unpatch` restores the model: its classes, and outputs bit for bit the unpatched model's.

An exact verdict notes what the values cannot show: the first module whose output the patched model lays out
otherwise (eager), and the calls a module-wide replacement handed back to the original (``_hf.KEPT``).

``mode="compiled"`` runs the patched model's training step (and the packed one) under ``torch.compile``
(``backend="aot_eager"`` off the GPU: it traces the backward with fake tensors, with the layouts a compiled
model's backward really gets), twice: the second step must reuse the first's graphs (no recompilation) and
give the same loss, and break Dynamo's graph no more often than the unpatched model's compiled step; against
the unpatched model's eager step, both with SDPA attention where the
family has it (as models are compiled; the mask decision ``causal_mask`` replaces is made only there); where the
patched compiled step fails, the unpatched model's compiled step tells whether the family itself does not
compile.

With ``variants``, each family runs again with each of :data:`VARIANTS` that its config has and keeps (the
activation, biases, a tied head, head width, rotary width, logit scales and caps, ...): the default config is one
point of a family. The tiny models' weights are drawn at about 1/sqrt(hidden) (``TINY``'s ``initializer_range``),
so that functions the patch must tell apart differ by more than the tolerances.

Each family and mode gets a :class:`Verdict`: ``exact`` (with what was patched), ``refused`` (nothing that
was patched computes differently, and the report says why each op was left alone), ``wrong: <figures>`` or
``error: <message>``. A family whose tiny model cannot be built is an ``error``, never left out.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import math
import re
import traceback
import warnings

import torch

from . import _hf

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
LOGITS_RTOL = 1e-5
# A check the tolerances fail passes at up to this many times the unpatched model's float32 error against
# float64 where the patched model in float64 is the float64 model to FLOAT64_RTOL (zoo._earned): above one
# float32 rounding of the loss (the patched loss's float32 output, as Hugging Face's, compiled, where
# _in_float64 does not reach inside the op), far below any change of the function the tolerances would see.
ROUNDING_SPREAD = 4.0
FLOAT64_RTOL = 1e-7
# ... and only where the unpatched model is itself within this many tolerances of the float64 model (the most
# the matrix has needed is 4.1, Gemma4-Unified's gradients).
REFERENCE_SPREAD = 10.0
MAX_PARAMS = 4_000_000

# The sizes every tiny model gets, where its config has the attribute (or takes it as an argument).
TINY = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=256, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
    topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    sliding_window=8, tie_word_embeddings=False, d_model=64, encoder_layers=2, decoder_layers=2,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
    # No dropout: the two models draw random numbers in different orders.
    attention_dropout=0.0, hidden_dropout=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    dropout=0.0, activation_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, resid_dropout=0.0,
    embed_dropout=0.0, mlp_dropout=0.0, classifier_dropout=0.0, local_attention_probs_dropout_prob=0.0,
    lsh_attention_probs_dropout_prob=0.0,
    # Weights of about 1 / sqrt(hidden_size): pre-activations and logits of order 1, where GELU and its tanh
    # form, or a soft cap and none, differ by far more than the tolerances (0.02 keeps them where they agree).
    initializer_range=0.15, init_std=0.15,
)
# Per family: the depth of its tiny model where TINY's two layers would leave out a kind of layer the default
# config builds (sliding and full attention, dense and sparse MLPs, linear and full attention, rope and no rope,
# cross-attention): the smallest depth that has every kind (missing_layer_kinds; tests/test_zoo.py checks it).
LAYERS: dict[str, int] = {
    **dict.fromkeys(("dots3_note", "dots3_note_text", "hy_v4"), 3),
    **dict.fromkeys(("afmoe", "cohere2", "cohere2_moe", "dory", "ergo", "exaone4", "exaone_moe", "flint",
                     "lara_mini", "llama4", "llama4_text", "mllama", "modernbert-decoder", "olmo3"), 4),
    **dict.fromkeys(("beam", "deepseek_v4", "kimi_linear", "kolibri1", "lfm3"), 5),
    **dict.fromkeys(("bailing_hybrid", "gemma3", "gemma3_text", "inkling2_text", "inkling_text", "mimo_v2_flash"), 6),
    **dict.fromkeys(("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "kolibri1_1"), 7),
    "gemma3n_text": 10,  # transformers 5.17 needs 10, 5.25 five
    "inkling2_loop_text": 12,
}
# The config attributes that list each layer's kind.
LAYER_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types", "attention_types",
               "kv_source_layers")
# Per family: values its defaults need beyond TINY (e.g. a vocabulary its special tokens fit in).
FAMILY_CONFIG: dict[str, dict] = {
    # Mamba mixers at the tiny width (the defaults' 128 heads of 64 and 256 states cost seconds a step on CPU).
    "bamba": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8, attn_layer_indices=[1]),
    "falcon_h1": dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=8),
    # Scales and caps away from 1 and None, so that a patch that drops them shows.
    "granite": dict(logits_scaling=4.0),
    "granitemoe": dict(logits_scaling=4.0),
    "gemma3_text": dict(final_logit_softcapping=30.0),
    "phi3": dict(partial_rotary_factor=0.5),
    "stablelm": dict(partial_rotary_factor=0.5),
    # GPT-J's rotary_dim (64 by default) is over the tiny head (16): partial, half of it.
    "gptj": dict(rotary_dim=8),
    "codegen": dict(rotary_dim=8),
    # Multi-head latent attention (MLA): keys and values come out of kv_b_proj with one head per query head,
    # and the rotary part of a head is qk_rope_head_dim wide (head_dim is the rotary width).
    **{f: dict(num_key_value_heads=4, head_dim=8) for f in (
        "axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa",
        "minicpm3", "sarvam_mla", "youtu")},
    # Sub-configs and layer patterns the shrunk sizes must agree with.
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(hidden_size=64, ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    "gpt_neo": dict(num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, state_size=16, chunk_size=8),
    "xlnet": dict(d_head=16, n_head=4, d_inner=128, n_layer=2),
    "zamba": dict(layers_block_type=["mamba", "hybrid"], n_mamba_heads=2, mamba_d_state=8),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], n_mamba_heads=2, mamba_d_state=8, chunk_size=8,
                   adapter_rank=8),
    "zaya": dict(num_experts_per_tok=1),
    # Ergo's dense first block and shared experts have sizes of their own; Kolibri's indexer heads must fit the
    # tiny model's query heads.
    "ergo": dict(first_dense_intermediate_size=128, shared_intermediate_size=64, moe_intermediate_size=32,
                 num_experts=4, num_experts_per_tok=2),
    "kolibri1_1": dict(index_num_heads=2, index_topk=8, mlp_only_layers=[0],
                       # indexed layers of each kind the default has: storing keys and values, reusing them,
                       # their own (the fewest that missing_layer_kinds finds)
                       layer_types=["sliding_attention"] * 2 + ["indexed_attention"] * 5,
                       kv_source_layers=[0, 1, 2, 2, 2, 5, 6]),
    # Local attention only: LSH attention hashes into buckets, and a rounding-level change moves a token.
    "reformer": dict(is_decoder=True, axial_pos_shape=[3, 4], axial_pos_embds_dim=[32, 32],
                     attn_layers=["local", "local"]),
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0)}),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # Hybrids whose first two default layers have no attention: one of each, so that attention (and the rope,
    # norms and masks it reaches) runs (tests/test_zoo.py checks that every text attention class is built).
    **{f: dict(layer_types=["linear_attention", "full_attention"])
       for f in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")},
    "bailing_hybrid": dict(num_key_value_heads=4, head_dim=8),
    **{f: dict(layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2, indexer_kv_heads=1,
               indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2)
       for f in ("qwen4_exp", "qwen4_exp_text")},
    # MoE families whose first default layers are dense, or whose experts, shared expert or attention layer are
    # off by default: one of each in two layers, so that the experts' gate (and what else the patch reaches
    # there) runs.
    "flint": dict(mlp_only_layers=[0]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "granitemoeshared": dict(logits_scaling=4.0, shared_intermediate_size=32),
    "granitemoe_swa": dict(shared_intermediate_size=32),
    "gemma4_text": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=16, enable_moe_block=True,
                        num_experts=4, top_k_experts=2, moe_intermediate_size=32),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_state=16,
                             mamba_chunk_size=8),
    # dots3's third layer (sliding attention) takes sizes of its own; the indexer's heads shrunk too.
    **{f: dict(num_key_value_heads=4, index_n_heads=4, index_head_dim=16,
               per_layer_config={"2": dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                                           kv_lora_rank=16, head_dim=16, qk_nope_head_dim=8, v_head_dim=16,
                                           qk_rope_head_dim=8)})
       for f in ("dots3_note", "dots3_note_text")},
    "deepseek_v4": dict(o_lora_rank=16, index_n_heads=4, index_head_dim=16),
    "gemma4_assistant": dict(text_config=dict(model_type="gemma4_text", hidden_size_per_layer_input=0,
                                              vocab_size_per_layer_input=0)),
    **{f: dict(text_config=dict(hidden_size_per_layer_input=16, vocab_size_per_layer_input=256),
               vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, head_dim=16))
       for f in ("gemma4", "gemma4_unified_assistant")},
    # Gemma 4 unified's encoder-free vision embedder: merged patches of 2x2 pixels into 32 features.
    "gemma4_unified": dict(text_config=dict(hidden_size_per_layer_input=16, vocab_size_per_layer_input=256),
                           vision_config=dict(patch_size=2, pooling_kernel_size=2, mm_embed_dim=32,
                                              mm_posemb_size=16, output_proj_dims=32),
                           audio_config=dict(audio_embed_dim=16)),
    "xmod": dict(default_language="en_XX"),
    "musicgen": dict(num_codebooks=1),
    "musicgen_melody": dict(num_codebooks=1),
    # Sizes under names of the family's own.
    "cpmant": dict(dim_ff=128, dim_head=16, position_bias_num_buckets=32),
    "moshi": dict(ffn_dim=128),
    "kimi_linear": dict(linear_head_dim=16, linear_num_heads=4, num_key_value_heads=4, head_dim=8),
    # Inkling's sliding-window layers take head counts and widths of their own.
    **{f: dict(unpadded_vocab_size=256, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16)
       for f in ("inkling2_text", "inkling2_loop_text")},
    "inkling_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16),
    "longcat_flash": dict(num_layers=2, ffn_hidden_size=128, expert_ffn_hidden_size=32, n_routed_experts=4,
                          moe_topk=2, zero_expert_num=2, num_key_value_heads=4, head_dim=8),
    "gemma3n_text": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=16, num_kv_shared_layers=0),
    # Multimodal: the towers the text-only batch never runs, shrunk too.
    "gemma3": dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2)),
    "git": dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2)),
    "got_ocr2": dict(vision_config=dict(hidden_size=32, mlp_dim=64, num_hidden_layers=1, num_attention_heads=2,
                                        output_channels=32, global_attn_indexes=[0])),
    "moss_transcribe_diarize": dict(audio_config=dict(d_model=32, encoder_ffn_dim=64, encoder_layers=1,
                                                      encoder_attention_heads=2)),
    "roc_bert": dict(shape_vocab_size=64, pronunciation_vocab_size=64, shape_embed_dim=16,
                     pronunciation_embed_dim=16),
    "phi4_multimodal": dict(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, crop_size=28, patch_size=14),
        audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2,
                          ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=32)),
    # The byte latent transformer: its entropy patcher, local encoder and decoder and global transformer, each
    # a small model of its own, and hash embeddings of two n-gram sizes.
    "blt": dict(encoder_hash_byte_group_vocab=256, encoder_hash_byte_group_size=[3, 4],
                patcher_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, intermediate_size=64, head_dim=16),
                encoder_config=dict(hidden_size=32, hidden_size_global=64, num_attention_heads=2,
                                    num_key_value_heads=2, num_hidden_layers=1, intermediate_size=64),
                decoder_config=dict(hidden_size=32, hidden_size_global=64, num_attention_heads=2,
                                    num_key_value_heads=2, num_hidden_layers=1, intermediate_size=64, head_dim=16),
                global_config=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                                   intermediate_size=128, head_dim=16)),
}

# Per family: why the matrix cannot check it, where no tiny config of the kind above makes it build and train
# unpatched on CPU. Appended to its error.
FAMILY_NOTE: dict[str, str] = {
    "gemma3n": "its vision tower is a TimmWrapperModel, which needs the timm package",
    "gemma4_assistant": "an assistant (drafter) model: its forward takes the target model's inputs_embeds and "
                        "shared_kv_states, which a text batch does not have",
    "gemma4_unified_assistant": "an assistant (drafter) model: its forward takes the target model's "
                                "inputs_embeds and shared_kv_states, which a text batch does not have",
    "git": "its causal LM needs pixel values (image tokens prefix the text): a text batch does not fit",
    "musicgen": "its causal LM takes input_ids per codebook and labels [batch, length, codebooks]: a text batch "
                "does not fit",
    "musicgen_melody": "its causal LM takes input_ids per codebook and labels [batch, length, codebooks]: a text "
                       "batch does not fit",
}


@dataclasses.dataclass
class Verdict:
    family: str
    mode: str
    status: str                     # "exact", "refused", "wrong", "error"
    detail: str = ""
    ops: dict = dataclasses.field(default_factory=dict)     # op -> "replaced xN" | "left alone: why"
    variant: str = ""                                         # a name in VARIANTS, or the default config

    def line(self) -> str:
        detail = self.detail
        if self.status == "error" and self.family in FAMILY_NOTE:
            detail = f"{FAMILY_NOTE[self.family]} ({detail})" if detail else FAMILY_NOTE[self.family]
        return self.status if not detail else f"{self.status}: {detail}"


# Config variants (``tritongrad models --variants``): a family's tiny config with values that change what a patch
# must establish, each checked like the default. A variant runs on a family whose config has every attribute,
# keeps the values it is given (Gemma's config turns hidden_act "gelu" into the tanh form) and changes one of them.
VARIANTS: dict[str, dict] = {
    "gelu": dict(hidden_act="gelu"),  # the gate's activation: GeGLU without the tanh approximation ...
    "gelu-tanh": dict(hidden_act="gelu_pytorch_tanh"),  # ... with it ...
    "relu": dict(hidden_act="relu"),  # ... or no op of tritongrad's (left alone)
    "gemma-gelu": dict(hidden_activation="gelu"),  # Gemma's name for it
    "mlp-bias": dict(mlp_bias=True),  # biases in the gate, up and down projections
    "attention-bias": dict(attention_bias=True),
    "tied": dict(tie_word_embeddings=True),  # the loss's weight is the input embedding's
    "head-dim": dict(head_dim=32),  # heads wider than hidden / heads
    "rms-eps": dict(rms_norm_eps=0.3),  # an eps the norms must take
    "layer-norm-eps": dict(layer_norm_eps=0.3),
    "partial-rotary": dict(partial_rotary_factor=0.25),
    "full-rotary": dict(partial_rotary_factor=1.0),
    "softcap": dict(final_logit_softcapping=5.0),  # the loss's soft cap on ...
    "no-softcap": dict(final_logit_softcapping=None, attn_logit_softcapping=None),  # ... and off
    "logits-scaling": dict(logits_scaling=0.25),  # Granite: logits / logits_scaling
    "logit-scale": dict(logit_scale=3.0),  # Cohere: logits * logit_scale
    "multipliers": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3),
    "qk-norm": dict(use_qk_norm=True),
    "qk-layernorm": dict(qk_layernorm=True),
    "parallel-residual": dict(use_parallel_residual=True),
    "serial-residual": dict(use_parallel_residual=False),
    "norm-topk": dict(norm_topk_prob=True),  # the experts' routing weights renormalised
}


def _config_values(config, names) -> dict:
    """The values of ``names`` a config holds, where it has them: its text config's attribute, its own, or an
    entry of its ``rope_parameters``."""
    out = {}
    for k in names:
        for c in (getattr(config, "text_config", None), config):
            if c is not None and k in _known(c):
                out[k] = getattr(c, k, None)
                break
            rope = getattr(c, "rope_parameters", None) if c is not None else None
            if isinstance(rope, dict) and k in rope:
                out[k] = rope[k]
                break
    return out


def variants(family: str) -> list[str]:
    """The names of the :data:`VARIANTS` that apply to ``family`` (see there), in the table's order."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
    try:
        default = _config_values(_tiny_config(family, cls), {k for v in VARIANTS.values() for k in v})
    except Exception:  # noqa: BLE001 - a family whose tiny config does not build has no variants
        return []
    out = []
    for name, values in VARIANTS.items():
        if not set(values) <= set(default):
            continue
        try:
            got = _config_values(_tiny_config(family, cls, values), values)
        except Exception:  # noqa: BLE001 - values the config rejects
            continue
        if got == values and any(default[k] != v for k, v in values.items()):
            out.append(name)
    return out


def layer_kinds(model: torch.nn.Module) -> set:
    """The kinds of layer in ``model``'s longest stack of layers (a ModuleList named ``layers``, ``h``,
    ``blocks``, ...): each layer's module classes, with their flag and name attributes (``is_sliding``,
    ``layer_type``, ...) and whether they hold a sliding window."""
    stacks = [m for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)
              and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks", "layer", "block")]
    if not stacks:
        return set()

    def kind(layer):
        return tuple(sorted({(type(m).__name__, getattr(m, "sliding_window", None) is not None,
                              tuple(sorted((k, v) for k, v in vars(m).items() if isinstance(v, (bool, str))
                                           and not k.startswith("_") and k != "training")))
                             for m in layer.modules()}, key=repr))

    return {kind(layer) for layer in max(stacks, key=len)}


def missing_layer_kinds(family: str) -> list:
    """The kinds of layer (:func:`layer_kinds`) that the family's tiny config at the default config's depth builds
    and :func:`build`'s tiny model lacks: what cutting the default pattern to the tiny depth (:data:`LAYERS`)
    leaves out. Both models are sized on the meta device."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
    own = FAMILY_CONFIG.get(family, {})
    default = _default_config(_config_class(family, cls), own)
    depth = getattr(default.get_text_config(), "num_hidden_layers", None)
    # The family's per-layer kinds (layer_types, ...) as the default has them, its other values kept.
    deep = {"num_hidden_layers": depth, **{k: getattr(default, k, None) for k in own if k in LAYER_LISTS}}
    if any(v is None for k, v in deep.items() if k in LAYER_LISTS):  # no default kinds: the family's own list
        deep = {"num_hidden_layers": TINY["num_hidden_layers"]}
    if isinstance(own.get("text_config"), dict):
        deep["text_config"] = {**own["text_config"], "num_hidden_layers": depth}
    with torch.device("meta"):
        tiny = layer_kinds(cls._from_config(_tiny_config(family, cls), attn_implementation="eager"))
        full = layer_kinds(cls._from_config(_tiny_config(family, cls, deep), attn_implementation="eager"))
    return sorted(full - tiny, key=repr)


def families() -> list[str]:
    """Every ``model_type`` transformers maps to a causal-LM class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build(family: str, seed: int = 0, attention: str = "eager", variant: str | None = None) -> torch.nn.Module:
    """The family's tiny float32 causal LM, random-init with ``seed``, in train mode; ``attention``: the
    ``attn_implementation`` ("eager", or "sdpa" where the family has it, else eager); ``variant``: a name in
    :data:`VARIANTS`, whose values its config takes."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
    config = _tiny_config(family, cls, VARIANTS[variant] if variant else None)
    with torch.device("meta"):  # sized first, on no memory
        size = sum(p.numel() for p in cls._from_config(config, attn_implementation="eager").parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"the shrunk default config still has {size / 1e6:.1f}M parameters (a tiny model has "
                         f"at most {MAX_PARAMS / 1e6:g}M): the family needs an entry in zoo.FAMILY_CONFIG")
    if attention != "eager" and not getattr(cls, f"_supports_{attention}", False):
        attention = "eager"
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=attention, dtype=torch.float32)
    with torch.no_grad():  # norm weights and biases away from their constant init, so that their semantics show
        g = torch.Generator().manual_seed(seed + 1)
        for m in model.modules():
            w = getattr(m, "weight", None)
            if "norm" in type(m).__name__.lower() and isinstance(w, torch.Tensor) and w.dim() == 1:
                w.add_(0.3 * torch.randn(w.shape, generator=g).to(w.dtype))
        for name, p in model.named_parameters():  # a kernel that drops a zero bias would still be exact
            if name.rsplit(".", 1)[-1] == "bias" and p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g).to(p.dtype))
    return model.train()


def _config_class(family: str, cls):
    """The family's config class; a composite (multimodal) family's causal LM takes its text config."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[family]
    sub_cls = getattr(cls, "config_class", None)
    if sub_cls is not None and sub_cls is not config_cls and any(
            isinstance(v, type) and issubclass(v, sub_cls) for v in getattr(config_cls, "sub_configs", {}).values()):
        return sub_cls
    return config_cls


def _default_config(config_cls, own: dict):
    """The family's default config; one that does not validate by itself, with the family's values ``own``."""
    try:
        return config_cls()
    except Exception:  # noqa: BLE001 - e.g. sub-configs the defaults leave inconsistent
        return config_cls(**own)


def _known(config) -> set:
    return set(config.to_dict()) | set(getattr(config, "attribute_map", {}))


def _tiny_config(family: str, cls, extra: dict | None = None):
    """The family's default config with :data:`TINY`'s sizes where it has them, then :data:`FAMILY_CONFIG`'s
    values, then ``extra``'s; a text config inside it shrunk too."""
    import transformers

    config_cls = _config_class(family, cls)
    own = {**FAMILY_CONFIG.get(family, {}), **(extra or {})}
    default = _default_config(config_cls, own)
    wanted = {**TINY, "num_hidden_layers": LAYERS.get(family, TINY["num_hidden_layers"]), **own}
    known = _known(default)
    kwargs = {k: v for k, v in wanted.items() if k in known}
    rope = getattr(default, "rope_parameters", None)
    moved = {k: v for k, v in own.items() if k not in known and isinstance(rope, dict) and k in rope}
    if moved:  # rotary settings (partial_rotary_factor) that the config keeps in its rope_parameters
        kwargs["rope_parameters"] = {**rope, **kwargs.get("rope_parameters", {}), **moved}
    text = getattr(default, "text_config", None)
    if isinstance(text, transformers.PretrainedConfig) and isinstance(own.get("text_config"), dict):
        # A text config given as values of its own: built with the tiny sizes it has too.
        tk = _known(text)
        kwargs["text_config"] = {"model_type": text.model_type, **{k: v for k, v in wanted.items() if k in tk},
                                 **own["text_config"]}
        kwargs["text_config"]["head_dim"] = TINY["hidden_size"] // TINY["num_attention_heads"]
    if ("head_dim" in kwargs and "hidden_size" in kwargs and "num_attention_heads" in kwargs
            and "head_dim" not in own):
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    config = config_cls(**kwargs)
    _shrink_text_config(config, wanted)
    return config


def _shrink_text_config(config, wanted: dict) -> None:
    """A multimodal config's text model: ``wanted``'s values where it has the attribute."""
    inner = getattr(config, "text_config", None)
    if inner is None or not hasattr(inner, "hidden_size"):
        return
    for k, v in wanted.items():
        try:
            present = hasattr(inner, k)
        except Exception:  # noqa: BLE001 - a per-layer attribute (Gemma4) that has no global value
            present = False
        if present:
            setattr(inner, k, v)


def _batch(vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, -2:] = -100
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - b| over max |b| (at least ``floor``: a gradient that is zero in exact arithmetic, such as a
    key projection's bias, holds rounding noise only)."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf
    scale = max(b.abs().max().item() if b.numel() else 0.0, floor)
    err = (a - b).abs().max().item() if b.numel() else 0.0
    if not math.isfinite(err):
        return math.inf
    return err / scale if scale > 0 else err


def _no_cache(model) -> dict:
    """``use_cache=False`` where the forward takes it: a training step builds no cache."""
    import inspect

    return {"use_cache": False} if "use_cache" in inspect.signature(type(model).forward).parameters else {}


class Recompiled(RuntimeError):
    """A second compiled training step recompiled; ``guards``: the failed guards, as Dynamo gives them."""

    def __init__(self, guards: list[str]):
        self.guards = guards
        self.why = "; ".join(guards)
        super().__init__(f"a second compiled step recompiled: {self.why}")

    def sources(self) -> list[str]:
        """Where each failed guard reads its value (the code and its line), else the guard; without Dynamo's
        frame numbers and the guarded values, which differ between two models with the same cause."""
        out = []
        for g in self.guards:
            g = re.sub(r"^\d+/\d+: ", "", g)
            out.append(g.split(" # ", 1)[1].split(" (HINT")[0] if " # " in g else g)
        return out


def _step(model, batch, compiled: bool, recompiles_ok: bool = False, **extra):
    """Loss and gradients of one training step (gradients zeroed first, then read and detached). Compiled, a
    second step follows, which must give the same loss and, unless ``recompiles_ok``, reuse the first's graphs."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    fn = model
    if compiled:
        torch._dynamo.reset()  # no guards or recompilation limits carried over from another model
        fn = torch.compile(model, backend="aot_eager" if not torch.cuda.is_available() else "inductor")
    loss = fn(**batch, **_no_cache(model), **extra).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if compiled:  # the next step reuses this one's graphs: state a patched path leaves changed fails no guard
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        try:
            with torch._dynamo.config.patch(error_on_recompile=not recompiles_ok):
                again = fn(**batch, **_no_cache(model), **extra).loss
        except torch._dynamo.exc.RecompileError as e:
            why = [" ".join(ln.split()[1:]) for ln in str(e).splitlines() if re.match(r"\s*- \d+/\d+:", ln)][:2]
            raise Recompiled(why or [_short(e)]) from e
        again.backward()
        if not torch.equal(again.detach(), loss.detach()):
            raise RuntimeError(f"a second compiled step's loss {again.item()!r} is not the first's {loss.item()!r}")
        model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _logits(model, batch, **extra):
    model.eval()
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            return model(input_ids=batch["input_ids"], **_no_cache(model), **extra).logits
    finally:
        model.train()


def _second_backward(model, batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = model(**batch, **_no_cache(model)).loss
    loss.backward(retain_graph=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _checkpointed(model, batch):
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise NotImplementedError("no gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if _FLOAT64_DEPTH[0]:  # the backward's recomputation runs outside the forward's mode: in it again
        kwargs["context_fn"] = lambda: (contextlib.nullcontext(), _in_float64())
    hooked = bool(getattr(model, "_require_grads_hooks", None) or hasattr(model, "_require_grads_hook"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    try:
        return _step(model, batch, False)[1]
    finally:
        model.gradient_checkpointing_disable()
        # transformers' enable makes the embeddings' output require grad (a hook) and its disable removes that
        # hook only under PEFT: left on, the hook raises under torch.func in every later check.
        if not hooked:
            model.disable_input_require_grads()


def _hooked(model, batch):
    """A training step's loss with a forward hook on every module scaling its tensor output (by 1 + j/64, j in
    1..5 by the module's place): where a patched path bypasses a module's call (reads its weights, stands for
    it), that module's hook must still count, so the path falls back to the call (docs/models.md#module-calls)."""
    handles = []
    for k, m in enumerate(model.modules()):
        def hook(mod, args, out, f=1 + (k % 5 + 1) / 64):
            return out * f if isinstance(out, torch.Tensor) and out.is_floating_point() else None
        handles.append(m.register_forward_hook(hook))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallbacks' warnings: the check is the loss
            return _step(model, batch, False)[0]
    finally:
        for h in handles:
            h.remove()


def _copy(model):
    """``copy.deepcopy(model)``, with the tensors a module keeps from its last forward that are not graph leaves
    (RecurrentGemma's recurrent state), which deepcopy refuses, copied detached: whether a copy could be made
    must not depend on which check ran before."""
    memo = {id(v): v.detach().clone() for m in model.modules() for v in vars(m).values()
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and not v.is_leaf}
    return copy.deepcopy(model, memo)


def _low_step(model, batch, autocast: bool):
    """A training step of a float32 model's copy in bfloat16, or under bfloat16 autocast (a float64 model as it
    is: the reference :func:`_low_problems` holds both models to): the loss and every gradient, in float64."""
    copied = _copy(model)
    low = next(copied.parameters()).dtype == torch.float32
    if low and not autocast:
        copied = copied.to(torch.bfloat16)
    device = next(copied.parameters()).device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=low and autocast):
        loss, grads = _step(copied, batch, False)
    return {"loss": loss.double(), **{n: g.double() for n, g in grads.items()}}


def _functional_loss(model, batch):
    """``(the parameters that take gradients, detached; the training loss as a function of them)``, through
    ``functional_call``, as functorch-based trainers take it."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())

    def loss(p):
        torch.manual_seed(0)
        return torch.func.functional_call(model, (p, buffers), (), {**batch, **_no_cache(model)},
                                          strict=False).loss

    return params, loss


def _func_grad(model, batch):
    """Every parameter's gradient of the training loss through ``torch.func.grad``: a patched path must run
    under the transform as the module does."""
    params, loss = _functional_loss(model, batch)
    return torch.func.grad(loss)(params)


def _func_jvp(model, batch):
    """The training loss's derivative along a fixed direction of every parameter, through ``torch.func.jvp``
    (forward-mode AD: tritongrad's ops run their references), and its terms' magnitude: the sum over parameters
    of ``|grad_n . v_n|``, from autograd's gradients, which :func:`_error` holds the derivative's difference to.
    The derivative itself is a sum over parameters that can cancel (XGLM's is 1/1500 of its terms), where float32
    rounding of the terms, the same in the patched and the unpatched model, is no smaller."""
    params, loss = _functional_loss(model, batch)
    # A fixed direction made by arithmetic, not drawn: the float64 reference (_in_float64) draws other numbers.
    # Made in float64 in both, else the float32 angles' rounding turns the direction (by up to 0.01 at the
    # embeddings' indices) and the float64 reference differentiates along another.
    tangents = {n: torch.cos(torch.arange(p.numel(), dtype=torch.float64, device=p.device) * 1.7 + k)
                .view(p.shape).to(p) for k, (n, p) in enumerate(params.items())}
    leaves = {n: p.detach().requires_grad_() for n, p in params.items()}
    grads = dict(zip(leaves, torch.autograd.grad(loss(leaves), list(leaves.values()), allow_unused=True)))
    terms = sum((g * tangents[n]).sum().abs() for n, g in grads.items() if g is not None).detach()
    return {"d loss": torch.func.jvp(loss, (params,), (tangents,))[1], "terms": terms}


def _generate(model, batch):
    model.eval()
    try:
        with torch.no_grad():
            return model.generate(batch["input_ids"][:1, :6], max_new_tokens=3, do_sample=False,
                                  pad_token_id=0).float()
    finally:
        model.train()


def _check_fns(batch, compiled: bool, recompiles_ok: bool = False) -> dict:
    """The checks, by name: each a function of the model returning tensors to compare."""
    ids = batch["input_ids"]
    # Two sequences packed in each row (positions restart, as DataCollatorWithFlattening gives): the model masks
    # attention across them, and causal_mask's decisions must leave that mask alone.
    packed = torch.cat([torch.arange(5), torch.arange(ids.shape[1] - 5)]).to(ids.device).expand_as(ids)
    steps = {}  # one training step per model and batch gives both its loss and its gradients (the model held)

    def step(m, kind="plain"):
        if steps.get("model") is not m:
            steps.clear()
            steps["model"] = m
        if kind not in steps:
            steps[kind] = _step(m, batch, compiled, recompiles_ok,
                                **({"position_ids": packed} if kind == "packed" else {}))
        return steps[kind]

    # The bfloat16 steps' batches (:func:`_low_problems`): this one, and its tokens shuffled over rows and
    # positions (each in another context) twice, the same positions ignored.
    lows = [batch]
    for seed in LOW_PRECISION_SHUFFLES:
        shuffled = ids.flatten()[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed)).to(
            ids.device)].view_as(ids)
        lows.append({"input_ids": shuffled, "labels": torch.where(batch["labels"] == -100, -100, shuffled)})
    training = {"loss": lambda m: step(m)[0], "grads": lambda m: step(m)[1],
                PACKED[0]: lambda m: step(m, "packed")[0], PACKED[1]: lambda m: step(m, "packed")[1]}
    if compiled:
        return training
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    items = torch.tensor(7, device=ids.device)
    return {
        **training,
        "logits": lambda m: _logits(m, batch),
        "logits, padding mask": lambda m: _logits(m, batch, attention_mask=mask),
        "logits, position_ids": lambda m: _logits(m, batch, position_ids=pos),
        "loss, padding mask": lambda m: _step(m, batch, False, attention_mask=mask)[0],
        "loss, position_ids": lambda m: _step(m, batch, False, position_ids=pos)[0],
        # as Trainer passes it under gradient accumulation: the loss is then the labelled tokens' sum over it
        "loss, num_items_in_batch": lambda m: _step(m, batch, False, num_items_in_batch=items)[0],
        "generate": lambda m: _generate(m, batch),
        "gradient checkpointing": lambda m: _checkpointed(m, batch),
        "second backward": lambda m: _second_backward(m, batch),
        FUNC_GRAD: lambda m: _func_grad(m, batch),
        FUNC_JVP: lambda m: _func_jvp(m, batch),
        "loss, module hooks": lambda m: _hooked(m, batch),
        BFLOAT16: lambda m: [_low_step(m, b, autocast=False) for b in lows],
        AUTOCAST: lambda m: [_low_step(m, b, autocast=True) for b in lows],
    }


NOT_CHECKED = "not checked (the unpatched model fails them): "


def check_names(compiled: bool = False) -> tuple[str, ...]:
    """Every check a mode runs, in order."""
    ids = torch.zeros(2, 12, dtype=torch.long)
    return tuple(_check_fns({"input_ids": ids, "labels": ids}, compiled))


def not_checked(line: str) -> set[str]:
    """The checks a verdict line notes as not checked, since the unpatched model fails them."""
    if NOT_CHECKED not in line:
        return set()
    rest, names = line.split(NOT_CHECKED, 1)[1].split("; ", 1)[0], set()
    known = sorted(check_names(), key=len, reverse=True)  # names hold commas: the longest that fits first
    while rest:
        name = next((n for n in known if rest == n or rest.startswith(n + ", ")), None)
        if name is None:
            raise ValueError(f"not a list of checks: {rest!r}")
        names.add(name)
        rest = rest[len(name) + 2:]
    return names


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _state(model) -> dict:
    """What a check must leave as it found it, for the checks after it: the training flag, every module's hooks
    and checkpointing flag, which parameters take gradients, grad mode and the default dtype."""
    state = {"training": model.training, "grad mode": torch.is_grad_enabled(), "dtype": torch.get_default_dtype(),
             "requires_grad": tuple(n for n, p in model.named_parameters() if p.requires_grad)}
    for name, m in model.named_modules():
        for d in _HOOK_DICTS:
            if getattr(m, d, None):
                state[f"{name or 'the model'}'s {d}"] = tuple(getattr(m, d))
        if getattr(m, "gradient_checkpointing", False):
            state[f"{name or 'the model'}'s gradient_checkpointing"] = True
    return state


def _checks(model, fns: dict, only=None) -> tuple[dict, dict]:
    """``(results, failures)``: each check's tensors, or the exception it raised. A check after the first that
    leaves the model changed raises: the checks after it would run on another model (or fail, and be noted as
    not checked). The first may: a model's first call can set it up (transformers installs its output hooks,
    BigBird swaps its attention modules for short sequences)."""
    out, failed = {}, {}
    first = True
    for name, fn in fns.items():
        if only is not None and name not in only:
            continue
        before = _state(model)
        try:
            out[name] = fn(model)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            failed[name] = e
        after = _state(model)
        if not first and after != before:
            changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
            raise RuntimeError(f"zoo: the check {name!r} left the model changed: {', '.join(changed)}")
        first = False
    return out, failed


def _error(key: str, g, w) -> tuple[float, str]:
    """How far ``g`` is from ``w`` for check ``key`` (relative; inf where they cannot be compared), and where."""
    if key == "generate":
        return (0.0 if g is not None and torch.equal(g, w) else math.inf), ""
    if key in LOW_PRECISION:  # the median over the loss and the gradients (docs/models.md#the-family-matrix)
        if set(w) != set(g or {}):
            return math.inf, f"gradients of {sorted(set(w) ^ set(g or {}))[:3]} present on one side only"
        floor = 1e-2 * max((t.abs().max().item() for n, t in w.items() if n != "loss" and t.numel()), default=0.0)
        errs = sorted(_rel(g[n], w[n], 0.0 if n == "loss" else floor) for n in w)
        return errs[len(errs) // 2], "median over the loss and gradients"
    if key == FUNC_JVP:
        if not isinstance(g, dict) or set(g) != set(w):
            return math.inf, "no derivative"
        return _rel(g["d loss"], w["d loss"], w["terms"].item()), "d loss, over its terms' magnitude,"
    if isinstance(w, dict):
        if set(w) != set(g or {}):
            return math.inf, f"gradients of {sorted(set(w) ^ set(g or {}))[:3]} present on one side only"
        floor = 1e-2 * max((t.abs().max().item() for t in w.values() if t.numel()), default=0.0)
        worst = max(((_rel(g[n], w[n], floor), n) for n in w), default=(0.0, ""))
        return worst
    return _rel(g, w), ""


def _tol(key: str, w) -> float:
    return GRAD_RTOL if isinstance(w, dict) else LOSS_RTOL if "loss" in key else LOGITS_RTOL


def _compare(got: dict, want: dict) -> dict[str, str]:
    """The checks where ``got`` differs from ``want`` beyond the tolerances, with their figures."""
    bad = {}
    for key, w in want.items():
        err, where = _error(key, got.get(key), w)
        if err > _tol(key, w):
            what = "different tokens" if key == "generate" else f"{where + ' ' if where else ''}off by {err:.2e} (relative)"
            bad[key] = f"{key}: {what}"
    return bad


def _earned(model, ref: dict, got: dict, want: dict, keys, same) -> tuple[dict, str]:
    """For checks the fixed tolerances fail: the unpatched model's own float32 error against the same model in
    float64 (:func:`_in_float64`) decides. A tiny random model can be ill-conditioned enough that a rounding-level
    change (``x / sqrt(v)`` for ``x * rsqrt(v)``) moves its logits by more than the fixed tolerance; the patched
    model passes when its error is at most twice the unpatched model's, plus a tenth of the tolerance; or at most
    :data:`ROUNDING_SPREAD` times it where the patched model run in float64 is the float64 model to
    :data:`FLOAT64_RTOL` (``same(ref64, keys)``: the errors, by check), which shows the same function: two
    float32 roundings of it land apart by more than 2x in a model that amplifies rounding enough."""
    keys = [k for k in keys if k != "generate"]
    try:
        model64 = _float64(model)
        with _in_float64():
            ref64, failed = _checks(model64, ref, only=keys)
    except Exception:  # noqa: BLE001 - no float64 model: the fixed tolerances stand
        return {}, ""
    held, notes, same64 = {}, [], None
    for k in keys:
        if k not in ref64:
            continue
        e_p, e_u = _error(k, got[k], ref64[k])[0], _error(k, want[k], ref64[k])[0]
        if e_u > REFERENCE_SPREAD * _tol(k, want[k]):
            continue  # the float64 run computes something else than the float32 check: it vouches for nothing
        if e_p <= 2 * e_u + 0.1 * _tol(k, want[k]):
            held[k] = True
            notes.append(f"{k} {e_p:.1e} vs {e_u:.1e}")
        elif e_p <= ROUNDING_SPREAD * e_u + 0.1 * _tol(k, want[k]):
            same64 = same(ref64, keys) if same64 is None else same64
            if same64.get(k, math.inf) <= FLOAT64_RTOL:
                held[k] = True
                notes.append(f"{k} {e_p:.1e} vs {e_u:.1e}, within {ROUNDING_SPREAD:g}x: the same function in "
                             f"float64 ({same64[k]:.1e})")
    return held, ", ".join(notes)


class _Float64Mode(torch.overrides.TorchFunctionMode):
    """Float32 casts and ``dtype=torch.float32`` arguments give float64 (see :func:`_in_float64`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") is torch.float32:
            kwargs = {**kwargs, "dtype": torch.float64}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        elif func in (torch.Tensor.to, torch.Tensor.type):
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _in_float64():
    """A float64 model computes in float64 throughout: its own upcasts to float32 (Llama's and Gemma's RMSNorms'
    ``.to(torch.float32)``, softmax's ``dtype=torch.float32``, rotary tables) and new tensors of the default
    dtype give float64, else the reference would carry float32 roundings where the model upcasts."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    _FLOAT64_DEPTH[0] += 1
    try:
        with _Float64Mode():
            yield
    finally:
        _FLOAT64_DEPTH[0] -= 1
        torch.set_default_dtype(default)


_FLOAT64_DEPTH = [0]  # how many _in_float64 blocks are open (gradient checkpointing's recomputation enters one)


def _same_in_float64(family: str, model, device, mode: str, variant, fns: dict, ops: dict):
    """``same(ref64, keys)`` for :func:`_earned`: the patched model in float64 (patched as the float32 one was:
    the same ops replaced), each check's error against ``ref64``; none where it cannot run."""
    def same(ref64, keys):
        try:
            patched64 = _patched(family, _float64(model), device, mode, variant)
        except Exception:  # noqa: BLE001
            return {}
        if isinstance(patched64, Verdict):
            return {}
        patched64, ops64 = patched64
        try:
            if ops64 != ops:
                return {}
            with _in_float64():
                got64, _ = _checks(patched64, fns, only=keys)
            return {k: _error(k, got64[k], ref64[k])[0] for k in got64 if k in ref64}
        finally:
            import tritongrad

            tritongrad.unpatch(patched64)
    return same


def _float64(model):
    model64 = _copy(model).double()
    if getattr(model64.config, "_experts_implementation", None) not in (None, "eager"):
        model64.config._experts_implementation = "eager"  # grouped GEMMs take no float64
    return model64


def _low_problems(model, fns: dict, got: dict, want: dict) -> dict:
    """The bfloat16 steps (:data:`LOW_PRECISION`) the unpatched model ran: where, on every batch (three), the
    patched model's median error against the float64 model is more than twice the unpatched model's (plus
    1e-4), what it is; nothing where there is no float64 model. Every batch: a rounding that flips a MoE
    router's top-k moves most gradients, patched or not, on a batch by chance (docs/models.md#the-family-matrix);
    a patched piece that loses precision does so on every batch."""
    bad = {}
    try:
        model64 = _float64(model)
    except Exception:  # noqa: BLE001 - no float64 model: nothing to hold the bfloat16 steps to
        return {}
    for key in want:
        try:
            with _in_float64():
                ref = fns[key](model64)
        except Exception:  # noqa: BLE001
            continue
        errs = [(_error(key, g, r)[0], _error(key, w, r)[0])
                for g, w, r in zip(got.get(key) or [None] * len(want[key]), want[key], ref)]
        if all(e_p > 2 * e_u + 1e-4 for e_p, e_u in errs):
            bad[key] = f"{key}: median error " + ", ".join(
                f"{e_p:.2e} (unpatched {e_u:.2e})" for e_p, e_u in errs) + f" against float64, on {len(errs)} batches"
    return bad


def _report_ops(report) -> dict:
    ops = {}
    for e in report.replaced + report.already:
        ops.setdefault(e.op, []).append(e.detail)
    out = {op: f"replaced x{len(v)}" for op, v in ops.items()}
    for e in report.skipped:
        if e.op not in out:
            out[e.op] = f"left alone: {e.detail}"
    return out


# A bfloat16 copy's training step: compared only through the float64 model, the patched model's median error
# (over the loss and the gradients) at most twice the unpatched model's. It holds each patched piece to the family's own
# bfloat16 rounding (where it casts, what it computes in float32), which float32 cannot show.
BFLOAT16 = "loss and grads, bfloat16"
AUTOCAST = "loss and grads, bfloat16 autocast"  # float32 weights, as Trainer's bf16=True trains
LOW_PRECISION = (BFLOAT16, AUTOCAST)
LOW_PRECISION_SHUFFLES = (1, 2)  # the seeds of the bfloat16 steps' batches beyond the first (_check_fns)
PACKED = ("loss, packed sequences", "grads, packed sequences")
FUNC_GRAD = "grads, torch.func.grad"
FUNC_JVP = "loss's directional derivative, torch.func.jvp"

KEPT_NOTE = "calls the patch handed to the original: "  # _hf.KEPT, counted over the patched model's checks
# The checks that exercise the kernels (the others differ only in what the model computes around them).
TRAINING_CHECKS = ("loss", "grads", "logits", "gradient checkpointing", "second backward", FUNC_GRAD, FUNC_JVP,
                   *LOW_PRECISION)


# Families whose tiny model leaves out an experts class on purpose: the other configuration of the family is
# checked elsewhere.
UNBUILT_OK: dict[str, str] = {
    "gemma4": "the dense text model here; gemma4_text runs the MoE block",
    "gemma4_assistant": "an assistant model, checked only as far as it builds",
}


def unbuilt(model) -> list[str]:
    """The classes of ``model``'s modeling modules that the patch reaches and ``model`` has no instance of:
    text attention classes whose forward applies the rotary embedding, and experts classes. A tiny config
    whose two layers are both of one kind (linear attention, dense MLPs) leaves the other kind's rope, norms or
    experts' gate unchecked (vision and audio towers aside: a text batch never runs them)."""
    import inspect
    import re
    import sys

    present = {type(m) for m in model.modules()}
    modules = {sys.modules[c.__module__] for c in present if c.__module__.startswith("transformers.models.")}
    missing = set()
    for mod in modules:
        for name, cls in vars(mod).items():
            if (not inspect.isclass(cls) or cls.__module__ != mod.__name__ or cls in present
                    or "Vision" in name or "Audio" in name or not issubclass(cls, torch.nn.Module)):
                continue
            if name.endswith("Experts"):
                missing.add(name)
            elif name.endswith("Attention"):
                try:
                    source = inspect.getsource(cls.forward)
                except (OSError, TypeError):
                    continue
                if re.search(r"\bapply_rotary_(pos_emb(_interleave)?|emb)\(", source):
                    missing.add(name)
    return sorted(missing)


def check(family: str, mode: str = "eager", device=None, only=None, variant: str | None = None) -> Verdict:
    """One family in one mode (``"eager"`` or ``"compiled"``): see the module docstring. ``only``: the names
    of the checks to run (e.g. :data:`TRAINING_CHECKS`), default all; ``variant``: a name in :data:`VARIANTS`
    (one of :func:`variants`), the default config without."""
    v = _check(family, mode, device, only, variant)
    return dataclasses.replace(v, variant=variant or "")


def _check(family: str, mode: str, device, only, variant) -> Verdict:
    import tritongrad

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    compiled = mode == "compiled"
    try:  # compiled: SDPA where the family has it, as users compile, which causal_mask's decision serves
        model = build(family, attention="sdpa" if compiled else "eager", variant=variant).to(device)
    except Exception as e:  # noqa: BLE001 - a family that cannot be built is reported, not dropped
        return Verdict(family, mode, "error", f"cannot build a tiny model: {type(e).__name__}: {_short(e)}")
    missing = [] if family in UNBUILT_OK else unbuilt(model)
    if missing:
        return Verdict(family, mode, "error", f"the tiny model builds no {', '.join(missing)}, which the patch "
                                              "reaches: zoo.FAMILY_CONFIG needs a layer pattern with one")
    batch, fns, ref = _check_plan(model, device, compiled, only)
    layouts = ({}, {})  # eager: each module's first output layout, unpatched and patched
    with _layouts(model, layouts[0], not compiled):
        want, failed = _checks(model, ref)
    if "loss" in failed or "grads" in failed:
        e = failed.get("loss") or failed["grads"]
        return Verdict(family, mode, "error", f"the unpatched model fails a training step: {type(e).__name__}: "
                                              f"{_short(e)}")
    patched = _patched(family, model, device, mode, variant)
    if isinstance(patched, Verdict):
        return patched
    patched, ops = patched
    kept_before = dict(_hf.KEPT)
    with _layouts(patched, layouts[1], not compiled), _graph_breaks() as broke:
        got, errors = _checks(patched, fns, only=want)
    kept = {k: n - kept_before.get(k, 0) for k, n in _hf.KEPT.items() if n > kept_before.get(k, 0)}
    recompiled = _own_recompile(model, fns, errors) if compiled else ""
    if recompiled:  # the family's own recompilation, not the patch's: the values are still checked
        lenient = {k: v for k, v in _check_fns(batch, True, recompiles_ok=True).items() if k in fns}
        got, errors = _checks(patched, lenient, only=want)
    tritongrad.unpatch(patched)
    if errors:
        return _error_verdict(family, mode, model, fns, errors, ops)
    # after unpatch: the module-wide patches (rope, causal_mask) must not count on the unpatched side
    added = _added_breaks(model, fns, broke, want) if compiled else ""
    if added:
        return Verdict(family, mode, "error", added, ops)
    got_low, want_low = ({k: d.pop(k) for k in LOW_PRECISION if k in d} for d in (got, want))
    bad = _compare(got, want)
    earned = ""
    if bad:
        same = _same_in_float64(family, model, device, mode, variant, fns, ops)
        held, earned = _earned(model, ref, got, want, bad, same)
        bad = {k: v for k, v in bad.items() if k not in held}
    if want_low:
        bad.update(_low_problems(model, ref, got_low, want_low))
    if not compiled:
        bad.update(_unpatch_problems(patched, model, batch, want))
    if bad:
        return Verdict(family, mode, "wrong", "; ".join(bad.values()), ops)
    notes = []
    if earned:
        notes.append(f"error against float64 as the unpatched model's float32 error allows ({earned})")
    if failed:
        notes.append(NOT_CHECKED + ", ".join(sorted(failed)))
    if recompiled:
        notes.append(f"the unpatched model's second compiled step recompiles too ({recompiled})")
    moved = _layout_moved(*layouts)
    if moved:
        notes.append(moved)
    if kept:  # right values, but the calls ran the original's ops: the report's "replaced" did not happen
        notes.append(KEPT_NOTE + ", ".join(f"{op} ({fn}) x{n}" for (op, fn), n in sorted(kept.items())))
    return Verdict(family, mode, "exact", "; ".join(notes), ops)


@contextlib.contextmanager
def _graph_breaks():
    """Dynamo's graph breaks, by reason, while the block runs (a Counter, filled when it ends)."""
    from torch._dynamo.utils import counters

    counter = counters["graph_break"]
    before = collections.Counter(counter)
    out = collections.Counter()
    try:
        yield out
    finally:
        out.update(collections.Counter(counter) - before)


def _added_breaks(model, fns: dict, patched_breaks, checks) -> str:
    """Empty unless the patched model's compiled steps break the graph more often than the unpatched model's
    (compiled only to tell, when the patched ones break): then how often each, and the patch's first reason."""
    if not patched_breaks:
        return ""
    with _graph_breaks() as own:
        _checks(model, fns, only=checks)
    if sum(patched_breaks.values()) <= sum(own.values()):
        return ""
    reason = next(iter(patched_breaks - own or patched_breaks)).strip().splitlines()[0]
    return (f"the patched model's compiled steps break the graph {sum(patched_breaks.values())} times, the "
            f"unpatched model's {sum(own.values())}: {reason}")


@contextlib.contextmanager
def _layouts(model, into: dict, on: bool = True):
    """Each module's first output, by the module's name, as its shape and strides (a tuple's first tensor),
    recorded into ``into`` while the block runs forwards (nothing when not ``on``)."""
    handles = []
    if on:
        for name, m in model.named_modules():
            def hook(mod, args, out, name=name):
                t = out[0] if isinstance(out, tuple) and out else out
                if isinstance(t, torch.Tensor) and name not in into:
                    into[name] = (tuple(t.shape), t.stride())
            setattr(hook, _hf.OBSERVER, True)  # it may go uncalled: a patched path that bypasses m stays
            handles.append(m.register_forward_hook(hook))
    try:
        yield into
    finally:
        for h in handles:
            h.remove()


def _layout_moved(unpatched: dict, patched: dict) -> str:
    """The first module (in the order outputs were made) whose output the patched model lays out otherwise
    than the unpatched one, with both strides: values the same, but the next ops may copy it (a defect of
    memory and speed the values do not show: docs/norms.md#rows-and-layouts). A dim of size 1 has no layout
    (its stride is never stepped). Empty where none."""
    for name, (shape, stride) in unpatched.items():
        got = patched.get(name)
        if got is not None and got[0] == shape and any(n > 1 and a != b for n, a, b in zip(shape, got[1], stride)):
            return f"layout: {name or 'the model'}'s output {shape} has strides {got[1]} (unpatched {stride})"
    return ""


def _check_plan(model, device, compiled: bool, only) -> tuple:
    """``(batch, the checks to run, the reference's checks)``. The reference is the unpatched model in eager
    mode; compiled, the patched model's compiled step must reproduce it (the unpatched model is compiled only
    to tell, when the patched one fails, whose failure it is)."""
    head = getattr(model.get_output_embeddings(), "weight", None)  # none, or a list of heads (MusicGen's)
    vocab = head.shape[0] if isinstance(head, torch.Tensor) else 256
    batch = _batch(min(vocab, 256), device)
    fns = _check_fns(batch, compiled)
    if only is not None:
        fns = {k: v for k, v in fns.items() if k in only}
    ref = {k: v for k, v in _check_fns(batch, False).items() if k in fns} if compiled else fns
    return batch, fns, ref


def _patched(family: str, model, device, mode: str, variant: str | None = None):
    """``(a patched copy of model, the report's ops)``, or the Verdict when patch raises or replaces nothing."""
    import warnings

    import tritongrad

    try:
        patched = _copy(model)
    except RuntimeError:  # non-leaf parameters (weight_norm): the same seed builds the same weights
        patched = build(family, attention=model.config._attn_implementation, variant=variant).to(device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = tritongrad.patch(patched)
    except Exception as e:  # noqa: BLE001
        tritongrad.unpatch(patched)
        return Verdict(family, mode, "error", f"patch raised {type(e).__name__}: {_short(e)}")
    ops = _report_ops(report)
    if not report.replaced:
        tritongrad.unpatch(patched)
        return Verdict(family, mode, "refused", "nothing replaced", ops)
    return patched, ops


def _own_recompile(model, fns: dict, errors: dict) -> str:
    """The failed guards when every check the patched model failed recompiled on its second compiled step and the
    unpatched model's do too, on the same guards (the family's own); else empty."""
    if not errors or not all(isinstance(e, Recompiled) for e in errors.values()):
        return ""
    own = _checks(model, fns, only=list(errors))[1]
    if set(own) != set(errors) or any(not isinstance(own[k], Recompiled) or own[k].sources() != e.sources()
                                      for k, e in errors.items()):
        return ""
    return next(iter(own.values())).why


def _error_verdict(family: str, mode: str, model, fns: dict, errors: dict, ops) -> Verdict:
    """The first check the patched model failed; compiled, the unpatched model's own failure where it has one."""
    name, e = next(iter(errors.items()))
    if mode == "compiled":
        own = _checks(model, fns, only=[name])[1].get(name)
        if own is not None:
            return Verdict(family, mode, "error", f"the unpatched model fails a compiled training step: "
                                                  f"{type(own).__name__}: {_short(own)}", ops)
    return Verdict(family, mode, "error", f"{name}: {type(e).__name__}: {_short(e)}\n{_where(e)}", ops)


def _unpatch_problems(patched, model, batch, want: dict) -> dict:
    """``unpatch`` restores the model: every module's class, and the eval logits bit for bit."""
    if any(type(a) is not type(b) for a, b in zip(patched.modules(), model.modules())):
        return {"unpatch": "unpatch: a module keeps a tritongrad class"}
    if "logits" in want and not torch.equal(_logits(patched, batch), want["logits"]):
        return {"unpatch": "unpatch: eval logits differ from the unpatched model's"}
    return {}


def _short(e: BaseException, n: int = 300) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return s if len(s) <= n else s[: n - 3] + "..."


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if "tritongrad" in f.filename]
    f = (mine or frames)[-1]
    return f"  at {f.filename.rsplit('/', 2)[-1]}:{f.lineno} ({f.name})"


def run(names=None, modes=("eager", "compiled"), device=None, progress=None, only=None,
        with_variants: bool = False) -> list[dict]:
    """``[{"family", "eager", "compiled", "ops"}]`` for ``names`` (default: every family); ``only``: as
    :func:`check`'s. ``with_variants``: after each family's default config, a row per variant that applies
    (:func:`variants`), with a ``"variant"`` key."""
    rows = []
    for family in names or families():
        for variant in [None, *(variants(family) if with_variants else ())]:
            row = {"family": family, **({"variant": variant} if variant else {})}
            ops = {}
            for mode in modes:
                try:
                    v = check(family, mode, device, only, variant)
                except Exception as e:  # noqa: BLE001 - one family's failure never stops the matrix
                    v = Verdict(family, mode, "error", f"{type(e).__name__}: {_short(e)}", variant=variant or "")
                row[mode] = v.line()
                ops = ops or v.ops
                if progress:
                    progress(v)
            row["ops"] = ops
            rows.append(row)
    return rows


def markdown(rows: list[dict], modes=("eager", "compiled")) -> str:
    """The matrix as a Markdown table: family, a column per mode, and what was patched."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")[:160]

    lines = ["| family | " + " | ".join(modes) + " | patched | left alone |",
             "|---" * (len(modes) + 3) + "|"]
    for r in rows:
        ops = r.get("ops", {})
        done = ", ".join(f"{op} {v.split()[-1]}" for op, v in sorted(ops.items()) if v.startswith("replaced"))
        alone = "; ".join(f"{op}: {v[len('left alone: '):]}" for op, v in sorted(ops.items())
                          if v.startswith("left alone"))
        name = f"{r['family']} [{r['variant']}]" if r.get("variant") else r["family"]
        lines.append(f"| {name} | " + " | ".join(cell(r.get(m, '')) for m in modes)
                     + f" | {cell(done)} | {cell(alone)} |")
    return "\n".join(lines)

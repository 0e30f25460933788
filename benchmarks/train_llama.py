"""Train a Llama model (or any Hugging Face causal-LM family) from random init with Hugging Face eager,
tritongrad-patched and Liger-patched kernels, eager and under torch.compile, optionally sharded with FSDP2, and
compare throughput, peak memory and loss.

    python benchmarks/train_llama.py                                  # ~1.2B Llama (3.2-1B shape), seq 4096
    python benchmarks/train_llama.py --size tiny --steps 20           # a few seconds (CPU: Triton's interpreter)
    python benchmarks/train_llama.py --family qwen3 --size 300m --seq 2048     # another family, ~350M
    python benchmarks/train_llama.py --family gemma3_text --vocab family       # the family's own vocabulary
    python benchmarks/train_llama.py --family qwen3_moe --experts 8 --top-k 2  # MoE: experts of intermediate/4
    python benchmarks/train_llama.py --providers tritongrad --modes eager --time-limit 60
    python benchmarks/train_llama.py --runs hf:eager,tritongrad:eager,liger:eager,hf:compile  # these, in order
    python benchmarks/train_llama.py --world-sizes 1,2 --fsdp              # FSDP2 at world sizes 1 and 2
    python benchmarks/train_llama.py --world-sizes 1,2 --ddp               # DDP at world sizes 1 and 2
    torchrun --nproc-per-node 2 benchmarks/train_llama.py --fsdp      # FSDP2, launched by hand

Every run (provider x mode x world size) starts in a process of its own (torchrun for FSDP2 and DDP), so
class-level patches (Liger's) and compile caches never leak into the next run, and the peak memory is the
run's own. All runs see the same initial weights (each parameter drawn from a generator seeded by its name)
and the same batches. Under torchrun the runs share the launched processes, one after another (Liger last:
its patches stay).

``--family MODEL_TYPE`` (default llama) builds ``AutoModelForCausalLM.from_config`` of
``AutoConfig.for_model(MODEL_TYPE, ...)``: the size's fields under the names that family's config has
(``head_dim`` = hidden / heads), MoE families with ``--experts`` experts of ``--moe-intermediate`` (default
intermediate / 4), ``--top-k`` per token, every layer sparse and no router loss; everything else the family's
defaults, but for ``FAMILY_CONFIG`` (Granite's multipliers), no padding token, and Gemma's
``query_pre_attn_scalar`` = head_dim. Llama keeps Llama 3's rope theta (500000) and norm eps (1e-5). Vocabulary:
the size's, ``--vocab N``, or ``--vocab family`` (the family's own). 2-D and larger parameters start at
N(0, 0.02) from a generator seeded by the name; 1-D ones: biases 0, norm weights 1, or 0 where the family's
RMSNorm applies ``1 + weight`` (Gemma's, read with ``tritongrad._hf.norm_kind`` from the family's own classes),
so every family starts at unit norm scale. Liger patches through its ``MODEL_TYPE_TO_APPLY_LIGER_FN`` entry
for the family, with the flags that function takes of rope, swiglu, geglu, rms_norm and fused linear cross
entropy; a family Liger lacks is recorded as "skipped: Liger has no <family>". A family whose model refuses
SDPA (Gemma2) runs eager attention for every provider, said in each run's ``attention``.

"eager" and "compile" say whether the model runs under torch.compile; attention is PyTorch's SDPA for every
provider (where the family takes it), so the runs differ in norms, MLP, rotary embedding and loss, and,
compiled, in the causal mask: tritongrad's patch lets SDPA use is_causal there as in eager mode (``--tg-ops``
without causal_mask: the explicit mask that transformers builds under torch.compile on torch < 2.14).

The data are sequences from a fixed random Markov chain (``MarkovChain``) whose entropy rate, printed as the
loss floor, is the lowest loss any model can reach. Written under --out (default $OUT, else train-out),
updated after every run: ``<stem>.json`` (settings, each run's losses, step times, patch report), ``<stem>.csv``
(one row per run: tokens/s, the median over the steps after warm-up, in all and per GPU; peak memory, the max
over the ranks; the loss differences to Hugging Face eager and, for FSDP2 and DDP runs, to the same provider
and mode on one GPU (unwrapped where that ran), with tokens/s per GPU as a fraction of that run's), ``<stem>-loss.png``,
``<stem>-throughput.png``, ``<stem>-memory.png``, and ``runs/<run>.json`` as each run goes. Each run's record
also has the peak of the bytes requested from the allocator (``peak_requested_gib``, without its rounding)
and, compiled, ``graphs_after_first_step``: graphs compiled after the first step, which a steady training
loop does not need.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as _dt
import gc
import importlib.util
import inspect
import json
import linecache
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
import zlib

import torch

# NVLink multicast stays off, also in the processes torchrun starts (they inherit this environment).
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

if not torch.cuda.is_available():  # tritongrad's kernels on CPU: Triton's interpreter, chosen before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

SIZES = {  # name: (vocab, hidden, intermediate, layers, heads, kv heads, tied embeddings)
    "tiny": (1024, 128, 384, 2, 4, 2, True),
    "small": (32000, 1024, 2816, 8, 16, 8, True),
    "300m": (32000, 1536, 4096, 12, 12, 4, True),   # ~350M dense at vocab 32000 (head dim 128, 12 layers)
    "1b": (128256, 2048, 8192, 16, 32, 8, True),    # Llama 3.2 1B: 1.24B parameters
    "3b": (128256, 3072, 8192, 28, 24, 8, True),    # Llama 3.2 3B
}
PROVIDERS = ("hf", "tritongrad", "liger")
MODES = ("eager", "compile")
TG_OPS = ("rms_norm", "swiglu", "geglu", "rope", "linear_cross_entropy", "cross_entropy", "causal_mask",
          "fused_add_rms_norm")
# Beyond the size fields, per family: values its defaults leave at a no-op, so the family differs from Llama
# (Granite 3.0 2B's muP multipliers: the loss's logit scale, scaled embeddings and residuals).
FAMILY_CONFIG: dict[str, dict] = {
    "granite": dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                    attention_multiplier=0.015625),
}
# Liger's flags for every family; each family's apply function gets those its signature has.
LIGER_FLAGS = dict(rope=True, swiglu=True, geglu=True, rms_norm=True, cross_entropy=False,
                   fused_linear_cross_entropy=True)
# Liger 0.8.5 raises NotImplementedError for Granite's fused linear cross entropy: its loss on the logits.
LIGER_FAMILY_FLAGS = {"granite": dict(cross_entropy=True, fused_linear_cross_entropy=False)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--providers", default=",".join(PROVIDERS), help="comma list of: " + ", ".join(PROVIDERS))
    p.add_argument("--modes", default=",".join(MODES), help="comma list of: eager, compile")
    p.add_argument("--runs", default=None,
                   help="comma list of provider:mode, run in that order, e.g. hf:eager,liger:eager,hf:compile\n"
                        "(instead of every provider under every mode)")
    p.add_argument("--family", default="llama",
                   help="transformers model_type to train (default llama), e.g. qwen3, gemma3_text, qwen3_moe")
    p.add_argument("--size", default="1b", choices=SIZES, help="model shape (default 1b); overridden below")
    p.add_argument("--vocab", type=_vocab_arg, help="override the size's vocab; 'family': the family's own")
    for name in ("hidden", "intermediate", "layers", "heads", "kv-heads"):
        p.add_argument(f"--{name}", type=int, help=f"override the size's {name}")
    p.add_argument("--experts", type=int, default=8, help="MoE families: experts per layer (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="MoE families: experts per token (default 2)")
    p.add_argument("--moe-intermediate", type=int, default=None,
                   help="MoE families: each expert's intermediate size (default intermediate / 4)")
    p.add_argument("--tied", type=int, choices=(0, 1), help="override the size's tied embeddings (0 or 1)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--batch", type=int, default=4, help="global batch in sequences (default 4), split over ranks")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the throughput median (default 5)")
    p.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (default 2e-4)")
    p.add_argument("--lr-warmup", type=int, default=40, help="steps of linear warm-up (default 40)")
    p.add_argument("--lr-decay", choices=("constant", "cosine"), default="cosine",
                   help="after warm-up: constant, or cosine down to a tenth by the last step (default cosine)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (default 1.0, the Trainer's; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markov-states", type=int, default=1024, help="states of the data's Markov chain (default 1024)")
    p.add_argument("--markov-branch", type=int, default=8, help="successors per state")
    p.add_argument("--time-limit", type=float, default=150.0,
                   help="seconds per run, setup and compile included: no step starts after it (default 150)")
    p.add_argument("--total-time-limit", type=float, default=None,
                   help="seconds for all runs: runs not started by then are recorded as skipped")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard (any world size, 1 too)")
    p.add_argument("--ddp", action="store_true", help="replicate with DistributedDataParallel instead (any world size)")
    p.add_argument("--world-sizes", default="1",
                   help="world sizes to run, e.g. 1,2 (more than 1: torchrun, and FSDP2 unless --ddp); a size may\n"
                        "name its own spread: 1,fsdp2,ddp2 (one GPU unwrapped, then FSDP2 and DDP on two)")
    p.add_argument("--tg-ops", default="rms_norm,swiglu,geglu,rope,linear_cross_entropy,causal_mask,"
                                       "fused_add_rms_norm",
                   help="tritongrad ops to patch (default: all but cross_entropy, which linear_cross_entropy "
                        "supersedes); an op this install lacks is dropped, and said so")
    p.add_argument("--tg-lce-chunk-mib", type=float, default=None,
                   help="linear_cross_entropy's chunk budget in MiB of logits for tritongrad's runs (default: the "
                        "table's); what a smaller chunk saves in peak memory and costs in time")
    p.add_argument("--tg-lce-rows", type=int, default=None,
                   help="linear_cross_entropy's fewest rows per chunk for tritongrad's runs (default: the table's "
                        "LCE_EFFICIENT_ROWS), within the chunk budget (--tg-lce-chunk-mib); what fewer, larger "
                        "chunks save in host time and cost in peak memory")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile the last N steps with torch.profiler: runs/<run>-profile.txt, device time per op")
    p.add_argument("--peak-step", type=_steps_arg, default=(),
                   help="comma list of warm-up steps (recording slows them): record the allocator during each and "
                        "list what is alive at its peak, by where it was allocated: runs/<run>-peak<step>.txt")
    p.add_argument("--out", default=os.environ.get("OUT") or "train-out", help="output folder (default $OUT)")
    p.add_argument("--stem", default=None, help="output file stem (default train-<device>-<time>)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # provider:mode, set by the orchestrator
    p.add_argument("--spread", default=None, help=argparse.SUPPRESS)  # fsdp, ddp or "" (none), set by it too
    args = p.parse_args(argv)
    sizes = dict(zip(("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "tied"), SIZES[args.size]))
    for name in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads"):
        if getattr(args, name) is None:
            setattr(args, name, sizes[name])
    if args.vocab == "family":
        from transformers import AutoConfig

        args.vocab = AutoConfig.for_model(args.family).vocab_size
    args.tied = sizes["tied"] if args.tied is None else bool(args.tied)
    if args.moe_intermediate is None:
        args.moe_intermediate = max(1, args.intermediate // 4)
    args.provider_list = _list(args.providers, PROVIDERS, "provider")
    args.mode_list = _list(args.modes, MODES, "mode")
    if args.runs is None:
        args.run_list = [(p, m) for p in args.provider_list for m in args.mode_list]
    else:
        pairs = [tuple(r.strip().partition(":")[::2]) for r in args.runs.split(",") if r.strip()]
        bad = [f"{p}:{m}" for p, m in pairs if p not in PROVIDERS or m not in MODES]
        if bad:
            raise SystemExit(f"unknown run(s) {bad}; each is provider:mode, a provider of {', '.join(PROVIDERS)} "
                             f"and a mode of {', '.join(MODES)}")
        args.run_list = pairs
    if args.fsdp and args.ddp:
        raise SystemExit("--fsdp and --ddp: choose one")
    if any(not 0 <= s < args.warmup for s in args.peak_step):
        raise SystemExit(f"--peak-step {args.peak_step}: warm-up steps only (0 to {args.warmup - 1}), since "
                         f"recording slows them")
    args.world_size_list = [_world_arg(args, w.strip()) for w in args.world_sizes.split(",") if w.strip()]
    return args


def _world_arg(args, text: str) -> tuple[int, str | None]:
    """A --world-sizes item: (ranks, spread), "2" spread as the flags say, "fsdp2" / "ddp2" as named."""
    name = text.rstrip("0123456789")
    if name not in ("", "fsdp", "ddp") or name == text:
        raise SystemExit(f"--world-sizes item {text!r}: a number of ranks, optionally after fsdp or ddp (fsdp2)")
    world = int(text[len(name):])
    return world, (name or parallel(args, world))


def parallel(args, world: int) -> str | None:
    """How a run at ``world`` ranks is spread by default: "fsdp", "ddp", or None (one process, unwrapped)."""
    if args.spread is not None:  # a worker: as its orchestrator says
        return args.spread or None
    if args.ddp:
        return "ddp"
    return "fsdp" if args.fsdp or world > 1 else None


def _steps_arg(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",") if s.strip())


def _vocab_arg(text: str):
    return "family" if text == "family" else int(text)


def _list(text: str, allowed, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad:
        raise SystemExit(f"unknown {what}(s) {bad}; choose from {', '.join(allowed)}")
    return items


# ---------------------------------------------------------------- data
class MarkovChain:
    """A fixed random Markov chain over ``states`` tokens (distinct ids drawn from the vocabulary). State s moves
    to ``succ[s, j]`` with probability ``p[j]`` (Zipf over ``branch`` choices), and each column ``succ[:, j]``
    is a permutation, so the transition matrix is doubly stochastic: the uniform start is stationary, and every
    position has the same conditional entropy. Its mean over the states (successors that coincide merged) is the
    entropy rate: the loss floor of any model, in nats."""

    def __init__(self, vocab: int, states: int, branch: int, seed: int):
        states = min(states, vocab)
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randperm(vocab, generator=g)[:states]
        self.succ = torch.stack([torch.randperm(states, generator=g) for _ in range(branch)], 1)
        p = 1.0 / torch.arange(1, branch + 1, dtype=torch.float64)
        self.p = p / p.sum()
        same = self.succ[:, :, None] == self.succ[:, None, :]                  # [S, K, K]
        q = (same.double() * self.p).sum(-1)                                    # merged probability of each choice
        self.entropy_rate = float(-(self.p * q.log()).sum(-1).mean())

    def sample(self, rows: int, seq: int, seed: int) -> torch.Tensor:
        """``[rows, seq]`` token ids, starting from uniform (stationary) states."""
        g = torch.Generator().manual_seed(seed)
        s = torch.randint(0, len(self.tokens), (rows,), generator=g)
        choice = torch.multinomial(self.p.float(), rows * max(seq - 1, 1), replacement=True, generator=g)
        choice = choice.view(rows, -1)
        out = torch.empty(rows, seq, dtype=torch.long)
        out[:, 0] = s
        for t in range(1, seq):
            s = self.succ[s, choice[:, t - 1]]
            out[:, t] = s
        return self.tokens[out]


# ---------------------------------------------------------------- one run
def _dist_info() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def model_config(args):
    """The ``--family`` config at the run's size: the size fields under the names the family's config has,
    MoE fields where it has them, :data:`FAMILY_CONFIG`'s values, the rest the family's defaults. No padding
    token (the data use every id: a padding_idx would freeze one embedding row). Llama keeps Llama 3's rope
    theta and norm eps."""
    from transformers import AutoConfig

    h, heads = args.hidden, args.heads
    wanted = dict(vocab_size=args.vocab, hidden_size=h, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=args.kv_heads,
                  head_dim=h // heads, max_position_embeddings=max(args.seq, 128), tie_word_embeddings=args.tied,
                  pad_token_id=None, use_cache=False)
    if args.family == "llama":
        wanted.update(rope_theta=500000.0, rms_norm_eps=1e-5)
    default = AutoConfig.for_model(args.family)
    known = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    known |= set(inspect.signature(type(default).__init__).parameters) - {"self", "kwargs"}
    if known & {"num_experts", "num_local_experts", "n_routed_experts"}:
        # MoE: every layer sparse; experts of moe_intermediate (the family's expert size, or intermediate)
        wanted.update(num_experts=args.experts, num_local_experts=args.experts, n_routed_experts=args.experts,
                      num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
                      decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
        if "moe_intermediate_size" not in known:
            wanted["intermediate_size"] = args.moe_intermediate
    if "query_pre_attn_scalar" in known:  # Gemma: attention scaled by 1/sqrt(head_dim), as its checkpoints are
        wanted["query_pre_attn_scalar"] = h // heads
    for k in ("bos_token_id", "eos_token_id"):  # special tokens outside a smaller vocabulary: none
        if isinstance(getattr(default, k, None), int) and getattr(default, k) >= args.vocab:
            wanted[k] = None
    wanted.update(FAMILY_CONFIG.get(args.family, {}))
    kwargs = {k: v for k, v in wanted.items() if k in known or args.family == "llama"}
    if "num_experts" in kwargs and getattr(default, "attribute_map", {}).get("num_experts") in kwargs:
        del kwargs["num_experts"]  # an alias of num_local_experts there: one name only
    return AutoConfig.for_model(args.family, attn_implementation=attention(args.family), **kwargs)


def attention(family: str) -> str:
    """SDPA, or eager attention for a family whose model refuses SDPA (Gemma2: attention logit soft-capping)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family, ""), None)
    return "eager" if cls is not None and not getattr(cls, "_supports_sdpa", True) else "sdpa"


def _causal_lm(config, device):
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def init_values(args) -> dict[str, float]:
    """The value each 1-D parameter starts at, by name: 0 for biases and for norm weights applied as
    ``1 + weight`` (Gemma's), else 1 (norm weights). Read from the family's own classes on the meta device,
    before any provider patches them (Liger's classes compute the same but are not Hugging Face's)."""
    from tritongrad._hf import norm_kind

    model = _causal_lm(model_config(args), "meta")
    kinds: dict[type, str | None] = {}
    out = {}
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            if p.dim() != 1:
                continue
            if pname == "bias":
                out[f"{mname}.{pname}" if mname else pname] = 0.0
                continue
            cls = type(m)
            if cls not in kinds:
                kinds[cls] = norm_kind(cls)[0] if cls.__name__.endswith("RMSNorm") else None
            out[f"{mname}.{pname}" if mname else pname] = 0.0 if kinds[cls] == "gemma" else 1.0
    return out


def build_model(args, device, ones: dict[str, float] | None = None):
    """The ``--family`` causal LM in bf16, every parameter drawn by name (``ones``: :func:`init_values`)."""
    model = _causal_lm(model_config(args), device)
    model.to(torch.bfloat16)
    # The same initial weights whatever the provider built: each parameter from a generator seeded by its name.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if ones is None else ones[name])  # norm weights (1, or 0 under 1 + w), biases 0
            else:
                g = torch.Generator(device=p.device).manual_seed(args.seed * 1_000_003 + zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * 0.02)
    return model.train()


class Skipped(Exception):
    """A run this install or family cannot make: recorded as "skipped: <why>", not an error."""


def apply_provider(provider: str, args, stage: str, model=None) -> dict:
    """Patch for ``provider``; ``stage`` is "classes" (before the model is built) or "model"."""
    info: dict = {}
    if provider == "liger" and stage == "classes":
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(args.family)
        if fn is None:
            raise Skipped(f"Liger has no {args.family}")
        accepted = inspect.signature(fn).parameters
        flags = {k: v for k, v in {**LIGER_FLAGS, **LIGER_FAMILY_FLAGS.get(args.family, {})}.items()
                 if k in accepted}
        fn(**flags)
        info.update(liger_fn=fn.__name__, liger_flags=flags)
        import liger_kernel

        info["liger_version"] = getattr(liger_kernel, "__version__", None) or _dist_version("liger-kernel")
    if provider == "tritongrad" and stage == "model":
        import tritongrad

        wanted = [op.strip() for op in args.tg_ops.split(",") if op.strip()]
        missing = []
        for op in wanted:
            fn = {"rope": "apply_rotary_pos_emb", "causal_mask": "patch"}.get(op, op)
            try:
                getattr(tritongrad, fn)
            except (ImportError, AttributeError) as e:
                missing.append(f"{op} ({type(e).__name__}: {e})")
        accepted = inspect.signature(tritongrad.patch).parameters
        missing += [f"{op} (tritongrad.patch has no {op} flag)" for op in wanted
                    if op in TG_OPS and op not in accepted]
        ops = {op: op in wanted and not any(m.startswith(op + " ") for m in missing)
               for op in TG_OPS if op in accepted}
        if args.tg_lce_chunk_mib is not None or args.tg_lce_rows is not None:
            # this worker process runs this run alone: set, not scoped
            from tritongrad.ops.cross_entropy import plans as ce_plans

            t = ce_plans.TABLE
            if args.tg_lce_chunk_mib is not None:
                t = dataclasses.replace(t, LCE_CHUNK_BYTES=int(args.tg_lce_chunk_mib * 2**20))
            if args.tg_lce_rows is not None:
                t = dataclasses.replace(t, LCE_EFFICIENT_ROWS=args.tg_lce_rows)
            ce_plans._table.value = t
            info["lce_chunk_bytes"], info["lce_rows"] = t.LCE_CHUNK_BYTES, t.LCE_EFFICIENT_ROWS
        report = tritongrad.patch(model, layer_norm=False, strict=True, **ops)
        info.update(tritongrad_ops=[op for op, on in ops.items() if on], tritongrad_missing=missing,
                    patch_report=str(report).splitlines())
        if _dist_info()[0] == 0:
            if missing:
                print("WARNING: tritongrad lacks " + "; ".join(missing) + ": those ops are not patched", flush=True)
            print(report, flush=True)
    return info


def _dist_version(name: str):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return None


def run_one(args, provider: str, mode: str, chain: MarkovChain, batches: torch.Tensor, started: float,
            ones: dict[str, float] | None = None) -> dict:
    rank, world, local_rank = _dist_info()
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    spread = parallel(args, world)
    result = dict(run=run_name(provider, mode, world, spread), provider=provider, mode=mode, world_size=world,
                  parallel=spread, status="ok", losses=[], step_times=[], loss_floor=chain.entropy_rate)
    info = apply_provider(provider, args, "classes")
    model = build_model(args, device, ones)
    info.update(apply_provider(provider, args, "model", model))
    result.update(info)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["attention"] = model.config._attn_implementation
    if spread == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    if mode == "compile":
        if spread == "fsdp":  # one graph per decoder layer, FSDP2's hooks between them (as torchtitan compiles)
            for layer in model.model.layers:
                layer.compile()
        else:
            model.compile()
    step_model = model
    if spread == "ddp":  # its all-reduce averages the gradients over the ranks
        step_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None)
    fused = device.type == "cuda"
    opt, sched = _optimizer(model, args, fused)
    result["optimizer"] = "AdamW fused" if fused else "AdamW"
    per_rank = args.batch // world
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    result["setup_s"] = round(time.time() - started, 2)
    bar = _progress(args.steps, result["run"]) if rank == 0 else None
    prof = None
    for step in range(args.steps):
        if time.time() - started > args.time_limit:
            result["status"] = f"time limit after {step} steps"
            break
        if args.profile_steps and step == args.steps - args.profile_steps and rank == 0:
            prof = torch.profiler.profile(activities=_activities())
            prof.__enter__()
        ids = batches[step, rank * per_rank:(rank + 1) * per_rank].to(device, non_blocking=True)
        recording = step in args.peak_step and device.type == "cuda" and rank == 0
        if recording:
            before = torch.cuda.memory_allocated(device)
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
        t0 = time.perf_counter()
        loss = step_model(input_ids=ids, labels=ids).loss
        phases = [_max_alloc(device)]
        loss.backward()
        phases.append(_max_alloc(device))
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # as the Trainer does; no host sync
        try:
            opt.step()
        except RuntimeError:
            if not fused or step:
                raise
            fused = False  # fused AdamW refused these parameters (e.g. sharded ones): the default instead
            opt, sched = _optimizer(model, args, fused)
            opt.step()
            result["optimizer"] = "AdamW (fused refused)"
        sched.step()
        opt.zero_grad(set_to_none=True)
        if recording:
            snapshot = torch.cuda.memory._snapshot(device)
            torch.cuda.memory._record_memory_history(enabled=None)
            _write_peak(snapshot, before, os.path.join(args.out, "runs", f"{result['run']}-peak{step}.txt"), result,
                        step)
        if step < 3 and device.type == "cuda":  # where the peak is set: forward, backward or optimizer step
            result.setdefault("peak_by_phase_gib", []).append([round(v / 2**30, 3) for v in (*phases, _max_alloc(device))])
        loss = loss.detach().float()
        if world > 1:
            torch.distributed.all_reduce(loss)  # the mean over ranks (gloo has no AVG)
            loss /= world
        value = loss.item()  # synchronises
        dt = time.perf_counter() - t0
        result["step_times"].append(dt)
        result["losses"].append(value)
        if mode == "compile" and step == 0:
            from torch._dynamo.utils import counters

            graphs_first = counters["stats"]["unique_graphs"]
        if bar is not None:
            bar.update(value, args.batch * args.seq / dt)
        if not math.isfinite(value):
            result["status"] = f"non-finite loss at step {step}"
            break
    if bar is not None:
        bar.close()
    if prof is not None:
        prof.__exit__(None, None, None)
        _write_profile(prof, os.path.join(args.out, "runs", result["run"] + "-profile.txt"), result, args.profile_steps)
    if mode == "compile":
        from torch._dynamo.utils import counters

        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["graph_break_reasons"] = sorted(counters["graph_break"])[:20]
        if result["step_times"]:  # graphs compiled after the first step: recompilations (0 in a steady loop)
            result["graphs_after_first_step"] = counters["stats"]["unique_graphs"] - graphs_first
    times = result["step_times"][args.warmup:args.steps - args.profile_steps]  # profiled steps run slower
    result["tokens_per_s"] = args.batch * args.seq / statistics.median(times) if times else None
    if device.type == "cuda":
        # requested: the bytes asked for, without the allocator's rounding and unsplit block ends (MiB apart)
        requested = torch.cuda.memory_stats(device).get("requested_bytes.all.peak", float("nan"))
        peak = torch.tensor([torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device),
                             requested], device=device, dtype=torch.float64)
        if world > 1:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        result["peak_mem_gib"], result["peak_reserved_gib"], result["peak_requested_gib"] = (peak / 2**30).tolist()
    if provider == "tritongrad":
        import tritongrad

        tritongrad.unpatch(model)  # the module-wide rope too, for the next run in this process
    del model, step_model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return result


def _activities():
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


# The device work a step is made of that no kernel library here replaces, by the operators that launch it (their
# self device time is their own kernels', so no kind counts another's); the rest is what the libraries differ in.
# Their sum bounds any patch's speed-up (BENCHMARKS.md, "Training a Llama").
STEP_KINDS = {
    "products": ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm"),
    "attention": ("aten::_cudnn_attention_forward", "aten::_cudnn_attention_backward",
                  "aten::_flash_attention_forward", "aten::_flash_attention_backward",
                  "aten::_efficient_attention_forward", "aten::_efficient_attention_backward",
                  "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "optimizer": ("aten::_fused_adamw_", "aten::_fused_adam_", "aten::_foreach_add_", "aten::_foreach_mul_",
                  "aten::_foreach_norm"),
}


def step_kinds(events, steps: int, attr: str) -> dict:
    """ms per step of each of STEP_KINDS and of the rest, from a profile's ``key_averages()`` (``attr``: the
    self time to read), over ``steps`` steps. The total is the kernels' time where the profile has kernels
    (the operators count them again), else every operator's."""
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    total = sum(getattr(e, attr, 0) for e in (kernels or events))
    by_name = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU:
            by_name[e.key] = by_name.get(e.key, 0) + getattr(e, attr, 0)
    out = {kind: sum(by_name.get(n, 0) for n in names) / 1e3 / steps for kind, names in STEP_KINDS.items()}
    out["rest"] = total / 1e3 / steps - sum(out.values())
    out["step"] = total / 1e3 / steps
    return out


def _write_profile(prof, path: str, result: dict, steps: int) -> None:
    """The profiled steps' operators by device time (self), then by host time: where a step's time goes; first
    the step's device time by kind (``step_kinds``), also in the run's record."""
    table = prof.key_averages()
    dev = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    kinds = result["step_kinds_ms"] = step_kinds(table, steps, dev)
    with open(path, "w") as f:
        f.write(f"{result['run']}: the last {steps} steps; self device time {kinds['step']:.1f} ms per step\n")
        f.write("per step, ms: " + ", ".join(f"{k} {v:.1f}" for k, v in kinds.items() if k != "step") + "\n\n")
        f.write(table.table(sort_by=dev, row_limit=40, max_name_column_width=70))
        f.write("\n\n")
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    result["profile"] = os.path.basename(path)


def _write_peak(snapshot: dict, before: int, path: str, result: dict, step: int) -> None:
    """The blocks alive at the recorded step's highest allocation, grouped by the two innermost frames outside
    PyTorch's own files (Inductor's generated code counts as outside), the innermost with its line of code;
    then the last allocations up to the peak: what sets the step's peak. An allocation in a compiled backward
    has a forward's frame second (as recorded on the GPU): its innermost frame is the one to read."""
    trace = snapshot["device_traces"][0]
    cur, best, at = 0, 0, -1  # at -1: nothing in the step rose above what was allocated before it
    for i, e in enumerate(trace):
        cur += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        if cur > best:
            best, at = cur, i
    live = {}
    for e in trace[:at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)

    def where(e) -> str:
        frames = [f for f in e.get("frames", ()) if f["filename"].endswith(".py") and ("torchinductor" in f["filename"]
                  or not any(k in f["filename"] for k in ("/torch/", "/contextlib.py", "/functools.py")))]
        names = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames[:2]]
        if names:
            code = linecache.getline(frames[0]["filename"], frames[0]["line"]).strip()[:100]
            names[0] += f" `{code}`" if code else ""
        return " <- ".join(names) or "?"

    groups = {}
    for e in live.values():
        n, total = groups.get(where(e), (0, 0))
        groups[where(e)] = (n + 1, total + e["size"])
    with open(path, "w") as f:
        f.write(f"{result['run']}: step {step}; {before / 2**30:.3f} GiB allocated before it, its peak "
                f"{(before + best) / 2**30:.3f} GiB (+{best / 2**20:.1f} MiB) at event {at} of {len(trace)}; "
                f"alive then, allocated in the step:\n\n")
        for key, (n, total) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:40]:
            f.write(f"{total / 2**20:10.1f} MiB  {n:5d} blocks  {key}\n")
        f.write("\nthe last allocations up to the peak:\n\n")
        last = [e for e in trace[:at + 1] if e["action"] == "alloc"][-8:]
        for e in last:
            f.write(f"{e['size'] / 2**20:10.1f} MiB  {'alive' if live.get(e['addr']) is e else 'freed'}  {where(e)}\n")
    result.setdefault("peak_listings", []).append(os.path.basename(path))


def _max_alloc(device) -> int:
    """The allocator's peak so far (host-side bookkeeping: no synchronisation)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _optimizer(model, args, fused: bool):
    """AdamW on the bf16 parameters (fused where the device has it); the learning rate warmed up linearly over
    ``--lr-warmup`` steps, then constant or cosine-decayed to a tenth by the last step (``--lr-decay``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if fused else {}))
    warm, total = max(1, args.lr_warmup), max(args.steps, 1)

    def factor(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        if args.lr_decay == "constant":
            return 1.0
        done = min(1.0, (s - warm) / max(1, total - warm))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * done))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


class _progress:
    """tqdm when importable, else a line every few steps."""

    def __init__(self, total: int, name: str):
        self.n, self.total, self.name = 0, total, name
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=name, unit="step", dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def update(self, loss: float, tps: float) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
            self.bar.update(1)
        elif self.n == 1 or self.n % 5 == 0 or self.n == self.total:
            print(f"{self.name} step {self.n}/{self.total} loss {loss:.4f} {tps:,.0f} tok/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_name(provider: str, mode: str, world: int, spread: str | None) -> str:
    return f"{provider}-{mode}" + (f"-{spread}{world}" if spread else "")


def worker(args, runs: list[tuple[str, str]], on_result=None) -> None:
    """Run ``runs`` one after another in this process (each rank, under torchrun); rank 0 writes each run's
    JSON and calls ``on_result(result)``."""
    rank, world, local_rank = _dist_info()
    if parallel(args, world):
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} does not split over {world} ranks")
    chain = MarkovChain(args.vocab, args.markov_states, args.markov_branch, args.seed)
    # a seed per step: a shorter run sees the first batches of a longer one (runs of any length compare)
    batches = torch.stack([chain.sample(args.batch, args.seq, args.seed + 1 + step) for step in range(args.steps)])
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    ones = init_values(args)  # before any run: Liger's class-level patches stay
    runs = sorted(runs, key=lambda r: r[0] == "liger")  # Liger's class-level patches stay: last
    for provider, mode in runs:
        started = time.time()
        if rank == 0:
            print(f"== {run_name(provider, mode, world, parallel(args, world))}: world size {world}, "
                  f"loss floor {chain.entropy_rate:.4f}", flush=True)
        try:
            if provider == "liger" and importlib.util.find_spec("liger_kernel") is None:
                raise ModuleNotFoundError("liger_kernel is not installed")
            result = run_one(args, provider, mode, chain, batches, started, ones)
        except Exception as e:  # noqa: BLE001 - a failed provider is a result, the next one still runs
            skipped = isinstance(e, Skipped)
            result = dict(run=run_name(provider, mode, world, parallel(args, world)), provider=provider,
                          mode=mode, world_size=world, parallel=parallel(args, world),
                          status=(f"skipped: {e}" if skipped else f"error: {type(e).__name__}: {e}")[:500],
                          losses=[], step_times=[])
            if not skipped:
                result["traceback"] = traceback.format_exc()[-4000:]
                print(result["traceback"], file=sys.stderr, flush=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        result["wall_s"] = round(time.time() - started, 2)
        if rank == 0:
            with open(os.path.join(args.out, "runs", result["run"] + ".json"), "w") as f:
                json.dump(result, f)
            _summary_line(result)
            if on_result is not None:
                on_result(result)
    if parallel(args, world):
        torch.distributed.destroy_process_group()


def _summary_line(r: dict) -> None:
    tps = f"{r['tokens_per_s']:,.0f} tok/s" if r.get("tokens_per_s") else "-"
    mem = f"{r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") is not None else "-"
    loss = f"{r['losses'][-1]:.4f}" if r["losses"] else "-"
    print(f"{r['run']:28} world {r['world_size']}  {tps:>16}  peak {mem:>10}  last loss {loss:>8}  "
          f"{len(r['losses'])} steps  {r['status']}", flush=True)


# ---------------------------------------------------------------- orchestration and reports
def _meta(args) -> tuple[str, dict]:
    """The output stem and the settings every report carries; prints the model and the loss floor."""
    family = "" if args.family == "llama" else args.family + "-"
    stem = args.stem or f"train-{family}{_device_tag()}-{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%SZ}"
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    chain = MarkovChain(args.vocab, args.markov_states, args.markov_branch, args.seed)
    n_params = _count_params(args)
    print(f"{_family_title(args.family)} {_params(n_params)} parameters (vocab {args.vocab}, hidden {args.hidden}, "
          f"{args.layers} layers), "
          f"seq {args.seq}, global batch {args.batch}, {args.steps} steps; data: Markov chain of "
          f"{len(chain.tokens)} states, loss floor (entropy rate) {chain.entropy_rate:.4f} nats", flush=True)
    meta = dict(settings={k: v for k, v in vars(args).items() if not k.endswith("_list") and k != "worker"},
                parameters=n_params, loss_floor=chain.entropy_rate, device=_device_name(), versions=_versions(),
                git=os.environ.get("TRITONGRAD_GIT_SHA") or _git_sha(), started=_dt.datetime.now().isoformat())
    return stem, meta


def orchestrate(args, argv: list[str]) -> int:
    stem, meta = _meta(args)
    results = []
    t_start = time.time()
    for world, spread in args.world_size_list:
        for provider, mode in args.run_list:
            name = run_name(provider, mode, world, spread)
            left = None if args.total_time_limit is None else args.total_time_limit - (time.time() - t_start)
            if left is not None and left < 10:
                results.append(dict(run=name, provider=provider, mode=mode, world_size=world, parallel=spread,
                                    status="skipped: total time limit", losses=[], step_times=[]))
                continue
            if provider == "liger" and importlib.util.find_spec("liger_kernel") is None:
                results.append(dict(run=name, provider=provider, mode=mode, world_size=world, parallel=spread,
                                    status="skipped: liger_kernel is not installed", losses=[], step_times=[]))
                _summary_line(results[-1])
                continue
            limit = args.time_limit if left is None else min(args.time_limit, left)
            results.append(_spawn(args, argv, provider, mode, world, spread, name, limit))
            write_reports(args.out, stem, meta, results)
    print(f"\nloss floor {meta['loss_floor']:.4f}; {meta['device']}")
    for r in results:
        _summary_line(r)
    print(f"written: {os.path.join(args.out, stem)}.json, .csv, -loss.png, -throughput.png, -memory.png")
    return 0


def _spawn(args, argv, provider, mode, world, spread, name, limit) -> dict:
    path = os.path.join(args.out, "runs", name + ".json")
    if os.path.exists(path):
        os.remove(path)
    child, skip = [], False
    for a in argv:  # every argument but --time-limit and its value (the worker gets its own limit)
        if skip or a.startswith("--time-limit="):
            skip = False
            continue
        if a == "--time-limit":
            skip = True
            continue
        child.append(a)
    cmd = [os.path.abspath(__file__), *child, "--worker", f"{provider}:{mode}", f"--spread={spread or ''}",
           f"--time-limit={limit}"]
    if spread:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *cmd]
    else:
        cmd = [sys.executable, *cmd]
    grace = 120 + (args.layers * 10 if mode == "compile" else 0)  # a step that started in time may still finish
    started = time.time()
    try:
        rc = subprocess.run(cmd, timeout=limit + grace).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    result = dict(run=name, provider=provider, mode=mode, world_size=world, parallel=spread,
                  status=f"no result (exit {rc})", losses=[], step_times=[], wall_s=round(time.time() - started, 2))
    _summary_line(result)
    return result


def write_reports(out: str, stem: str, meta: dict, results: list[dict]) -> None:
    ref = next((r for r in results if r["run"] == "hf-eager" and r["losses"]), None) or next(
        (r for r in results if r["provider"] == "hf" and r["mode"] == "eager" and r["losses"]), None)
    by_name = {r["run"]: r for r in results}
    for r in results:
        r["max_loss_diff_vs_hf_eager"] = _max_diff(r, ref)
        r["mean_rel_loss_diff_vs_hf_eager"] = _mean_rel_diff(r, ref)
        r["first_loss_rel_diff_vs_hf_eager"] = _mean_rel_diff(r, ref, 1)
        tps = r.get("tokens_per_s")
        r["tokens_per_s_per_gpu"] = tps / r["world_size"] if tps else None
        single = None
        if r.get("parallel"):  # the same provider and mode on one GPU: unwrapped, else wrapped at world size 1
            single = next((by_name[n] for n in (run_name(r["provider"], r["mode"], 1, None),
                                                 run_name(r["provider"], r["mode"], 1, r["parallel"]))
                           if n in by_name and n != r["run"] and by_name[n]["losses"]), None)
        r["world_size_1_run"] = single["run"] if single else None
        r["max_loss_diff_vs_world_size_1"] = _max_diff(r, single)
        r["mean_rel_loss_diff_vs_world_size_1"] = _mean_rel_diff(r, single)
        r["first_loss_rel_diff_vs_world_size_1"] = _mean_rel_diff(r, single, 1)
        one = single.get("tokens_per_s") if single else None
        r["per_gpu_vs_world_size_1"] = r["tokens_per_s_per_gpu"] / one if one and tps else None
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(dict(meta, runs=results), f, indent=1)
    cols = ["run", "provider", "mode", "world_size", "parallel", "steps", "tokens_per_s", "tokens_per_s_per_gpu",
            "per_gpu_vs_world_size_1", "peak_mem_gib", "first_loss", "last_loss", "max_loss_diff_vs_hf_eager",
            "mean_rel_loss_diff_vs_hf_eager", "first_loss_rel_diff_vs_hf_eager", "world_size_1_run",
            "first_loss_rel_diff_vs_world_size_1", "mean_rel_loss_diff_vs_world_size_1",
            "max_loss_diff_vs_world_size_1", "graph_breaks", "setup_s", "wall_s", "status"]
    with open(os.path.join(out, stem + ".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in results:
            row = dict(r, steps=len(r["losses"]), first_loss=r["losses"][0] if r["losses"] else None,
                       last_loss=r["losses"][-1] if r["losses"] else None)
            w.writerow([_fmt(row.get(c)) for c in cols])
    try:
        _plots(out, stem, meta, results)
    except ImportError:
        print("matplotlib is not installed: no plots", flush=True)


def _max_diff(r: dict, ref: dict | None):
    if ref is None or ref is r or not r["losses"] or not ref["losses"]:
        return None
    return max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))


def _mean_rel_diff(r: dict, ref: dict | None, steps: int | None = None):
    """The mean over the common steps (the first ``steps`` of them) of |loss - reference| / reference."""
    if ref is None or ref is r or not r["losses"] or not ref["losses"]:
        return None
    pairs = list(zip(r["losses"], ref["losses"]))[:steps]
    return sum(abs(a - b) / abs(b) for a, b in pairs) / len(pairs)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def _plots(out: str, stem: str, meta: dict, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = (f"{_family_title(meta['settings'].get('family', 'llama'))} {_params(meta['parameters'])}, "
             f"seq {meta['settings']['seq']}, batch "
             f"{meta['settings']['batch']} on {meta['device']}")
    ref = next((r for r in results if r["provider"] == "hf" and r["mode"] == "eager" and r["losses"]), None)
    fig, (ax, dax) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True, height_ratios=(2, 1))
    for r in results:
        if r["losses"]:
            steps = range(1, len(r["losses"]) + 1)
            ax.plot(steps, r["losses"], label=r["run"], lw=1.2)
            if ref is not None:
                dax.plot(steps[:len(ref["losses"])], [a - b for a, b in zip(r["losses"], ref["losses"])], lw=1)
    ax.axhline(meta["loss_floor"], color="k", ls="--", lw=0.8, label=f"floor {meta['loss_floor']:.3f}")
    ax.set(ylabel="loss (nats)", title=title)
    ax.legend(fontsize=8)
    dax.set(xlabel="step", ylabel=f"loss - {ref['run'] if ref else 'hf-eager'}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, stem + "-loss.png"), dpi=120)
    plt.close(fig)
    for key, label, suffix in (("tokens_per_s", "tokens/s (median after warm-up)", "throughput"),
                               ("peak_mem_gib", "peak memory allocated (GiB, max over ranks)", "memory")):
        done = [r for r in results if r.get(key)]
        fig, ax = plt.subplots(figsize=(9, 4.5))
        bars = ax.bar([r["run"] for r in done], [r[key] for r in done],
                      color=["C%d" % PROVIDERS.index(r["provider"]) for r in done])
        ax.bar_label(bars, fmt="{:,.0f}" if key == "tokens_per_s" else "{:.1f}", fontsize=8)
        ax.set(ylabel=label, title=title)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"{stem}-{suffix}.png"), dpi=120)
        plt.close(fig)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _family_title(family: str) -> str:
    return "Llama" if family == "llama" else family


def _count_params(args) -> int:
    """The model's parameters, counted on the meta device (no memory)."""
    return sum(p.numel() for p in _causal_lm(model_config(args), "meta").parameters())



def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (Triton interpreter)"


def _device_tag() -> str:
    return _device_name().lower().replace("nvidia ", "").split(" ")[0].replace("(", "") or "cpu"


def _versions() -> dict:
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for name in ("transformers", "triton", "liger_kernel"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            out[name] = _dist_version(name.replace("_", "-"))
    return out


def _git_sha():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker is not None:
        provider, mode = args.worker.split(":")
        worker(args, [(provider, mode)])
        return 0
    if "LOCAL_RANK" in os.environ:  # launched by torchrun: every run in these processes, rank 0 reports
        results = []
        if int(os.environ.get("RANK", 0)) == 0:
            stem, meta = _meta(args)

            def on_result(r):
                results.append(r)
                write_reports(args.out, stem, meta, results)
        else:
            on_result = None
        worker(args, args.run_list, on_result)
        return 0
    return orchestrate(args, argv)


if __name__ == "__main__":
    sys.exit(main())

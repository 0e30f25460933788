"""A GRPO training step of a Llama in a plain loop, one provider of the loss at a time, on one GPU (or tiny on
CPU through Triton's interpreter): tokens/s and peak memory.

    python benchmarks/grpo_step.py [--size 1b] [--batch 8] [--prompt 256] [--completion 1024] [--steps 8]
                                   [--providers tritongrad,tritongrad-patched,liger,trl-fused,trl-logits]

A step: the policy's forward to its last hidden states, the reference model's under no_grad (a copy of the
initial policy), the GRPO loss over the completion tokens (dapo, beta 0.04, on-policy: the old
log-probabilities are the detached current ones, TRL's default with one iteration a generation), backward,
fused AdamW. The completions have random lengths (the mask ends each at its length). The loss, per provider:

- ``tritongrad``: the reference's log-probabilities by ``tritongrad.linear_token_logprobs`` (no gradient),
  the loss by ``tritongrad.linear_grpo_loss``; ``tritongrad-patched`` the same, the model patched by
  ``tritongrad.patch`` (norms, SwiGLU, rope);
- ``liger``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (the reference's hidden states and head given to it,
  its own chunks);
- ``trl-fused``: TRL 1.16's own path: log-probabilities by its fused LM head's ``_ChunkedLogProbFunction``
  (policy and reference), TRL's GRPO formula on them;
- ``trl-logits``: the logits materialised, TRL's ``selective_log_softmax``, the same formula.

Every provider starts from the same weights and sees the same batches. Tokens/s: prompt and completion tokens
over the median step time after ``--warmup`` steps. Peak: ``max_memory_allocated`` over the steps. The loss of
each step, and its largest difference to the first provider's, relative. Writes ``grpo-step-<device>-<time>.json``
to $OUT (or ./bench-out).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

import torch

if not torch.cuda.is_available():  # tritongrad's kernels on CPU: Triton's interpreter, chosen before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import tritongrad  # noqa: E402
from tritongrad.ops.post_training.reference import grpo_from_logprobs  # noqa: E402

SIZES = {  # name: (vocab, hidden, intermediate, layers, heads, kv heads), tied embeddings: Llama 3.2's
    "tiny": (512, 64, 128, 2, 4, 2),
    "1b": (128256, 2048, 8192, 16, 32, 8),  # Llama 3.2 1B: 1.24B parameters
}
PROVIDERS = ("tritongrad", "tritongrad-patched", "liger", "trl-fused", "trl-logits")
BETA = 0.04


def build(size: str, device, dtype):
    """The Llama of ``size`` on ``device``, random weights (the runs load the same initial state into it)."""
    import transformers

    V, H, inter, layers, heads, kv = SIZES[size]
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, head_dim=H // heads,
                                   tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                                   max_position_embeddings=4096, pad_token_id=None, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    return model.train()


def batches(args, V: int, device):
    out = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        B, P, T = args.batch, args.prompt, args.completion
        ids = torch.randint(0, V, (B, P + T), generator=g)
        lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
        mask = (torch.arange(T)[None] < lengths[:, None]).float()
        adv = torch.randn(B, generator=g)
        out.append(tuple(t.to(device) for t in (ids, mask, adv)))
    return out


def _trl():
    """TRL's fused log-prob function and selective_log_softmax. ``trl.trainer.utils`` imports accelerate,
    datasets and pandas at module level for its other helpers; where one is not installed (the GPU machine has
    no registry), a stand-in module takes its name. These two functions use none of them."""
    import importlib.util
    import types

    for name in ("accelerate", "accelerate.logging", "datasets", "pandas"):
        if name not in sys.modules and importlib.util.find_spec(name.split(".")[0]) is None:
            stub = types.ModuleType(name)
            stub.__getattr__ = lambda attr: type(attr, (), {})  # any name imported from it: an empty class
            stub.__path__ = []
            sys.modules[name] = stub
    from trl.trainer.utils import _ChunkedLogProbFunction, selective_log_softmax

    return _ChunkedLogProbFunction, selective_log_softmax


def loss_fn(provider: str):
    """``f(h, W, ref_h, ref_W, completion_ids, mask, advantages) -> loss`` for the provider."""
    if provider.startswith("tritongrad"):
        def f(h, W, rh, rW, ids, mask, adv):
            with torch.no_grad():
                ref = tritongrad.linear_token_logprobs(rh, rW, ids)
            return tritongrad.linear_grpo_loss(h, W, ids, adv, mask, ref_logprobs=ref, beta=BETA, loss_type="dapo")[0]
        return f
    if provider == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss = LigerFusedLinearGRPOLoss(beta=BETA, loss_type="dapo", use_ref_model=True)
        return lambda h, W, rh, rW, ids, mask, adv: loss(h, W, ids, mask, adv, ref_input=rh, ref_weight=rW)[0]
    chunked, selective = _trl()

    def logps(h, W, ids):
        if provider == "trl-fused":
            B, T, H = h.shape
            return chunked.apply(h.reshape(B * T, H), W, None, ids.reshape(-1), 1.0, 4096, None, 1.0,
                                 ("log_probs",))[0].view(B, T)
        return selective(torch.nn.functional.linear(h, W), ids)

    def f(h, W, rh, rW, ids, mask, adv):
        with torch.no_grad():
            ref = logps(rh, rW, ids)
        return grpo_from_logprobs(logps(h, W, ids), adv, mask, None, ref, beta=BETA, loss_type="dapo")[0]
    return f


def run(provider: str, args, initial: dict, data, device) -> dict:
    model = build(args.size, device, args.dtype)
    model.load_state_dict(initial)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    if provider == "tritongrad-patched":
        tritongrad.patch(model, linear_cross_entropy=False)
    f = loss_fn(provider)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if device != "cpu" else {}))
    P = args.prompt
    times, losses = [], []
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for ids, mask, adv in data:
        t0 = time.perf_counter()
        with torch.no_grad():
            rh = ref.model(input_ids=ids).last_hidden_state[:, P - 1:-1]
        h = model.model(input_ids=ids).last_hidden_state[:, P - 1:-1]
        loss = f(h, model.lm_head.weight, rh, ref.lm_head.weight, ids[:, P:], mask, adv)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronises
        times.append(time.perf_counter() - t0)
    steady = sorted(times[args.warmup:]) or sorted(times)
    median = steady[len(steady) // 2]
    out = dict(provider=provider, status="ok", step_s=median, tokens_per_s=ids.numel() / median,
               completion_tokens_per_s=mask.numel() / median, losses=losses, step_times=times)
    if device != "cpu":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if provider == "tritongrad-patched":
        tritongrad.unpatch(model)
    del model, ref, opt
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="1b", choices=SIZES)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--completion", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-out")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = torch.bfloat16 if device == "cuda" else torch.float32
    initial = {k: v.to("cpu") for k, v in build(args.size, device, args.dtype).state_dict().items()}
    data = batches(args, SIZES[args.size][0], device)
    results = []
    for provider in args.providers.split(","):
        try:
            results.append(run(provider, args, initial, data, device))
        except Exception as e:  # noqa: BLE001 - a provider that cannot run here is recorded, the rest go on
            results.append(dict(provider=provider, status=f"error: {type(e).__name__}: {str(e)[:300]}"))
        if device == "cuda":
            torch.cuda.empty_cache()
        r = results[-1]
        print(f"{provider:>20}: {r['status']}" + (
            f", {r['tokens_per_s']:9.0f} tokens/s ({r['step_s'] * 1e3:7.1f} ms a step), peak "
            f"{r.get('peak_mem_gib', float('nan')):6.2f} GiB, losses {[round(x, 5) for x in r['losses'][:3]]}"
            if r["status"] == "ok" else ""), flush=True)
    base = next((r for r in results if r["status"] == "ok"), None)
    for r in results:
        if r["status"] == "ok" and base is not None:
            r["max_rel_loss_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], base["losses"]))
    sha = os.environ.get("TRITONGRAD_GIT_SHA") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    from importlib.metadata import PackageNotFoundError, version

    versions = {"torch": torch.__version__}
    for dist in ("triton", "transformers", "liger-kernel", "trl"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name = "h200" if device == "cuda" and "H200" in torch.cuda.get_device_name() else device
    record = dict(what="benchmarks/grpo_step.py", git=sha, date=stamp, versions=versions,
                  device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  command="python3 " + " ".join([os.path.relpath(__file__, os.path.join(HERE, ".."))] + sys.argv[1:]),
                  settings={k: str(v) for k, v in vars(args).items()}, runs=results)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"grpo-step-{name}-{stamp}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()

"""What a patched model keeps for its backward, tensor by tensor, and its peak memory (GPU).

    python benchmarks/saved_bytes.py FAMILY PROVIDER [--layers 2]      # PROVIDER: hf, tritongrad, liger

Builds FAMILY at the training benchmark's ``300m`` widths (hidden 1536, intermediate 4096, 12 heads, 4 KV
heads, vocab 32000) with ``--layers`` layers, bf16, batch 4 x 2048 tokens; runs three training steps and prints,
for the second, every storage that autograd saved (parameters left out: size, shape, dtype, where it was
saved), their sum, and for the third (no saved-tensor hooks) the memory allocated after the forward and the
step's peak (parameter gradients included), both above the model and its inputs. Two providers' listings side
by side show which op keeps what the other does not. ``--peaks`` also prints the third step's forward peak and,
for the backward nodes whose run set its highest peaks, the peak reached while each ran (hooks on its nodes).
"""

from __future__ import annotations

import argparse
import os
import traceback
from contextlib import nullcontext

import torch

# torch's own frames are left out of "where it was saved" (a prefix: a virtual environment may live under a
# folder named torch, as the GPU machine's does, and then every package's path contains "torch/").
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family")
    p.add_argument("provider", choices=("hf", "tritongrad", "liger"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--peaks", action="store_true", help="the forward's peak and the backward's, node by node")
    args = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        args.family, vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=args.layers,
        num_attention_heads=12, num_key_value_heads=4, head_dim=128, tie_word_embeddings=True, pad_token_id=None,
        use_cache=False, attn_implementation="sdpa", max_position_embeddings=2048)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).train()
    if args.provider == "tritongrad":
        import tritongrad

        tritongrad.patch(model)
    elif args.provider == "liger":
        import liger_kernel.transformers as lk

        getattr(lk, f"apply_liger_kernel_to_{args.family}")(model=model)
    ids = torch.randint(0, 32000, (4, 2048), device="cuda")
    params = {t.untyped_storage().data_ptr() for t in model.parameters()}
    seen: dict[int, tuple] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.data_ptr() not in params and st.nbytes():
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(TORCH_DIR)]
            where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames[-3:]))
            seen[st.data_ptr()] = (st.nbytes(), tuple(t.shape), str(t.dtype).removeprefix("torch."), where)
        return t

    # The first step warms up (kernels compiled, the allocator's cache); the second lists what is saved; the
    # third measures, without saved-tensor hooks: under them a tensor unpacked may not be the one saved, and
    # an op that writes a gradient over its own input (swiglu's inplace_backward) then allocates instead.
    for step in ("warm-up", "listing", "peaks"):
        seen.clear()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if step == "listing" else nullcontext()
        with hooks:
            loss = model(input_ids=ids, labels=ids).loss
        if step == "listing":
            listed = dict(seen)
        after_forward = torch.cuda.memory_allocated() - base
        forward_peak = torch.cuda.max_memory_allocated() - base
        nodes = _hook_nodes(loss.grad_fn, base) if args.peaks and step == "peaks" else []
        loss.backward()
        torch.cuda.synchronize()
        peak = max([torch.cuda.max_memory_allocated() - base, forward_peak] + [r[2] for r in nodes])
        model.zero_grad(set_to_none=True)
        del loss
    seen = listed
    mib = 2.0**20
    for n, shape, dtype, where in sorted(seen.values(), key=lambda r: r[3]):
        print(f"  {n / mib:9.2f} MiB {str(shape):24s} {dtype:9s} {where}")
    if args.peaks:
        print(f"forward peak {forward_peak / mib:.1f} MiB; backward nodes by the peak while each ran:")
        for name, before, top in sorted(nodes, key=lambda r: -r[2])[:12]:
            print(f"  {top / mib:9.1f} MiB peak, {before / mib:9.1f} MiB when it began  {name}")
    print(f"{args.family} {args.provider}, {args.layers} layers: saved {sum(r[0] for r in seen.values()) / mib:.1f} MiB "
          f"in {len(seen)} storages; after the forward {after_forward / mib:.1f} MiB, step peak {peak / mib:.1f} MiB")


def _hook_nodes(root, base: int) -> list:
    """Hooks on every autograd node under ``root``; each appends (name, allocated when it began, peak while it
    ran), both above ``base``, to the list returned, as the backward runs it, and the same for the gap before
    it. The hooks reset the peak counter."""
    out, seen, todo = [], set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
        began = {}

        def pre(grads, node=node, began=began):
            began["at"] = torch.cuda.memory_allocated() - base
            # since the last node ended: the engine summing gradients that meet, freeing saved tensors
            out.append((f"(before {node.name()})", began["at"], torch.cuda.max_memory_allocated() - base))
            torch.cuda.reset_peak_memory_stats()

        def post(grads_in, grads_out, node=node, began=began):
            out.append((node.name(), began.get("at", 0), torch.cuda.max_memory_allocated() - base))

        node.register_prehook(pre)
        node.register_hook(post)
    return out


if __name__ == "__main__":
    main()

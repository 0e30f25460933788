"""tritongrad.patch and tritongrad.patch_transformers on tiny Hugging Face models (2 layers, hidden 64, vocab 512),
one per family, forward and backward through Triton's interpreter on CPU (compiled kernels on a GPU).

Loss and gradients of the patched model are checked against the unpatched model's with earned tolerances: the
error of the patched float32 model against a float64 reference may be at most twice the error of the unpatched
float32 model, plus a few ulps. The float64 reference is the unpatched model in float64 with its RMSNorms
computing in float64 too (Hugging Face's own norms drop to float32).

Tests that need ops built in their own families (a missing op makes them fail, naming it, not skip):

- ``tritongrad.swiglu``, ``tritongrad.apply_rotary_pos_emb`` and ``tritongrad.linear_cross_entropy``:
  ``test_all_ops_match_hf`` (8 families), ``test_patch_transformers_all_ops``, ``test_fsdp2_world_size_1[all]``;
- ``tritongrad.linear_cross_entropy`` alone: ``test_linear_cross_entropy_keeps_hf_loss_semantics`` (2);
- ``tritongrad.cross_entropy`` alone: ``test_cross_entropy_loss_function`` (2).

The rest need only the norms.
"""

import copy
import importlib
import math
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
from conftest import DEVICE, clipped_mlp_class

import tritongrad
from tritongrad import _hf, zoo
from tritongrad.ops.norm.reference import llama_rms_norm_reference

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
# family: (config model_type, RMSNorm modules, gated MLPs, their op). Why each: Llama, Mistral, Qwen2 copy
# Llama's norm; Qwen3 adds per-head q_norm/k_norm; Gemma's norm is (1 + w) in float32 and its MLP GELU-gated
# (geglu); Gemma2 and Gemma3 add sandwich norms (and q/k norms) and final-logit softcapping; Olmo2 multiplies
# before the cast; Phi3 projects gate and up in one gate_up_proj.
FAMILIES = {
    "llama": ("llama", 5, 2, "swiglu"),
    "mistral": ("mistral", 5, 2, "swiglu"),
    "qwen2": ("qwen2", 5, 2, "swiglu"),
    "qwen3": ("qwen3", 9, 2, "swiglu"),
    "gemma": ("gemma", 5, 2, "geglu"),
    "gemma2": ("gemma2", 9, 2, "geglu"),
    "gemma3": ("gemma3_text", 13, 2, "geglu"),
    "olmo2": ("olmo2", 9, 2, "swiglu"),
    "phi3": ("phi3", 5, 2, "swiglu"),  # gate and up in one gate_up_proj
}
NORMS_ONLY = dict(swiglu=False, geglu=False, rope=False, linear_cross_entropy=False, causal_mask=False,
                  fused_add_rms_norm=False)
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def _restore_transformers():
    # rope is patched module-wide, and patch_transformers patches classes: restore both after each test.
    yield
    tritongrad.unpatch_transformers()


def _model(family: str, **config) -> torch.nn.Module:
    model_type = FAMILIES[family][0] if family in FAMILIES else family  # a family's config name
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, **config})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(DEVICE)
    with torch.no_grad():  # norm weights away from their constant init, so that their semantics show
        for m in model.modules():
            if _hf.looks_like_rms_norm(m):
                m.weight.add_(0.3 * torch.randn_like(m.weight))
    return model.train()


def _batch(ignore: bool = True) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, TINY["vocab_size"], (2, 12), generator=g)
    labels = ids.clone()
    if ignore:
        labels[0, :3] = -100  # a prompt that is not trained on
        labels[1, -2:] = -100
    return dict(input_ids=ids.to(DEVICE), labels=labels.to(DEVICE))


def _run(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out.loss.backward()
    grads = {n: _full(p.grad).double() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _references(model, batch, **kwargs):
    """(float32 output and grads, float64 output and grads) of the unpatched model, the float64 model float64
    throughout (zoo._in_float64: its norms' and softmax's float32 upcasts too); run before patching (rope is
    patched module-wide)."""
    ref32 = _run(copy.deepcopy(model), batch, **kwargs)
    with zoo._in_float64():
        return ref32, _run(zoo._float64(model), batch, **kwargs)


def _assert_earned(got, ref32, ref64, what: str) -> None:
    got, ref32, ref64 = got.double(), ref32.double(), ref64.double()
    err, base = (got - ref64).abs().max().item(), (ref32 - ref64).abs().max().item()
    atol = 8 * EPS32 * max(1.0, ref64.abs().max().item())
    assert err <= 2 * base + atol, f"{what}: error {err:.3g} vs float64, unpatched float32's {base:.3g}"


def _assert_matches(out, grads, refs) -> None:
    (out32, grads32), (out64, grads64) = refs
    _assert_earned(out.loss, out32.loss, out64.loss, "loss")
    assert grads.keys() == grads32.keys()
    for name in grads:
        _assert_earned(grads[name], grads32[name], grads64[name], f"grad of {name}")


def _autograd_nodes(t: torch.Tensor) -> set:
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    return names


def _norm_node(family: str) -> str:
    llama_kind = FAMILIES[family][0] in ("llama", "mistral", "qwen2", "qwen3", "phi3")
    return "LlamaRmsNormBackward" if llama_kind else "RmsNormBackward"


@pytest.fixture
def spy(monkeypatch):
    """Counts calls of tritongrad's public ops (the real ones run). A missing op fails here."""
    calls = {}

    def wrap(name):
        fn = getattr(tritongrad, name)

        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(tritongrad, name, counted)

    def start(*names):
        for name in names:
            wrap(name)
        return calls
    return start


# ---------------------------------------------------------------- norms (no other op needed)
@pytest.mark.parametrize("family", FAMILIES)
def test_norms_match_hf(family):
    model = _model(family)
    batch = _batch()
    refs = _references(model, batch)
    report = tritongrad.patch(model, **NORMS_ONLY)
    assert report.ops() == {"rms_norm": FAMILIES[family][1]}
    assert {"model.norm", "model.layers.1.post_attention_layernorm"} <= set(report.targets("rms_norm"))
    assert not report.skipped
    out, grads = _run(model, batch)
    assert _norm_node(family) in _autograd_nodes(out.loss)
    _assert_matches(out, grads, refs)


@pytest.mark.parametrize("family", ["llama", "gemma", "olmo2"])
def test_norm_semantics_bf16(family):
    # Each family's rounding and dtype rules, with bfloat16 activations and float32 or bfloat16 weights: the
    # patched norm gives the dtype Hugging Face's gives, and values within one bfloat16 rounding.
    model = _model(family)
    norm = copy.deepcopy(model.model.norm)
    x = torch.randn(3, 5, 64, device=DEVICE).bfloat16()
    for wdtype in (torch.float32, torch.bfloat16):
        norm = norm.to(wdtype)
        want = norm(x)
        patched = copy.deepcopy(norm)
        assert tritongrad.patch(patched).count == 1
        got = patched(x)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=torch.finfo(torch.bfloat16).eps, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_patch_twice_is_idempotent(family):
    model = _model(family)
    first = tritongrad.patch(model, **NORMS_ONLY)
    classes = [type(m) for m in model.modules()]
    second = tritongrad.patch(model, **NORMS_ONLY)
    assert second.count == 0 and not second.replaced
    assert sorted(e.target for e in second.already) == sorted(e.target for e in first.replaced)
    assert [type(m) for m in model.modules()] == classes


def test_patch_keeps_modules_parameters_and_state():
    model = _model("llama")
    params = dict(model.named_parameters())
    keys, text = list(model.state_dict()), repr(model)
    norm_type = type(model.model.norm)
    tritongrad.patch(model, **NORMS_ONLY)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys and repr(model) == text
    assert isinstance(model.model.norm, norm_type) and type(model.model.norm).__name__ == norm_type.__name__


def test_pickled_model_loads_as_transformers_defines_it_and_copies_stay_patched():
    """torch.save stores the classes patch found (a tritongrad subclass is not importable by name, and its
    per-instance state would go stale); copy.copy and copy.deepcopy (TRL's reference models) keep the patch."""
    import io
    model, batch = _model("gemma2"), _batch()
    want = copy.deepcopy(model)(**batch).loss
    classes = [type(m) for m in model.modules()]
    first = tritongrad.patch(model)
    model(**batch)  # the per-instance state patch's forwards keep (head spec, gate) is there to leave out
    patched = [type(m) for m in model.modules()]
    for twin in (copy.deepcopy(model), copy.copy(model)):
        assert [type(m) for m in twin.modules()] == patched
        torch.testing.assert_close(twin(**batch).loss, want, rtol=1e-5, atol=0)
    deep = copy.deepcopy(model)
    assert all(p is not q for p, q in zip(deep.parameters(), model.parameters()))
    buf = io.BytesIO()
    torch.save(model, buf)
    tritongrad.unpatch(model)  # the module-wide rope too: the optional `kernels` package rebuilds it by name
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert [type(m) for m in loaded.modules()] == classes
    assert not [k for m in loaded.modules() for k in vars(m) if k.startswith("_tritongrad")]
    torch.testing.assert_close(loaded(**batch).loss, want, rtol=1e-6, atol=0)
    again = tritongrad.patch(loaded)
    assert again.ops() == first.ops() and not again.already and len(again.replaced) == len(first.replaced)


def test_trainer_with_gradient_accumulation_updates_as_unpatched(tmp_path):
    """transformers' Trainer, two micro-batches per step of unequal token counts (padding): the patched loss
    takes the step's ``num_items_in_batch`` as the model's does (a per-micro-batch mean weighs their tokens
    otherwise), and the forward's signature still shows Trainer the loss kwargs."""
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, TINY["vocab_size"], (3 + 4 * i,), generator=g).tolist()}
            for i in range(8)]

    def collate(batch):
        n = max(len(r["input_ids"]) for r in batch)
        pad = [n - len(r["input_ids"]) for r in batch]
        ids = torch.tensor([r["input_ids"] + [0] * k for r, k in zip(batch, pad)])
        mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * k for r, k in zip(batch, pad)])
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    start = _model("llama")
    runs = []
    for patched in (False, True):
        model = copy.deepcopy(start)
        if patched:
            assert "linear_cross_entropy" in tritongrad.patch(model).ops()
        args = TrainingArguments(str(tmp_path / str(patched)), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=2, learning_rate=1.0, optim="sgd",
                                 lr_scheduler_type="constant", report_to=[], use_cpu=DEVICE == "cpu", seed=0,
                                 logging_steps=1, save_strategy="no", dataloader_drop_last=True)
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
        trainer.train()
        assert trainer.model_accepts_loss_kwargs
        runs.append(([h["loss"] for h in trainer.state.log_history if "loss" in h],
                     {n: p.detach() - q.detach() for (n, p), q in zip(model.named_parameters(), start.parameters())}))
    (want_loss, want), (got_loss, got) = runs
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0)
    for n, w in want.items():  # each parameter's total update
        torch.testing.assert_close(got[n], w, rtol=0, atol=1e-4 * w.abs().max().item(), msg=lambda m: f"{n}: {m}")


def test_head_that_casts_its_input_keeps_the_cast():
    """Mamba's forward runs its head on ``h.to(lm_head.weight.dtype)`` (a float32 stream, a bfloat16 head): the
    probe establishes that cast, and the fused loss makes it too, where it raised on the two dtypes. Llama's calls
    the head as it is, which F.linear refuses for two dtypes, as the fused loss does."""
    mamba, llama = zoo.build("mamba"), zoo.build("llama")
    assert _hf.head_spec(mamba).cast_input and not _hf.head_spec(llama).cast_input
    mamba = mamba.to(DEVICE).to(torch.bfloat16)
    batch = zoo._batch(mamba.config.vocab_size, DEVICE)
    want = zoo._low_step(mamba, batch, autocast=False)
    assert "linear_cross_entropy" in tritongrad.patch(mamba).ops()
    got = zoo._low_step(mamba, batch, autocast=False)
    with zoo._in_float64():
        ref = zoo._low_step(zoo._float64(zoo.build("mamba").to(DEVICE)), batch, autocast=False)
    assert zoo._error(zoo.BFLOAT16, got, ref)[0] <= 1.5 * zoo._error(zoo.BFLOAT16, want, ref)[0]


def test_unpatch():
    model = _model("qwen3")
    classes = [type(m) for m in model.modules()]
    assert tritongrad.patch(model, **NORMS_ONLY).count == 9
    assert tritongrad.unpatch(model) == 9
    assert [type(m) for m in model.modules()] == classes
    assert tritongrad.patch(model, **NORMS_ONLY).count == 9  # and again


def test_gemma_mlp_is_geglu_and_another_gate_is_left_alone():
    model = _model("gemma")
    report = tritongrad.patch(model, rms_norm=False, rope=False, linear_cross_entropy=False, causal_mask=False)
    assert report.ops() == {"geglu": 2}
    assert all("approximate='tanh'" in e.detail for e in report.replaced)
    other = _model("gemma")
    for layer in other.model.layers:
        layer.mlp.act_fn = torch.nn.ReLU()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nothing patched: the warning is tested below
        report = tritongrad.patch(other, rms_norm=False, rope=False, linear_cross_entropy=False, causal_mask=False)
    assert report.count == 0 and len(report.skipped) == 2
    assert all(e.op == "swiglu" and "ReLU" in e.detail and "neither SiLU nor GELU" in e.detail for e in report.skipped)
    assert "GemmaMLP" in str(report)


@pytest.mark.parametrize("family", ["phi3", "qwen3_moe"])
def test_one_gate_up_product_takes_its_halves_gradients(family):
    # Phi3's gate_up_proj(x) and the MoE experts' [gate; up] product feed the gate alone: each swiglu backward
    # writes its gradients over the product's halves, its own inputs (Phi3's step peak was 61 MiB above
    # Liger's when they were allocated); a retained graph still allocates.
    from conftest import KernelSpy

    from tritongrad.ops.swiglu import experts as sw_experts
    from tritongrad.ops.swiglu import launch as sw_launch

    model = _model(family) if family in FAMILIES else zoo.build(family).to(DEVICE)
    report = tritongrad.patch(model, rms_norm=False, rope=False, linear_cross_entropy=False, causal_mask=False)
    assert report.ops().get("swiglu"), report
    ids = torch.randint(0, model.config.vocab_size, (2, 8), device=DEVICE)
    # The experts' backward takes the gate's gradients in its own kernel: dpre (argument 3) over pre (0).
    kern, written, read = ((sw_experts._bwd_kernel, slice(3, 4), slice(0, 1)) if family == "qwen3_moe"
                           else (sw_launch._bwd_kernel, slice(3, 5), slice(0, 2)))
    for retain in (True, False):
        with KernelSpy(kern) as bwd:
            model(input_ids=ids, labels=ids).loss.backward(retain_graph=retain)
        assert bwd.ptrs and all((p[written] == p[read]) != retain for p in bwd.ptrs), (retain, bwd.ptrs)


def test_one_gate_up_product_gets_its_halves_gradients_without_a_copy():
    # Eager, the halves' gradients written over Phi3's gate_up_proj output are that output's gradient as they
    # lie: no concatenation (chunk's backward made one, a [tokens, 2 intermediate] copy per layer); a retained
    # graph (gradients allocated apart) still concatenates. The gradients are the unpatched model's.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Cats(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten.cat.default
            return func(*args, **(kwargs or {}))

    model = _model("phi3")
    ref = copy.deepcopy(model)
    tritongrad.patch(model, rms_norm=False, rope=False, linear_cross_entropy=False, causal_mask=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), device=DEVICE)
    ref(input_ids=ids, labels=ids).loss.backward()
    layers = model.config.num_hidden_layers
    for retain, cats in ((True, layers), (False, 0)):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        with Cats() as seen:
            loss.backward(retain_graph=retain)
        assert seen.n == cats, (retain, seen.n)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_one_gate_up_product_under_torch_func_and_forward_ad():
    # The halves' split that hands their gradients on (eager autograd only) leaves torch.func's transforms and
    # forward-mode AD to the gated op's reference, as chunk does: grad, jvp and vmap give the unpatched MLP's.
    model = _model("phi3")
    mlp, ref = model.model.layers[0].mlp, copy.deepcopy(model.model.layers[0].mlp)
    tritongrad.patch(model, rms_norm=False, rope=False, linear_cross_entropy=False, causal_mask=False)
    assert _hf.GATE_ATTR in vars(mlp) or getattr(mlp, _hf.GATE_ATTR, None), "the MLP was not patched"
    x = torch.randn(2, 5, model.config.hidden_size, device=DEVICE)
    t = torch.randn_like(x)
    params = {k: v.detach() for k, v in mlp.named_parameters()}

    def loss(m, p, x):
        return torch.func.functional_call(m, p, (x,)).square().sum()

    got, want = (torch.func.grad(lambda p: loss(m, p, x))(params) for m in (mlp, ref))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    (y, dy), (y0, dy0) = (torch.func.jvp(m, (x,), (t,)) for m in (mlp, ref))
    torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dy, dy0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.func.vmap(mlp)(x), torch.func.vmap(ref)(x), rtol=1e-5, atol=1e-6)


def _compiled_step(model, batch) -> tuple:
    """``(output, grads, shapes of the tensors the forward graph saves, graphs)`` of one compiled step."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    saved, graphs = [], []

    def forward_graph(gm, _):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        saved.extend(tuple(a.meta["val"].shape) for a in out.args[0] if isinstance(a, torch.fx.Node)
                     and isinstance(a.meta.get("val"), torch.Tensor))
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    forward = model.forward
    model.forward = torch.compile(forward, fullgraph=True, backend=aot_autograd(
        fw_compiler=forward_graph, bw_compiler=lambda gm, _: make_boxed_func(gm.forward)))
    try:
        out, grads = _run(model, batch)
    finally:
        model.forward = forward
    return out, grads, saved, graphs


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_compiled_mlps_keep_no_gated_product(family, monkeypatch):
    # Compiled, the MLP's down projection goes through gated_linear, whose backward makes the gated product
    # again: the forward graph saves gate and up (Phi3: the halves of its one projection), not act(gate) * up
    # beside them, as it does with down_proj's own call. Loss and gradients are the eager model's.
    model = _model(family)
    batch = _batch()
    eager_out, eager_grads = _run(copy.deepcopy(model), batch)
    tritongrad.patch(model, rms_norm=False, rope=False, linear_cross_entropy=False, causal_mask=False)
    traced, gated_linear = [], tritongrad.gated_linear
    # Traced, a Triton op is its kernels, not its name, in the graph (on a GPU): its calls are counted instead.
    monkeypatch.setattr(tritongrad, "gated_linear", lambda *a, **k: traced.append(1) or gated_linear(*a, **k))
    out, grads, saved, _ = _compiled_step(model, batch)
    B, T = batch["input_ids"].shape
    products = B * T * model.config.intermediate_size  # elements of act(gate) * up, of gate, of up
    n_layers = model.config.num_hidden_layers
    assert traced
    assert [math.prod(s) for s in saved].count(products) == 2 * n_layers, saved  # gate and up
    torch.testing.assert_close(out.loss, eager_out.loss, rtol=1e-5, atol=1e-6)
    for name, g in eager_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    # With down_proj's own call, the product is saved too.
    monkeypatch.setattr(_hf, "_down_weight", lambda *a: None)
    saved_apart = _compiled_step(model, batch)[2]
    assert [math.prod(s) for s in saved_apart].count(products) == 3 * n_layers, saved_apart


def test_fused_gate_up_mlp_is_swiglu_and_swapped_halves_are_left_alone():
    # Phi3's MLP: gate, up = gate_up_proj(x).chunk(2, -1); the halves in the other order compute another
    # function, which the probe sees.
    model = _model("phi3")
    report = tritongrad.patch(model, rms_norm=False, rope=False, linear_cross_entropy=False, causal_mask=False)
    assert report.ops() == {"swiglu": 2}
    assert all("gate_up_proj(x).chunk(2, -1)" in e.detail for e in report.replaced)

    def forward(self, x):
        up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))

    # As a transformers class would be: in its modeling module.
    phi3 = importlib.import_module("transformers.models.phi3.modeling_phi3")
    swapped = type("SwappedMLP", (phi3.Phi3MLP,), {"forward": forward, "__module__": phi3.__name__})
    other = _model("phi3")
    for layer in other.model.layers:
        layer.mlp.__class__ = swapped
    report = tritongrad.patch(other, rms_norm=False, rope=False, linear_cross_entropy=False, causal_mask=False)
    assert report.count == 0 and len(report.skipped) == 2
    assert all(e.op == "swiglu" and "SwappedMLP.forward is not down_proj(activation_fn(gate) * up)" in e.detail
               for e in report.skipped), report
    # An instance with an act_fn beside the activation_fn its forward reads: the GELU act_fn must not make
    # its SiLU MLP a geglu.
    third = _model("phi3")
    for layer in third.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    report = tritongrad.patch(third, rms_norm=False, rope=False, linear_cross_entropy=False, causal_mask=False)
    assert report.count == 0 and len(report.skipped) == 2
    assert all(e.op == "geglu" and "is not down_proj(act_fn(gate) * up)" in e.detail for e in report.skipped), report


def test_nothing_to_patch_warns_or_raises():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    with pytest.warns(UserWarning, match="nothing in Sequential was patched"):
        report = tritongrad.patch(model)
    assert report.count == 0 and str(report) == "nothing to patch"
    with pytest.raises(ValueError, match="nothing in Sequential was patched"):
        tritongrad.patch(model, strict=True)
    gemma = _model("gemma")
    for layer in gemma.model.layers:
        layer.mlp.act_fn = torch.nn.ReLU()
    with pytest.warns(UserWarning, match="ReLU"):  # the reason is in the warning
        tritongrad.patch(gemma, rms_norm=False, rope=False, linear_cross_entropy=False, causal_mask=False)


def test_report_says_what_has_no_candidate():
    model = _model("llama").model  # the base model: no lm_head
    report = tritongrad.patch(model, swiglu=False, rope=False, causal_mask=False)
    assert report.ops() == {"rms_norm": 5, "fused_add_rms_norm": 2}
    assert [(e.op, e.detail) for e in report.skipped] == [("linear_cross_entropy", "no *ForCausalLM module (or one with "
                                                          "lm_head and model)")]


def test_flags_off_patch_nothing_of_theirs():
    model = _model("llama")
    with pytest.warns(UserWarning):
        report = tritongrad.patch(model, rms_norm=False, **NORMS_ONLY)
    assert report.count == 0 and all(type(m).__module__.startswith("transformers.") for m in model.modules()
                                     if "RMSNorm" in type(m).__name__)


def test_missing_op_patches_nothing(monkeypatch):
    monkeypatch.setitem(importlib.import_module("tritongrad.patch")._NEEDS, "swiglu", "no_such_op")
    model = _model("llama")
    classes = [type(m) for m in model.modules()]
    with pytest.raises(ImportError, match="swiglu needs tritongrad.no_such_op"):
        tritongrad.patch(model, rope=False, linear_cross_entropy=False)
    assert [type(m) for m in model.modules()] == classes  # the norms were not patched either


def test_torch_norms_and_subclasses():
    class KeepsForward(torch.nn.LayerNorm):
        pass

    class OwnForward(torch.nn.RMSNorm):
        def forward(self, x):
            return super().forward(x) * 2

    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.RMSNorm(8), KeepsForward(8), OwnForward(8)).to(DEVICE)
    x = torch.randn(3, 8, device=DEVICE)
    want = model(x)
    report = tritongrad.patch(model)
    assert report.ops() == {"layer_norm": 2, "rms_norm": 1}
    assert type(model[0]) is tritongrad.nn.LayerNorm and type(model[1]) is tritongrad.nn.RMSNorm
    assert type(model[3]) is OwnForward
    torch.testing.assert_close(model(x), want)
    assert tritongrad.patch(model).count == 0
    assert tritongrad.unpatch(model) == 3 and type(model[0]) is torch.nn.LayerNorm and type(model[2]) is KeepsForward


def test_patch_transformers_norms():
    modeling = _hf.modeling_module("llama")
    original = modeling.LlamaRMSNorm.forward
    report = tritongrad.patch_transformers("llama", **NORMS_ONLY)
    assert [e.target for e in report.replaced] == ["transformers.models.llama.modeling_llama.LlamaRMSNorm.forward"]
    model = _model("llama")  # built after: patched through its classes
    again = tritongrad.patch(model, **NORMS_ONLY)
    assert again.count == 0 and again.ops() == {"rms_norm": 5}
    batch = _batch()
    assert "LlamaRmsNormBackward" in _autograd_nodes(model(**batch).loss)
    assert tritongrad.patch_transformers("llama", **NORMS_ONLY).count == 0  # idempotent
    assert tritongrad.unpatch_transformers("llama") == 1
    assert modeling.LlamaRMSNorm.forward is original
    assert "LlamaRmsNormBackward" not in _autograd_nodes(model(**batch).loss)


def test_patch_transformers_gemma_mlp_is_geglu_and_unknown_family():
    report = tritongrad.patch_transformers("gemma", rms_norm=False, rope=False, linear_cross_entropy=False,
                                           causal_mask=False)
    assert [e.target.rsplit(".", 2)[-2] for e in report.replaced] == ["GemmaMLP"]
    assert report.ops() == {"geglu": 1} and "GELU" in report.replaced[0].detail
    model = _model("gemma")
    batch = _batch()
    loss = model(**batch).loss
    assert "GegluBackward" in _autograd_nodes(loss)
    with pytest.raises(ValueError, match="tested families"):
        tritongrad.patch_transformers("no_such_family")


def test_multimodal_wrapper_gets_its_text_stack():
    # Gemma3ForConditionalGeneration: the text stack's norms (and its layers' add + pre-feedforward norm) and the
    # vision tower's LayerNorms are patched; its loss is reported as left alone (not a *ForCausalLM forward).
    text = dict(TINY, num_hidden_layers=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).to(DEVICE)
    batch = _batch()
    want = copy.deepcopy(model)(**batch).loss
    report = tritongrad.patch(model, swiglu=False, geglu=False, rope=False, causal_mask=False)
    assert report.ops() == {"rms_norm": 14, "layer_norm": 4, "fused_add_rms_norm": 2}
    assert [(e.op, e.target) for e in report.skipped] == [("linear_cross_entropy", "")]
    got = model(**batch).loss
    assert "RmsNormBackward" in _autograd_nodes(got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- with swiglu, rope and linear_cross_entropy
@pytest.mark.parametrize("family", FAMILIES)
def test_all_ops_match_hf(family, spy):
    calls = spy("swiglu", "geglu", "gated_linear", "apply_rotary_pos_emb", "linear_cross_entropy", "fused_add_rms_norm")
    model = _model(family)
    batch = _batch()
    refs = _references(model, batch)
    model.eval()
    with torch.no_grad():
        logits_want = model(input_ids=batch["input_ids"]).logits
    model.train()
    report = tritongrad.patch(model)
    n_norms, n_mlps, gate = FAMILIES[family][1:]
    # Decoder layers fused: Llama's add and post-attention norm, Gemma's too (its norm's offset weight), Gemma 2's
    # and 3's add and pre-feedforward norm, Phi3's add of a dropout's output; Olmo2 norms before its adds.
    fused = FAMILIES[family][0] != "olmo2"
    assert report.ops() == {"rms_norm": n_norms, "rope": 1, "linear_cross_entropy": 1, "causal_mask": 2,
                            gate: n_mlps, **({"fused_add_rms_norm": 2} if fused else {})}
    assert all(e.op == "fused_add_rms_norm" and "does not compute" in e.detail
               for e in report.skipped) and bool(report.skipped) != fused
    out, grads = _run(model, batch)
    assert out.logits is None  # no logits in training with labels
    assert calls == {"apply_rotary_pos_emb": 2, "linear_cross_entropy": 1, gate: 2,
                     **({"fused_add_rms_norm": 2} if fused else {})}  # eager: no gated_linear
    _assert_matches(out, grads, refs)
    # No labels, or eval mode: the logits, as Hugging Face computes them.
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
        evaluated = model(**batch)
    torch.testing.assert_close(logits, logits_want, rtol=1e-4, atol=1e-5)
    assert evaluated.logits is not None
    torch.testing.assert_close(evaluated.loss, refs[0][0].loss, rtol=1e-5, atol=1e-5)
    assert tritongrad.patch(model).count == 0  # idempotent with every op


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_linear_cross_entropy_keeps_hf_loss_semantics(family, spy):
    # Gemma2: final-logit softcapping (30 by default) maps to logit_softcap.
    calls = spy("linear_cross_entropy")
    model = _model(family)
    batch = _batch()
    n = torch.tensor(7)  # num_items_in_batch: the loss is a sum over labelled tokens divided by it
    refs = _references(model, batch, num_items_in_batch=n)
    tritongrad.patch(model, rms_norm=False, swiglu=False, rope=False)
    out, grads = _run(model, batch, num_items_in_batch=n)
    assert calls == {"linear_cross_entropy": 1}
    _assert_matches(out, grads, refs)
    # Positional arguments, and return_dict=False: a tuple with the original's positions (loss, logits, ...),
    # logits None.
    got = model(batch["input_ids"], None, None, None, None, batch["labels"], return_dict=False, use_cache=True)
    loss = got[0]
    torch.testing.assert_close(loss, refs[0][0].loss * 7 / (batch["labels"][:, 1:] != -100).sum(), rtol=1e-5, atol=1e-6)
    model.train(False)
    want = model(batch["input_ids"], None, None, None, None, batch["labels"], return_dict=False, use_cache=True)
    model.train(True)
    assert got[1] is None and len(got) == len(want) == 3  # (loss, logits, cache)
    assert type(got[2]) is type(want[2])


def test_patch_transformers_all_ops():
    modeling = _hf.modeling_module("qwen3")
    # Where the decoder layer's class wraps its forward when it is created (transformers' checkpointing layer,
    # since 5.x), a forward set on the class itself would lose that wrapper: patch_transformers then leaves the
    # layer to patch(model). Where it does not, the class's forward is replaced.
    wrapped = bool(_hf.wrappers(modeling.Qwen3DecoderLayer.forward))
    report = tritongrad.patch_transformers("qwen3")
    ops = {"rms_norm": 1, "swiglu": 1, "rope": 1, "linear_cross_entropy": 1, "causal_mask": 2}
    assert report.ops() == (ops if wrapped else {**ops, "fused_add_rms_norm": 1})
    assert [(e.op, "a class-level patch would not keep" in e.detail) for e in report.skipped] == (
        [("fused_add_rms_norm", True)] if wrapped else [])
    model = _model("qwen3")
    again = tritongrad.patch(model)  # every op already patched through the classes; patch fuses the layers
    assert {e.op for e in again.replaced} == ({"fused_add_rms_norm"} if wrapped else set())
    assert again.count == (2 if wrapped else 0)
    assert _hf.patched_op(modeling.apply_rotary_pos_emb) == "rope"
    out = model(**_batch())
    assert out.logits is None
    out.loss.backward()
    # The class-level MLP forward established each instance (its plain attributes too) on its first call.
    assert [m.__dict__.get(_hf.GATE_ATTR) for m in model.modules() if isinstance(m, modeling.Qwen3MLP)] == ["silu"] * 2
    assert tritongrad.unpatch_transformers("qwen3") == (4 if wrapped else 5)
    assert _hf.patched_op(modeling.apply_rotary_pos_emb) is None and model(**_batch()).logits is not None


def _clipped_pair(monkeypatch):
    """Two instances of a gated-MLP class of a stand-in transformers family (``clipped_family``): the class
    carries a default (``limit = None``) that the second instance overrides to clip its gate and up. The class
    passes its probe; the clipping instance must not."""
    import types

    name = "transformers.models.clipped_family.modeling_clipped_family"
    ClippedMLP = clipped_mlp_class(name)

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.plain, self.clipped = ClippedMLP(), ClippedMLP(limit=0.05)

        def forward(self, x):
            return self.plain(x), self.clipped(x)

    module = types.ModuleType(name)
    module.ClippedMLP = ClippedMLP
    monkeypatch.setitem(sys.modules, name, module)
    torch.manual_seed(0)
    return Pair().to(DEVICE)


@pytest.mark.parametrize("at_trace", [True, False], ids=["established-at-trace", "own-forward-at-trace"])
def test_patch_transformers_first_call_compiled_establishes_each_instance(monkeypatch, at_trace):
    """A class patched by patch_transformers establishes each instance on its first call. When that call is
    traced by torch.compile, the instance's own attributes decide there, as in eager mode, with no graph break
    (``established-at-trace``, where dynamo takes a module in assume_constant_result); where it cannot, the
    traced call runs the instance's own forward (``own-forward-at-trace``), never a kernel taken on its class's
    word.

    The MLP's class carries a default (``limit = None``) that one instance overrides to clip its gate: the class
    passes its probe, the clipping instance must not. The Qwen3 model's norms, fused add-norms and loss from
    hidden states are established at the trace too (the training output has no logits); either way loss and
    gradients match the unpatched model's."""
    if at_trace and not _hf._trace_decides():
        pytest.skip(f"torch {torch.__version__}: dynamo's assume_constant_result takes no module argument")
    if not at_trace:
        monkeypatch.setattr(_hf, "_trace_decides", torch.compiler.assume_constant_result(lambda: False))

    pair = _clipped_pair(monkeypatch)
    x = torch.randn(3, 16, device=DEVICE)
    with torch.no_grad():
        want = pair(x)
    assert tritongrad.patch_transformers("clipped_family").ops() == {"swiglu": 1, "causal_mask": 2}
    traced = []
    for name in ("swiglu", "gated_linear"):  # the gate, with or without the down projection after it
        fn = getattr(tritongrad, name)
        monkeypatch.setattr(tritongrad, name, lambda *a, fn=fn, **k: traced.append(1) or fn(*a, **k))
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(pair, backend="aot_eager", fullgraph=True)(x)
    assert len(traced) == int(at_trace)  # the plain instance's call, traced once; never the clipping one's
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert _hf.GATE_ATTR not in vars(pair.plain)  # nothing kept by the trace: no guard to fail
    with torch.no_grad():  # eager calls establish and keep
        pair(x)
    assert (vars(pair.plain)[_hf.GATE_ATTR], vars(pair.clipped)[_hf.GATE_ATTR]) == ("silu", False)
    tritongrad.unpatch_transformers("clipped_family")

    model, batch = _model("qwen3"), _batch()
    refs = _references(model, batch)
    tritongrad.patch_transformers("qwen3")
    torch._dynamo.reset()
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(**batch)
    assert (out.logits is None) == at_trace  # the loss from hidden states where established at the trace
    out.loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    _assert_matches(out, grads, refs)
    assert not any(_hf.SPEC_ATTR in vars(m) or _hf.NORM_ATTR in vars(m) for m in model.modules())
    torch._dynamo.reset()


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_patch_transformers_exported_before_any_call_computes_the_model(monkeypatch, strict):
    """torch.export of a model whose classes patch_transformers patched, before any eager call. Strict export
    traces with dynamo, which establishes each instance as torch.compile does (where dynamo takes a module in
    assume_constant_result); non-strict export traces with fake tensors, which hold no data for a probe, so each
    instance runs its own forward. Either way the exported program computes the model's function, and the
    clipping instance never runs swiglu."""
    pair = _clipped_pair(monkeypatch)
    x = torch.randn(3, 16, device=DEVICE)
    with torch.no_grad():
        want = pair(x)
    tritongrad.patch_transformers("clipped_family")
    torch._dynamo.reset()
    program = torch.export.export(pair, (x,), strict=strict)
    calls = [n for n in program.graph.nodes if "swiglu" in str(n.target) or "gated_linear" in str(n.target)]
    assert len(calls) == int(strict and _hf._trace_decides()), program.graph
    got = program.module()(x)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


class _HubWrapped(torch.nn.Module):
    """What transformers with the ``kernels`` package makes of a module's ``apply_rotary_pos_emb``: a module
    instance whose forward, with the function's signature, calls the function."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return self.fn(q, k, cos, sin, unsqueeze_dim)


def test_rope_wrapped_in_a_module_is_established_replaced_and_restored(monkeypatch):
    modeling = _hf.modeling_module("llama")
    plain = modeling.apply_rotary_pos_emb
    plain = plain.forward if isinstance(plain, torch.nn.Module) else plain
    wrapped = _HubWrapped(plain)
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", wrapped)
    model = _model("llama")
    batch = _batch()
    refs = _references(model, batch)
    report = tritongrad.patch(model, **{**NORMS_ONLY, "rms_norm": False, "rope": True})
    assert report.ops() == {"rope": 1}, report
    _assert_matches(*_run(model, batch), refs)
    tritongrad.unpatch(model)
    assert modeling.apply_rotary_pos_emb is wrapped


# ---------------------------------------------------------------- with cross_entropy
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_cross_entropy_loss_function(family, spy):
    calls = spy("cross_entropy")
    model = _model(family)
    batch = _batch()
    refs = _references(model, batch)
    report = tritongrad.patch(model, rms_norm=False, swiglu=False, geglu=False, rope=False,
                              linear_cross_entropy=False, cross_entropy=True, causal_mask=False)
    assert report.ops() == {"cross_entropy": 1}
    out, grads = _run(model, batch)
    assert calls == {"cross_entropy": 1} and out.logits is not None
    _assert_matches(out, grads, refs)


# ---------------------------------------------------------------- the causal mask under torch.compile
def test_causal_mask_decision_under_compile_and_export():
    # The replacement, over an original that never skips the mask (as transformers' does under torch.compile on
    # torch < 2.14): compiled without padding and q_length 1 or kv_length, it skips; otherwise, in eager mode
    # and under torch.export, the original decides.
    def never(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        return False

    decide = _hf.causal_mask_function(never)
    assert _hf.causal_mask_why_not(never) is None and _hf.causal_mask_why_not(lambda x: x) is not None
    pad = torch.ones(2, 8, dtype=torch.bool)
    cases = {  # arguments -> the decision under torch.compile
        (None, 8, 8, 0, 0): True,
        (None, 1, 8, 7, 0): True,
        (None, 4, 8, 4, 0): False,     # a chunk of a prefill: the mask is needed
        (None, 8, 8, 0, 0, 4): False,  # a sliding window shorter than the keys
        (pad, 8, 8, 0, 0): False,      # a padding mask: its values would be read
    }
    for args, want in cases.items():
        assert decide(*args) is False  # eager mode: the original
        compiled = torch.compile(lambda x: x + int(decide(*args)), fullgraph=True, backend="eager")
        assert int(compiled(torch.zeros(()))) == int(want), args

    class M(torch.nn.Module):
        def forward(self, x):
            return x + int(decide(None, 8, 8, 0, 0))

    assert int(torch.export.export(M(), (torch.zeros(()),)).module()(torch.zeros(()))) == 0


def test_causal_mask_is_patched_module_wide_and_restored(monkeypatch):
    import transformers.masking_utils as mu

    names = ("find_packed_sequence_indices", "_ignore_causal_mask_sdpa")
    for name in names:
        if (mu, name) in _hf.SAVED:  # patched by an earlier test in this process: start from the original
            monkeypatch.setattr(mu, name, _hf.SAVED[(mu, name)][0])
            monkeypatch.delitem(_hf.SAVED, (mu, name))
    originals = [getattr(mu, name) for name in names]
    model = _model("llama")
    report = tritongrad.patch(model)
    assert report.targets("causal_mask") == [f"transformers.masking_utils.{name}" for name in names]
    assert all(_hf.patched_op(getattr(mu, name)) == "causal_mask" for name in names)
    again = tritongrad.patch(_model("qwen3"))  # another model: already patched, module-wide
    assert [e.op for e in again.already] == ["causal_mask", "causal_mask"]
    tritongrad.unpatch(model)
    assert [getattr(mu, name) for name in names] == originals and not any((mu, n) in _hf.SAVED for n in names)


def test_compiled_training_forward_builds_no_mask():
    # Compiled, transformers cannot read the position ids and builds the packed-sequence mask (a cumsum over
    # their differences) and an explicit attention mask; the patched training forward, called without
    # position_ids, knows the rows are unpacked. With position_ids given, the original check stays.
    # use_cache=False, as training sets it: with a cache, transformers looks for no packed sequences at all.
    cfg = transformers.AutoConfig.for_model("llama", **TINY, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(DEVICE).train()
    tritongrad.patch(model)
    ids = _batch()["input_ids"]
    for kwargs, packed_check in (({}, False), ({"position_ids": torch.arange(ids.shape[1], device=DEVICE)[None]}, True)):
        codes = []

        def backend(gm, example_inputs):
            codes.append(gm.code)
            return gm.forward

        torch._dynamo.reset()
        loss = torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids, labels=ids, **kwargs).loss
        code = "\n".join(codes)
        sdpa = [line for line in code.splitlines() if "scaled_dot_product_attention" in line]
        assert len(sdpa) == 2, code  # one per layer
        assert ("cumsum" in code) == packed_check, kwargs
        assert all(("is_causal = True" in line) != packed_check for line in sdpa), sdpa
        torch.testing.assert_close(loss, model(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- FSDP2
@pytest.mark.parametrize("ops", ["norms", "all"])
def test_fsdp2_world_size_1(ops, tmp_path):
    # fully_shard over the decoder layers and the root, one process (gloo): the patched ops see the plain
    # tensors FSDP2 all-gathers, and loss and gradients match the unsharded model's.
    dist = pytest.importorskip("torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not dist.is_available() or not hasattr(fsdp, "fully_shard"):
        pytest.skip("torch.distributed.fsdp.fully_shard is not available")
    model = _model("llama")
    batch = _batch()
    refs = _references(model, batch)
    dist.init_process_group("gloo" if DEVICE == "cpu" else "nccl", init_method=f"file://{tmp_path}/pg", rank=0,
                            world_size=1)
    try:
        tritongrad.patch(model, **(NORMS_ONLY if ops == "norms" else {}))
        for layer in model.model.layers:
            fsdp.fully_shard(layer)
        fsdp.fully_shard(model)
        assert type(model.model.norm.weight).__name__ == "DTensor"  # sharded outside the forward
        out, grads = _run(model, batch)
        _assert_matches(out, grads, refs)
        # A patched norm called outside its FSDP unit gets a sharded DTensor weight: it is gathered.
        norm = model.model.norm
        x = torch.randn(2, 3, 64, device=DEVICE)
        y = norm(x)
        want = llama_rms_norm_reference(x, norm.weight.full_tensor().detach(), norm.variance_epsilon)
        assert type(y) is torch.Tensor
        torch.testing.assert_close(y, want)
    finally:
        dist.destroy_process_group()


_TWO_RANKS = """
import os, sys, tempfile
import torch, torch.distributed as dist, torch.multiprocessing as mp

DEVICE = os.environ["TWO_RANKS_DEVICE"]  # cpu: gloo, the kernels in the interpreter; cuda: NCCL, a GPU a rank


def dtensor_activations_refused(rank):
    # Tensor parallelism is not handled: a DTensor activation, sharded over the features or replicated, reaches
    # the op's custom op, which DTensor's dispatch refuses (no sharding strategy), never a kernel run per shard.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    import tritongrad
    mesh = init_device_mesh(DEVICE, (2,))
    x = torch.randn(4, 8, device=DEVICE)
    w, labels = torch.ones(8, device=DEVICE), torch.zeros(4, dtype=torch.long, device=DEVICE)
    calls = {"rms_norm": lambda a: tritongrad.rms_norm(a, [8], w, 1e-6),
             "layer_norm": lambda a: tritongrad.layer_norm(a, [8], w, None, 1e-5),
             "swiglu": lambda a: tritongrad.swiglu(a, a), "geglu": lambda a: tritongrad.geglu(a, a),
             "cross_entropy": lambda a: tritongrad.cross_entropy(a, labels)}
    for place in (Shard(1), Replicate()):
        d = distribute_tensor(x, mesh, [place]).requires_grad_()
        for weights in ("plain", "replicated"):
            if weights == "replicated":
                w, labels = (distribute_tensor(t, mesh, [Replicate()]) for t in (w, labels))
            for name, call in calls.items():
                try:
                    call(d)
                except (NotImplementedError, RuntimeError) as e:
                    assert ("does not have a sharding strategy registered" in str(e)
                            or "got mixed torch.Tensor and DTensor" in str(e)), (name, place, weights, e)
                else:
                    raise AssertionError(f"{name} ran on a DTensor activation ({place}, weights {weights})")


def dtensor_weight(rank):
    # A patched norm called with a still-sharded weight: gathered, and its gradient averaged over the ranks.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import tritongrad
    from tritongrad import _hf, zoo
    mesh = init_device_mesh(DEVICE, (2,))
    w = torch.randn(8, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    weight = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(r + 1)).to(DEVICE) for r in range(2)]
    g = torch.arange(8.0, device=DEVICE)
    (tritongrad.rms_norm(xs[rank], [8], _hf._plain(weight), 1e-6) * g).sum().backward()
    got = weight.grad.full_tensor()
    want = 0
    for x in xs:  # FSDP2's gradient: the mean over ranks of each rank's own
        wr = w.clone().requires_grad_()
        (torch.nn.functional.rms_norm(x, [8], wr, 1e-6) * g).sum().backward()
        want = want + wr.grad / 2
    torch.testing.assert_close(got, want)


def mean_over_ranks(grads):
    # each rank's reference gradients (of its own sequence), averaged over the ranks: (a + b) / 2, as computed
    # from both on one rank
    out = {}
    for name, g in grads.items():
        total = g.clone()
        dist.all_reduce(total)
        out[name] = total / 2
    return out


def ddp_model(rank, **flags):
    # The same under DistributedDataParallel: its all-reduce averages the patched ops' gradients.
    import test_patch_models as T
    import tritongrad
    tritongrad.unpatch_transformers()
    model = T._model("llama")
    batch = T._batch()
    (out32, grads32), (out64, grads64) = T._references(model, {k: v[rank:rank + 1] for k, v in batch.items()})
    mean32, mean64 = mean_over_ranks(grads32), mean_over_ranks(grads64)
    report = tritongrad.patch(model, **flags)
    assert flags.get("cross_entropy") is not True or "cross_entropy" in report.ops(), report
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.zero_grad(set_to_none=True)
    out = ddp(**{k: v[rank:rank + 1] for k, v in batch.items()})
    out.loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    T._assert_matches(out, grads, ((out32, mean32), (out64, mean64)))
    tritongrad.unpatch_transformers()


# The ops each family's patch must replace: together, every op patch() has (Gemma 2: its norm kind, geglu and
# the soft-capped loss; Phi3: gate and up in one projection; GPT-NeoX: LayerNorm, partial rotary; DDP below:
# the loss on the logits).
FSDP_OPS = {"llama": {"rms_norm", "fused_add_rms_norm", "swiglu", "rope", "linear_cross_entropy", "causal_mask"},
            "gemma2": {"rms_norm", "geglu", "rope", "linear_cross_entropy", "causal_mask"},
            "phi3": {"rms_norm", "swiglu", "rope", "linear_cross_entropy", "causal_mask"},
            "gpt_neox": {"layer_norm", "rope", "linear_cross_entropy", "causal_mask"},  # LayerNorm, partial rotary
            "qwen3_moe": {"rms_norm", "swiglu", "rope", "linear_cross_entropy", "causal_mask"}}  # grouped_experts


def fsdp2_model(rank, head, tied, family="llama", compiled=False):
    # A patched tiny model under fully_shard at world size 2, each rank on its own sequence: its loss is the
    # unpatched model's on that sequence, and every gradient the mean over ranks of the unpatched model's.
    # compiled: each decoder layer compiled before it is sharded (torchtitan's recipe; aot_eager on CPU).
    import test_patch_models as T
    import tritongrad
    from torch.distributed.fsdp import fully_shard
    tritongrad.unpatch_transformers()  # rope is patched module-wide: the references run unpatched
    model = T._model(family, tie_word_embeddings=tied)
    batch = T._batch()
    mine = {k: v[rank:rank + 1] for k, v in batch.items()}
    (out32, grads32), (out64, grads64) = T._references(model, mine)
    mean32, mean64 = mean_over_ranks(grads32), mean_over_ranks(grads64)
    report = tritongrad.patch(model)
    assert FSDP_OPS[family] <= set(report.ops()), (family, report)
    assert family != "qwen3_moe" or "grouped_experts" in str(report), report
    for layer in model.base_model.layers:
        if compiled:
            layer.compile(backend="aot_eager" if DEVICE == "cpu" else "inductor", fullgraph=True)
        fully_shard(layer)
    if head == "own":  # the LM head in a unit of its own, which the fused loss never enters
        fully_shard(model.lm_head)
    fully_shard(model)
    traced, gated_linear = [], tritongrad.gated_linear
    # Compiled, the MLPs' down projection goes through gated_linear: the unsharded weight, a plain tensor.
    tritongrad.gated_linear = lambda *a, **k: traced.append(1) or gated_linear(*a, **k)
    try:
        out, grads = T._run(model, mine)
    finally:
        tritongrad.gated_linear = gated_linear
    assert bool(traced) == compiled, traced
    T._assert_matches(out, grads, ((out32, mean32), (out64, mean64)))
    tritongrad.unpatch_transformers()
    if compiled:
        from torch._dynamo.utils import counters
        assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["stats"])
        torch._dynamo.reset()


def sharded_head(rank, rows, hidden, vocab):
    # linear_cross_entropy with the LM head's weight sharded by fully_shard (all-gathered in the forward, its
    # gradient reduce-scattered), each rank on its own rows: the weight's gradient is the mean over ranks of the
    # unsharded loss's, each rank's input gradient its own, both within float32's rounding (against float64).
    import test_patch_models as T
    import tritongrad
    from torch.distributed.fsdp import fully_shard
    g = torch.Generator().manual_seed(7)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5
    hs = [torch.randn(rows, hidden, generator=g, dtype=torch.float64) for _ in range(2)]
    ys = [torch.randint(0, vocab, (rows,), generator=g) for _ in range(2)]
    for y in ys:
        y[::5] = -100  # ignored rows: each rank's mean over its own valid rows

    def reference(dtype):
        wr = w.to(DEVICE, dtype, copy=True).requires_grad_()
        hr = hs[rank].to(DEVICE, dtype, copy=True).requires_grad_()
        torch.nn.functional.cross_entropy(hr @ wr.t(), ys[rank].to(DEVICE)).backward()
        return hr.grad, mean_over_ranks({"w": wr.grad})["w"]

    class Head(torch.nn.Module):  # the loss in the head's FSDP unit: its forward sees the gathered weight
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(hidden, vocab, bias=False, device=DEVICE)

        def forward(self, h, y):
            return tritongrad.linear_cross_entropy(h, self.lm_head.weight, y)

    (h32, w32), (h64, w64) = reference(torch.float32), reference(torch.float64)
    head = Head()
    with torch.no_grad():
        head.lm_head.weight.copy_(w)  # float32
    fully_shard(head)
    assert type(head.lm_head.weight).__name__ == "DTensor"
    h = hs[rank].to(DEVICE, torch.float32).requires_grad_()
    head(h, ys[rank].to(DEVICE)).backward()
    T._assert_earned(h.grad, h32, h64, f"rank {rank}: grad of the input")
    T._assert_earned(head.lm_head.weight.grad.full_tensor(), w32, w64, f"rank {rank}: grad of the sharded weight")


def main(rank, path):
    sys.path.insert(0, os.environ["TESTS_DIR"])
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if DEVICE == "cpu" else "nccl", init_method="file://" + path, rank=rank,
                            world_size=2)
    try:
        # the loss alone, in a sharded head's unit: at a real size on GPUs, in the interpreter's on CPU
        sharded_head(rank, *((4096, 512, 32768) if DEVICE == "cuda" else (48, 32, 320)))
        dtensor_weight(rank)
        dtensor_activations_refused(rank)
        for head, tied in (("root", False), ("own", False), ("root", True)):
            fsdp2_model(rank, head, tied)
        fsdp2_model(rank, "root", False, "gemma2")
        fsdp2_model(rank, "root", False, "phi3")
        fsdp2_model(rank, "root", False, "gpt_neox")
        fsdp2_model(rank, "root", False, "qwen3_moe")
        fsdp2_model(rank, "root", False, compiled=True)
        ddp_model(rank)
        ddp_model(rank, cross_entropy=True, linear_cross_entropy=False)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    # CPU ranks fork from a process that has imported what they use, rather than each importing it again; CUDA
    # ranks are spawned (a forked CUDA runtime is unusable).
    sys.path.insert(0, os.environ["TESTS_DIR"])
    if DEVICE == "cpu":
        import gc
        import test_patch_models, tritongrad, transformers  # noqa: F401
        import torch.distributed.fsdp, torch.distributed.tensor  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401
        from transformers.models.gemma2 import modeling_gemma2  # noqa: F401
        from transformers.models.phi3 import modeling_phi3  # noqa: F401
        from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: F401
        from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401
        from transformers.integrations import moe  # noqa: F401
        gc.collect()
        gc.freeze()  # what both ranks share stays shared, and their collector does not walk it
    mp.start_processes(main, args=(tempfile.mktemp(),), nprocs=2, start_method="fork" if DEVICE == "cpu" else "spawn")
    print("ok")
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs"))])
def test_two_ranks_dtensor_weight_fsdp2_and_ddp(device, tmp_path):
    # Two ranks: gloo on CPU (in CI), NCCL on two GPUs. A weight still sharded when a patched module runs
    # (called outside its FSDP unit) is gathered, and its gradient, different on each rank, comes back averaged,
    # as FSDP2 averages. linear_cross_entropy under a sharded LM head (on GPUs at a real size too) gets the
    # unsharded gradients. A tiny Llama patched with every op and fully_shard-ed (the LM head in the root's
    # unit, in its own unit, and tied to the embedding), Gemma 2, Phi3, GPT-NeoX and Qwen3-MoE (the ops Llama
    # does not have, the MoE's experts through grouped_experts: FSDP_OPS), and under DDP (the loss from hidden states, and on the logits), gives each rank the
    # unpatched model's loss and the mean of its gradients over ranks. A DTensor activation is refused.
    pytest.importorskip("torch.distributed.tensor")
    pytest.importorskip("torch.distributed.fsdp").fully_shard
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    tests = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(os.path.dirname(tests), "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), TESTS_DIR=tests,
               TWO_RANKS_DEVICE=device, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    if device == "cpu":  # CPU ranks with the kernels in the interpreter, also on a GPU machine (CPU tensors)
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_fused_decoder_layers_keep_gradient_checkpointing():
    # The layer's class wraps its forward for gradient checkpointing; the fused layer's subclass is wrapped the
    # same way, so each layer still recomputes in the backward, and the gradients are the unfused model's.
    model = _model("llama")
    model.gradient_checkpointing_enable()
    model.train()
    batch = _batch()
    _, want = _run(model, batch)
    report = tritongrad.patch(model, swiglu=False, rope=False, linear_cross_entropy=False, causal_mask=False)
    assert report.ops() == {"rms_norm": 5, "fused_add_rms_norm": 2}
    calls = []
    for layer in model.model.layers:
        func = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, _f=func, **k: calls.append(1) or _f(*a, **k)
    _, got = _run(model, batch)
    assert len(calls) == 2
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------- modules a patched path bypasses
class _LoraLike(torch.nn.Module):
    """A LoRA layer as PEFT builds one: the Linear it wraps as ``base_layer``, its ``weight`` that Linear's, its
    output the Linear's plus a low-rank term the weight does not show."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2):
        super().__init__()
        self.base_layer = base
        # a at PEFT's init scale (kaiming: about 1 / sqrt(in_features)); b nonzero (PEFT starts it at zero) so
        # that the term shows: about as large as the Linear's own output here.
        g = torch.Generator().manual_seed(3)
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features, generator=g).to(base.weight.device)
                                    / base.in_features ** 0.5)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, rank, generator=g).to(base.weight.device) / 8)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + (x @ self.a.t()) @ self.b.t()


def _wrap_linears(model, names) -> None:
    for parent in list(model.modules()):
        for n in names:
            if isinstance(parent._modules.get(n), torch.nn.Linear):
                setattr(parent, n, _LoraLike(parent._modules[n]))


@pytest.mark.parametrize("when", ["after patch", "before patch"])
def test_lora_layers_keep_their_terms(when):
    # LoRA layers in place of the LM head and the MLP's projections (PEFT's layout), set after patch (the head
    # patch established is gone: the fused loss, which reads the head's weight, falls back to the model's own
    # loss and says so once) or before it (the head is refused; the MLP's projections are called as they are,
    # so swiglu still stands for the gate, without writing gradients over the layers' outputs).
    names = ("lm_head", "gate_proj", "up_proj", "q_proj")
    model = _model("llama")
    batch = _batch()
    ref = copy.deepcopy(model)
    _wrap_linears(ref, names)
    refs = _references(ref, batch)
    if when == "before patch":
        _wrap_linears(model, names)
    report = tritongrad.patch(model)
    assert "swiglu" in report.ops(), report
    assert ("linear_cross_entropy" in report.ops()) == (when == "after patch"), report
    if when == "after patch":
        _wrap_linears(model, names)
    else:
        assert "the output embedding is a _LoraLike, not a torch.nn.Linear" in str(report), report
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out, grads = _run(model, batch)
        _run(model, batch)
    _assert_matches(out, grads, refs)
    assert {n for n in grads if n.endswith((".a", ".b"))} == {n for n in refs[0][1] if n.endswith((".a", ".b"))}
    ours = [str(w.message) for w in seen if "tritongrad" in str(w.message)]
    if when == "after patch":
        assert len(ours) == 1 and "lm_head is a test_patch_models._LoraLike" in ours[0], ours
    else:
        assert ours == [], ours


def _scale_output(f):
    return lambda mod, args, out: out * f


def _scale_input(f):
    return lambda mod, args: (args[0] * f, *args[1:])


# Each way a module's call runs more than its forward, on a module that a patched path bypasses (or the module
# replaced after patch).
_CALLS = {
    "forward hook on lm_head": lambda m: m.lm_head.register_forward_hook(_scale_output(0.75)),
    "forward pre-hook on lm_head": lambda m: m.lm_head.register_forward_pre_hook(_scale_input(1.25)),
    "forward on the lm_head instance": lambda m: setattr(  # a bound method: deep copies keep it their own
        m.lm_head, "forward", types.MethodType(lambda self, x: torch.nn.Linear.forward(self, x) * 0.5, m.lm_head)),
    "forward pre-hook on post_attention_layernorm": lambda m: m.model.layers[1].post_attention_layernorm
    .register_forward_pre_hook(_scale_input(0.5)),
    "forward hook on act_fn": lambda m: m.model.layers[0].mlp.act_fn.register_forward_hook(_scale_output(1.5)),
    "act_fn replaced by a GELU": lambda m: setattr(m.model.layers[0].mlp, "act_fn", torch.nn.GELU()),
    "global forward hook": lambda m: torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: out * 1.125 if type(mod) is torch.nn.Linear else None),
}


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.extended)])
@pytest.mark.parametrize("how", _CALLS)
def test_a_bypassed_modules_call_still_counts(how, compiled):
    # The fused loss reads the LM head's weight, fused_add_rms_norm the post-attention norm's, swiglu stands for
    # act_fn: each falls back to the module's call wherever that call runs more than the class's forward, with
    # hooks registered after patch (as FSDP, DeepSpeed or accelerate register theirs); compiled (fullgraph)
    # too.
    model = _model("llama")
    batch = _batch()
    ref = copy.deepcopy(model)
    handle = _CALLS[how](ref)
    try:
        refs = _references(ref, batch)
    finally:
        if how.startswith("global"):
            handle.remove()
    assert set(tritongrad.patch(model).ops()) >= {"linear_cross_entropy", "fused_add_rms_norm", "swiglu"}
    handle = _CALLS[how](model)
    try:
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if compiled:  # the parameters by the model's own names
                out = torch.compile(model, backend="aot_eager", fullgraph=True)(**batch)
                out.loss.backward()
                grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
            else:
                out, grads = _run(model, batch)
    finally:
        if how.startswith("global"):
            handle.remove()
    _assert_matches(out, grads, refs)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_a_projections_kept_output_is_not_overwritten(family):
    # A forward hook that keeps a projection's output: the MLP's gradients are not written over it (the patch's
    # inplace_backward is taken only for projections whose call nothing else sees).
    name = "gate_up_proj" if family == "phi3" else "gate_proj"
    model = _model(family)
    batch = _batch()
    ref = copy.deepcopy(model)
    tritongrad.patch(model)
    kept = {}

    def keep(key):
        def hook(mod, args, out):  # returns None: the output goes on unchanged
            kept.setdefault(key, out.detach())
        return hook

    for key, m in (("ref", ref), ("patched", model)):
        getattr(m.model.layers[0].mlp, name).register_forward_hook(keep(key))
        _run(m, batch)
    torch.testing.assert_close(kept["patched"], kept["ref"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.extended)])
@pytest.mark.parametrize("family, name, value", [("gemma2", "final_logit_softcapping", 5.0),
                                                 ("gemma2", "final_logit_softcapping", None),
                                                 ("granite", "logits_scaling", 0.5)])
def test_a_logit_scale_set_after_patch_is_taken(family, name, value, compiled):
    # The fused loss applies the scale and cap that patch's probe established; the model's forward reads its
    # config at each call. Set after patch, the head is established again (the probe with the new value), or,
    # in a traced call, the model's own forward runs.
    model = _model(family, **({"logits_scaling": 4.0} if family == "granite" else {}))
    batch = _batch()
    ref = copy.deepcopy(model)
    assert "linear_cross_entropy" in tritongrad.patch(model).ops()
    for m in (model, ref):
        setattr(m.config, name, value)
    refs = _references(ref, batch)
    torch._dynamo.reset()
    fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    model.zero_grad(set_to_none=True)
    out = fn(**batch)
    out.loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    _assert_matches(out, grads, refs)
    assert (out.logits is None) == (not compiled)  # eager: the fused loss with the new value


@pytest.mark.parametrize("family, config", [("phi3", dict(resid_pdrop=0.25)),  # residual + dropout(h)
                                            ("granite", dict(residual_multiplier=0.5)),  # residual + h * m
                                            ("llama", {})])
def test_the_fused_add_takes_what_the_layer_adds(family, config):
    # The layer's added term, whatever expression it is, is evaluated as the layer evaluates it (a dropout draws
    # the same random numbers), then the add and the norm run fused: the unpatched model's loss and gradients
    # (the other ops off), to the norm's rounding.
    model = _model(family, **config)
    batch = _batch()
    ref = copy.deepcopy(model)
    report = tritongrad.patch(model, swiglu=False, rope=False, linear_cross_entropy=False, causal_mask=False)
    assert report.ops().get("fused_add_rms_norm") == 2, report
    calls = []
    fused = tritongrad.fused_add_rms_norm
    try:
        tritongrad.fused_add_rms_norm = lambda *a, **k: calls.append(1) or fused(*a, **k)
        for m in (ref, model):
            torch.manual_seed(5)
            m.zero_grad(set_to_none=True)
            m(**batch).loss.backward()
    finally:
        tritongrad.fused_add_rms_norm = fused
    assert len(calls) == 2
    losses = []
    for m in (ref, model):
        torch.manual_seed(5)
        with torch.no_grad():
            losses.append(m(**batch).loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_patch_transformers_mlp_whose_act_fn_is_replaced_runs_its_own_forward():
    # Established on its first call (class-level patch), the gate keeps the activation it was established with:
    # an act_fn set in its place afterwards makes the MLP run its own forward.
    model, batch = _model("llama"), _batch()
    ref = copy.deepcopy(model)
    ref.model.layers[0].mlp.act_fn = torch.nn.GELU()
    refs = _references(ref, batch)  # unpatched (before patch_transformers)
    tritongrad.patch_transformers("llama")
    _run(model, batch)  # establishes each MLP, with SiLU
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    out, grads = _run(model, batch)
    _assert_matches(out, grads, refs)


def test_a_decorator_that_fails_on_the_recompiled_layer_forward_is_a_refusal(tmp_path):
    # The fused add recompiles the layer's forward and applies its decorators again; one that reads where its
    # function lives (transformers' auto_docstring of some versions reads the source path) may raise there.
    # patch must not: the layer keeps its forward and the reason is given.
    import importlib.util

    (tmp_path / "layer_with_decorator.py").write_text(
        "import inspect, torch\n"
        "def where(f):\n"
        "    if not inspect.getsourcefile(f).endswith('.py'):\n"
        "        raise IndexError('not a source file')\n"
        "    return f\n"
        "class Layer(torch.nn.Module):\n"
        "    @where\n"
        "    def forward(self, residual, h):\n"
        "        hidden_states = residual + h\n"
        "        residual = hidden_states\n"
        "        hidden_states = self.post_attention_layernorm(hidden_states)\n"
        "        return hidden_states, residual\n")
    spec = importlib.util.spec_from_file_location("layer_with_decorator", tmp_path / "layer_with_decorator.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    forward, norm, why = _hf.add_norm_forward(module.Layer)
    assert forward is None and norm is None
    assert why == ("Layer.forward's decorator @where raised IndexError: not a source file on the recompiled "
                   "forward"), why


class GatedRMSNorm(torch.nn.Module):
    """A gated norm (Mamba2's form): Llama's RMSNorm on the input alone, times silu(gate) where given."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, gate=None):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * h.to(dtype)
        return out if gate is None else out * torch.nn.functional.silu(gate)


class KwargsRMSNorm(GatedRMSNorm):
    """Llama's RMSNorm whose forward takes (and ignores) keyword arguments."""

    def forward(self, hidden_states, **kwargs):
        return super().forward(hidden_states)


def test_a_gated_norm_is_left_alone_and_a_norm_called_with_more_is_counted():
    # A forward that takes a gate beyond its input is called with it (Mamba2, Bamba, Zamba2, NemotronH, ...):
    # established on the input alone, the op would never run while the report said replaced. It is left alone,
    # with the reason. A norm established on its input that is called with more (here keyword arguments its
    # forward ignores) runs its own forward, with the right values, and the call is counted in _hf.KEPT, which
    # the family matrix notes; called with the input alone it runs the op and nothing is counted.
    from tritongrad import _hf

    kind, why = _hf.instance_norm_kind(GatedRMSNorm(16))
    assert kind is None and "GatedRMSNorm.forward takes gate beyond its input (a gated norm)" in why
    norm = KwargsRMSNorm(16)
    with torch.no_grad():
        norm.weight.mul_(torch.linspace(0.5, 1.5, 16))
    assert _hf.instance_norm_kind(norm)[0] == "llama"
    forward = _hf.norm_forward("llama", "variance_epsilon")
    x = torch.randn(3, 16)
    key = ("rms_norm", f"{__name__.rsplit('.', 1)[-1]}.KwargsRMSNorm")
    before = _hf.KEPT.get(key, 0)
    torch.testing.assert_close(forward(norm, x), norm(x))
    assert _hf.KEPT.get(key, 0) == before
    torch.testing.assert_close(forward(norm, x, extra=1), norm(x))
    assert _hf.KEPT.get(key, 0) == before + 1

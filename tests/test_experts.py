"""grouped_experts, a MoE layer's gated experts as transformers' ``grouped_mm`` experts implementation computes
them, with a backward that keeps the gate-and-up product alone: its forward is transformers' function's (with
the patched gate) bit for bit; its gradients against float64, no further from it than autograd's on
transformers' function; what it keeps for the backward; every layout and activation; the patch that routes a
model's experts through it, and the calls it leaves to transformers."""

import pytest
import torch
from conftest import DEVICE

import tritongrad
from tritongrad import zoo
from tritongrad.ops.swiglu import experts as X
from tritongrad.ops.swiglu import grouped_experts, grouped_experts_reference

moe = pytest.importorskip("transformers.integrations.moe")


class _Experts(torch.nn.Module):
    """transformers' experts attributes, the gate as ``patch`` makes it (swiglu or geglu)."""

    def __init__(self, E, H, I, dtype, transposed=False, approximate=None, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        gu, dn = ((E, H, 2 * I), (E, I, H)) if transposed else ((E, 2 * I, H), (E, H, I))
        self.gate_up_proj = torch.nn.Parameter((0.2 * torch.randn(gu, generator=g)).to(dtype).to(DEVICE))
        self.down_proj = torch.nn.Parameter((0.2 * torch.randn(dn, generator=g)).to(dtype).to(DEVICE))
        self.num_experts, self.has_gate, self.has_bias, self.is_transposed = E, True, False, transposed
        self.is_concatenated, self._is_expert_parallel, self.has_post_expert_norm = True, False, False
        self.approximate = approximate

    def _apply_gate(self, pre):
        gate, up = pre.chunk(2, dim=-1)
        if self.approximate is None:
            return tritongrad.swiglu(gate, up)
        return tritongrad.geglu(gate, up, approximate=self.approximate)

    def transformers(self, x, idx, w):
        return moe.grouped_mm_experts_forward(self, x, idx, w)

    forward = transformers

    def ours(self, x, idx, w):
        return grouped_experts(x, idx, w, self.gate_up_proj, self.down_proj, approximate=self.approximate,
                               is_transposed=self.is_transposed)


def _routing(T, E, K, dtype, seed=0):
    """Top-k of random scores over all experts but the last (an expert with no token), the weights in dtype."""
    g = torch.Generator().manual_seed(seed + 1)
    scores = torch.rand(T, E - 1, generator=g)
    w, idx = scores.softmax(-1).topk(K, dim=-1)
    return idx.to(DEVICE), w.to(dtype).to(DEVICE)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _grads(fn, x, w, mod, g):
    out = fn(x, w)
    return out, torch.autograd.grad(out, (x, w, mod.gate_up_proj, mod.down_proj), g)


CASES = [  # (T, H, I, E, K, transposed, approximate)
    (37, 64, 32, 4, 2, False, None),
    (37, 64, 32, 4, 2, True, None),
    (29, 64, 32, 5, 3, False, "tanh"),
    (29, 64, 32, 5, 1, True, "none"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[3]}-K{c[4]}-{'t' if c[5] else 'n'}-{c[6]}")
def test_forward_is_transformers_and_gradients_as_close_to_float64(case, dtype):
    T, H, I, E, K, transposed, approximate = case
    mod = _Experts(E, H, I, dtype, transposed, approximate)
    idx, w = _routing(T, E, K, dtype)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE).requires_grad_()
    w.requires_grad_()
    g = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    got, got_g = _grads(lambda x, w: mod.ours(x, idx, w), x, w, mod, g)
    want, want_g = _grads(lambda x, w: mod.transformers(x, idx, w), x, w, mod, g)
    assert torch.equal(got, want), "the forward is not transformers' grouped_mm experts forward, bit for bit"

    params = [t.detach().double().requires_grad_() for t in (x, w, mod.gate_up_proj, mod.down_proj)]
    ref = grouped_experts_reference(params[0], idx, params[1], params[2], params[3], approximate=approximate,
                                    is_transposed=transposed)
    ref_g = torch.autograd.grad(ref, params, g.double())
    assert _rel(want, ref) < (1e-5 if dtype == torch.float32 else 2e-2)  # the reference is the same function
    for name, a, b, r in zip(("x", "top_k_weights", "gate_up_proj", "down_proj"), got_g, want_g, ref_g):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        floor = 1e-6 if dtype == torch.float32 else 4e-3
        assert _rel(a, r) <= 2 * _rel(b, r) + floor, (name, _rel(a, r), _rel(b, r))


def test_backward_keeps_the_gate_and_up_product_alone():
    """Autograd on transformers' function keeps the gathered inputs, the gate's output and the down product's
    output as well: S x (H + I + H) elements more."""
    T, H, I, E, K = 37, 64, 32, 4, 2
    mod = _Experts(E, H, I, torch.float32)
    idx, w = _routing(T, E, K, torch.float32)
    x = torch.randn(T, H, device=DEVICE, requires_grad=True)
    w.requires_grad_()
    known = {p.data_ptr() for p in (x, w, mod.gate_up_proj, mod.down_proj)}

    def saved_bytes(fn):
        seen = {}

        def pack(t):
            if t.data_ptr() not in known:
                seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x, idx, w)
        return sum(seen.values()), sorted(seen)

    S = T * K
    ours, what = saved_bytes(mod.ours)
    # pre [S, 2I]; the weights sorted [S]; perm, its inverse and the pairs' tokens [S] int64; offsets [E] int32
    assert ours == S * 2 * I * 4 + S * 4 + 3 * S * 8 + E * 4, what
    theirs, _ = saved_bytes(mod.transformers)
    assert theirs - ours >= S * (H + I + H) * 4


def test_second_order_gradients_are_refused():
    mod = _Experts(4, 64, 32, torch.float32)
    idx, w = _routing(11, 4, 2, torch.float32)
    x = torch.randn(11, 64, device=DEVICE, requires_grad=True)
    (gx,) = torch.autograd.grad(mod.ours(x, idx, w).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|double backward|twice"):
        gx.sum().backward()


def test_bad_inputs_name_the_shapes():
    mod = _Experts(4, 64, 32, torch.float32)
    idx, w = _routing(11, 4, 2, torch.float32)
    x = torch.randn(11, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"x \(11, 64\), top_k_index \(11, 2\), top_k_weights \(11, 1\)"):
        grouped_experts(x, idx, w[:, :1], mod.gate_up_proj, mod.down_proj)
    with pytest.raises(ValueError, match=r"gate_up_proj \(4, 64, 64\) and down_proj \(4, 64, 32\)"):
        grouped_experts(x, idx, w, mod.gate_up_proj, mod.down_proj, is_transposed=True)
    with pytest.raises(ValueError, match="approximate"):
        grouped_experts(x, idx, w, mod.gate_up_proj, mod.down_proj, approximate="erf")
    with pytest.raises(ValueError, match=r"top_k_index torch.float32 on"):
        grouped_experts(x, idx.float(), w, mod.gate_up_proj, mod.down_proj)
    if DEVICE != "cpu":
        with pytest.raises(ValueError, match=r"x torch.float32 on cpu"):
            grouped_experts(x.cpu(), idx, w, mod.gate_up_proj, mod.down_proj)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
def test_patched_moe_takes_grouped_experts_for_grouped_mm_alone(implementation, monkeypatch):
    """The patch routes the experts through grouped_experts where transformers would run its grouped_mm
    function, and leaves every other implementation to transformers (the gate patched): one step equals the
    unpatched model's."""
    calls = []
    apply = X._GroupedExperts.apply
    monkeypatch.setattr(X._GroupedExperts, "apply", lambda *a: calls.append(1) or apply(*a))
    base = zoo.build("qwen3_moe").to(DEVICE)
    base.config._experts_implementation = implementation
    model = zoo.build("qwen3_moe").to(DEVICE)
    model.config._experts_implementation = implementation
    report = tritongrad.patch(model)
    assert "grouped_experts" in str(report)
    batch = {k: v.to(DEVICE) for k, v in zoo._batch(model.config.vocab_size, DEVICE).items()}
    losses = []
    for m in (base, model):
        loss = m(**batch).loss
        loss.backward()
        losses.append(loss.detach())
    assert bool(calls) == (implementation == "grouped_mm")
    assert _rel(losses[1], losses[0]) < 1e-5
    for (n, p), q in zip(base.named_parameters(), model.parameters()):
        if p.grad is not None:
            assert _rel(q.grad, p.grad) < 1e-4, n


def test_bench_rows_time_the_same_function():
    """``tritongrad bench grouped_experts`` times transformers' grouped_mm experts (eager, torch.compile),
    tritongrad's and, where installed, Liger's fused MoE only as one function: on the bench's inputs the same
    output and gradients (float32; transformers' gate rounds twice, swiglu once; Liger's Triton products take
    float32 inputs as TF32, hence its looser bound)."""
    from tritongrad.bench.ops import OPS

    op = OPS["grouped_experts"]
    inputs = op.inputs(24, 96, torch.float32, DEVICE)
    grads_of = [inputs[0], inputs[2], inputs[3], inputs[4]]

    def run(fn):
        out = op.bind(fn)(*inputs)
        return out, torch.autograd.grad(out, grads_of, torch.ones_like(out))

    want, want_g = run(tritongrad.grouped_experts)
    rows = {"eager": op.torch_fn}
    if torch.cuda.is_available():  # Liger's kernels need a GPU
        from tritongrad.bench.providers import PROVIDERS, Unavailable

        try:
            rows["liger"] = PROVIDERS["liger"].build(op)
        except Unavailable:  # not installed: its row is not timed either
            pass
    for name, fn in rows.items():
        got, got_g = run(fn)
        tol, grad_tol = (1e-5, 1e-4) if name == "eager" else (1e-2, 3e-2)
        assert _rel(got, want) < tol, name
        for which, a, b in zip(("x", "top_k_weights", "gate_up_proj", "down_proj"), got_g, want_g):
            assert a.shape == b.shape and _rel(a, b) < grad_tol, (name, which, _rel(a, b))


def test_experts_whose_call_is_not_transformers_dispatch_keep_their_own(monkeypatch):
    """An experts class with a forward of its own (here one that scales the output) is not transformers'
    dispatch: the patch leaves its forward alone (the gate still patched), and an instance with a post-expert
    norm, which grouped_experts does not compute, takes transformers' function at each call."""
    calls = []
    apply = X._GroupedExperts.apply
    monkeypatch.setattr(X._GroupedExperts, "apply", lambda *a: calls.append(1) or apply(*a))
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q

    class ScaledExperts(q.Qwen3MoeExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 0.5 * super().forward(hidden_states, top_k_index, top_k_weights)

    base, model = zoo.build("qwen3_moe").to(DEVICE), zoo.build("qwen3_moe").to(DEVICE)
    for m in (base, model):
        for layer in m.model.layers:
            layer.mlp.experts.__class__ = ScaledExperts
    report = tritongrad.patch(model)
    assert "grouped_experts" not in str(report) and report.ops().get("swiglu"), report
    batch = {k: v.to(DEVICE) for k, v in zoo._batch(model.config.vocab_size, DEVICE).items()}
    assert _rel(model(**batch).loss, base(**batch).loss) < 1e-5
    assert not calls

    plain = zoo.build("qwen3_moe").to(DEVICE)
    tritongrad.patch(plain)
    plain(**batch)
    served = len(calls)
    assert served == len(plain.model.layers), "grouped_experts serves the plain model's every layer"
    calls.clear()
    experts = plain.model.layers[0].mlp.experts
    experts.has_post_expert_norm, experts.post_expert_norm = True, torch.nn.Identity()
    plain(**batch)
    assert len(calls) == served - 1, "the layer with a post-expert norm took grouped_experts"


@pytest.mark.parametrize("wanted", [(0,), (1,), (2,), (3,), (0, 3), (1, 2)], ids=str)
def test_only_the_gradients_asked_for_and_the_same(wanted):
    """Each subset of x, the routing weights and the two projections, asked alone, gets the gradients the
    full backward gives (frozen experts, a frozen router, LoRA-style training)."""
    mod = _Experts(4, 64, 32, torch.float32)
    idx, w = _routing(19, 4, 2, torch.float32)
    x = torch.randn(19, 64, device=DEVICE)
    g = torch.randn(19, 64, device=DEVICE)
    tensors = [x, w, mod.gate_up_proj.detach(), mod.down_proj.detach()]

    def grads(which):
        ts = [t.detach().clone().requires_grad_(i in which) for i, t in enumerate(tensors)]
        out = grouped_experts(ts[0], idx, ts[1], ts[2], ts[3])
        return torch.autograd.grad(out, [ts[i] for i in which], g)

    full = grads((0, 1, 2, 3))
    for i, got in zip(wanted, grads(wanted)):
        assert torch.equal(got, full[i]), i


def test_without_transformers_moe_the_error_says_what_it_needs(monkeypatch):
    """Its grouped products are transformers' own: where that module does not import, the call says so."""
    import sys

    monkeypatch.setattr(X, "_MOE", [None])
    monkeypatch.setitem(sys.modules, "transformers.integrations.moe", None)  # an import of it raises
    x, gu, dn = torch.randn(5, 8), torch.randn(2, 8, 8), torch.randn(2, 8, 4)
    with pytest.raises(ImportError, match=r"grouped_experts: .*transformers.integrations.moe"):
        grouped_experts(x, torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1), gu, dn)


def test_torch_func_and_forward_mode_as_transformers():
    """grouped_experts' autograd.Function gives no tangents and no batching rule: under torch.func's transforms and
    forward-mode AD the op runs the same forward in PyTorch's ops (the gated op on its reference), which PyTorch
    differentiates as transformers' own function: the same gradients, and forward-mode AD refused where torch's
    grouped_mm refuses it for both."""
    import torch.autograd.forward_ad as fwAD

    mod = _Experts(4, 64, 32, torch.float32, approximate="tanh")
    idx, w = _routing(11, 4, 2, torch.float32)
    x = torch.randn(11, 64, device=DEVICE)
    params = (mod.gate_up_proj.detach(), mod.down_proj.detach())

    def ours(x, w, gu, dn):
        return grouped_experts(x, idx, w, gu, dn, approximate="tanh")

    def theirs(x, w, gu, dn):
        return torch.func.functional_call(mod, {"gate_up_proj": gu, "down_proj": dn}, (x, idx, w))

    got, want = (torch.func.grad(lambda *a, f=f: f(*a).square().sum(), argnums=(0, 1, 2, 3))(x, w, *params)
                 for f in (ours, theirs))
    for name, a, b in zip(("x", "top_k_weights", "gate_up_proj", "down_proj"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    for f in (ours, theirs):
        with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward AD"):
            f(fwAD.make_dual(x, torch.ones_like(x)), w, *params)


def test_compiled_experts_import_nothing_while_traced(monkeypatch):
    """torch.compile traces the patched experts (forward and backward) without an import: Dynamo's import inside
    a trace breaks the graph where it refuses transformers' lazy modules (torch 2.11: eight breaks in a 12-layer
    MoE), so transformers' module is resolved at patch time and by eager calls, never while traced."""
    import builtins

    model = zoo.build("qwen3_moe").to(DEVICE)
    tritongrad.patch(model)
    experts = model.model.layers[0].mlp.experts
    idx, w = _routing(13, experts.num_experts, 2, torch.float32)
    x = torch.randn(13, model.config.hidden_size, device=DEVICE, requires_grad=True)
    imported, real = [], builtins.__import__

    def spy(name, *args, **kwargs):
        if name.startswith("transformers"):
            imported.append(name)
        return real(name, *args, **kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
    monkeypatch.setattr(builtins, "__import__", spy)
    out = compiled(x, idx, w.requires_grad_())
    out.square().sum().backward()
    monkeypatch.undo()
    assert not imported, f"imported while traced: {imported}"
    ref_x = x.detach().requires_grad_()
    ref = experts(ref_x, idx, w.detach())
    assert torch.equal(out.detach(), ref.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_gradients_are_the_eager_ones(dtype):
    """Compiled, every gradient is eager's, bit for bit (the traced backward is one op around eager's code).
    Dynamo (torch 2.11, the GPU image's) returns the traced function's intermediates beside its output, and an
    output that is one of them (a ``.to`` to the dtype it has) got a zero gradient: the experts trained on
    nothing, silently. Torch 2.13 returns the output alone, so there only the bitwise part can fail; on 2.11
    the whole test fails without the fix."""
    mod = _Experts(4, 64, 32, dtype)
    idx, w = _routing(29, 4, 2, dtype)
    x = (0.5 * torch.randn(29, 64, generator=torch.Generator().manual_seed(3))).to(dtype).to(DEVICE)
    g = torch.randn(29, 64, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(mod.ours, backend="aot_eager", fullgraph=True)
    ref_out, ref = _grads(lambda x, w: mod.ours(x, idx, w), x.requires_grad_(), w.requires_grad_(), mod, g)
    out, got = _grads(lambda x, w: compiled(x, idx, w), x, w, mod, g)
    assert torch.equal(out, ref_out)
    for name, a, b in zip(("x", "w", "gate_up_proj", "down_proj"), got, ref):  # traced, the same code runs
        assert b.abs().max() > 0 and torch.equal(a, b), (name, _rel(a, b))


def test_compiled_backward_saves_what_eager_saves():
    """Compiled (Inductor's partitioner), the forward saves for the backward what the function saves: the
    gate-and-up product [S, 2I], not the gathered rows [S, H] nor the gated product [S, I], which the backward
    makes again. As PyTorch ops in the graph, they are inputs of grouped products, which the partitioner saves
    rather than recompute."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    T, H, I, E, K = 29, 40, 24, 4, 2
    mod = _Experts(E, H, I, torch.float32)
    idx, w = _routing(T, E, K, torch.float32)
    x = torch.randn(T, H, device=DEVICE, requires_grad=True)
    saved = []

    def fw(gm, _):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved.extend(tuple(v.meta["val"].shape) for v in outputs[1:] if isinstance(v, torch.fx.Node)
                     and isinstance(v.meta.get("val"), torch.Tensor))
        return gm.forward

    backend = aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, _: gm.forward,
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    torch.compile(lambda x, w: mod.ours(x, idx, w), backend=backend, fullgraph=True)(x, w.requires_grad_())
    S = T * K
    rows = [shape for shape in saved if len(shape) == 2 and shape[0] == S]  # the pairs' [S, features] tensors
    assert sum(f for _, f in rows) == 2 * I, saved


@pytest.mark.parametrize("needs", [[True, True, True, True], [True, False, False, True]], ids=["all", "x-down"])
def test_backward_op_passes_opcheck(needs):
    """The traced backward's op, on the tensors the function saves: its schema (no output aliases an input, no
    input mutated), its fake against the real outputs' shapes, strides and dtypes, and AOT dispatch
    (torch.library.opcheck); the gradients not needed are empty."""
    mod = _Experts(4, 64, 32, torch.bfloat16)
    idx, w = _routing(29, 4, 2, torch.bfloat16)
    x = torch.randn(29, 64, device=DEVICE).to(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mod.ours(x.requires_grad_(), idx, w.requires_grad_())
    xs, gu, dn, pre, perm, inv_perm, tokens, w_g, offs = (t.detach() for t in saved)
    dout = torch.randn(29, 64, device=DEVICE).to(torch.bfloat16)
    args = (dout, xs, gu, dn, pre, perm, inv_perm, tokens, w_g, offs, None, False, 2, torch.bfloat16,
            torch.bfloat16, torch.bfloat16, needs)
    torch.library.opcheck(X._backward_op, args)
    grads = X._backward_op(*args)
    assert [g.numel() > 0 for g in grads] == needs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("approximate", [None, "tanh", "none"], ids=str)
@pytest.mark.parametrize("K", [1, 3])
def test_one_pass_backward_equals_the_pytorch_ops(dtype, approximate, K, monkeypatch):
    """The eager backward's kernels (dw, G w and the gate's gradients in one pass over pre and G; dx's gather
    and sum in one) give what the PyTorch ops of the traced backward give: every gradient but dw bit for bit,
    dw (a float32 row sum in another order) to float32 rounding."""
    mod = _Experts(5, 64, 40, dtype, approximate=approximate)
    idx, w = _routing(23, 5, K, dtype)
    x = torch.randn(23, 64, device=DEVICE).to(dtype)
    g = torch.randn(23, 64, device=DEVICE).to(dtype)

    def grads():
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        return torch.autograd.grad(mod.ours(xs, idx, ws), (xs, ws, mod.gate_up_proj, mod.down_proj), g)

    fused = grads()
    assert X._one_pass(x.device)
    monkeypatch.setattr(X, "_one_pass", lambda device: False)
    plain = grads()
    for name, a, b in zip(("x", "top_k_weights", "gate_up_proj", "down_proj"), fused, plain):
        if name == "top_k_weights":
            assert _rel(a, b) < (1e-6 if dtype == torch.float32 else 8e-3), name
        else:
            assert torch.equal(a, b), (name, _rel(a, b))


def test_one_pass_backward_reads_a_strided_pre(monkeypatch):
    """A saved-tensor hook may hand the backward pre in another layout (here column-major): the one-pass
    kernel, which reads unit columns, gets gradients equal to those of pre as saved."""
    mod = _Experts(4, 64, 40, torch.float32)
    idx, w = _routing(17, 4, 2, torch.float32)
    x = torch.randn(17, 64, device=DEVICE)
    g = torch.randn(17, 64, device=DEVICE)

    def grads(unpack):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            out = mod.ours(xs, idx, ws)
        return torch.autograd.grad(out, (xs, ws, mod.gate_up_proj, mod.down_proj), g)

    want = grads(lambda t: t)
    got = grads(lambda t: t.t().contiguous().t() if t.dim() == 2 and t.shape[-1] == 80 else t)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_retained_graph_gets_the_same_gradients_twice(dtype):
    """With the graph kept, pre's gradient is a buffer of its own; the gradients are those of a backward that
    writes over pre, bit for bit, and again on the second backward."""
    mod = _Experts(5, 64, 40, dtype, approximate="tanh")
    idx, w = _routing(31, 5, 2, dtype)
    x = torch.randn(31, 64, device=DEVICE).to(dtype)
    g = torch.randn(31, 64, device=DEVICE).to(dtype)
    params = (mod.gate_up_proj, mod.down_proj)

    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.autograd.grad(mod.ours(xs, idx, ws), (xs, ws, *params), g)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = mod.ours(xs, idx, ws)
    for _ in range(2):
        got = torch.autograd.grad(out, (xs, ws, *params), g, retain_graph=True)
        for name, a, b in zip(("x", "top_k_weights", "gate_up_proj", "down_proj"), got, want):
            assert torch.equal(a, b), (name, _rel(a, b))


def _backward_peak(T, H, I, E, K, reuse):
    """Bytes the backward allocates above what it starts with, at its peak, and its plan's figure in elements:
    ``max(S (H + 2I) + E I H, P + S H + T H + 3 E I H)``, the rows, G, the gated product and the down weight's
    gradient, or later pre's gradient (P: 0 over pre, 2 S I a buffer of its own, in a kept graph), a product's
    [S, H] output and the three weight and input gradients (docs/swiglu-rope.md#moe-experts)."""
    mod = _Experts(E, H, I, torch.bfloat16)
    idx, w = _routing(T, E, K, torch.bfloat16)
    x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
    S, EIH = T * K, E * I * H
    plan = max(S * (H + 2 * I) + EIH, (0 if reuse else 2 * S * I) + S * H + T * H + 3 * EIH)
    for _ in range(2):  # the first call makes the products' workspaces
        out = mod.ours(x, idx, w.clone().requires_grad_())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        grads = torch.autograd.grad(out, (x, mod.gate_up_proj, mod.down_proj), g, retain_graph=not reuse)
        peak = torch.cuda.max_memory_allocated() - start
        del out, grads
    return peak, plan * 2


@pytest.mark.skipif(DEVICE != "cuda", reason="the caching allocator's peak")
@pytest.mark.parametrize("reuse", [True, False], ids=["over-pre", "kept-graph"])
def test_the_backward_peak_is_its_plan(reuse):
    """The backward's transient buffers follow the plan in _grads: the rows, their weighted copy, G and the gated
    product never alive at once (the weighted rows written over the rows)."""
    peak, plan = _backward_peak(8192, 256, 256, 4, 2, reuse)
    assert peak <= plan + 2**20, (peak / 2**20, plan / 2**20)


# ---------------------------------------------------------------- what the kit checks of a declared op
# grouped_experts is an autograd.Function over transformers' products, not a tritongrad.op, so the kit's
# battery does not generate its cases; these are the kit's checks it lacked, written for it.
def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t's values in another memory layout: "transposed" (the last two dims' storage swapped), "sliced" (rows
    of a wider buffer)."""
    if layout == "transposed":
        return t.detach().transpose(-2, -1).contiguous().transpose(-2, -1)
    wide = torch.full((*t.shape[:-1], t.shape[-1] + 8), float("nan"), dtype=t.dtype, device=t.device)
    wide[..., : t.shape[-1]] = t.detach()
    return wide[..., : t.shape[-1]]


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
@pytest.mark.parametrize("upstream", ["dense", "expanded", "transposed"])
def test_any_layout_of_inputs_and_upstream_gradient(layout, upstream):
    T, H, I, E, K = 19, 64, 32, 4, 2
    mod = _Experts(E, H, I, torch.float32)
    idx, w = _routing(T, E, K, torch.float32)
    x = torch.randn(T, H, device=DEVICE)
    g = torch.randn(T, H, device=DEVICE)
    if upstream == "expanded":
        g = g[:1].expand(T, H)
    elif upstream == "transposed":
        g = g.t().contiguous().t()
    tensors = [x, w, mod.gate_up_proj.detach(), mod.down_proj.detach()]

    def run(ts, g):
        ts = [t.requires_grad_() for t in ts]
        out = grouped_experts(ts[0], idx, ts[1], ts[2], ts[3])
        return out, torch.autograd.grad(out, ts, g)

    want, want_g = run([t.clone() for t in tensors], g.contiguous())
    got, got_g = run([_layout(t, layout) for t in tensors], g)
    # Another layout may take another product kernel (cuBLAS), so another summation order: float32 rounding of
    # the largest terms, not of each element, separates the two.
    for name, a, b in zip(("out", "x", "top_k_weights", "gate_up_proj", "down_proj"), (got, *got_g), (want, *want_g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_gradcheck_in_float64(monkeypatch):
    # torch's grouped_mm takes no float64 (transformers' function fails there too): its fallback, a product
    # per expert, carries the forward and the backward's products here.
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *a: False)
    mod = _Experts(3, 8, 4, torch.float64)
    idx, w = _routing(7, 3, 2, torch.float64)
    x = torch.randn(7, 8, dtype=torch.float64, device=DEVICE)
    inputs = [t.detach().clone().requires_grad_() for t in (x, w, mod.gate_up_proj, mod.down_proj)]
    assert torch.autograd.gradcheck(lambda x, w, gu, dn: grouped_experts(x, idx, w, gu, dn), inputs,
                                    eps=1e-6, atol=1e-7, rtol=1e-5)


def test_no_graph_without_gradients():
    mod = _Experts(4, 64, 32, torch.float32)
    idx, w = _routing(11, 4, 2, torch.float32)
    x = torch.randn(11, 64, device=DEVICE, requires_grad=True)
    with torch.no_grad():
        assert mod.ours(x, idx, w).grad_fn is None
    frozen = grouped_experts(x.detach(), idx, w, mod.gate_up_proj.detach(), mod.down_proj.detach())
    assert frozen.grad_fn is None and not frozen.requires_grad


def test_gradients_accumulate_and_belong_to_the_caller():
    # Two backwards accumulate into .grad; a gradient the caller changed in place changes nothing of the next.
    mod = _Experts(4, 64, 32, torch.float32)
    idx, w = _routing(11, 4, 2, torch.float32)
    x = torch.randn(11, 64, device=DEVICE, requires_grad=True)
    g = torch.randn(11, 64, device=DEVICE)
    mod.ours(x, idx, w).backward(g)
    once = [t.grad.clone() for t in (x, mod.gate_up_proj, mod.down_proj)]
    for t in (x, mod.gate_up_proj, mod.down_proj):
        t.grad.mul_(0.0)  # the caller's own
    mod.ours(x, idx, w).backward(g)
    mod.ours(x, idx, w).backward(g)
    for t, o in zip((x, mod.gate_up_proj, mod.down_proj), once):
        torch.testing.assert_close(t.grad, 2 * o, rtol=1e-6, atol=1e-6)

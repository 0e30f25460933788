"""apply_rotary_pos_emb (Hugging Face's rotate_half convention): the OpSuite battery, then what is special to
it: Hugging Face's own function in float64, q and k read in place from transposed projections and outputs in
their layout, inputs never written, determinism, bad inputs, export, CUDA graphs and the sm_90 compile of
every specialization."""

import os

import pytest
import torch
from conftest import DEVICE, KernelSpy, run_without_interpreter

from tritongrad.ops.rope import apply_rotary_pos_emb, apply_rotary_pos_emb_reference
from tritongrad.ops.rope import launch as rope_launch
from tritongrad.testing import OpSuite


def hf_apply(q, k, cos, sin, unsqueeze_dim=1):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf

    return hf(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def randn(*shape, dtype, device):
    return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)


def tables(Bc, T, Dh, dtype, device):
    """Rotary tables as Hugging Face builds them (halves repeated), from random positions."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, Dh, 2, dtype=torch.float32, device=device) / Dh))
    pos = torch.randint(0, 4096, (Bc, T), device=device).float()
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def projections(B, T, HQ, HK, Dh, dtype, device):
    """q and k as attention receives them: [B, H, T, Dh] transposed views of [B, T, H, Dh] projections."""
    q = randn(B, T, HQ, Dh, dtype=dtype, device=device).transpose(1, 2)
    k = randn(B, T, HK, Dh, dtype=dtype, device=device).transpose(1, 2)
    return q, k


# Samples, and why each is here.
def gqa(dtype, device):
    # Llama's layout: transposed projections, 4 q heads per k head, [B, T, Dh] tables.
    q, k = projections(2, 5, 8, 2, 16, dtype, device)
    return (q, k, *tables(2, 5, 16, dtype, device), 1)


def broadcast_tables(dtype, device):
    # [1, T, Dh] tables for all the batch (shared position ids), and tokens of two batches in one block.
    q, k = projections(3, 3, 4, 4, 8, dtype, device)
    return (q, k, *tables(1, 3, 8, dtype, device), 1)


def bthd_layout(dtype, device):
    # unsqueeze_dim=2: q and k contiguous [B, T, H, Dh].
    q = randn(2, 4, 6, 8, dtype=dtype, device=device)
    k = randn(2, 4, 3, 8, dtype=dtype, device=device)
    return (q, k, *tables(2, 4, 8, dtype, device), 2)


def odd_half(dtype, device):
    # Dh = 6: halves of 3 columns (masked to a block of 4), 3 heads, contiguous [B, H, T, Dh] q and k,
    # independent random halves of cos and sin (the adjoint pairs s2 with dy2, not s1).
    q = randn(1, 3, 7, 6, dtype=dtype, device=device)
    k = randn(1, 1, 7, 6, dtype=dtype, device=device)
    return q, k, randn(1, 7, 6, dtype=dtype, device=device), randn(1, 7, 6, dtype=dtype, device=device), 1


suite = OpSuite(apply_rotary_pos_emb, [gqa, broadcast_tables, bthd_layout, odd_half], baseline=hf_apply,
                mixed=True)
test_rope_suite = suite.pytest()


# ---------------------------------------------------------------- Hugging Face's function
@pytest.mark.parametrize("unsqueeze_dim, Bc", [(1, 2), (1, 1), (2, 2), (2, 1)])
def test_float64_equals_hugging_face(unsqueeze_dim, Bc):
    B, T, HQ, HK, Dh = 2, 6, 8, 2, 16
    q, k = projections(B, T, HQ, HK, Dh, torch.float64, DEVICE)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    # Random tables: halves that differ check the adjoint's pairing of sin's halves too.
    cos, sin = randn(Bc, T, Dh, dtype=torch.float64, device=DEVICE), randn(Bc, T, Dh, dtype=torch.float64, device=DEVICE)
    ours = [t.detach().requires_grad_() for t in (q, k)]
    theirs = [t.detach().requires_grad_() for t in (q, k)]
    got = apply_rotary_pos_emb(*ours, cos, sin, unsqueeze_dim)
    want = hf_apply(*theirs, cos, sin, unsqueeze_dim)
    grads = [torch.randn_like(w) for w in want]
    torch.autograd.backward(got, grads)
    torch.autograd.backward(want, grads)
    for a, b in [*zip(got, want), (ours[0].grad, theirs[0].grad), (ours[1].grad, theirs[1].grad)]:
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)


def test_backward_sign():
    # y = x cos + rotate_half(x) sin, dx = dy cos - rotate_half(dy sin): one element by hand. Dh = 2, x = [1, 0]:
    # y = [c1, s2]; with dy = [0, 1], dx = [s2, c2].
    q = torch.tensor([1.0, 0.0], dtype=torch.float64, device=DEVICE).view(1, 1, 1, 2).requires_grad_()
    k = torch.zeros(1, 1, 1, 2, dtype=torch.float64, device=DEVICE, requires_grad=True)
    cos = torch.tensor([[[0.3, 0.5]]], dtype=torch.float64, device=DEVICE)
    sin = torch.tensor([[[0.7, 0.11]]], dtype=torch.float64, device=DEVICE)
    qe, ke = apply_rotary_pos_emb(q, k, cos, sin)
    assert qe.flatten().tolist() == [0.3, 0.11]
    qe.backward(torch.tensor([0.0, 1.0], dtype=torch.float64, device=DEVICE).view(1, 1, 1, 2))
    assert q.grad.flatten().tolist() == [0.11, 0.5]


# ---------------------------------------------------------------- memory: in place, layouts, no writes
def test_transposed_projections_are_read_in_place_and_layouts_kept(monkeypatch):
    spy = KernelSpy(rope_launch._kernel)
    monkeypatch.setattr(rope_launch, "_kernel", spy)
    q, k = projections(2, 5, 8, 2, 16, torch.float32, DEVICE)
    cos, sin = tables(1, 5, 16, torch.float32, DEVICE)
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
    qe, ke = apply_rotary_pos_emb(qr, kr, cos, sin)
    assert spy.ptrs[0][:2] == [q.data_ptr(), k.data_ptr()]  # the kernel's q and k: the projections' memory
    assert spy.ptrs[0][4:6] == [cos.data_ptr(), sin.data_ptr()]
    # Outputs laid out like the inputs: [B, T, H, Dh] in memory, so attention reads them as it would q and k.
    assert qe.stride() == q.stride() and ke.stride() == k.stride()
    # Gradients of a transposed view of the projection transpose back to a contiguous [B, T, H, Dh]: the
    # reshape to [B, T, H * Dh] is a view.
    dqe, dke = torch.randn_like(qe), torch.randn_like(ke)
    (qe * dqe).sum().add((ke * dke).sum()).backward()
    assert qr.grad.stride() == q.stride() and kr.grad.stride() == k.stride()


def test_one_launch_for_q_and_k(monkeypatch):
    spy = KernelSpy(rope_launch._kernel)
    monkeypatch.setattr(rope_launch, "_kernel", spy)
    q, k = projections(1, 4, 4, 2, 8, torch.float32, DEVICE)
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
    qe, ke = apply_rotary_pos_emb(qr, kr, *tables(1, 4, 8, torch.float32, DEVICE))
    (qe.sum() + ke.sum()).backward()
    assert len(spy.ptrs) == 2  # one forward launch, one backward launch


def test_inputs_are_never_written_and_results_are_deterministic():
    q, k = projections(2, 9, 8, 4, 32, torch.bfloat16, DEVICE)
    cos, sin = tables(2, 9, 32, torch.bfloat16, DEVICE)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    before = [t.clone() for t in (q, k, cos, sin, dq, dk)]
    runs = []
    for _ in range(2):
        qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
        qe, ke = apply_rotary_pos_emb(qr, kr, cos, sin)
        torch.autograd.backward([qe, ke], [dq, dk])
        runs.append((qe, ke, qr.grad, kr.grad))
    for a, b in zip(before, (q, k, cos, sin, dq, dk)):
        assert torch.equal(a, b)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_only_k_needs_grad():
    q, k = projections(1, 3, 4, 2, 8, torch.float32, DEVICE)
    kr = k.detach().requires_grad_()
    cos, sin = tables(1, 3, 8, torch.float32, DEVICE)
    qe, ke = apply_rotary_pos_emb(q, kr, cos, sin)
    assert qe.grad_fn is not None and ke.grad_fn is not None
    ke.backward(torch.ones_like(ke))
    want = torch.func.grad(lambda t: apply_rotary_pos_emb_reference(q, t, cos, sin)[1].sum())(k)
    torch.testing.assert_close(kr.grad, want)


def test_mixed_dtypes_follow_promotion():
    q, k = projections(1, 3, 4, 2, 8, torch.bfloat16, DEVICE)
    cos, sin = tables(1, 3, 8, torch.float32, DEVICE)
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
    qe, ke = apply_rotary_pos_emb(qr, kr, cos, sin)
    assert qe.dtype == ke.dtype == torch.float32  # as Hugging Face's q * cos
    (qe.sum() + ke.sum()).backward()
    assert qr.grad.dtype == kr.grad.dtype == torch.bfloat16


def test_empty_inputs():
    q, k = projections(2, 0, 4, 2, 8, torch.float32, DEVICE)
    cos, sin = tables(2, 0, 8, torch.float32, DEVICE)
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
    qe, ke = apply_rotary_pos_emb(qr, kr, cos, sin)
    assert qe.shape == q.shape and ke.shape == k.shape
    (qe.sum() + ke.sum()).backward()
    assert qr.grad.shape == q.shape


# ---------------------------------------------------------------- bad inputs
def _args(B=2, T=5, HQ=8, HK=2, Dh=16, Bc=None, dtype=torch.float32):
    q, k = projections(B, T, HQ, HK, Dh, dtype, DEVICE)
    cos, sin = tables(B if Bc is None else Bc, T, Dh, torch.float32, DEVICE)
    return [q, k, cos, sin]


def _bad(change):
    args = _args()
    change(args)
    return args


BAD = [
    ("q 3-D", lambda a: a.__setitem__(0, a[0][0]), ValueError, ["q must be 4-D", "(8, 5, 16)"]),
    ("k's T differs", lambda a: a.__setitem__(1, a[1][:, :, :4]), ValueError, ["q (2, 8, 5, 16)", "k (2, 2, 4, 16)"]),
    ("heads not divisible", lambda a: a.__setitem__(1, torch.randn(2, 3, 5, 16, device=DEVICE)), ValueError,
     ["3 heads must divide q's 8", "(2, 3, 5, 16)"]),
    ("Dh odd", lambda a: a.__setitem__(slice(0, 4), _args(Dh=15)), ValueError, ["must be even", "15"]),
    ("cos and sin differ", lambda a: a.__setitem__(3, a[3][:1]), ValueError, ["cos (2, 5, 16)", "sin (1, 5, 16)"]),
    ("cos's T differs", lambda a: a.__setitem__(slice(2, 4), [a[2][:, :4], a[3][:, :4]]), ValueError,
     ["[2, 5, 16] or [1, 5, 16]", "(2, 4, 16)"]),
    ("cos's batch", lambda a: a.__setitem__(slice(2, 4), [a[2][:1].expand(3, 5, 16)] * 2), ValueError,
     ["(3, 5, 16)"]),
    ("cos 2-D", lambda a: a.__setitem__(slice(2, 4), [a[2][0], a[3][0]]), ValueError, ["(5, 16)"]),
    ("integer q", lambda a: a.__setitem__(0, a[0].to(torch.int64)), TypeError, ["q has dtype torch.int64", "(2, 8, 5, 16)"]),
    ("integer cos", lambda a: a.__setitem__(2, a[2].to(torch.int32)), TypeError, ["cos has dtype torch.int32"]),
    ("devices", lambda a: a.__setitem__(3, a[3].to("meta")), ValueError, ["one device", "sin (2, 5, 16) on meta"]),
]


@pytest.mark.parametrize("name, change, error, words", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_name_shapes_dtypes_devices(name, change, error, words):
    args = _bad(change)
    with pytest.raises(error) as info:
        apply_rotary_pos_emb(*args)
    for w in words:
        assert w in str(info.value), str(info.value)


@pytest.mark.parametrize("dim", [0, 3, True, 1.0])
def test_bad_unsqueeze_dim(dim):
    with pytest.raises(ValueError, match="unsqueeze_dim must be 1"):
        apply_rotary_pos_emb(*_args(), dim)


def test_tables_that_require_grad_are_refused():
    q, k, cos, sin = _args()
    with pytest.raises(ValueError, match=r"cos \(2, 5, 16\) requires grad.*cos.detach\(\)"):
        apply_rotary_pos_emb(q.requires_grad_(), k, cos.requires_grad_(), sin)


# ---------------------------------------------------------------- graphs: export, CUDA graphs
def test_export():
    class Attn(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            return apply_rotary_pos_emb(q, k, cos, sin)

    args = tuple(_args())
    ep = torch.export.export(Attn(), args)
    assert any("apply_rotary_pos_emb" in str(n.target) for n in ep.graph.nodes)
    for a, b in zip(ep.module()(*args), apply_rotary_pos_emb(*args)):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay():
    q, k = projections(2, 64, 8, 2, 128, torch.bfloat16, "cuda")
    cos, sin = tables(1, 64, 128, torch.bfloat16, "cuda")
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up: compile the kernels outside the capture
        for _ in range(2):
            q.grad = k.grad = None
            qe, ke = apply_rotary_pos_emb(q, k, cos, sin)
            (qe.float().sum() + ke.float().sum()).backward()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    q.grad = k.grad = None
    with torch.cuda.graph(graph):
        qe, ke = apply_rotary_pos_emb(q, k, cos, sin)
    with torch.no_grad():
        q.copy_(torch.randn_like(q))
    graph.replay()
    want = apply_rotary_pos_emb_reference(q.detach(), k.detach(), cos, sin)
    torch.testing.assert_close(qe, want[0])
    torch.testing.assert_close(ke, want[1])


# ---------------------------------------------------------------- sm_90
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite compiles and runs the kernels itself")
def test_kernels_compile_for_sm90_with_vector_access():
    script = os.path.join(os.path.dirname(__file__), "sm90_compile_llm_ops.py")
    out = run_without_interpreter([script, "rope"], timeout=900)
    assert out.returncode == 0 and " 0 failures" in out.stdout, (out.stdout + out.stderr)[-4000:]

"""apply_rotary_pos_emb (Hugging Face's rotate_half convention): the OpSuite battery, then what is special to
it: Hugging Face's own function in float64, q and k read in place from transposed projections and outputs in
their layout, inputs never written, determinism, bad inputs, export, CUDA graphs and the sm_90 compile of
every specialization."""

import os

import pytest
import torch
from conftest import DEVICE, run_without_interpreter

from tritongrad.ops.rope import apply_rotary_pos_emb, apply_rotary_pos_emb_reference
from tritongrad.ops.rope import launch as rope_launch
from tritongrad.testing import OpSuite


def hf_apply(q, k, cos, sin, unsqueeze_dim=1, interleaved=False, out_dtype=None):
    """Eager Hugging Face code of each mode, in the inputs' dtypes (the kit's baseline): Llama's function
    (full rotary), Phi-3's (partial), and GLM's rotation and formula without its rewrite of cos and sin (the
    op takes them per feature); with ``out_dtype``, the result cast to it (Olmo2's ``.to(q_type)``)."""
    if out_dtype is not None:
        return tuple(y.to(out_dtype) for y in hf_apply(q, k, cos, sin, unsqueeze_dim, interleaved))
    if interleaved:
        from transformers.models.glm.modeling_glm import rotate_half as glm_rotate

        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        r = c.shape[-1]
        return tuple(torch.cat([x[..., :r] * c + glm_rotate(x[..., :r]) * s, x[..., r:]], dim=-1) for x in (q, k))
    if cos.shape[-1] < q.shape[-1]:
        from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3

        return phi3(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf

    return hf(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def randn(*shape, dtype, device):
    return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)


def tables(Bc, T, Dh, dtype, device):
    """Rotary tables of Dh features as Hugging Face builds them (halves repeated), from random positions."""
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


def partial_half(dtype, device):
    # Partial rotary (GPT-NeoX, Phi-3): D = 16, the first R = 8 features rotate, 8 pass; GQA, transposed
    # projections, tables of R features.
    q, k = projections(2, 5, 4, 2, 16, dtype, device)
    return (q, k, *tables(2, 5, 8, dtype, device), 1)


def partial_quarter(dtype, device):
    # R = 4 of D = 16 (a pass block wider than the rotated one), [B, T, H, D] through unsqueeze_dim=-2,
    # [1, T, R] random tables (halves differ).
    q = randn(2, 3, 4, 16, dtype=dtype, device=device)
    k = randn(2, 3, 1, 16, dtype=dtype, device=device)
    return q, k, randn(1, 3, 4, dtype=dtype, device=device), randn(1, 3, 4, dtype=dtype, device=device), -2


def interleaved(dtype, device):
    # The interleaved convention over the whole head (D = R = 8), GQA, random tables: the adjoint pairs
    # sin[2i + 1] with dy[2i + 1]'s partner, which equal entries would hide.
    q, k = projections(2, 4, 4, 2, 8, dtype, device)
    return dict(q=q, k=k, cos=randn(2, 4, 8, dtype=dtype, device=device), sin=randn(2, 4, 8, dtype=dtype, device=device),
                unsqueeze_dim=1, interleaved=True)


def interleaved_partial(dtype, device):
    # Interleaved and partial (GLM): R = 6 of D = 13 (3 pairs, masked to 4; an odd head), [B, T, H, D].
    q = randn(1, 5, 3, 13, dtype=dtype, device=device)
    k = randn(1, 5, 3, 13, dtype=dtype, device=device)
    return dict(q=q, k=k, cos=randn(1, 5, 6, dtype=dtype, device=device), sin=randn(1, 5, 6, dtype=dtype, device=device),
                unsqueeze_dim=2, interleaved=True)


suite = OpSuite(apply_rotary_pos_emb, [gqa, broadcast_tables, bthd_layout, odd_half, partial_half, partial_quarter,
                                       interleaved, interleaved_partial], baseline=hf_apply, mixed=True)
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


def _hf_both(fn_ours, fn_theirs, q, k, dtype_grads=torch.float64):
    """Outputs and gradients of q and k of two functions for the same inputs and upstream gradients."""
    ours = [t.detach().requires_grad_() for t in (q, k)]
    theirs = [t.detach().requires_grad_() for t in (q, k)]
    got, want = fn_ours(*ours), fn_theirs(*theirs)
    grads = [torch.randn_like(w) for w in want]
    torch.autograd.backward(got, grads)
    torch.autograd.backward(want, grads)
    return [*got, ours[0].grad, ours[1].grad], [*want, theirs[0].grad, theirs[1].grad]


@pytest.mark.parametrize("module", ["gpt_neox", "phi3"])
@pytest.mark.parametrize("R, unsqueeze_dim", [(8, 1), (4, 2), (16, 1), (6, -2)])
def test_float64_partial_rotary_equals_hugging_face(module, R, unsqueeze_dim):
    import importlib

    hf = importlib.import_module(f"transformers.models.{module}.modeling_{module}").apply_rotary_pos_emb
    B, T, HQ, HK, D = 2, 5, 4, 2, 16
    q, k = projections(B, T, HQ, HK, D, torch.float64, DEVICE)
    if unsqueeze_dim in (2, -2):
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = randn(B, T, R, dtype=torch.float64, device=DEVICE), randn(B, T, R, dtype=torch.float64, device=DEVICE)
    got, want = _hf_both(lambda a, b: apply_rotary_pos_emb(a, b, cos, sin, unsqueeze_dim),
                         lambda a, b: hf(a, b, cos, sin, unsqueeze_dim), q, k)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)
    # The passed features: q's own values, and q's gradient there is the upstream gradient itself.
    assert torch.equal(got[0][..., R:], q[..., R:])


@pytest.mark.parametrize("module, D, R", [("glm", 16, 8), ("glm", 16, 16), ("helium", 8, 8)])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_float64_interleaved_equals_hugging_face_glm_and_helium(module, D, R, unsqueeze_dim):
    # GLM (partial) and Helium (full width) rewrite their tables first, cos[..., :R/2] repeat-interleaved; the op
    # takes cos and sin per feature, so it is called with the rewritten tables.
    import importlib

    hf = importlib.import_module(f"transformers.models.{module}.modeling_{module}").apply_rotary_pos_emb
    B, T, HQ, HK = 2, 5, 4, 2
    q, k = projections(B, T, HQ, HK, D, torch.float64, DEVICE)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = randn(B, T, R, dtype=torch.float64, device=DEVICE), randn(B, T, R, dtype=torch.float64, device=DEVICE)
    ci, si = (t[..., : R // 2].repeat_interleave(2, -1) for t in (cos, sin))
    got, want = _hf_both(lambda a, b: apply_rotary_pos_emb(a, b, ci, si, unsqueeze_dim, interleaved=True),
                         lambda a, b: hf(a, b, cos, sin, unsqueeze_dim), q, k)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)


def test_float64_interleaved_equals_gpt_j():
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj

    B, T, H, D = 2, 5, 3, 8
    x = randn(B, T, H, D, dtype=torch.float64, device=DEVICE)
    sin, cos = randn(B, T, D // 2, dtype=torch.float64, device=DEVICE), randn(B, T, D // 2, dtype=torch.float64, device=DEVICE)
    ci, si = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    got, _ = apply_rotary_pos_emb(x, x, ci, si, 2, interleaved=True)
    torch.testing.assert_close(got, gptj(x, sin, cos), rtol=1e-14, atol=1e-14)


def test_interleaved_and_rotate_half_differ():
    # The two conventions are different maps: a kernel that ignored the flag would fail the kit's interleaved
    # samples, and this shows those samples can tell them apart.
    q, k = projections(1, 3, 2, 2, 8, torch.float64, DEVICE)
    cos, sin = randn(1, 3, 8, dtype=torch.float64, device=DEVICE), randn(1, 3, 8, dtype=torch.float64, device=DEVICE)
    a = apply_rotary_pos_emb(q, k, cos, sin)
    b = apply_rotary_pos_emb(q, k, cos, sin, interleaved=True)
    assert (a[0] - b[0]).abs().max() > 0.1


def test_interleaved_backward_by_hand():
    # Pairs (0, 1), (2, 3) of D = 4 (rotate_half would pair 0 with 2): x = [1, 0, 0, 0] gives
    # y = [x0 c0 - x1 s0, x1 c1 + x0 s1, ...] = [c0, s1, 0, 0]; dy = [0, 1, 0, 0] gives
    # dx = [dy0 c0 + dy1 s1, dy1 c1 - dy0 s0, ...] = [s1, c1, 0, 0].
    q = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64, device=DEVICE).view(1, 1, 1, 4).requires_grad_()
    k = torch.zeros(1, 1, 1, 4, dtype=torch.float64, device=DEVICE, requires_grad=True)
    cos = torch.tensor([[[0.3, 0.5, 0.2, 0.9]]], dtype=torch.float64, device=DEVICE)
    sin = torch.tensor([[[0.7, 0.11, 0.13, 0.17]]], dtype=torch.float64, device=DEVICE)
    qe, _ = apply_rotary_pos_emb(q, k, cos, sin, interleaved=True)
    assert qe.flatten().tolist() == [0.3, 0.11, 0.0, 0.0]
    qe.backward(torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64, device=DEVICE).view(1, 1, 1, 4))
    assert q.grad.flatten().tolist() == [0.11, 0.5, 0.0, 0.0]


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
def test_transposed_projections_are_read_in_place_and_layouts_kept(kernel_spy):
    spy = kernel_spy(rope_launch._kernel)
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


def test_one_launch_for_q_and_k(kernel_spy):
    spy = kernel_spy(rope_launch._kernel)
    q, k = projections(1, 4, 4, 2, 8, torch.float32, DEVICE)
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
    qe, ke = apply_rotary_pos_emb(qr, kr, *tables(1, 4, 8, torch.float32, DEVICE))
    (qe.sum() + ke.sum()).backward()
    assert len(spy.ptrs) == 2  # one forward launch, one backward launch


def test_a_kept_launch_serves_only_calls_that_differ_in_data_alone():
    # Launches are kept per shapes, strides, dtypes and flags (launch._LAUNCHES). Each variant differs from
    # the base in one of those; run in turn, each must still equal the float64 reference, which a
    # launch kept for another variant would not give.
    def base(**o):
        q, k = projections(2, 4, 4, 2, 8, torch.float32, DEVICE)
        cos, sin = randn(2, 4, 8, dtype=torch.float32, device=DEVICE), randn(2, 4, 8, dtype=torch.float32, device=DEVICE)
        return dict(q=q, k=k, cos=cos, sin=sin, unsqueeze_dim=1, interleaved=False) | o

    def one(name, value):
        a = base()
        return a | {name: value(a[name])}

    def tokens():
        q, k = projections(2, 6, 4, 2, 8, torch.float32, DEVICE)
        return base(q=q, k=k, cos=randn(2, 6, 8, dtype=torch.float32, device=DEVICE),
                    sin=randn(2, 6, 8, dtype=torch.float32, device=DEVICE))

    def partial():
        return base(cos=randn(2, 4, 4, dtype=torch.float32, device=DEVICE), sin=randn(2, 4, 4, dtype=torch.float32, device=DEVICE))

    def as_bthd():
        a = base()
        return a | dict(q=a["q"].transpose(1, 2), k=a["k"].transpose(1, 2), unsqueeze_dim=2)

    strided = lambda t: torch.cat([t, t], -1)[..., ::2]  # noqa: E731 (equal values, feature stride 2)
    variants = [
        base, tokens, partial, as_bthd, lambda: base(interleaved=True),
        lambda: one("q", torch.Tensor.contiguous), lambda: one("k", torch.Tensor.contiguous),  # strides of one
        lambda: one("q", lambda q: torch.cat([q, q], 1)),  # q's heads alone
        lambda: base(cos=randn(1, 4, 8, dtype=torch.float32, device=DEVICE),  # batch stride 0
                     sin=randn(1, 4, 8, dtype=torch.float32, device=DEVICE)),
        lambda: base(q=projections(3, 4, 4, 2, 8, torch.float32, DEVICE)[0],  # the batch alone (strides equal)
                     k=projections(3, 4, 4, 2, 8, torch.float32, DEVICE)[1],
                     cos=randn(1, 4, 8, dtype=torch.float32, device=DEVICE), sin=randn(1, 4, 8, dtype=torch.float32, device=DEVICE)),
        lambda: base(q=randn(2, 4, 4, 8, dtype=torch.float32, device=DEVICE),  # 4 heads of 4 tokens as [B, H, T, D] ...
                     k=randn(2, 4, 4, 8, dtype=torch.float32, device=DEVICE)),
        lambda: base(q=randn(2, 4, 4, 8, dtype=torch.float32, device=DEVICE),  # ... and as [B, T, H, D]
                     k=randn(2, 4, 4, 8, dtype=torch.float32, device=DEVICE), unsqueeze_dim=2),
        lambda: one("cos", strided), lambda: one("sin", strided),
        lambda: one("q", torch.Tensor.double), lambda: one("cos", torch.Tensor.double),
    ]
    for make in variants:
        for need_q in (True, False):
            a = make()
            q, k = a["q"].detach().requires_grad_(need_q), a["k"].detach().requires_grad_()
            got = apply_rotary_pos_emb(q, k, a["cos"], a["sin"], a["unsqueeze_dim"], interleaved=a["interleaved"])
            dq_e, dk_e = torch.randn_like(got[0]), torch.randn_like(got[1])
            torch.autograd.backward(got, (dq_e, dk_e))
            q64, k64 = (t.detach().double().requires_grad_() for t in (a["q"], a["k"]))
            want = apply_rotary_pos_emb_reference(q64, k64, a["cos"].double(), a["sin"].double(),
                                                  a["unsqueeze_dim"], interleaved=a["interleaved"])
            torch.autograd.backward(want, (dq_e.double(), dk_e.double()))
            for g, w in [*zip(got, want), (k.grad, k64.grad)] + ([(q.grad, q64.grad)] if need_q else []):
                torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


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


@pytest.mark.parametrize("interleaved_", [False, True])
@pytest.mark.parametrize("R", [16, 8])
def test_out_dtype_rounds_once_from_float32_tables(interleaved_, R):
    # Olmo2's apply_rotary_pos_emb: bfloat16 q and k times float32 tables, computed in float32 and cast back to
    # q's dtype. out_dtype=q.dtype is that: the float64 reference rounded once to bfloat16, forward and backward.
    q, k = projections(2, 5, 4, 2, 16, torch.bfloat16, DEVICE)
    cos, sin = randn(1, 5, R, dtype=torch.float32, device=DEVICE), randn(1, 5, R, dtype=torch.float32, device=DEVICE)
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
    qe, ke = apply_rotary_pos_emb(qr, kr, cos, sin, interleaved=interleaved_, out_dtype=torch.bfloat16)
    assert qe.dtype == ke.dtype == torch.bfloat16 and qe.stride() == q.stride() and ke.stride() == k.stride()
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    want = apply_rotary_pos_emb_reference(q64, k64, cos.double(), sin.double(), interleaved=interleaved_)
    gq, gk = randn(*q.shape, dtype=torch.bfloat16, device=DEVICE), randn(*k.shape, dtype=torch.bfloat16, device=DEVICE)
    (qe.float() * gq.float()).sum().add((ke.float() * gk.float()).sum()).backward()
    (want[0] * gq.double()).sum().add((want[1] * gk.double()).sum()).backward()
    # one rounding to bfloat16 (half an ulp, 2**-9 relative) of the float32 result, at most one more ulp apart
    for got, ref in ((qe, want[0]), (ke, want[1]), (qr.grad, q64.grad), (kr.grad, k64.grad)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), ref.detach(), rtol=2 ** -8, atol=2 ** -8 * ref.abs().max().item())
    # and the same bits as the promoted (float32) op rounded to bfloat16, wherever that rounding is not a tie
    qf, kf = apply_rotary_pos_emb(q, k, cos, sin, interleaved=interleaved_)
    assert qf.dtype == torch.float32
    assert (qf.to(torch.bfloat16) != qe.detach()).float().mean() < 0.01


def test_out_dtype_must_be_floating():
    q, k = projections(1, 3, 4, 2, 8, torch.bfloat16, DEVICE)
    cos, sin = tables(1, 3, 8, torch.float32, DEVICE)
    with pytest.raises(TypeError, match=r"out_dtype must be None or one of .*torch.int32.*q \(1, 4, 3, 8\)"):
        apply_rotary_pos_emb(q, k, cos, sin, out_dtype=torch.int32)


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
    ("D = R odd", lambda a: a.__setitem__(slice(0, 4), [*_args(Dh=15)[:2], a[2][..., :15], a[3][..., :15]]),
     ValueError, ["must be even", "R = 15", "q (2, 8, 5, 15)"]),
    ("cos and sin differ", lambda a: a.__setitem__(3, a[3][:1]), ValueError, ["cos (2, 5, 16)", "sin (1, 5, 16)"]),
    ("cos's T differs", lambda a: a.__setitem__(slice(2, 4), [a[2][:, :4], a[3][:, :4]]), ValueError,
     ["[2, 5, 16] or [1, 5, 16]", "(2, 4, 16)"]),
    ("cos's batch", lambda a: a.__setitem__(slice(2, 4), [a[2][:1].expand(3, 5, 16)] * 2), ValueError,
     ["(3, 5, 16)"]),
    ("cos 2-D", lambda a: a.__setitem__(slice(2, 4), [a[2][0], a[3][0]]), ValueError, ["(5, 16)"]),
    ("R > D", lambda a: a.__setitem__(slice(2, 4), [torch.randn(2, 5, 18, device=DEVICE)] * 2), ValueError,
     ["R = 18", "head dim D = 16", "(2, 5, 18)", "q (2, 8, 5, 16)"]),
    ("R odd", lambda a: a.__setitem__(slice(2, 4), [a[2][..., :7], a[3][..., :7]]), ValueError,
     ["must be even", "R = 7", "cos (2, 5, 7)", "q (2, 8, 5, 16)"]),
    ("R empty", lambda a: a.__setitem__(slice(2, 4), [a[2][..., :0], a[3][..., :0]]), ValueError,
     ["at least 2", "R = 0", "cos (2, 5, 0)"]),
    ("R of cos and sin differ", lambda a: a.__setitem__(3, a[3][..., :8]), ValueError,
     ["cos (2, 5, 16)", "sin (2, 5, 8)", "rotary widths R differ"]),
    ("interleaved not a bool", lambda a: a.extend([1, 1]), TypeError, ["interleaved must be a bool", "1"]),
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


@pytest.mark.parametrize("dim", [0, 3, -1, -4, 4, -5, True, 1.0, None])
def test_bad_unsqueeze_dim(dim):
    with pytest.raises(ValueError, match="unsqueeze_dim must be 1") as info:
        apply_rotary_pos_emb(*_args(), dim)
    for w in (f"got {dim!r}", "q (2, 8, 5, 16)", "k (2, 2, 5, 16)", "cos (2, 5, 16)"):
        assert w in str(info.value), str(info.value)


# ---------------------------------------------------------------- unsqueeze_dim as torch.unsqueeze reads it
@pytest.mark.parametrize("negative, positive", [(-3, 1), (-2, 2)])
def test_negative_unsqueeze_dim_is_cos_unsqueeze(negative, positive):
    # -3 and -2 name dims 1 and 2 of the 4-D cos.unsqueeze(unsqueeze_dim), as in Hugging Face's code.
    q, k = projections(2, 5, 4, 2, 8, torch.float64, DEVICE)
    if positive == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = randn(2, 5, 8, dtype=torch.float64, device=DEVICE), randn(2, 5, 8, dtype=torch.float64, device=DEVICE)
    got, want = _hf_both(lambda a, b: apply_rotary_pos_emb(a, b, cos, sin, negative),
                         lambda a, b: hf_apply(a, b, cos, sin, negative), q, k)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)
    for a, b in zip(got[:2], apply_rotary_pos_emb(q, k, cos, sin, positive)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("interleaved_", [False, True])
def test_unsqueeze_dim_minus_2_with_as_many_heads_as_tokens(interleaved_):
    # Regression: -2 was taken as 1 (-2 % 3). With T == H the shapes still broadcast, so that read q [B, T, H, D]
    # as [B, H, T, D]: each head rotated by the table row of its head index, a silent wrong answer.
    B, T, H, D = 2, 4, 4, 8
    q, k = randn(B, T, H, D, dtype=torch.float64, device=DEVICE), randn(B, T, H, D, dtype=torch.float64, device=DEVICE)
    cos, sin = randn(B, T, D, dtype=torch.float64, device=DEVICE), randn(B, T, D, dtype=torch.float64, device=DEVICE)
    want = hf_apply(q, k, cos, sin, -2, interleaved_)
    old = hf_apply(q, k, cos, sin, 1, interleaved_)  # what the old mapping computed
    assert (want[0] - old[0]).abs().max() > 0.1  # the test tells the two apart
    got = apply_rotary_pos_emb(q, k, cos, sin, -2, interleaved=interleaved_)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------- upstream gradients of any layout
def _upstream(shape, kind, dtype):
    """An upstream gradient of ``shape`` stored as ``kind``."""
    if kind == "contiguous":
        return randn(*shape, dtype=dtype, device=DEVICE)
    if kind == "expanded":  # stride 0 everywhere, as y.sum().backward() gives
        return randn(dtype=dtype, device=DEVICE).expand(shape)
    if kind == "expanded-heads":  # one row broadcast over the heads and tokens
        return randn(shape[0], 1, 1, shape[3], dtype=dtype, device=DEVICE).expand(shape)
    if kind == "transposed":  # memory [D, T, H, B]
        return randn(*shape[::-1], dtype=dtype, device=DEVICE).permute(3, 2, 1, 0)
    if kind == "permuted":  # memory [H, D, B, T]: no two dims in order, D not the fastest
        return randn(shape[2], shape[3], shape[0], shape[1], dtype=dtype, device=DEVICE).permute(2, 3, 0, 1)
    if kind == "strided":  # every other element of a wider buffer
        return randn(*shape[:3], 2 * shape[3], dtype=dtype, device=DEVICE)[..., ::2]
    raise ValueError(kind)


MODES = [  # (D, R, interleaved)
    (16, 16, False), (16, 8, False), (16, 6, True), (8, 8, True)]
UPSTREAM = ["expanded", "expanded-heads", "transposed", "permuted", "strided"]


@pytest.mark.parametrize("D, R, interleaved_", MODES, ids=[f"D{m[0]}-R{m[1]}-{'pairs' if m[2] else 'half'}" for m in MODES])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("kind", UPSTREAM)
def test_upstream_gradients_of_any_layout(D, R, interleaved_, unsqueeze_dim, kind):
    B, T, HQ, HK = 2, 3, 4, 2
    q, k = projections(B, T, HQ, HK, D, torch.float32, DEVICE)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = randn(B, T, R, dtype=torch.float32, device=DEVICE), randn(B, T, R, dtype=torch.float32, device=DEVICE)
    gq, gk = _upstream(q.shape, kind, torch.float32), _upstream(k.shape, kind, torch.float32)
    before = [t.clone() for t in (gq, gk)]
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
    torch.autograd.backward(apply_rotary_pos_emb(qr, kr, cos, sin, unsqueeze_dim, interleaved=interleaved_), [gq, gk])
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    want = apply_rotary_pos_emb_reference(q64, k64, cos.double(), sin.double(), unsqueeze_dim, interleaved=interleaved_)
    torch.autograd.backward(want, [gq.double(), gk.double()])
    torch.testing.assert_close(qr.grad, q64.grad.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kr.grad, k64.grad.float(), rtol=1e-5, atol=1e-5)
    for a, b in zip(before, (gq, gk)):
        assert torch.equal(a, b)  # the caller's gradients are read, not written


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("D, R, interleaved_", [(16, 8, False), (16, 6, True)], ids=["partial-half", "partial-pairs"])
def test_compiled_backward_with_permuted_and_expanded_upstream_gradients(D, R, interleaved_, dynamic):
    # torch.compile (aot_eager on CPU) traces the backward with fake tensors: q_embed's gradient is a permuted
    # tensor (the loss multiplies by one), k_embed's an expanded one (a sum). Eager and the reference agree.
    B, T, HQ, HK = 2, 3, 4, 2
    q, k = projections(B, T, HQ, HK, D, torch.float32, DEVICE)
    cos, sin = randn(1, T, R, dtype=torch.float32, device=DEVICE), randn(1, T, R, dtype=torch.float32, device=DEVICE)
    w = _upstream(q.shape, "permuted", torch.float32)

    def loss(f, q, k):
        qe, ke = f(q, k, cos, sin, 1, interleaved=interleaved_)
        return (qe * w).sum() + ke.sum()

    def grads(fn):
        qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
        fn(qr, kr).backward()
        return qr.grad, kr.grad

    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: loss(apply_rotary_pos_emb, a, b), backend="aot_eager", fullgraph=True,
                             dynamic=dynamic)
    got = grads(compiled)
    eager = grads(lambda a, b: loss(apply_rotary_pos_emb, a, b))
    ref = grads(lambda a, b: loss(apply_rotary_pos_emb_reference, a.double(), b.double()))
    for g, e, r in zip(got, eager, ref):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g, r.float(), rtol=1e-5, atol=1e-5)

    # The same with the permuted gradient passed in from outside the compiled forward.
    torch._dynamo.reset()
    fwd = torch.compile(apply_rotary_pos_emb, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
    gk = _upstream(k.shape, "permuted", torch.float32)
    torch.autograd.backward(fwd(qr, kr, cos, sin, 1, interleaved=interleaved_), [w, gk])
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    torch.autograd.backward(apply_rotary_pos_emb_reference(q64, k64, cos.double(), sin.double(), 1,
                                                           interleaved=interleaved_), [w.double(), gk.double()])
    torch.testing.assert_close(qr.grad, q64.grad.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kr.grad, k64.grad.float(), rtol=1e-5, atol=1e-5)


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


def test_out_dtype_compiled_and_exported():
    # The schema's optional dtype: traced (aot_eager traces the backward too) and exported as eager computes.
    q, k = (x.detach().requires_grad_() for x in projections(2, 5, 4, 2, 16, torch.bfloat16, DEVICE))
    cos, sin = randn(1, 5, 16, dtype=torch.float32, device=DEVICE), randn(1, 5, 16, dtype=torch.float32, device=DEVICE)

    def loss(q, k):
        qe, ke = apply_rotary_pos_emb(q, k, cos, sin, out_dtype=torch.bfloat16)
        assert qe.dtype == ke.dtype == torch.bfloat16
        return (qe.float() * torch.arange(16, device=DEVICE)).sum() + (ke.float() ** 2).sum()

    eager = loss(q, k)
    want = torch.autograd.grad(eager, (q, k))
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)(q, k)
    assert torch.equal(compiled, eager)
    for a, b in zip(torch.autograd.grad(compiled, (q, k)), want):
        assert torch.equal(a, b)

    class Attn(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            return apply_rotary_pos_emb(q, k, cos, sin, out_dtype=torch.bfloat16)

    ep = torch.export.export(Attn(), (q.detach(), k.detach(), cos, sin))
    for a, b in zip(ep.module()(q.detach(), k.detach(), cos, sin), apply_rotary_pos_emb(q, k, cos, sin,
                                                                                          out_dtype=torch.bfloat16)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.detach())


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
def test_kernels_compile_for_sm90_with_vector_access(sm90_cases):
    script = os.path.join(os.path.dirname(__file__), "sm90_compile_llm_ops.py")
    out = run_without_interpreter([script, "rope", *sm90_cases], timeout=900)
    assert out.returncode == 0 and " 0 failures" in out.stdout, (out.stdout + out.stderr)[-4000:]

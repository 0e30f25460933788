"""The family matrix (``tritongrad models``, :mod:`tritongrad.zoo`) in CI.

- ``test_every_family_eager``: every causal-LM family of the installed transformers, eager, loss and
  gradients (all the training checks in the extended tier), in subprocesses where the ops take their PyTorch
  references on the CPU (no interpreter): it checks what ``patch`` puts in each family's place, for all. No
  family may be ``wrong``; the families listed in ``EXACT``, and those the committed record calls exact, must
  stay ``exact``, and every op the record replaces in a family must still be replaced there. The other checks
  (generation, padding, position ids) run with ``tritongrad models``.
- ``test_family_with_kernels``: families that reach every patched code path (q/k norms, GeGLU, logit scales
  and soft caps, partial and interleaved rotary, router logits), eager and compiled (``aot_eager``, which
  traces the backward with fake tensors), with the kernels in Triton's interpreter: the training checks
  (loss, gradients, logits, checkpointing, a second backward), which exercise the kernels. The quick tier
  runs two of them compiled (tests/conftest.py EXTENDED).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE, GC_THRESHOLDS

from tritongrad import _hf, zoo

pytest.importorskip("transformers")

# Families that must stay exact in eager mode: these, and every family exact in the committed record of the
# installed transformers (benchmarks/results/zoo-cpu-*-transformers-<major.minor>.json, else the newest record of
# an older minor version), so that a family the record calls exact cannot fall to an error unnoticed.
EXACT = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite", "cohere",
         "cohere2", "gpt_neox", "phi3", "glm", "mixtral", "qwen3_moe", "stablelm", "helium",
         # built from zoo.FAMILY_CONFIG entries: MLA, GPT-J rotary, DBRX sub-configs, hybrid linear attention
         "deepseek_v3", "gptj", "dbrx", "qwen3_5", "gemma4_text", "bamba", "granitemoehybrid")


def _version(text: str) -> tuple:
    return tuple(int(p) for p in text.split(".")[:2])


def _record() -> dict:
    """The committed record for the installed transformers' minor version, else for the newest older minor
    version that has one (a new release must keep what the last one had): family -> row; empty without one."""
    import glob
    import re

    import transformers

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    installed = _version(transformers.__version__)
    found = {}
    for path in glob.glob(os.path.join(root, "benchmarks", "results", "zoo-cpu-*-transformers-*.json")):
        v = _version(re.search(r"transformers-(\d+\.\d+)\.json$", path).group(1))
        if v <= installed:
            found[v] = path
    if not found:
        return {}
    with open(found[max(found)]) as f:
        return {r["family"]: r for r in json.load(f)}


def _behind() -> bool:
    """Whether the installed transformers is older than the newest committed record's: zoo.FAMILY_CONFIG is
    written for that one, and an older release may reject a family's values (Qwen4-exp's layer types), which
    the matrix then reports as that family's error."""
    import glob
    import re

    import transformers

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    recorded = [_version(re.search(r"transformers-(\d+\.\d+)\.json$", p).group(1))
                for p in glob.glob(os.path.join(root, "benchmarks", "results", "zoo-cpu-*-transformers-*.json"))]
    return bool(recorded) and _version(transformers.__version__) < max(recorded)


def _replaced(ops: dict) -> set:
    return {op for op, what in ops.items() if what.startswith("replaced")}


# Each reaches a code path of the patch the others do not.
KERNEL_FAMILIES = {
    "llama": "RMSNorm, SwiGLU, rope, the linear loss",
    "qwen3": "per-head q/k norms, whose backward gets transposed gradients when compiled",
    "gemma3_text": "Gemma's (1 + w) norms, GeGLU (tanh)",
    "gemma2": "final logit soft cap",
    "granite": "logits / logits_scaling",
    "cohere": "logits * logit_scale, interleaved rotary over the whole head, LayerNorm",
    "gpt_neox": "partial rotary (rotary_pct 0.25)",
    "glm": "GLM's interleaved partial rotary",
    "gemma4_unified_text": "ill-conditioned: compiled, its float32 gradients land 2.3x the unpatched model's error "
                           "from float64, and the patched model run in float64 decides (zoo._earned)",
    "mixtral": "router logits (the aux loss keeps the original forward); the experts through grouped_experts",
}
# The checks of TRAINING_CHECKS a kernel family's unpatched model fails, so that they run on neither model.
KERNEL_UNCHECKED = {
    "mixtral": {zoo.FUNC_JVP},  # transformers' experts' grouped product has no forward-mode AD
}


# Families whose patched outputs keep another layout than Hugging Face's code with the kernels, and why.
KERNEL_LAYOUTS = {
    "inkling_text": "its k_norm gets the features strided (heads innermost), which no [rows, features] launch reads "
                    "in place: the norm copies them into rows, and its output is contiguous",
}


def _run_matrix(names=None, modes=("eager",), only=None, kernels=False, with_variants=False):
    code = (
        "import json, sys, warnings; warnings.filterwarnings('ignore');"
        "import transformers; transformers.logging.set_verbosity_error();"
        "from tritongrad import zoo;"
        # as the test processes do after collection (tests/conftest.py)
        f"import gc; gc.collect(); gc.freeze(); gc.set_threshold(*{GC_THRESHOLDS!r});"
        f"print(json.dumps(zoo.run({names!r}, {modes!r}, only={only!r}, with_variants={with_variants!r})))"
    )
    # Off the GPU: the PyTorch path, or with ``kernels`` Triton's kernels in the interpreter.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if kernels and not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# The families in one subprocess: each subprocess spends seconds importing torch and transformers, more than
# splitting the families over the workers saves (docs/measuring.md#the-test-suite).
CHUNKS = 1


# The quick tier: loss and every gradient, what patch substitutes into each family, also with two sequences
# packed in a row, the loss with a hook on every module (a module call that a patched path bypasses must still
# count: docs/models.md#module-calls), the loss over Trainer's num_items_in_batch, the gradients through
# torch.func.grad and a derivative through torch.func.jvp (a patched path must run under the transforms), and
# a bfloat16 copy's step against the float64 model (the family's own casts: docs/models.md#the-family-matrix);
# the extended tier adds logits, gradient checkpointing, a second backward and bfloat16 autocast (the kernel
# families check those in the quick tier).
CHECKS = [pytest.param(("loss", "grads", *zoo.PACKED, "loss, module hooks", "loss, num_items_in_batch",
                        zoo.FUNC_GRAD, zoo.FUNC_JVP, zoo.BFLOAT16), id="quick-checks"),
          pytest.param(zoo.TRAINING_CHECKS, id="training", marks=pytest.mark.extended)]


@pytest.mark.slow
@pytest.mark.parametrize("checks", CHECKS)
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_every_family_eager(chunk, checks):
    names = zoo.families()[chunk::CHUNKS]
    rows = _run_matrix(names, only=checks)
    assert [r["family"] for r in rows] == names  # none left out
    wrong = {r["family"]: r["eager"] for r in rows if r["eager"].startswith("wrong")}
    assert not wrong, wrong
    eager = {r["family"]: r["eager"] for r in rows}
    # Every output keeps its layout on the CPU path; on a GPU the kernels run, with the listed exceptions.
    moved = {f for f, r in eager.items() if "layout:" in r}
    expected = set(KERNEL_LAYOUTS) & set(eager) if torch.cuda.is_available() else set()
    assert moved == expected, {f: eager[f] for f in moved ^ expected}
    record = _record()
    exact = {f for f, r in record.items() if r["eager"].startswith("exact")}
    lost = {f: eager[f] for f in set(EXACT) | exact if f in eager and eager[f].split(":")[0] != "exact"}
    assert not lost, lost
    # A check the record ran stays run: one the unpatched model now fails (a check that leaves the model
    # changed, a new release) is noted as not checked under a verdict that stays exact.
    unchecked = {f: zoo.not_checked(eager[f]) & set(checks) - zoo.not_checked(record[f]["eager"])
                 for f in eager if f in record}
    unchecked = {f: names for f, names in unchecked.items() if names}
    assert not unchecked, unchecked
    # Calls of a replaced function run tritongrad's op wherever the record's did: a call handed back to the
    # original (the values right, the speed lost: Olmo2's float32 rotary tables) is a note the record lacks.
    kept = {f: eager[f] for f in eager if f in record and zoo.KEPT_NOTE in eager[f]
            and zoo.KEPT_NOTE not in record[f]["eager"]}
    assert not kept, kept
    # What the record replaces stays replaced: an op left alone where it was established (a new release that
    # wraps a function the patch then no longer recognises) is a regression the verdicts alone do not show.
    now = {r["family"]: r["ops"] for r in rows}
    dropped = {f: {op: now[f].get(op, "not reported") for op in _replaced(record[f]["ops"]) - _replaced(now[f])}
               for f in now if f in record}
    dropped = {f: ops for f, ops in dropped.items() if ops}
    assert not dropped, dropped


# Variants each of these families must have (zoo.VARIANTS): a config value the family's checks reach only there.
VARIANT_COVERAGE = {
    "llama": {"gelu", "gelu-tanh", "relu", "mlp-bias", "attention-bias", "tied", "head-dim", "rms-eps"},
    "phi3": {"partial-rotary", "full-rotary"},
    "gpt_neox": {"full-rotary", "serial-residual"},
    "gemma2": {"gemma-gelu", "softcap", "no-softcap"},
    "granite": {"logits-scaling", "multipliers"},
    "cohere": {"logit-scale", "qk-norm"},
    "stablelm": {"qk-layernorm", "parallel-residual"},
    "qwen3_moe": {"norm-topk"},
}


@pytest.mark.slow
def test_config_variants():
    # The families that must stay exact, each also with every config variant that applies: the activation
    # (GeGLU exact or tanh, or left alone), biases, a tied head, wider heads, an eps, rotary width, logit scales
    # and caps, residual forms. A variant is exact, or the unpatched model cannot train with it (the family's
    # own limit); never wrong.
    rows = _run_matrix(list(EXACT), only=("loss", "grads", *zoo.PACKED), with_variants=True)
    ran = {}
    for r in rows:
        ran.setdefault(r["family"], set()).add(r.get("variant"))
    missing = {f: want - ran.get(f, set()) for f, want in VARIANT_COVERAGE.items() if want - ran.get(f, set())}
    assert not missing, missing
    bad = {(r["family"], r.get("variant")): r["eager"] for r in rows
           if not r["eager"].startswith("exact")
           and not (r.get("variant") and r["eager"].startswith("error: the unpatched model fails"))}
    assert not bad, bad


def test_family_config_values_are_taken():
    # Every value zoo.FAMILY_CONFIG gives a family is in its tiny config (an attribute, its text config's or a
    # rope_parameters entry): a value the config drops silently would leave the case it is there for unchecked
    # (Phi3's partial rotary once ran full width).
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names

    # Values the config stores under its own spelling.
    respelled = {"layers_block_type": {"mamba": "linear_attention"}, "layer_types": {"mamba": "linear_attention",
                                                                                    "attention": "full_attention"}}
    lost, rejected = {}, {}
    for family, own in zoo.FAMILY_CONFIG.items():
        if family not in names:
            continue
        try:
            config = zoo._tiny_config(family, getattr(transformers, names[family]))
        except Exception as e:  # noqa: BLE001 - allowed on an older transformers only (_behind)
            rejected[family] = repr(e)[:200]
            continue
        flat = {k: v for k, v in own.items() if not isinstance(v, dict)}
        got = zoo._config_values(config, flat)
        for k, v in flat.items():
            if isinstance(v, (list, tuple)):
                v = [respelled.get(k, {}).get(x, x) if isinstance(x, str) else x for x in v]
                g = list(got[k]) if isinstance(got.get(k), (list, tuple)) else got.get(k, "absent")
            else:
                g = got.get(k, "absent")
            if g != v:
                lost[(family, k)] = (v, g)
    assert not lost, lost
    assert _behind() or not rejected, rejected


def test_every_family_has_every_layer_kind():
    # The tiny model has every kind of layer the family's config builds at its default depth: cut to two
    # layers, Gemma 3 had only sliding-window layers, Llama 4 only rope layers, and the matrix checked neither's
    # other kind (zoo.LAYERS gives such a family the depth it needs). Only the families the matrix cannot build
    # (zoo.FAMILY_NOTE) may fail to build here, and on an older transformers those whose values it rejects.
    missing, unbuilt = {}, set()
    for family in zoo.families():
        try:
            kinds = zoo.missing_layer_kinds(family)
        except Exception:  # noqa: BLE001 - only the families the matrix calls unbuildable
            unbuilt.add(family)
            continue
        if kinds:
            missing[family] = [sorted(f"{name}{dict(attrs)}" for name, _, attrs in kind if attrs) for kind in kinds]
    assert not missing, missing
    assert _behind() or unbuilt <= set(zoo.FAMILY_NOTE), unbuilt - set(zoo.FAMILY_NOTE)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("family", KERNEL_FAMILIES)
def test_family_with_kernels(family, mode):
    if mode == "compiled":
        pytest.importorskip("torch._dynamo")
    v = zoo.check(family, mode, only=zoo.TRAINING_CHECKS)
    assert v.status == "exact", f"{family} ({KERNEL_FAMILIES[family]}), {mode}: {v.line()}\n{v.ops}"
    # every call of a replaced function runs tritongrad's op, also with float32 tables in the bfloat16 steps
    assert zoo.KEPT_NOTE not in v.detail, v.line()
    # every check runs but those the unpatched model fails, listed (none left unchecked under the exact verdict)
    assert zoo.not_checked(v.detail) == (KERNEL_UNCHECKED.get(family, set()) if mode == "eager" else set()), v.line()
    # Eager, every module's output keeps the unpatched model's layout: a kernel's output laid out otherwise
    # made the next ops copy it (Gemma 3's q_norm and o_proj), which the values do not show.
    assert "layout:" not in v.detail, v.line()


@pytest.mark.extended
def test_every_family_with_the_kernels():
    # The matrix with Triton's kernels on every family (the interpreter off the GPU), loss and every gradient:
    # the quick tier's matrix takes the PyTorch path, and the kernel families above are nine. Every family the
    # record holds exact stays exact; none is wrong; only the families listed lay an output out otherwise.
    rows = _run_matrix(zoo.families(), only=("loss", "grads"), kernels=True)
    eager = {r["family"]: r["eager"] for r in rows}
    wrong = {f: v for f, v in eager.items() if v.startswith("wrong")}
    assert not wrong, wrong
    record = _record()
    lost = {f: eager[f] for f, r in record.items() if r["eager"].startswith("exact") and f in eager
            and not eager[f].startswith("exact")}
    assert not lost, lost
    moved = {f for f, v in eager.items() if "layout:" in v}
    assert moved == set(KERNEL_LAYOUTS) & set(eager), {f: eager[f] for f in moved ^ set(KERNEL_LAYOUTS)}


def test_a_tiny_model_without_the_familys_attention_is_an_error(monkeypatch):
    # Qwen3-Next's default layers start with three linear-attention layers: a 2-layer model of them has no
    # attention, so its rope and q/k norms would go unchecked while the verdict said exact.
    monkeypatch.delitem(zoo.FAMILY_CONFIG, "qwen3_next")
    v = zoo.check("qwen3_next", "eager", device="cpu", only=zoo.TRAINING_CHECKS)
    assert v.status == "error" and "Qwen3NextAttention" in v.detail and "FAMILY_CONFIG" in v.detail, v.line()
    monkeypatch.undo()
    assert zoo.unbuilt(zoo.build("qwen3_next")) == []
    # Beam's first default layers are dense: its experts too must be built (Beam came with transformers 5.25;
    # zoo.LAYERS gives it the depth that reaches them).
    if "beam" in zoo.families():
        monkeypatch.delitem(zoo.LAYERS, "beam")
        assert zoo.unbuilt(zoo.build("beam")) == ["BeamExperts"]


def test_grouped_rms_norm_is_left_alone():
    """An RMSNorm instance whose plain attributes change its math (a group_size that normalises groups of
    features, not the row) is probed as that instance, not as its class's default: left alone, with the
    reason, where patching by class would have been silently wrong."""
    import torch

    import tritongrad

    class GroupedRMSNorm(torch.nn.Module):
        def __init__(self, dim, group_size=None, eps=1e-6):
            super().__init__()
            self.eps, self.group_size = eps, group_size
            self.weight = torch.nn.Parameter(torch.zeros(dim))

        def forward(self, x):
            xf = x.float()
            if self.group_size is not None:
                xf = xf.reshape(*xf.shape[:-1], -1, self.group_size)
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            y = y.flatten(-2) if self.group_size is not None else y
            return (y * (1.0 + self.weight.float())).type_as(x)

    GroupedRMSNorm.__module__ = "transformers.models.qwen4_exp.modeling_qwen4_exp"
    model = torch.nn.Sequential(GroupedRMSNorm(64), GroupedRMSNorm(64, group_size=16))
    report = tritongrad.patch(model)
    assert report.targets("rms_norm") == ["0"]
    assert [e.target for e in report.skipped if e.op == "rms_norm"] == ["1"]
    x = torch.randn(3, 64)
    with torch.no_grad():
        model[1].weight.normal_()
        want = GroupedRMSNorm.forward(model[1], x)
    torch.testing.assert_close(model[1](x), want, rtol=0, atol=0)


def test_clipped_gated_mlp_is_probed_as_the_instance():
    """A gated MLP whose plain attribute changes its math (BailingHybrid's shared experts clip gate and up at a
    per-layer ``limit``, None where it is off) is probed as that instance: replaced where the limit is off,
    left alone with the reason where it is on, where probing by class alone either fails on the attribute or,
    with a class-level default, would have been silently wrong."""
    import torch

    import tritongrad

    from conftest import clipped_mlp_class

    ClippedMLP = clipped_mlp_class("transformers.models.qwen4_exp.modeling_qwen4_exp")
    model = torch.nn.Sequential(ClippedMLP(), ClippedMLP(limit=0.05))
    x = torch.randn(3, 16)
    with torch.no_grad():
        want = [ClippedMLP.forward(m, x) for m in model]
    report = tritongrad.patch(model, rms_norm=False, rope=False, linear_cross_entropy=False, causal_mask=False)
    assert report.targets("swiglu") == ["0"]
    assert [e.target for e in report.skipped if e.op == "swiglu"] == ["1"]
    with torch.no_grad():
        torch.testing.assert_close(model[0](x), want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model[1](x), want[1], rtol=0, atol=0)


def test_deepseek_interleaved_rotary_is_replaced_and_restored():
    """MLA families define DeepSeek's apply_rotary_pos_emb_interleave beside apply_rotary_pos_emb and call it
    where the config sets rope_interleave (DeepSeek-V3's default): both are established and replaced, each
    reported, and unpatch restores both."""
    import tritongrad
    from tritongrad import _hf

    model = zoo.build("deepseek_v3")
    mod = _hf.modeling_module("deepseek_v3")
    before = {f: vars(mod)[f] for f in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")}
    report = tritongrad.patch(model)
    try:
        assert sorted(e.target.rsplit(".", 1)[1] for e in report.replaced if e.op == "rope") == sorted(before)
        assert not [e for e in report.skipped if e.op == "rope"]
        assert all(_hf.patched_op(vars(mod)[f]) == "rope" for f in before)
    finally:
        tritongrad.unpatch(model)
    assert {f: vars(mod)[f] for f in before} == before


def _on_device(t, grad: bool = False):
    """``t`` on the device the kernels run on (the interpreter's CPU, else the GPU), as a leaf."""
    return t.to(DEVICE).requires_grad_(grad)


def _reaches(node, name: str, depth: int = 4) -> bool:
    """Whether autograd node ``node`` is ``name`` or has it among its inputs, ``depth`` nodes down at most."""
    if node is None or depth < 0:
        return False
    return type(node).__name__ == name or any(_reaches(n, name, depth - 1) for n, _ in node.next_functions)


def _deepseek_interleave_with_full_tables(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    # DeepSeek's interleaved rotary as transformers wrote it before 5.25: features reordered evens first,
    # then odds (a copy), then Llama's rotate_half with both halves of the tables.
    import torch

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


@pytest.mark.parametrize("family, kind", [("helium", "glm_full"), ("ernie4_5", "glm_full"), ("nanochat", "flipped"),
                                          ("gpt_oss", "half"), ("gemma4", "llama"), ("gptj", "gptj"),
                                          ("deepseek_v3", "deinterleave_half"), ("before 5.25", "deinterleave"),
                                          ("deepseek_v4", "trailing_pairs")])
def test_rotary_variants_are_established_and_computed_by_the_kernel(family, kind):
    """The family's own apply_rotary_pos_emb is recognised as ``kind`` on probes, and its replacement, which
    runs the rope kernel on rewritten tables, equals it: in float32, both layouts (heads before or after the
    tokens), grouped k heads; in float64 the formula, forward and backward; in bfloat16 within one ulp of the
    exact result. A
    table width the kind was not established for goes to the family's own function. Gemma 4's takes one
    tensor, q and k in two calls; GPT-J's one tensor [B, T, H, R] and per-pair tables, as (tensor, sin, cos);
    DeepSeek's interleaved one takes position_ids before unsqueeze_dim; DeepSeek-V4's rotates pairs over the
    head's last features (here half of them), one tensor at a time."""
    import torch

    from tritongrad import _hf

    if kind.startswith("deinterleave"):
        fn = (_deepseek_interleave_with_full_tables if family == "before 5.25"
              else vars(_hf.modeling_module(family))["apply_rotary_pos_emb_interleave"])
    else:
        fn = vars(_hf.modeling_module(family))["apply_rotary_pos_emb"]
    assert _hf.rope_kind(fn) == (kind, None)
    replaced = _hf.rope_function(fn)
    if kind.startswith("deinterleave"):
        six_fn, six_replaced = fn, replaced
        fn = lambda q, k, c, s, d: six_fn(q, k, c, s, None, d)  # noqa: E731
        replaced = lambda q, k, c, s, d: six_replaced(q, k, c, s, None, d)  # noqa: E731
    if _hf._rope_single(fn):
        one_fn, one_replaced = fn, replaced
        fn = lambda q, k, c, s, d: (one_fn(q, c, s, d), one_fn(k, c, s, d))  # noqa: E731
        replaced = lambda q, k, c, s, d: (one_replaced(q, c, s, d), one_replaced(k, c, s, d))  # noqa: E731
    if kind == "gptj":
        one_fn, one_replaced = fn, replaced
        fn = lambda q, k, c, s, d: (one_fn(q, s, c), one_fn(k, s, c))  # noqa: E731
        replaced = lambda q, k, c, s, d: (one_replaced(q, s, c), one_replaced(k, s, c))  # noqa: E731
    g = torch.Generator().manual_seed(0)
    D = 16
    R = D // 2 if kind in ("half", "gptj") else D // 4 if kind == "trailing_pairs" else D
    for dim in (2,) if kind == "gptj" else (1, 2):
        shape_q, shape_k = ((2, 4, 5, D), (2, 2, 5, D)) if dim == 1 else ((2, 5, 4, D), (2, 5, 2, D))
        q, k = (_on_device(torch.randn(*shape, generator=g, dtype=torch.float64), True)
                for shape in (shape_q, shape_k))
        cos, sin = (_on_device(torch.randn(2, 5, R, generator=g, dtype=torch.float64)) for _ in range(2))
        # float64: the established formula (Ernie's own function computes in float32 whatever it is given)
        got = replaced(q, k, cos, sin, dim)
        assert all(_reaches(t.grad_fn, "ApplyRotaryPosEmbBackward") for t in got)  # the op's own node
        want = tuple(_hf._rope_formula(kind, x, cos.unsqueeze(dim), sin.unsqueeze(dim)) for x in (q, k))
        gq, gk = torch.randn_like(want[0]), torch.randn_like(want[1])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        grads = torch.autograd.grad(got, (q, k), (gq, gk))
        for a, b in zip(grads, torch.autograd.grad(want, (q, k), (gq, gk))):
            torch.testing.assert_close(a, b)
        f32 = [t.detach().float() for t in (q, k, cos, sin)]
        for a, b in zip(replaced(*f32, dim), fn(*f32, dim)):  # the family's own function, float32
            torch.testing.assert_close(a, b)
        low = [t.detach().to(torch.bfloat16) for t in (q, k, cos, sin)]
        exact = fn(*[t.double() for t in low], dim)
        for a, b in zip(replaced(*low, dim), exact):  # within one bfloat16 ulp of the exact result
            assert a.dtype == torch.bfloat16
            ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2.0**-100))) - 7)
            assert ((a.double() - b).abs() <= ulp).all(), ((a.double() - b).abs() / ulp).max()
    if kind == "half":  # full-width tables: the family's own function decides (it raises on them)
        with pytest.raises(RuntimeError):
            replaced(q, k, *(_on_device(torch.randn(2, 5, D, dtype=torch.float64)) for _ in range(2)), 2)


@pytest.mark.parametrize("family, mixed", [("olmo2", "cast"), ("llama", "promote"), ("phi3", "promote"),
                                           ("cohere", "cast"), ("gptj", "promote"), ("deepseek_v3", "promote"),
                                           ("deepseek_v4", "cast")])
def test_float32_tables_with_bfloat16_q_and_k_run_the_kernel(family, mixed):
    """bfloat16 q and k with float32 tables (Olmo2's and GPT-J's rotary tables are float32, and every family's
    under bfloat16 autocast): the probes establish what the family's function returns for them, the float32
    formula cast back to q's dtype (Olmo2's ``.to(q_type)``) or the float32 result (Llama's ``q * cos``); the
    replacement runs the op's own node and returns the same dtype, within one rounding of the family's
    function; no call is handed to the original. Each form: Llama's, partial (Phi3), interleaved (Cohere),
    GPT-J's one tensor with per-pair tables, DeepSeek's interleave, DeepSeek-V4's trailing pairs (one tensor)."""
    name = "apply_rotary_pos_emb_interleave" if family == "deepseek_v3" else "apply_rotary_pos_emb"
    fn = vars(_hf.modeling_module(family))[name]
    assert _hf.rope_mixed(fn) == mixed
    replaced = _hf.rope_function(fn)
    g = torch.Generator().manual_seed(0)
    R = {"phi3": 8, "gptj": 8, "deepseek_v4": 4}.get(family, 16)
    q, k = (_on_device(torch.randn(*shape, generator=g).to(torch.bfloat16), True) for shape in ((2, 4, 5, 16),
                                                                                                 (2, 2, 5, 16)))
    if family == "gptj":  # [B, T, H, D], one tensor at a time
        q, k = (_on_device(x.detach().transpose(1, 2).contiguous(), True) for x in (q, k))
    cos, sin = (_on_device(torch.randn(1, 5, R, generator=g)) for _ in range(2))
    call = {"gptj": lambda f, q, k, cos, sin: (f(q, sin, cos), f(k, sin, cos)),
            "deepseek_v3": lambda f, q, k, cos, sin: f(q, k, cos, sin, None, 1),
            "deepseek_v4": lambda f, q, k, cos, sin: (f(q, cos, sin), f(k, cos, sin))}.get(
                family, lambda f, q, k, cos, sin: f(q, k, cos, sin))
    before = dict(_hf.KEPT)
    got = call(replaced, q, k, cos, sin)
    assert _hf.KEPT == before
    assert all(_reaches(t.grad_fn, "ApplyRotaryPosEmbBackward", 6) for t in got)
    want = call(fn, q.detach(), k.detach(), cos, sin)
    # each output is x*cos + rot(x)*sin: its terms' magnitude, from the family's own function in float64
    a64, c64, s64 = (lambda t: t.detach().double().abs()), cos.double().abs(), sin.double().abs()
    terms = [u.abs() + v.abs() for u, v in zip(call(fn, a64(q), a64(k), c64, 0 * s64),
                                                call(fn, a64(q), a64(k), 0 * c64, s64))]
    for a, b, m in zip(got, want, terms):
        assert a.dtype == b.dtype == (torch.bfloat16 if mixed == "cast" else torch.float32)
        # a few float32 roundings of the terms apart (products and sum in another order, or fused), then the
        # cast to bfloat16 at most one of its units apart
        err = (a.double() - b.double()).abs()
        bound = 2.0**-22 * m + (2.0**-7 if mixed == "cast" else 0) * b.double().abs()
        assert (err <= bound).all(), (err / bound).max()


def test_calls_handed_to_the_original_are_counted_and_noted(monkeypatch):
    """A replacement that hands a call back to the original computes the right values, so only a count shows
    that the report's "replaced" did not happen: ``_hf.KEPT`` counts those calls and the matrix notes them
    (Olmo2's bfloat16 steps, with the probes of mixed dtypes made to establish nothing)."""
    checks = ("loss", "grads", zoo.BFLOAT16)
    v = zoo.check("olmo2", "eager", device=DEVICE, only=checks)
    assert v.status == "exact" and zoo.KEPT_NOTE not in v.detail, v.line()
    monkeypatch.setattr(_hf, "rope_mixed", lambda fn: None)
    v = zoo.check("olmo2", "eager", device=DEVICE, only=checks)
    assert v.status == "exact" and f"{zoo.KEPT_NOTE}rope (modeling_olmo2.apply_rotary_pos_emb) x" in v.detail, v.line()


@pytest.mark.parametrize("family, kind", [("llama4", "complex_bthd"), ("deepseek_v2", "complex_bhtd")])
def test_complex_rotary_is_established_and_computed_by_the_kernel(family, kind):
    """Llama 4's and DeepSeek-V2's apply_rotary_emb(xq, xk, freqs_cis) rotate feature pairs by a complex table
    in float32 and round once to xq's dtype; the replacement runs the kernel on its real and imaginary parts:
    float32 to rounding, forward and backward, bfloat16 within one ulp of the float32 product."""
    import torch

    from tritongrad import _hf

    fn = vars(_hf.modeling_module(family))["apply_rotary_emb"]
    assert _hf.rope_kind(fn) == (kind, None)
    replaced = _hf.rope_function(fn)
    g = torch.Generator().manual_seed(0)
    shape_q, shape_k = ((2, 4, 5, 16), (2, 2, 5, 16)) if kind == "complex_bhtd" else ((2, 5, 4, 16), (2, 5, 2, 16))
    q, k = (_on_device(torch.randn(*shape, generator=g), True) for shape in (shape_q, shape_k))
    freqs = _on_device(torch.polar(torch.ones(2, 5, 8), 6 * torch.rand(2, 5, 8, generator=g)))
    got, want = replaced(q, k, freqs), fn(q, k, freqs)
    assert all(_reaches(t.grad_fn, "ApplyRotaryPosEmbBackward") for t in got)
    gq, gk = torch.randn_like(want[0]), torch.randn_like(want[1])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    for a, b in zip(torch.autograd.grad(got, (q, k), (gq, gk)), torch.autograd.grad(want, (q, k), (gq, gk))):
        torch.testing.assert_close(a, b)
    low = [t.detach().to(torch.bfloat16) for t in (q, k)]
    exact = fn(*[t.double() for t in low], freqs.to(torch.complex128))  # the float32 product, unrounded
    for a, b in zip(replaced(*low, freqs), exact):
        assert a.dtype == torch.bfloat16
        ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2.0**-100))) - 7)
        assert ((a.double() - b).abs() <= ulp).all(), ((a.double() - b).abs() / ulp).max()


def test_rotary_called_without_k_rotates_q_alone():
    """Qwen4-exp's apply_rotary_pos_emb(q, k=None, ...) returns q alone when called without k (its indexer does);
    the replacement does too, through the kernel. Where k is required (Llama's), both raise alike."""
    import torch

    from tritongrad import _hf

    fn = vars(_hf.modeling_module("qwen4_exp"))["apply_rotary_pos_emb"]
    assert _hf.rope_kind(fn) == ("partial", None)
    replaced = _hf.rope_function(fn)
    g = torch.Generator().manual_seed(0)
    q = _on_device(torch.randn(2, 5, 4, 16, generator=g, dtype=torch.float64), True)
    cos, sin = (_on_device(torch.randn(2, 5, 8, generator=g, dtype=torch.float64)) for _ in range(2))
    got, want = replaced(q, cos=cos, sin=sin, unsqueeze_dim=2), fn(q, cos=cos, sin=sin, unsqueeze_dim=2)
    assert isinstance(got, torch.Tensor) and _reaches(got.grad_fn, "ApplyRotaryPosEmbBackward")
    torch.testing.assert_close(got, want)
    gy = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, q, gy)[0], torch.autograd.grad(want, q, gy)[0])
    llama = vars(_hf.modeling_module("llama"))["apply_rotary_pos_emb"]
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    for f in (llama, _hf.rope_function(llama)):
        with pytest.raises(TypeError):  # k * cos with k None
            f(q, cos=cos, sin=sin, unsqueeze_dim=2)


def test_gated_rms_norm_is_left_alone_with_the_reason():
    """A norm whose forward takes a gate beyond its input (Bamba's and Mamba2's gated RMSNorm,
    forward(x, gate=None)) is called with the gate, so an op established on the input alone would never run
    while the report said replaced: it is left alone, with the reason, and computes its own forward, exactly."""
    import torch

    import tritongrad

    class GatedRMSNorm(torch.nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.variance_epsilon = eps
            self.weight = torch.nn.Parameter(torch.randn(dim))

        def forward(self, hidden_states, gate=None):
            x = hidden_states.float()
            if gate is not None:
                x = x * torch.nn.functional.silu(gate.float())
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * x.to(hidden_states.dtype)

    GatedRMSNorm.__module__ = "transformers.models.bamba.modeling_bamba"
    model = torch.nn.Sequential(GatedRMSNorm(64))
    x, gate = torch.randn(3, 64), torch.randn(3, 64)
    with torch.no_grad():
        want, want_gated = model[0](x), model[0](x, gate)
    report = tritongrad.patch(model)
    assert report.targets("rms_norm") == []
    assert [e.detail for e in report.skipped if e.op == "rms_norm"] == [
        "GatedRMSNorm.forward takes gate beyond its input (a gated norm): rms_norm computes the norm of the input "
        "alone"]
    with torch.no_grad():
        torch.testing.assert_close(model[0](x, gate), want_gated, rtol=0, atol=0)
        torch.testing.assert_close(model[0](x), want, rtol=0, atol=0)


def test_matrix_says_why_a_forward_it_cannot_establish_is_left_alone():
    """A causal LM whose forward scales the logits by a name the probe does not know: linear_cross_entropy is
    left alone with the reason, and the model stays exact."""
    import torch
    import transformers

    import tritongrad

    model = zoo.build("llama")

    class Scaled(type(model)):
        def forward(self, *args, labels=None, logits_to_keep=0, **kwargs):
            out = super().forward(*args, logits_to_keep=logits_to_keep, **kwargs)
            out.logits = out.logits * 0.5  # a scale no config attribute names
            if labels is not None:
                out.loss = self.loss_function(out.logits, labels, self.config.vocab_size)
            return out

    Scaled.__name__ = Scaled.__qualname__ = "ScaledLlamaForCausalLM"
    Scaled.__module__ = transformers.LlamaForCausalLM.__module__
    model.__class__ = Scaled
    report = tritongrad.patch(model, swiglu=False, rope=False, rms_norm=False)
    why = [e.detail for e in report.skipped if e.op == "linear_cross_entropy"]
    assert why and "logits other than" in why[0], report
    tritongrad.unpatch(model)
    assert torch.is_tensor(model.lm_head.weight)


def test_models_json_is_all_that_stdout_holds(monkeypatch, capsys):
    # Some families print while they run; `tritongrad models --json | jq` must still get JSON alone.
    from tritongrad.cli import main

    def run(names, modes, progress=None, with_variants=False):
        print("Warning: position_ids is not a recognized input.")
        return [{"family": n, "eager": "exact", "ops": {}} for n in names]

    monkeypatch.setattr(zoo, "run", run)
    assert main(["models", "llama", "--json", "--mode", "eager"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == [{"family": "llama", "eager": "exact", "ops": {}}]
    assert "not a recognized input" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="--no-kernels chooses the path off the GPU")
def test_models_no_kernels_runs_the_references_whatever_the_environment_says():
    # `--no-kernels` under an inherited TRITON_INTERPRET=1 ran the kernels in the interpreter and said nothing.
    # The command re-runs itself without it and names the path; called in a process that imported triton in the
    # interpreter, it stops instead.
    from tritongrad import _runtime
    from tritongrad.cli import main

    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "tritongrad", "models", "no_such_family", "--no-kernels"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "the ops' PyTorch references" in out.stderr, out.stderr[-2000:]
    assert "unknown family: no_such_family" in out.stderr
    if _runtime.INTERPRET:
        with pytest.raises(SystemExit, match="--no-kernels runs the ops' PyTorch references"):
            main(["models", "llama", "--no-kernels"])


def test_a_patched_path_that_leaves_guarded_state_changed_is_an_error_compiled(monkeypatch):
    # The linear loss's unpacked-positions flag as a class attribute: its first write adds it to the instance's
    # dict, which torch.compile guards on, so every compiled training run compiled again on its second step.
    class Flag:
        value = False

    monkeypatch.setattr(_hf, "UNPACKED", Flag())
    v = zoo.check("llama", "compiled", only=("loss",))
    assert v.status == "error" and "second compiled step recompiled" in v.detail and "UNPACKED" in v.detail, v.line()


def test_a_familys_own_recompilation_is_a_note_not_an_error_compiled(monkeypatch):
    # State a guard reads, changed on every call of the family's own base model, which patch leaves alone: both
    # models recompile on their second step, so the verdict stays exact and says why.
    import functools

    from transformers.models.llama import modeling_llama

    class Flag:
        calls = 0

    original = modeling_llama.LlamaModel.forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        modeling_llama.FLAG.calls += 1  # read and written on every call: a guard on its value
        return original(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama, "FLAG", Flag(), raising=False)
    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", forward)
    v = zoo.check("llama", "compiled", only=("loss",))
    assert v.status == "exact" and "second compiled step recompiles too" in v.detail, v.line()


def test_a_patched_path_that_breaks_the_graph_is_an_error_compiled(monkeypatch):
    # The patched experts' per-call check, made to break Dynamo's graph (as an import inside the trace did with
    # torch 2.11): the values stay exact, the compiled model runs in pieces.
    why_not = _hf._experts_lean_why_not

    def breaking(self, x):
        torch._dynamo.graph_break()
        return why_not(self, x)

    monkeypatch.setattr(_hf, "_experts_lean_why_not", breaking)
    v = zoo.check("qwen3_moe", "compiled", only=("loss",))
    assert v.status == "error" and "break the graph" in v.detail and "unpatched model's 0" in v.detail, v.line()


def test_a_module_wide_patch_that_breaks_the_graph_is_an_error_compiled(monkeypatch):
    # rope replaces the family module's apply_rotary_pos_emb, which the unpatched model also calls while the
    # patch is on: its compiled steps are counted after unpatch, else both sides break alike.
    import tritongrad

    rotary = tritongrad.apply_rotary_pos_emb

    def breaking(*args, **kwargs):
        torch._dynamo.graph_break()
        return rotary(*args, **kwargs)

    monkeypatch.setattr(tritongrad, "apply_rotary_pos_emb", breaking)
    v = zoo.check("llama", "compiled", only=("loss",))
    assert v.status == "error" and "break the graph" in v.detail and "unpatched model's 0" in v.detail, v.line()


def test_a_familys_own_graph_break_is_not_the_patchs_compiled(monkeypatch):
    # A break in the family's own base model, which patch leaves alone, breaks both models' graphs alike.
    import functools

    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaModel.forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", forward)
    v = zoo.check("llama", "compiled", only=("loss",))
    assert v.status == "exact", v.line()


@pytest.mark.parametrize("family, op", [("gpt_neox", "layer_norm"), ("phi", "linear_cross_entropy")])
def test_an_op_that_drops_its_bias_is_wrong(monkeypatch, family, op):
    # The families initialise biases to zero; zoo.build moves them, else an op that ignores its bias's value
    # (and passes its gradient on) stays exact (docs/models.md#the-family-matrix).
    import tritongrad.nn

    def dropped(b):
        return None if b is None else b - b.detach()

    if op == "layer_norm":
        def forward(self, x):
            return tritongrad.nn.layer_norm(x, self.normalized_shape, self.weight, dropped(self.bias), self.eps)

        monkeypatch.setattr(tritongrad.nn.LayerNorm, "forward", forward)
    else:
        loss = _hf.causal_lm_linear_loss
        monkeypatch.setattr(_hf, "causal_lm_linear_loss",
                            lambda h, w, b, *args, **kwargs: loss(h, w, dropped(b), *args, **kwargs))
    v = zoo.check(family, "eager", only=("loss",))
    assert v.status == "wrong" and "loss: off by" in v.detail, v.line()


def test_a_loss_that_ignores_num_items_in_batch_is_wrong(monkeypatch):
    # Trainer passes num_items_in_batch under gradient accumulation: a patched loss that took the mean instead of
    # the sum over it would scale every accumulated step's gradient.
    loss = _hf.causal_lm_linear_loss
    monkeypatch.setattr(_hf, "causal_lm_linear_loss",
                        lambda *args, num_items_in_batch=None, **kwargs: loss(*args, **kwargs))
    v = zoo.check("llama", "eager", only=("loss", "loss, num_items_in_batch"))
    assert v.status == "wrong" and "loss, num_items_in_batch: off by" in v.detail, v.line()


def test_the_float64_model_keeps_its_own_upcasts_in_float64():
    # Llama's RMSNorm computes in float32 whatever its input (`.to(torch.float32)`): a float64 copy alone would
    # carry float32 roundings into the reference the float32 models are held to.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64, eps=1e-6).double()
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    exact = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (norm(x) - exact).abs().max() > 1e-9  # float32 inside
    with zoo._in_float64():
        out = norm(x)
        assert torch.empty(1).dtype == torch.float64 and torch.zeros(1, dtype=torch.float32).dtype == torch.float64
    assert (out - exact).abs().max() < 1e-14
    assert torch.empty(1).dtype == torch.float32  # restored


@pytest.mark.parametrize("ratio, same64, held, unpatched", [
    (1.9, None, True, 3e-5), (3.0, 1e-12, True, 3e-5), (3.0, 1e-5, False, 3e-5), (3.0, None, False, 3e-5),
    (5.0, 1e-12, False, 3e-5), (1.5, None, False, 2e-4), (3.0, 1e-12, False, 2e-4)])
def test_a_rounding_spread_beyond_2x_needs_the_same_function_in_float64(ratio, same64, held, unpatched):
    # zoo._earned: the patched model's float32 error against float64 at `ratio` times the unpatched model's.
    # Past 2x it passes only where the patched model run in float64 is the float64 model (same64: its error;
    # None: it cannot run), and never past ROUNDING_SPREAD; and nothing passes where the unpatched model itself
    # is further than REFERENCE_SPREAD tolerances (here 1e-5 each) from the float64 run.
    model = zoo.build("llama")
    batch = zoo._batch(256, "cpu")
    fns = {"loss": lambda m: zoo._step(m, batch, False)[0]}
    with zoo._in_float64():
        ref64 = fns["loss"](zoo._float64(model))
    d = unpatched * ref64.abs()
    want, got = {"loss": (ref64 + d).float()}, {"loss": (ref64 + ratio * d).float()}
    asked = []

    def same(r64, keys):
        asked.append(keys)
        assert torch.equal(r64["loss"], ref64)
        return {} if same64 is None else {"loss": same64}

    kept, note = zoo._earned(model, fns, got, want, ["loss"], same)
    assert bool(kept) == held, note
    assert bool(asked) == (2 < ratio <= zoo.ROUNDING_SPREAD and unpatched <= zoo.REFERENCE_SPREAD * zoo.LOSS_RTOL)


def test_gradient_checkpointing_recomputes_in_float64():
    # The recomputation runs in the backward, outside the forward's _in_float64 block: without entering it again
    # it recomputes Llama's norms in float32, and checkpointing raises on the saved tensors' dtypes.
    model64 = zoo._float64(zoo.build("llama"))
    batch = zoo._batch(256, "cpu")
    with zoo._in_float64():
        plain = zoo._step(model64, batch, False)[1]
        recomputed = zoo._checkpointed(model64, batch)
    assert plain.keys() == recomputed.keys()
    for n, g in plain.items():
        torch.testing.assert_close(recomputed[n], g, rtol=1e-12, atol=1e-14, msg=n)


@pytest.mark.parametrize("check", [zoo.FUNC_GRAD, zoo.FUNC_JVP])
def test_an_op_that_drops_its_derivative_under_torch_func_is_wrong(monkeypatch, check):
    # Under torch.func's transforms an op runs its reference: one that returned it detached there (the tangents
    # and gradients through it zero, as forward-mode AD once gave) is wrong, in eager mode nothing else changes.
    from tritongrad import _pattern

    def detached(self, args):
        out = self.reference(*args)
        return tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()

    monkeypatch.setattr(_pattern.Op, "_under_transform", detached)
    v = zoo.check("llama", "eager", only=("loss", "grads", check))
    assert v.status == "wrong" and f"{check}: " in v.detail and "grads:" not in v.detail, v.line()


def test_the_directional_derivative_is_held_to_its_terms_along_one_direction_in_both_precisions():
    # XGLM's derivative along the check's direction is a sum over parameters that cancels to 1/1500 of its terms,
    # so float32 rounding of the terms moved it by 5.7e-4 of itself on a GPU. The check holds the difference to the
    # terms' magnitude, and the float64 model differentiates along the same direction (its angles were float32 ones
    # before, which turned it: 5.5e-3 in float64 against -9.7e-3 in float32, and the float64 rule vouched for nothing).
    model = zoo.build("xglm").to(DEVICE)
    batch = zoo._batch(256, DEVICE)
    with zoo._in_float64():
        want = zoo._func_jvp(zoo._float64(model), batch)
    assert want["terms"] > 1000 * want["d loss"].abs()  # the cancellation this test is about
    patched, _ = zoo._patched("xglm", model, DEVICE, "eager")
    for m in (model, patched):
        got = zoo._func_jvp(m, batch)
        assert zoo._error(zoo.FUNC_JVP, got, want)[0] < zoo.GRAD_RTOL / 10
        assert (got["d loss"] - want["d loss"]).abs() < 0.1 * want["d loss"].abs()


def test_the_checks_after_gradient_checkpointing_run_on_the_model_as_it_was():
    # transformers' gradient_checkpointing_enable hooks the embeddings to make their output require grad, and its
    # disable removes the hook only under PEFT: left on, the torch.func checks after it raised on the unpatched
    # model too, and were noted as not checked, the verdict still exact.
    v = zoo.check("llama", "eager", only=("loss", "grads", "gradient checkpointing", zoo.FUNC_GRAD, zoo.FUNC_JVP))
    assert v.status == "exact" and "not checked" not in v.detail, v.line()


def test_a_check_that_leaves_the_model_changed_is_an_error(monkeypatch):
    def leaves_a_hook(model, batch):
        model.model.embed_tokens.register_forward_hook(lambda m, a, out: None)
        return zoo._step(model, batch, False)[1]

    monkeypatch.setattr(zoo, "_checkpointed", leaves_a_hook)
    [row] = zoo.run(["llama"], ("eager",), only=("loss", "grads", "gradient checkpointing", zoo.FUNC_GRAD))
    assert row["eager"].startswith("error: RuntimeError: zoo: the check 'gradient checkpointing' left the model "
                                   "changed: model.embed_tokens's _forward_hooks"), row


def test_not_checked_reads_the_checks_back_from_a_verdict_line():
    names = {zoo.FUNC_GRAD, zoo.FUNC_JVP, "grads", "loss and grads, bfloat16"}  # names that hold commas
    line = f"exact: {zoo.NOT_CHECKED}{', '.join(sorted(names))}; layout: model.norm"
    assert zoo.not_checked(line) == names
    assert zoo.not_checked("exact") == set() and zoo.not_checked(f"exact: {zoo.NOT_CHECKED}generate") == {"generate"}
    with pytest.raises(ValueError, match="not a list of checks"):
        zoo.not_checked(f"exact: {zoo.NOT_CHECKED}grads, something else")


def test_a_copy_of_a_model_that_keeps_a_non_leaf_tensor():
    # RecurrentGemma keeps its recurrent state from the last forward; after a training forward that state is no
    # graph leaf, which deepcopy refuses: whether the bfloat16 checks could copy the model depended on the check
    # before them.
    import copy

    model = zoo.build("llama")
    w = torch.ones(3, requires_grad=True)
    model.model.norm.kept = w * 2
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(model)
    copied = zoo._copy(model)
    assert copied.model.norm.kept.grad_fn is None and torch.equal(copied.model.norm.kept, model.model.norm.kept)
    assert model.model.norm.kept.grad_fn is not None  # the model itself is left as it was
    assert all(torch.equal(a, b) for a, b in zip(copied.parameters(), model.parameters()))

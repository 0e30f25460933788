"""``tritongrad bench`` end to end on a tiny sweep (through Triton's interpreter without a GPU), then checks
that what it wrote holds together. Nothing here asserts a speed: only that every number is what its
definition says it is."""

import contextlib
import csv
import dataclasses
import functools
import io
import json
import math
from pathlib import Path

import pytest
import torch

import tritongrad
from tritongrad.bench import harness, providers, report
from tritongrad.bench.ops import OPS
from tritongrad.bench.providers import PROVIDERS
from tritongrad.cli import main

# One sweep for the module (on one worker under pytest-xdist: conftest.ONE_WORKER_MODULES), started early: it
# takes tens of seconds.
pytestmark = pytest.mark.slow

# Explicit shapes and dtype, so the same few seconds of work on a GPU machine as on CPU; through the
# interpreter one shape (every row of the sweep is a torch.compile and an interpreted kernel).
SHAPES = ["4x64", "16x256"] if torch.cuda.is_available() else ["4x64"]
ARGS = ["--shapes", ",".join(SHAPES), "--dtype", "fp32", "--rep", "5", "--warmup", "0"]
# The full sweep (every provider, shape and mode) on one row op, with a weight and a bias: the bench runs every
# op through the same code; the others at one shape and mode in test_every_built_in_op_runs (extended tier), and
# users' ops (the examples' weighted sum) in test_examples.
ROW_OPS = ["layer_norm"]

# Bytes at x: [4, 64] float32 (s = 4), worked by hand from each op's formula in bench/ops.py:
# N*D*s = 1024, D*s = 256, N*s = 16.
BYTES_4x64_FP32 = {
    # fwd: x + w + y; bwd: x + w + g + gx + gw
    "weighted_sum": {"fwd": 1024 + 256 + 16, "bwd": 1024 + 256 + 16 + 1024 + 256},
    # fwd: x + w + y; bwd: x + w + g + gx + gw
    "rms_norm": {"fwd": 1024 + 256 + 1024, "bwd": 1024 + 256 + 1024 + 1024 + 256},
    # fwd: x + w + b + y; bwd: x + w + g + gx + gw + gb
    "layer_norm": {"fwd": 1024 + 512 + 1024, "bwd": 1024 + 256 + 1024 + 1024 + 512},
    # fwd: logits + int64 targets (8 N = 32); bwd: logits + targets + their gradient
    "cross_entropy": {"fwd": 1024 + 32, "bwd": 2 * 1024 + 32},
    # V = 8 D = 512, W: V*D*s = 131072; fwd: h + W + targets; bwd: h + W + targets + gh + gW
    "linear_cross_entropy": {"fwd": 1024 + 131072 + 32, "bwd": 2 * (1024 + 131072) + 32},
    # fwd: gate + up + y; bwd: gate + up + g + d_gate + d_up
    "swiglu": {"fwd": 3 * 1024, "bwd": 5 * 1024},
    # weight [24, 64] (6144 bytes), y [4, 24] (384); fwd: gate + up + W + y; bwd: gate + up + g + W + d_gate + d_up + dW
    "gated_linear": {"fwd": 2 * 1024 + 6144 + 384, "bwd": 4 * 1024 + 2 * 6144 + 384},
    # 32 + 8 heads of 64 over 4 positions (40 * 1024 = 40960 bytes each way), cos + sin (2 * 1024)
    "rotary": {"fwd": 2 * 40960 + 2048, "bwd": 2 * 40960 + 2048},
}


def _one(paths):
    paths = list(paths)
    assert len(paths) == 1, paths
    return paths[0]


# The torch.compile provider through aot_eager in the quick tier, Inductor in the extended one: what the checks
# test is the bench's handling of a compiled provider, and Inductor's C++ build on a cold cache is most of the
# sweep's CPU time (docs/measuring.md#the-test-suite).
@pytest.fixture(scope="module", params=["aot_eager", pytest.param("inductor", marks=pytest.mark.extended)])
def bench(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    printed = io.StringIO()
    compiled = PROVIDERS["torch.compile"]
    build = functools.partial(providers._compile_build, backend=request.param)
    with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as mp:
        mp.setitem(PROVIDERS, "torch.compile", dataclasses.replace(compiled, build=build))
        assert main(["bench", *ROW_OPS, "--out", str(out), *ARGS]) == 0
    doc = json.loads(_one(out.glob("*.json")).read_text())
    with _one(out.glob("*.csv")).open(newline="") as f:
        csv_rows = list(csv.DictReader(f))
    return out, doc, csv_rows, printed.getvalue()


def test_every_provider_is_measured_or_says_why(bench):
    _, doc, _, printed = bench
    rows = doc["results"]
    assert list(doc["providers"]) == list(PROVIDERS)
    for op in ROW_OPS:
        for provider in PROVIDERS:
            mine = [r for r in rows if (r["op"], r["provider"]) == (op, provider)]
            assert len(mine) == len(SHAPES) * 3, (op, provider)  # shapes x 3 modes
            for r in mine:
                assert r["status"] in ("ok", "skipped", "error")
                assert r["status"] == "ok" or r["reason"], r
    # What is always there must run: eager, torch.compile, and tritongrad for every op it has.
    for r in rows:
        must_run = r["provider"] in ("eager", "torch.compile") or (
            r["provider"] == "tritongrad" and hasattr(tritongrad, r["op"])
        )
        if must_run:
            assert r["status"] == "ok", r
        elif r["provider"] == "tritongrad":
            assert r["status"] == "skipped" and "does not exist" in r["reason"], r
    assert "copy bandwidth" in printed and "== summary" in printed


def test_bytes_follow_each_ops_formula(bench):
    _, doc, _, _ = bench
    for r in doc["results"]:
        if r["shape"] == "4x64":
            want = BYTES_4x64_FP32[r["op"]]
            assert r["bytes"] == {**want, "fwdbwd": want["fwd"] + want["bwd"]}[r["mode"]], r


def test_derived_numbers_follow_their_definitions(bench):
    _, doc, _, _ = bench
    copy = doc["copy"]
    assert copy["GBps"] == pytest.approx(copy["bytes"] / (copy["ms"] * 1e-3) / 1e9)
    ok = [r for r in doc["results"] if r["status"] == "ok"]
    tritongrad_ms = {(r["op"], r["shape"], r["mode"]): r["ms"] for r in ok if r["provider"] == "tritongrad"}
    assert tritongrad_ms  # layer_norm at least
    for r in ok:
        assert 0 < r["ms_p20"] <= r["ms"] <= r["ms_p80"], r
        assert r["GBps"] == pytest.approx(r["bytes"] / (r["ms"] * 1e-3) / 1e9), r
        assert r["pct_copy"] == pytest.approx(100 * r["GBps"] / copy["GBps"]), r
        ref = tritongrad_ms.get((r["op"], r["shape"], r["mode"]))
        if r["provider"] != "tritongrad" and ref is not None:
            assert r["speedup"] == pytest.approx(r["ms"] / ref), r
        if r["mode"] == "fwdbwd":
            assert r["host_us"] > 0, r
        # Device time (CUDA-graph replays) exists only on a GPU; there tritongrad's ops must be capturable,
        # and any other provider that is not says why.
        if doc["meta"]["device"] != "cuda":
            assert "dev_ms" not in r and "dev_reason" not in r, r
        elif "dev_ms" in r:
            assert 0 < r["dev_ms_p20"] <= r["dev_ms"] <= r["dev_ms_p80"], r
            assert r["dev_pct_copy"] == pytest.approx(100 * r["bytes"] / (r["dev_ms"] * 1e-3) / 1e9 / copy["GBps"]), r
        elif r["mode"] == "bwd":
            assert r["dev_reason"].startswith("not measured for bwd"), r
        elif r["dev_reason"] != "below what the flush subtraction resolves":  # a run of a few microseconds
            assert r["provider"] != "tritongrad" and r["dev_reason"], r


def test_csv_is_the_json_tagged(bench):
    _, doc, csv_rows, _ = bench
    meta = doc["meta"]
    for key in ("gpu", "torch", "triton", "git_sha", "date"):
        assert meta[key]
    assert len(csv_rows) == len(doc["results"])
    for c, r in zip(csv_rows, doc["results"]):
        assert (c["gpu"], c["torch"], c["git_sha"]) == (meta["gpu"], meta["torch"], meta["git_sha"])
        assert (c["op"], c["provider"], c["mode"], c["status"]) == (r["op"], r["provider"], r["mode"], r["status"])
        assert int(c["bytes"]) == r["bytes"]
        if r["status"] == "ok":
            assert math.isclose(float(c["GBps"]), r["GBps"])


def test_one_plot_per_op(bench):
    pytest.importorskip("matplotlib")
    out, doc, _, _ = bench
    for op in {r["op"] for r in doc["results"] if r["status"] == "ok"}:
        png = _one(out.glob(f"*-{op}.png"))
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_built_in_op_runs(tmp_path):
    """The ops past the full sweep's (rms_norm, cross_entropy, linear_cross_entropy, swiglu, gated_linear,
    rotary), by name or alias, each timed on its inputs by tritongrad and eager PyTorch, with its bytes formula."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "rms_norm", "cross_entropy", "linear_cross_entropy", "swiglu", "gated_linear",
                     "apply_rotary_pos_emb",
                     "--shapes", "4x64", "--dtype", "fp32", "--mode", "fwdbwd", "--rep", "1", "--warmup", "0",
                     "--provider", "tritongrad", "eager", "--out", str(tmp_path)])
    assert code == 0
    rows = json.loads(_one(tmp_path.glob("*.json")).read_text())["results"]
    assert {(r["op"], r["provider"]) for r in rows} == {
        (op, p) for op in ("rms_norm", "cross_entropy", "linear_cross_entropy", "swiglu", "gated_linear", "rotary")
        for p in ("tritongrad", "eager")}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["bytes"] == sum(BYTES_4x64_FP32[r["op"]].values()), r


def test_readme_speed_table_ops_are_bench_ops():
    """Every op in the README's speed table is `tritongrad bench OP`."""
    from tritongrad.bench.ops import ALIASES

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("## Speed"):readme.index("A 1.24B Llama")]
    names = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "---" not in line}
    names.discard("op")
    assert names and all(ALIASES.get(n.replace(" ", "_"), n.replace(" ", "_")) in OPS for n in names), names
    assert set(OPS) >= {"weighted_sum", "rms_norm", "layer_norm", "cross_entropy", "linear_cross_entropy", "swiglu",
                        "rotary"}


def test_list_and_bad_arguments(capsys):
    assert main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in [*OPS, *PROVIDERS])
    assert main(["bench", "no_such_op", *ARGS]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "--shapes", "4096"])


def test_summary_with_device_times():
    """The GPU-only columns of the summary, from hand-made rows: per-call / device shares and speedups,
    bwd rows (never captured) left out of the list of rows without a device time, other such rows listed."""
    def row(provider, mode, ms, dev=None, reason=None, speedup=None, dev_speedup=None):
        r = dict(op="rms_norm", dtype="bf16", shape="8x8", N=8, D=8, mode=mode, provider=provider, status="ok",
                 bytes=1000, ms=ms, pct_copy=50.0, speedup=speedup)
        if dev is not None:
            r.update(dev_ms=dev, dev_pct_copy=80.0, dev_speedup=dev_speedup)
        if reason is not None:
            r["dev_reason"] = reason
        return r

    rows = [
        row("tritongrad", "fwd", 1.0, dev=0.5),
        row("eager", "fwd", 2.0, dev=2.0, speedup=2.0, dev_speedup=4.0),
        row("tritongrad", "bwd", 1.0, reason="not measured for bwd (see Timer.device_ms)"),
        row("eager", "bwd", 3.0, reason="not measured for bwd (see Timer.device_ms)", speedup=3.0),
        row("eager", "fwdbwd", 3.0, reason="not capturable in a CUDA graph: boom", speedup=1.5),
        row("tritongrad", "fwdbwd", 2.0, dev=1.0),
    ]
    text = "\n".join(report.summary(rows, ["tritongrad", "eager"]))
    assert "50.0% / 80.0% at 8x8" in text      # fwd: per call / device share
    assert "2x / 4x" in text                   # fwd: per call / device speedup over eager
    assert "3x" in text and "3x /" not in text  # bwd: per call only
    assert "1 rows without a device time" in text and "boom" in text and "not measured for bwd" not in text


def test_device_time_fields_follow_their_definitions():
    """The GPU-only row fields, with a timer that claims a GPU and returns fixed times: dev_pct_copy and
    dev_speedup from dev_ms, bwd rows never captured, a failed capture recorded as a reason."""
    class FixedTimer(harness.Timer):
        def __init__(self, dev_ms):
            super().__init__("cuda", 0.0, 0.0)
            self.dev = dev_ms

        def __call__(self, run, leaves=()):
            run()
            return 2.0, 1.5, 2.5

        def host_us(self, run, leaves, median_ms, batches=5):
            return 10.0

        def peak_memory(self, run, leaves):
            return 0

        def device_ms(self, run, leaves, median_ms):
            if self.dev is None:
                raise RuntimeError("capture failed")
            return self.dev, self.dev * 0.9, self.dev * 1.1

    op = OPS["weighted_sum"]
    inputs = op.inputs(4, 64, torch.float32, "cpu")
    g = torch.randn(4)
    cfg = harness.Config(
        ops=["weighted_sum"], dtypes=["fp32"], modes=list(harness.MODES), providers=["tritongrad", "eager"]
    )
    base = dict(op="weighted_sum", dtype="fp32", shape="4x64", N=4, D=64, itemsize=4)
    reference: dict = {}
    copy = 1000.0
    rows = {}
    for name, dev in (("tritongrad", 0.5), ("eager", 1.0)):
        for r in harness._provider_rows(name, op, inputs, g, base, None, cfg, FixedTimer(dev), copy, reference):
            rows[name, r["mode"]] = r
    for mode in ("fwd", "fwdbwd"):
        mine, other = rows["tritongrad", mode], rows["eager", mode]
        assert mine["dev_pct_copy"] == pytest.approx(100 * mine["bytes"] / (0.5e-3) / 1e9 / copy)
        assert other["dev_speedup"] == pytest.approx(1.0 / 0.5) and other["speedup"] == pytest.approx(1.0)
    for name in ("tritongrad", "eager"):
        assert "dev_ms" not in rows[name, "bwd"] and rows[name, "bwd"]["dev_reason"].startswith("not measured")
    failed = list(harness._provider_rows("eager", op, inputs, g, base, None, cfg, FixedTimer(None), copy, {}))
    assert all(r["status"] == "ok" and "dev_ms" not in r for r in failed)
    reasons = [r["dev_reason"] for r in failed if r["mode"] != "bwd"]
    assert reasons == ["not capturable in a CUDA graph: RuntimeError: capture failed"] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_failed_capture_leaves_random_inputs_working():
    # A provider that reads a value back mid-call cannot be captured; the next shape's inputs are still made.
    x = torch.randn(1024, device="cuda")
    timer = harness.Timer("cuda", warmup_ms=1, rep_ms=1)
    with pytest.raises(Exception):
        timer.device_ms(lambda: x.sum().item(), [], 0.01)
    assert torch.randn(8, device="cuda").isfinite().all()


def test_liger_grpo_row_times_the_same_function():
    """Liger's chunked GRPO loss is timed against tritongrad's only as the same function: on the bench's GRPO
    inputs (three sequences, a small head) the same loss and gradients. On CPU, Liger's loss
    uncompiled."""
    pytest.importorskip("liger_kernel.chunked_loss")
    from tritongrad.bench.ops import grpo_layout
    from tritongrad.bench.providers import liger_grpo_loss

    op = OPS["linear_grpo_loss"]
    N, D = 3 * 16, 16  # sequences of gcd(N, 1024) = 16 tokens
    assert grpo_layout(N) == (3, 16)
    inputs = op.inputs(N, D, torch.float32, "cpu")
    h, W = (inputs[0].detach().requires_grad_(), inputs[1].detach().requires_grad_())
    ours, _ = op.bind(tritongrad.linear_grpo_loss)(h, W, *inputs[2:])  # (loss, metrics)
    want = torch.autograd.grad(ours, (h, W))
    theirs = liger_grpo_loss(compiled=False)(h, W, *inputs[2:])
    got = torch.autograd.grad(theirs, (h, W))
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_liger_dpo_row_times_the_same_function():
    """Liger's chunked DPO loss is timed against tritongrad's only as the same function: on the bench's DPO
    inputs (two pairs, a small head, the reference model's hidden states and head) the same loss and policy
    gradients. On CPU, Liger's loss uncompiled."""
    pytest.importorskip("liger_kernel.chunked_loss")
    from tritongrad.bench.ops import dpo_layout
    from tritongrad.bench.providers import liger_dpo_loss

    op = OPS["linear_dpo_loss"]
    N, D = 4 * 16, 16  # four sequences of gcd(N / 4, 1024) = 16 tokens: two pairs
    assert dpo_layout(N) == (4, 16) and dpo_layout(8192) == (8, 1024)
    inputs = op.inputs(N, D, torch.float32, "cpu")
    h, W = (inputs[0].detach().requires_grad_(), inputs[1].detach().requires_grad_())
    ours, metrics = op.bind(tritongrad.linear_dpo_loss)(h, W, *inputs[2:])
    assert metrics["rewards/margins"].abs() > 0  # the reference differs from the policy
    want = torch.autograd.grad(ours, (h, W))
    base, _ = op.bind(op.torch_fn)(h, W, *inputs[2:])
    torch.testing.assert_close(base, ours, rtol=1e-5, atol=1e-6)
    theirs = liger_dpo_loss(compiled=False)(h, W, *inputs[2:])
    got = torch.autograd.grad(theirs, (h, W))
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _jsd_row(N=24, D=16):
    op = OPS["linear_jsd"]
    inputs = op.inputs(N, D, torch.float32, "cpu")
    hs, Ws = (inputs[0].detach().requires_grad_(), inputs[1].detach().requires_grad_())
    ours = op.bind(tritongrad.linear_jsd)(hs, Ws, *inputs[2:])
    return op, inputs, hs, Ws, ours, torch.autograd.grad(ours, (hs, Ws))


def test_jsd_row_baseline_is_the_same_function():
    """The JSD row's eager and torch.compile baseline (materialised logits) is tritongrad's function: the same
    loss and student gradients on the bench's inputs, whose two heads differ."""
    op, inputs, hs, Ws, ours, want = _jsd_row()
    base = op.bind(op.torch_fn)(hs, Ws, *inputs[2:])
    assert base > 1e-3
    torch.testing.assert_close(base, ours, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(base, (hs, Ws)), want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_liger_jsd_row_times_the_same_function():
    """Liger's chunked JSD loss (its distillation term alone) is timed against tritongrad's only as the same
    function: the same loss and student gradients on the bench's inputs. On CPU, Liger's loss uncompiled."""
    pytest.importorskip("liger_kernel.chunked_loss")
    from tritongrad.bench.providers import liger_jsd_loss

    _, inputs, hs, Ws, ours, want = _jsd_row()
    theirs = liger_jsd_loss(compiled=False)(hs, Ws, *inputs[2:])
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(theirs, (hs, Ws)), want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

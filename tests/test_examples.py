"""The ops in examples/, written on the public API alone, as CI runs them: each through the test kit on tiny
shapes made by its own input declaration, and through ``tritongrad bench --op`` (a one-shape, one-mode sweep
that works through the interpreter); then ``--op`` refusing what it cannot time right."""

import json
import os
import sys

import pytest
import torch
from conftest import DEVICE, ROOT, import_example

import tritongrad
from tritongrad.cli import main
from tritongrad.testing import OpSuite

softcap = import_example("softcap").softcap
weighted_sum = import_example("weighted_sum").weighted_sum

# Per example: its samples, from the op's own declared inputs (N x D), each there for a reason.
def softcap_eager(x, cap=30.0):
    """The formula the op replaces, in x's dtype: torch.tanh's backward works from its saved output, as the
    op's does from y, so 1 - t^2 carries the output's rounding (the error baseline)."""
    return cap * torch.tanh(x / cap)


SUITES = {
    "softcap": OpSuite(softcap, [softcap.sample(7, 33)],  # one block of 1024, mostly masked
                       baseline=softcap_eager, leading=("x",), dtypes=(torch.float32, torch.bfloat16)),
    "weighted_sum": OpSuite(weighted_sum, [
        weighted_sum.sample(5, 37),    # rows and columns short of a tile: every mask on
        weighted_sum.sample(40, 150),  # three row tiles, one partial row each, two column blocks: reduce_partials
    ], leading=("x",), dtypes=(torch.float32, torch.bfloat16)),
}
test_softcap = SUITES["softcap"].pytest()
test_weighted_sum = SUITES["weighted_sum"].pytest()


# Two ops that `tritongrad bench --op` must refuse (neither ever runs): one that declares no inputs, and the
# issue's y = a * tanh(x / a) * g whose declared gain is [N, D] where the op takes [D].
def _tanh_reference(x: torch.Tensor, g: torch.Tensor, a: float = 2.0) -> torch.Tensor:
    return a * torch.tanh(x / a) * g


@tritongrad.op("examples_test::no_inputs", reference=_tanh_reference)
def no_inputs(x: torch.Tensor, g: torch.Tensor, a: float = 2.0) -> torch.Tensor:
    raise AssertionError("never launched")


def _validate_gain(x, g, a=2.0):
    if g.shape != x.shape[-1:]:
        raise ValueError(f"scaled_tanh: g must be [D] = [{x.shape[-1]}], got {tuple(g.shape)}")


@tritongrad.op("examples_test::wrong_inputs", reference=_tanh_reference, validate=_validate_gain)
def wrong_inputs(x: torch.Tensor, g: torch.Tensor, a: float = 2.0) -> torch.Tensor:
    raise AssertionError("never launched")


@wrong_inputs.inputs(fwd_bytes=lambda N, D, s: 3 * N * D * s, bwd_bytes=lambda N, D, s: 5 * N * D * s)
def _(N, D, dtype, device):
    return torch.randn(N, D, dtype=dtype, device=device), torch.randn(N, D, dtype=dtype, device=device)


def _bench(capsys, *args):
    code = main(["bench", "--shapes", "4x64", "--dtype", "fp32", "--mode", "fwdbwd", "--rep", "1", "--warmup", "0",
                 "--provider", "tritongrad", "eager", *args])
    return code, capsys.readouterr()


@pytest.mark.parametrize("path", ["examples.softcap:softcap", "examples.weighted_sum:weighted_sum"])
def test_bench_times_each_example(path, tmp_path, monkeypatch, capsys):
    """``tritongrad bench --op``: tritongrad's op and its reference (the eager row) timed on the op's declared
    inputs, with its declared bytes."""
    monkeypatch.chdir(ROOT)
    code, out = _bench(capsys, "--op", path, "--out", str(tmp_path))
    assert code == 0, out.err
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    rows = doc["results"]
    assert {r["provider"] for r in rows} == {"tritongrad", "eager"} and all(r["status"] == "ok" for r in rows), rows
    op = sys.modules[path.split(":")[0]].__dict__[path.split(":")[1]]
    declared = op.declared_inputs
    assert all(r["bytes"] == declared.fwd_bytes(4, 64, 4) + declared.bwd_bytes(4, 64, 4) for r in rows)


def _refused(capsys, path, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out = _bench(capsys, "--op", path)
    assert code == 2 and out.out == "", (code, out.out)
    return out.err


def test_bench_refuses_an_op_without_declared_inputs(capsys, monkeypatch):
    err = _refused(capsys, "test_examples:no_inputs", monkeypatch)
    assert "declares no inputs" in err and "@no_inputs.inputs(fwd_bytes=" in err, err


def test_bench_refuses_inputs_the_op_does_not_take(capsys, monkeypatch):
    """The gain of y = a tanh(x / a) g declared [N, D] where the op takes [D]: refused at the op's validation,
    never timed against a reference that would broadcast it."""
    err = _refused(capsys, "test_examples:wrong_inputs", monkeypatch)
    assert "cannot be built" in err and "g must be [D]" in err, err


def test_bench_refuses_what_cannot_be_loaded(capsys, monkeypatch):
    assert "ModuleNotFoundError" in _refused(capsys, "examples.no_such_module:op", monkeypatch)
    assert "neither a tritongrad op" in _refused(capsys, "examples.softcap:softcap_reference", monkeypatch)


def test_examples_run_as_scripts():
    """Each example run as a script (in the interpreter without a GPU) prints its op's node and its errors
    against the reference relative to the reference's size, each under 1e-5 (float32 rounding is about 1e-7;
    absolute errors of sums near 50 came within a few ulps of 1e-5 and made this test fail now and then). The
    scripts run one after the other as ``__main__`` in one fresh process, which imports torch once."""
    import re
    import subprocess

    scripts = {"softcap": ("SoftcapBackward", 2), "weighted_sum": ("WeightedSumBackward", 3)}
    code = ("import runpy, sys\n"
            "for name in sys.argv[1:]:\n"
            "    print('== ' + name, flush=True)\n"
            "    runpy.run_path('examples/' + name + '.py', run_name='__main__')\n")
    # PYTHONPATH: tritongrad from src/ where it is not installed; the interpreter where there is no GPU
    env = {"PATH": "/usr/bin:/bin", **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ},
           **({} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"})}
    out = subprocess.run([sys.executable, "-c", code, *scripts], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    printed = dict(re.findall(r"^== (\w+)\n(.*?)(?=^== |\Z)", out.stdout, re.M | re.S))
    assert sorted(printed) == sorted(scripts), out.stdout
    for name, (node, n_errors) in scripts.items():
        assert f"{node} object" in printed[name], printed[name]
        errors = [float(v) for v in re.findall(r"= ([0-9.e+-]+)$", printed[name], re.M)]
        assert len(errors) == n_errors and max(errors) < 1e-5, printed[name]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="Inductor launches the kernels only on a GPU")
@pytest.mark.parametrize("name", ["softcap", "weighted_sum"])
def test_compiled_equals_eager_bitwise(name):
    """Under torch.compile (Inductor, which passes a Python float to a kernel as float64) the example's
    outputs and gradients equal eager mode's bit for bit: float arguments reach the kernel as float32 either
    way (tritongrad.kernel), and reduce_partials runs in the compiled graph."""
    op = SUITES[name].op
    args = op.make_inputs(1000, 300, torch.float32, DEVICE)
    compiled = torch.compile(op, fullgraph=True)
    for fn in (op, compiled):
        args = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
        out = fn(*args)
        out.backward(torch.ones_like(out))
        got = (out.detach(), *[a.grad for a in args if isinstance(a, torch.Tensor)])
        if fn is op:
            want = got
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_readme_quick_start_says_what_ran(capsys):
    """The README's quick start, run as it is: it names the path the ops took and prints a result."""
    readme = (ROOT / "README.md").read_text()
    code = readme[readme.index("## Quick start"):].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "README quick start", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == tritongrad.backend(DEVICE) and printed[0].startswith("Triton kernels"), printed
    assert printed[1].startswith("loss ") and "(CrossEntropyBackward)" in printed[1], printed
    if DEVICE == "cpu":  # the figures the README shows
        assert readme.count(printed[1]) == 1, printed[1]


def test_demo_says_what_ran(capsys):
    assert main(["demo"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"tritongrad {tritongrad.__version__}: {tritongrad.backend(DEVICE)}", first

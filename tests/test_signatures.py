"""One signature per op: the registered op's (its forward launcher's) is the schema; its reference and validate
take the same parameters, with the same defaults where they give any; the public function, where it is a
separate wrapper, agrees with it on every parameter both take, and the differences are listed here with why."""

import importlib
import inspect
import pkgutil
import sys

import pytest

import tritongrad
from tritongrad import _pattern

# Parameters a public wrapper and its registered op differ on, on purpose.
PUBLIC_DIFFERS = {
    "tritongrad::cross_entropy": {
        "compute_grad": "set by the wrapper from grad mode and requires_grad",
        "return_lse": "the registered op returns lse by default (its backward needs it); the wrapper on request",
    },
    "tritongrad::linear_cross_entropy": {"grads": "set by the wrapper from grad mode and requires_grad"},
    "tritongrad::linear_token_logprobs": {
        "temperature": "the wrapper's name; the registered op takes its reciprocal, logit_scale",
        "logit_scale": "from temperature",
        "return_stats": "for the GRPO and DPO losses built on the registered op",
        "grad_weight_f32": "for the losses built on the registered op",
        "post_scale": "from temperature where there is a soft cap (the cap sits between the two scales)",
    },
}


def _ops():
    import tritongrad.ops

    for m in pkgutil.iter_modules(tritongrad.ops.__path__):  # every family declares its ops on import
        if m.ispkg:
            importlib.import_module(f"tritongrad.ops.{m.name}")
    return sorted(_pattern._OPS.items())


def _params(fn):
    return inspect.signature(inspect.unwrap(fn)).parameters


def _public(op):
    """The public function of ``op`` where it is a wrapper: the function of the op's name in its module."""
    module = sys.modules[inspect.unwrap(op.forward).__module__]
    fn = getattr(module, op.name, None)
    return fn if callable(fn) and fn is not op and not isinstance(fn, _pattern.Op) else None


def test_the_built_in_ops_are_declared():
    names = {name for name, _ in _ops()}
    assert {"tritongrad::cross_entropy", "tritongrad::linear_cross_entropy", "tritongrad::rms_norm",
            "tritongrad::layer_norm", "tritongrad::apply_rotary_pos_emb", "tritongrad::swiglu",
            "tritongrad::weighted_sum"} <= names
    assert tritongrad.cross_entropy is _public(_pattern._OPS["tritongrad::cross_entropy"])


@pytest.mark.parametrize("name", [name for name, _ in _ops()])
def test_reference_and_validate_take_the_launchers_parameters(name):
    op = _pattern._OPS[name]
    want = op.signature.parameters
    for role, fn in (("reference", op.reference), ("validate", op._validate), ("native", op.native)):
        if fn is None:
            continue
        got = _params(fn)
        assert list(got) == list(want), f"{name}: {role} takes {list(got)}, the op {list(want)}"
        for p in got.values():
            if p.default is not p.empty:
                assert p.default == want[p.name].default, f"{name}: {role}'s default of {p.name}"


@pytest.mark.parametrize("name", [name for name, op in _ops() if _public(op) is not None])
def test_the_public_function_agrees_with_the_registered_op(name):
    op = _pattern._OPS[name]
    pub, want = _params(_public(op)), op.signature.parameters
    differs = PUBLIC_DIFFERS.get(name, {})
    assert set(pub) ^ set(want) <= set(differs), f"{name}: public {list(pub)}, registered {list(want)}"
    for n in set(pub) & set(want):
        if n not in differs:
            assert pub[n].default == want[n].default, f"{name}: the default of {n}"
    positional = [n for n, p in pub.items() if p.kind is p.POSITIONAL_OR_KEYWORD and n in want]
    assert positional == [n for n in want if n in positional], f"{name}: the positional parameters' order"


def _documented_signatures():
    """``(page, name, text)`` of every API table row in README.md and docs/*.md whose first cell is a public
    function's signature: ``| `name(params)` |``, ``...`` where the row leaves the rest out."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    row = re.compile(r"^\| `(?:tritongrad\.)?([A-Za-z_][A-Za-z_0-9]*)\(([^`]*)\)`")
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for line in page.read_text().splitlines():
            m = row.match(line)
            if m and callable(getattr(tritongrad, m.group(1), None)):
                yield page.name, m.group(1), m.group(2)


@pytest.mark.parametrize("page,name,text", list(_documented_signatures()), ids=lambda v: str(v)[:40])
def test_documented_signatures_are_the_functions_own(page, name, text):
    # the API tables of the README and the topic pages list each parameter by its name, in order, with its
    # default and kind (positional or keyword-only); "..." ends a row that leaves the rest out
    import ast

    real_fn = getattr(tritongrad, name)
    real = inspect.signature(real_fn).parameters
    cut = text.rstrip().endswith("...")
    args = ast.parse(f"def f({text.rstrip().removesuffix('...').rstrip().rstrip(',')}): pass").body[0].args
    doc = [(a.arg, "kw" if a in args.kwonlyargs else "pos") for a in args.args + args.kwonlyargs]
    want = [(n, "kw" if p.kind is p.KEYWORD_ONLY else "pos") for n, p in real.items()]
    assert doc == (want[:len(doc)] if cut else want), f"{page}: {name}({text}), not {name}{inspect.signature(real_fn)}"
    defaults = dict(zip([a.arg for a in args.args][len(args.args) - len(args.defaults):], args.defaults))
    defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    for n, node in defaults.items():
        assert ast.literal_eval(node) == real[n].default, f"{page}: {name}'s default of {n}"

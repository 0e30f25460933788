"""The test kit: one battery that any op declared with :func:`tritongrad.op` runs.

    from tritongrad.testing import OpSuite, use_interpreter
    use_interpreter()                      # first, before triton is imported: kernels run on CPU tensors
    suite = OpSuite(softcap, [lambda dtype, device: (torch.randn(7, 33, dtype=dtype, device=device), 5.0)])
    test_softcap = suite.pytest()          # one pytest case per check

Checks (``OpSuite.cases``): for every sample and dtype, the outputs and the gradients against the op's
reference in float64; the same with inputs in other memory layouts, with an extra leading dim, and in mixed
precision where declared; upstream gradients expanded (stride 0) and transposed; gradients for each subset of inputs (``needs_input_grad``); no graph under
``torch.no_grad``; ``torch.autograd.gradcheck`` in float64; ``torch.library.opcheck`` on the registered ops;
``torch.compile(fullgraph=True)``, static and dynamic, forward and backward.

Tolerances are earned, not guessed: a result passes when its error against the float64 reference is at most
``factor`` times the error of a baseline in the same dtype (the reference itself run in that dtype, or plain
eager PyTorch given as ``baseline``), plus a few ulps. Every value check also asserts that the op's own
autograd node ran, so that a test cannot pass on the reference alone.
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def use_interpreter() -> None:
    """Run Triton kernels on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``) when no GPU is
    present. Triton reads the variable once, on import: call this before anything imports triton (the top of
    a conftest.py). Raises if triton was already imported without it."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise RuntimeError(
            "tritongrad.testing.use_interpreter(): triton is already imported without TRITON_INTERPRET=1, so its "
            "kernels cannot run on the CPU in this process. Call it before importing tritongrad or triton, or "
            "set TRITON_INTERPRET=1 in the environment."
        )
    os.environ["TRITON_INTERPRET"] = "1"


def default_device() -> str:
    """``"cuda"`` where a GPU is present, else ``"cpu"`` (kernels in Triton's interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _require_kernels(device) -> None:
    from . import _runtime as rt

    if not rt.uses_triton(torch.device(device)):
        raise RuntimeError(
            "tritongrad.testing: no GPU and Triton's interpreter is off, so the Triton kernels would not run and "
            "the PyTorch reference would be tested in their place. Call tritongrad.testing.use_interpreter() "
            "before triton is imported (e.g. at the top of conftest.py), or set TRITON_INTERPRET=1."
        )


# ---------------------------------------------------------------- inputs
def make_rows(shape: tuple[int, ...], dtype: torch.dtype, device, layout: str = "contiguous", scale=1.0):
    """Random ``shape`` tensor ([..., D]) stored in ``layout``, filled with fresh normal values.

    - transposed:  the memory is [D, ...]: the last dim has the largest stride (x.t() of a contiguous tensor)
    - row-sliced:  rows are a slice of wider rows (row stride > D), as ``big[..., :D]``
    - col-strided: every other column of a wider tensor (column stride 2)
    - permuted:    leading dims swapped, so they cannot be merged into one stride (forces a copy)
    """
    shape = tuple(shape)
    D = shape[-1] if shape else 1
    if layout == "contiguous":
        t = torch.randn(shape, dtype=torch.float32, device=device)
    elif layout == "transposed":
        t = torch.randn(shape[::-1], dtype=torch.float32, device=device).permute(*range(len(shape) - 1, -1, -1))
    elif layout == "row-sliced":
        t = torch.randn((*shape[:-1], D + 7), dtype=torch.float32, device=device)[..., :D]
    elif layout == "col-strided":
        t = torch.randn((*shape[:-1], 2 * D), dtype=torch.float32, device=device)[..., ::2]
    elif layout == "permuted":
        if len(shape) < 3:
            raise ValueError("permuted layout needs at least 3 dims")
        t = torch.randn((shape[1], shape[0], *shape[2:]), dtype=torch.float32, device=device).transpose(0, 1)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    t = (t * scale).to(dtype)
    assert t.shape == shape
    return t


def relayout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The values of ``t`` stored in another layout (see :func:`make_rows`); 0-d and 1-d tensors that the
    layout does not apply to come back unchanged."""
    if t.dim() < 1 or (layout in ("transposed", "permuted") and t.dim() < (2 if layout == "transposed" else 3)):
        return t
    out = make_rows(tuple(t.shape), t.dtype, t.device, layout)
    return out.copy_(t)


# ---------------------------------------------------------------- comparisons
def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - ref.double()).abs().max().item()


def ulp_atol(dtype: torch.dtype, ref: torch.Tensor, ulps: float = 2.0) -> float:
    """``ulps`` units of ``dtype``'s precision at the reference's largest magnitude (at least 1)."""
    scale = max(1.0, ref.detach().abs().max().item()) if ref.numel() else 1.0
    return ulps * torch.finfo(dtype).eps * scale


def assert_close_earned(
    what: str, got: torch.Tensor, ref64: torch.Tensor, baseline: torch.Tensor, factor: float = 2.0, atol: float = 1e-5
) -> None:
    """``|got - ref64|_max <= factor * |baseline - ref64|_max + atol``; also checks shape and finiteness."""
    from . import _runtime as rt

    assert got.shape == ref64.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(ref64.shape)}"
    assert torch.isfinite(got).all() == torch.isfinite(ref64).all(), f"{what}: non-finite values"
    err, base = max_err(got, ref64), max_err(baseline, ref64)
    if got.dtype == torch.bfloat16 and rt.INTERPRET and got.numel():
        # Triton's interpreter converts float32 -> bfloat16 by truncation (a GPU rounds to nearest even):
        # up to one bfloat16 ulp (2**-7 relative) more than a GPU's half ulp.
        atol += 2.0**-7 * ref64.abs().max().item()
    assert err <= factor * base + atol, f"{what}: error {err:.3e} > {factor} x baseline's {base:.3e} + {atol:.3g}"


# ---------------------------------------------------------------- the battery
def _floating(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def _tuple(outs) -> tuple:
    return outs if isinstance(outs, tuple) else tuple(outs) if isinstance(outs, list) else (outs,)


@dataclass
class _Run:
    outs: tuple
    grads: dict  # argument position -> gradient


class OpSuite:
    """The standard battery for one declared op (module docstring).

    Args:
        op: the :class:`tritongrad.Op`.
        samples: callables ``make(dtype, device)`` returning the op's arguments (a tuple, or a dict of keyword
            arguments); tensors of any shapes the op accepts, fresh random values. Name them (``__name__``)
            to name the cases; say in a comment why each is there.
        baseline: plain eager PyTorch with the op's signature, whose error in each dtype sets the tolerance;
            default: the op's reference run in that dtype.
        dtypes: the floating dtypes to run (default float32, float16, bfloat16, float64).
        leading: arguments that take any leading dims together (e.g. ``("x",)``): a case stacks a second
            random batch onto them, adding a leading dim of 2.
        mixed: also run with the first floating tensor in bfloat16 and the other floating tensors in float32.
        factor, ulps: the tolerance, ``factor x baseline error + ulps units of the dtype``.
        compile: include the torch.compile cases (fullgraph; dynamic shapes too).
    """

    def __init__(self, op, samples: Sequence[Callable], *, baseline: Callable | None = None,
                 dtypes: Sequence[torch.dtype] = FLOAT_DTYPES, leading: Sequence[str] = (), mixed: bool = False,
                 factor: float = 2.0, ulps: float = 4.0, compile: bool = True, device: str | None = None):
        self.op = op
        self.samples = list(samples)
        self.baseline = baseline
        self.dtypes = tuple(dtypes)
        self.leading = tuple(leading)
        self.mixed = mixed
        self.factor, self.ulps = factor, ulps
        self.compile = compile
        self.device = device or default_device()
        bad = [n for n in self.leading if n not in op._names]
        if bad:
            raise ValueError(f"OpSuite({op.label}): leading={self.leading} names {bad}, not arguments of the op")

    # ------------------------------------------------------------ cases
    @property
    def cases(self) -> list[tuple[str, Callable[[], None]]]:
        """``(id, check)`` pairs; each check raises AssertionError on failure."""
        out = []
        names = [getattr(s, "__name__", f"sample{i}") for i, s in enumerate(self.samples)]
        names = [n if n != "<lambda>" else f"sample{i}" for i, n in enumerate(names)]
        for (name, sample), dtype in itertools.product(zip(names, self.samples), self.dtypes):
            out.append((f"values-{name}-{str(dtype)[6:]}", _bind(self.check_values, sample, dtype)))
        first, first_name = self.samples[0], names[0]
        for name, sample in zip(names, self.samples):
            for layout in ("transposed", "row-sliced"):
                out.append((f"layout-{layout}-{name}", _bind(self.check_values, sample, torch.float32, layout=layout)))
            if self.leading:
                out.append((f"leading-{name}", _bind(self.check_values, sample, torch.float32, leading=True)))
            if self.mixed:
                out.append((f"mixed-{name}", _bind(self.check_values, sample, torch.bfloat16, mixed=True)))
        out += [
            (f"upstream-grads-{first_name}", _bind(self.check_upstream_grads, first)),
            (f"needs_input_grad-{first_name}", _bind(self.check_needs_input_grad, first)),
            (f"no_grad-{first_name}", _bind(self.check_no_grad, first)),
            (f"gradcheck-{first_name}", _bind(self.check_gradcheck, first)),
            (f"opcheck-{first_name}", _bind(self.check_opcheck, first)),
        ]
        if self.compile:
            out += [(f"compile-{first_name}", _bind(self.check_compile, first, False)),
                    (f"compile-dynamic-{first_name}", _bind(self.check_compile, first, True))]
        return out

    def pytest(self):
        """A pytest test function parametrized over :attr:`cases`; assign it to a ``test_*`` name."""
        import pytest

        cases = self.cases

        @pytest.mark.parametrize("check", [c for _, c in cases], ids=[n for n, _ in cases])
        def test_op(check):
            check()

        return test_op

    def run_all(self) -> None:
        """Every case in turn (outside pytest)."""
        for _, check in self.cases:
            check()

    # ------------------------------------------------------------ inputs
    def _args(self, sample, dtype, *, layout=None, leading=False, mixed=False) -> tuple:
        _require_kernels(self.device)
        made = sample(dtype, self.device)
        args = list(self.op.bind((), made) if isinstance(made, dict) else self.op.bind(tuple(made), {}))
        float_pos = [i for i in self.op.tensor_positions if _floating(args[i])]
        if leading:
            for name in self.leading:
                i = self.op._names.index(name)
                if isinstance(args[i], torch.Tensor):
                    other = torch.randn_like(args[i], dtype=torch.float32).to(args[i].dtype) if _floating(
                        args[i]) else args[i].clone()
                    args[i] = torch.stack([args[i], other])
        if mixed:
            for k, i in enumerate(float_pos):
                args[i] = args[i].to(torch.bfloat16 if k == 0 else torch.float32)
        if layout is not None:
            args = [relayout(a, layout) if i in float_pos else a for i, a in enumerate(args)]
        return tuple(args)

    def _diff(self, args) -> list[int]:
        return [i for i in self.op._diff_positions if _floating(args[i])]

    def _run(self, fn, args, wanted, grads_out) -> _Run:
        """``fn(*args)`` with gradients for positions ``wanted``; ``grads_out``: one upstream gradient per
        output (float64), or None for a forward only."""
        args = list(args)
        for i in wanted:
            args[i] = args[i].detach().requires_grad_()
        outs = _tuple(fn(*args))
        grads = {}
        if grads_out is not None and wanted:
            pairs = [(o, g.to(o.dtype)) for o, g in zip(outs, grads_out) if o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wanted], [g for _, g in pairs],
                                      allow_unused=True)
            grads = dict(zip(wanted, got))
        return _Run(outs, grads)

    def _upcast(self, args) -> tuple:
        return tuple(a.detach().double() if _floating(a) else a for a in args)

    # ------------------------------------------------------------ checks
    def check_values(self, sample, dtype, *, layout=None, leading=False, mixed=False) -> None:
        """Outputs and gradients against the float64 reference, within the earned tolerance; output and
        gradient dtypes as the reference's; the op's own autograd node in the graph."""
        op = self.op
        args = self._args(sample, dtype, layout=layout, leading=leading, mixed=mixed)
        wanted = self._diff(args)
        ref_low = _tuple(op.reference(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args]))
        g = [torch.randn(o.shape, dtype=torch.float64, device=o.device) if o.is_floating_point() else None
             for o in ref_low]
        ref = self._run(op.reference, self._upcast(args), wanted, g)
        got = self._run(op, args, wanted, g)
        base = self._run(self.baseline or op.reference, args, wanted, g)
        from . import _runtime as rt

        # Triton's interpreter rounds float32 -> bfloat16 by truncation (module docstring of
        # assert_close_earned): an intermediate rounded to bfloat16 may then be one bfloat16 ulp off.
        trunc = rt.INTERPRET and any(_floating(a) and a.dtype == torch.bfloat16 for a in args)
        label = f"{op.label}({dtype}{', ' + layout if layout else ''}{', leading dims' if leading else ''}" \
                f"{', mixed' if mixed else ''})"
        assert len(got.outs) == len(ref_low), f"{label}: {len(got.outs)} outputs, the reference returns {len(ref_low)}"
        for k, (o, r, b, lo) in enumerate(zip(got.outs, ref.outs, base.outs, ref_low)):
            assert o.dtype == lo.dtype, f"{label}: output {k} is {o.dtype}, the reference's is {lo.dtype}"
            if wanted and o.requires_grad and torch.device(self.device).type in ("cuda", "cpu"):
                fn_name = type(o.grad_fn).__name__
                assert fn_name == op._function.__name__ + "Backward", (
                    f"{label}: output {k} has grad_fn {fn_name}, not the op's own; its kernels did not run")
            if o.is_floating_point():
                atol = ulp_atol(o.dtype, r, self.ulps) + (ulp_atol(torch.bfloat16, r, 1.0) if trunc else 0.0)
                assert_close_earned(f"{label} output {k}", o, r, b, self.factor, atol)
            else:
                assert torch.equal(o, r), f"{label}: output {k} differs from the reference"
        for i in wanted:
            name = op._names[i]
            gi, ri, bi = got.grads[i], ref.grads[i], base.grads[i]
            assert gi is not None, f"{label}: no gradient for {name}"
            assert gi.dtype == args[i].dtype and gi.shape == args[i].shape, (
                f"{label}: grad of {name} is {gi.dtype} {tuple(gi.shape)}, expected {args[i].dtype} "
                f"{tuple(args[i].shape)}")
            if ri is None:
                ri = torch.zeros_like(gi, dtype=torch.float64)
                bi = torch.zeros_like(gi) if bi is None else bi
            atol = ulp_atol(gi.dtype, ri, self.ulps) + (ulp_atol(torch.bfloat16, ri, 1.0) if trunc else 0.0)
            assert_close_earned(f"{label} grad {name}", gi, ri, bi, self.factor, atol)

    def check_upstream_grads(self, sample) -> None:
        """Upstream gradients of other strides, read through them: one value expanded to each output's shape
        (stride 0, as ``y.sum().backward()`` gives), then a transposed one (a strided one for 1-D outputs);
        gradients against the float64 reference's for the same upstream values."""
        op = self.op
        args = self._args(sample, torch.float32)
        wanted = self._diff(args)
        if not wanted:
            return
        outs = _tuple(op(*args))
        for kind in ("expanded", "transposed"):
            g = []
            for o in outs:
                if not o.is_floating_point():
                    g.append(None)
                elif kind == "expanded":
                    g.append(torch.randn((), dtype=o.dtype, device=o.device).expand(o.shape))
                elif o.dim() >= 2:
                    g.append(relayout(torch.randn(o.shape, dtype=o.dtype, device=o.device), "transposed"))
                else:  # every third element of a wider buffer
                    g.append(torch.randn((*o.shape, 3), dtype=o.dtype, device=o.device)[..., 1])
            got = self._run(op, args, wanted, g)
            ref = self._run(op.reference, self._upcast(args), wanted, [x if x is None else x.double() for x in g])
            base = self._run(self.baseline or op.reference, args, wanted, g)
            for i in wanted:
                ri = ref.grads[i]
                if ri is None:
                    continue
                gi = got.grads[i]
                assert gi is not None, f"{op.label}: no gradient for {op._names[i]} ({kind} upstream gradient)"
                assert_close_earned(f"{op.label} grad {op._names[i]} ({kind} upstream gradient)", gi, ri,
                                    base.grads[i], self.factor, ulp_atol(gi.dtype, ri, self.ulps))

    def check_needs_input_grad(self, sample) -> None:
        """Each differentiable input alone: only its gradient comes back, equal to the all-inputs run's."""
        args = self._args(sample, torch.float32)
        wanted = self._diff(args)
        outs = _tuple(self.op(*args))
        g = [torch.randn(o.shape, dtype=torch.float64, device=o.device) if o.is_floating_point() else None
             for o in outs]
        full = self._run(self.op, args, wanted, g)
        for i in wanted:
            part = self._run(self.op, args, [i], g)
            assert list(part.grads) == [i]
            torch.testing.assert_close(part.grads[i], full.grads[i], msg=lambda m: f"{self.op.label}: grad of "
                                       f"{self.op._names[i]} alone differs from the all-inputs run: {m}")

    def check_no_grad(self, sample) -> None:
        """No graph and nothing saved under no_grad, nor when no input requires grad."""
        args = self._args(sample, torch.float32)
        wanted = self._diff(args)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with torch.no_grad():
                run = self._run(self.op, args, wanted, None)
            plain = _tuple(self.op(*args))
        assert all(o.grad_fn is None and not o.requires_grad for o in run.outs), f"{self.op.label}: a graph under no_grad"
        assert all(o.grad_fn is None for o in plain), f"{self.op.label}: a graph without requires_grad"
        assert not saved, f"{self.op.label}: {len(saved)} tensors saved for a backward that cannot run"

    def check_gradcheck(self, sample) -> None:
        """``torch.autograd.gradcheck`` in float64 on every differentiable input."""
        args = list(self._args(sample, torch.float64))
        for i in self._diff(args):
            args[i] = args[i].detach().requires_grad_()
        assert torch.autograd.gradcheck(self.op, tuple(args), eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=True)

    def check_opcheck(self, sample) -> None:
        """``torch.library.opcheck`` on the registered forward (schema, fake tensors, autograd registration,
        AOT dispatch) and on the registered backward (schema, fake tensors)."""
        op = self.op
        args = self._args(sample, torch.float32)
        diff = self._diff(args)
        req = [a.detach().requires_grad_() if i in diff else a for i, a in enumerate(args)]
        torch.library.opcheck(op.opoverload, tuple(req))
        outs = _tuple(op.opoverload(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args]))
        returned = dict(zip(op.outputs + op.residuals, outs))
        saved = [args[op._names.index(s)] if s in op._names else returned[s] for s in op.save]
        grads = [torch.randn_like(o) for o in outs[: op.n_outputs]]
        nontensor = [args[i] for i in op._nontensor]
        for needs in itertools.product((True, False), repeat=len(op.tensor_positions)):
            if not any(n and i in diff for n, i in zip(needs, op.tensor_positions)):
                continue
            needs = [n and i in diff for n, i in zip(needs, op.tensor_positions)]
            torch.library.opcheck(op.backward_opoverload, (*grads, *saved, *nontensor, needs),
                                  test_utils=("test_schema", "test_faketensor"))

    def check_compile(self, sample, dynamic: bool) -> None:
        """``torch.compile(fullgraph=True)``: forward and gradients equal eager's (Inductor on a GPU, the AOT
        tracer on CPU, where the interpreter's kernels run opaque)."""
        op = self.op
        args = self._args(sample, torch.float32)
        wanted = self._diff(args)
        outs = _tuple(op(*args))
        g = [torch.randn(o.shape, dtype=torch.float64, device=o.device) if o.is_floating_point() else None
             for o in outs]
        backend = "inductor" if torch.device(self.device).type == "cuda" else "aot_eager"
        torch._dynamo.reset()
        compiled = torch.compile(op, fullgraph=True, dynamic=dynamic, backend=backend)
        want = self._run(op, args, wanted, g)
        got = self._run(compiled, args, wanted, g)
        for o, w in zip(got.outs, want.outs):
            torch.testing.assert_close(o, w, atol=1e-5, rtol=1e-5)
        for i in wanted:
            torch.testing.assert_close(got.grads[i], want.grads[i], atol=1e-5, rtol=1e-5)


def _bind(fn, *args, **kwargs):
    def check():
        from . import _pattern

        # Small CUDA inputs would run PyTorch's own ops (tritongrad.set_small_input_threshold): the kit tests
        # the kernels, so that path is off while a check runs.
        prev = _pattern.set_small_input_threshold(0)
        try:
            return fn(*args, **kwargs)
        finally:
            _pattern.set_small_input_threshold(prev)

    check.__name__ = getattr(fn, "__name__", "check")
    return check

"""The test kit: one battery that any op declared with :func:`tritongrad.op` runs.

    from tritongrad.testing import OpSuite, use_interpreter
    use_interpreter()                      # first, before triton is imported: kernels run on CPU tensors
    suite = OpSuite(softcap, [lambda dtype, device: (torch.randn(7, 33, dtype=dtype, device=device), 5.0)])
    test_softcap = suite.pytest()          # one pytest case per check

Checks (``OpSuite.cases``), for every sample: the outputs and the gradients against the op's reference in
float64, in every dtype (16-bit results also element by element, in units of the dtype's precision, so that
math done in 16 bits instead of float32 fails); the same with inputs in other memory layouts (transposed,
row-sliced, col-strided, permuted), with an extra leading dim, and in mixed precision where declared; every
input inside a larger buffer padded with NaN (guard bands: an unmasked read past an edge shows as NaN);
upstream gradients expanded (stride 0) and transposed; gradients for each subset of inputs
(``needs_input_grad``); no graph under ``torch.no_grad``; for an op with a ``native`` small-input version, no
more bytes kept for the backward than the kernels keep (``native-memory``); torch.func ``jvp``, ``vmap`` and
``grad`` against the reference (or a clear refusal); a backward repeated through a retained graph (bitwise equal), after the
caller mutated a returned gradient, and accumulated into existing ``.grad``; ``torch.autograd.gradcheck`` in
float64 on a few elements of each input, with a time cap; ``torch.library.opcheck`` on the registered ops;
``torch.compile(fullgraph=True)``, static and dynamic, forward and backward, with expanded and transposed
upstream gradients.

Tolerances are earned, not guessed: a result passes when its error against the float64 reference is at most
``factor`` times the error of a baseline in the same dtype (the reference itself run in that dtype, or plain
eager PyTorch given as ``baseline``), plus a few ulps. Every value check also asserts that the op's own
autograd node ran, so that a test cannot pass on the reference alone.

Under Triton's interpreter every load and store of every kernel a case launches is checked against the
extents of the launch's tensor arguments (:class:`bounds_checked`): an unmasked access past a buffer, which
would read another allocation or abort the process, fails its case with an IndexError naming the kernel.
``OpSuite(isolate=True)`` (or ``TRITONGRAD_KIT_FORK=1``) runs each case in a forked child as well, for crashes
of other kinds, at some tenths of a second per case.

Two tiers. The quick cases (:attr:`OpSuite.quick_cases`) are the values on every sample (each sample is there
for a mask or a path): in every dtype on the first sample, the representative (make it the one where every
mask is active), and in float32 and one other dtype, the others in turn, on each other sample (each dtype is
there for its casts, and meets the samples' masks and paths as they come round, not as the whole product);
and every other kind of check once, but the static compile (which opcheck and the dynamic trace cover): on the
representative, or, for a layout that does not apply to it, on the first sample it applies to.
``OpSuite.pytest`` marks the rest ``extended``: the other dtypes' values, the static compile, and the other
checks again on the other samples. A project's default test command can leave them out with
``-m "not extended"`` and run them in a second one.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import signal
import sys
import threading
import traceback
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
LAYOUTS = ("transposed", "row-sliced", "col-strided", "permuted", "guarded")

# Elements of NaN before and after every tensor the kit lays out: more than the largest tile a kernel reads past
# an edge, so that an unmasked read lands in them (NaN in a result) rather than outside the allocation.
GUARD = 4096


def _strided_view(shape: tuple, layout: str, alloc: Callable) -> torch.Tensor:
    """A ``shape`` view in ``layout`` of the storage ``alloc(base_shape)`` returns."""
    D = shape[-1] if shape else 1
    if layout in ("contiguous", "guarded"):
        return alloc(shape)
    if layout == "transposed":
        return alloc(shape[::-1]).permute(*range(len(shape) - 1, -1, -1))
    if layout == "row-sliced":
        return alloc((*shape[:-1], D + 7))[..., :D]
    if layout == "col-strided":
        return alloc((*shape[:-1], 2 * D))[..., ::2]
    if layout == "permuted":
        if len(shape) < 3:
            raise ValueError("permuted layout needs at least 3 dims")
        return alloc((shape[1], shape[0], *shape[2:])).transpose(0, 1)
    raise ValueError(f"unknown layout {layout!r}")


def _nan_storage(dtype, device):
    """``alloc`` for :func:`_strided_view`: a NaN-filled buffer with :data:`GUARD` elements on either side."""

    def alloc(base_shape):
        n = math.prod(base_shape)
        buf = torch.full((n + 2 * GUARD,), float("nan"), dtype=dtype, device=device)
        return buf[GUARD:GUARD + n].view(base_shape)

    return alloc


def make_rows(shape: tuple[int, ...], dtype: torch.dtype, device, layout: str = "contiguous", scale=1.0):
    """Random ``shape`` tensor ([..., D]) stored in ``layout``, filled with fresh normal values.

    - transposed:  the memory is [D, ...]: the last dim has the largest stride (x.t() of a contiguous tensor)
    - row-sliced:  rows are a slice of wider rows (row stride > D), as ``big[..., :D]``
    - col-strided: every other column of a wider tensor (column stride 2)
    - permuted:    leading dims swapped, so they cannot be merged into one stride (forces a copy)
    - guarded:     contiguous, inside a larger buffer (see :func:`relayout`)

    The storage around and between the elements holds NaN (floating dtypes), with :data:`GUARD` elements of
    it before and after: a kernel that reads an element it should have masked off produces NaN.
    """
    shape = tuple(shape)
    values = (torch.randn(shape, dtype=torch.float32, device=device) * scale).to(dtype)
    if layout == "contiguous":
        return values
    return relayout(values, layout)


def relayout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The values of ``t`` stored in another layout (see :func:`make_rows`), in a NaN-filled buffer with
    guard bands (floating dtypes; other dtypes: zeros around the elements, no guard bands); 0-d and 1-d tensors
    that a layout does not apply to come back unchanged (``guarded`` applies to every tensor)."""
    if layout != "guarded" and (t.dim() < 1 or (layout in ("transposed", "permuted")
                                                and t.dim() < (2 if layout == "transposed" else 3))):
        return t
    if t.is_floating_point():
        alloc = _nan_storage(t.dtype, t.device)
    else:
        def alloc(base_shape):
            return torch.zeros(base_shape, dtype=t.dtype, device=t.device)
    out = _strided_view(tuple(t.shape), layout, alloc)
    assert out.shape == t.shape
    return out.copy_(t)


def _applies(t, layout: str) -> bool:
    """Whether :func:`relayout` changes how ``t`` is stored."""
    if not isinstance(t, torch.Tensor):
        return False
    if layout == "guarded":
        return True
    if layout == "transposed":
        return t.dim() >= 2
    if layout == "permuted":
        return t.dim() >= 3
    return t.dim() >= 1


# ---------------------------------------------------------------- comparisons
def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest absolute difference where the reference is finite."""
    finite = torch.isfinite(ref)
    if a.numel() == 0 or not finite.any():
        return 0.0
    return (a.double() - ref.double())[finite].abs().max().item()


def eps_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference, in units of ``a.dtype``'s eps at the reference's largest magnitude: a result
    computed in float32 and rounded once is within 0.5 of it; math in a 16-bit dtype drifts further."""
    finite = torch.isfinite(ref)
    if a.numel() == 0 or not finite.any():
        return 0.0
    scale = ref.double()[finite].abs().max().item()
    return max_err(a, ref) / (torch.finfo(a.dtype).eps * scale) if scale else (0.0 if max_err(a, ref) == 0 else
                                                                                math.inf)


def typical_eps_err(a: torch.Tensor, ref: torch.Tensor, q: float = 0.75, floor: float = 2.0**-8) -> float:
    """The ``q`` quantile over the elements of each one's difference in eps of its own magnitude (of ``floor``
    times the largest, for smaller elements). Rounded once from float32, three elements in four are within
    0.375 eps of themselves; math in a 16-bit dtype moves most elements further, most of all the small ones
    (``1 - t*t`` from a rounded ``t``), while a few elements lost in cancellation move the quantile little."""
    finite = torch.isfinite(ref)
    if a.numel() == 0 or not finite.any():
        return 0.0
    r = ref.double()[finite]
    scale = r.abs().max().item()
    diff = (a.double()[finite] - r).abs()
    if not scale:
        return 0.0 if not diff.any() else math.inf
    e = (diff / (torch.finfo(a.dtype).eps * r.abs().clamp_min(floor * scale))).flatten()
    if e.numel() > 2**24:  # torch.quantile's limit: the nearest rank instead of interpolating between two
        return e.kthvalue(min(e.numel(), max(1, round(q * (e.numel() - 1)) + 1))).values.item()
    return e.quantile(q).item()


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
    bad = torch.isfinite(got) != torch.isfinite(ref64)
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements non-finite where the reference's are finite (or the "
                           f"reverse), the first at {tuple(bad.nonzero()[0].tolist())}")
    err, base = max_err(got, ref64), max_err(baseline, ref64)
    if got.dtype == torch.bfloat16 and rt.BF16_TRUNCATES and got.numel():
        # an interpreter that converts float32 -> bfloat16 by truncation (a GPU rounds to nearest even, and
        # so does the one tritongrad patches): up to one bfloat16 ulp (2**-7 relative) more than half an ulp.
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
            to name the cases; say in a comment why each is there. Every case runs on every sample: keep
            them tiny (a few rows, each one there for a mask, a path or a schema of its own).
        baseline: plain eager PyTorch with the op's signature, whose error in each dtype sets the tolerance;
            default: the op's reference run in that dtype.
        dtypes: the floating dtypes to run (default float32, float16, bfloat16, float64).
        leading: arguments that take any leading dims together (e.g. ``("x",)``): a case stacks a second
            random batch onto them, adding a leading dim of 2.
        mixed: also run with the first floating tensor in bfloat16 and the other floating tensors in float32.
        factor, ulps: the tolerance, ``factor x baseline error + ulps units of the dtype``.
        compile: include the torch.compile cases (fullgraph; dynamic shapes too).
        device: where the samples are made and the cases run (default :func:`default_device`: the GPU if there
            is one, else the CPU, whose kernels need Triton's interpreter, :func:`use_interpreter`).
        isolate: run each case in a forked child process, so that a crash of the process fails the case
            instead of ending the session. Out-of-bounds accesses, the usual crash, need no child: under the
            interpreter every case checks each load and store (:class:`bounds_checked`). A child costs its
            case the warm caches (compiled graphs, kernels) of the parent, some tenths of a second, so the
            default is off unless ``TRITONGRAD_KIT_FORK=1``; only under the interpreter (a forked child cannot
            use CUDA).
        gradcheck_seconds: the time cap of a gradcheck case (a wrong gradient fails it, never a slow one).
        known_failures: ``{case id or its prefix: reason}``, cases that fail for a known defect: pytest marks
            them ``xfail(strict=True)``, so that they pass again (and must be unmarked) once it is fixed.
        stop_gradient: ``{sample name: reason}``, samples whose op holds constants made from differentiable
            inputs (a ``detach`` in the reference, e.g. TRL's no-grad weights): the op's gradient is then not
            the derivative of its value, so those samples get no gradcheck; every other check, the gradients
            against the reference's included, still runs.
    """

    def __init__(self, op, samples: Sequence[Callable], *, baseline: Callable | None = None,
                 dtypes: Sequence[torch.dtype] = FLOAT_DTYPES, leading: Sequence[str] = (), mixed: bool = False,
                 factor: float = 2.0, ulps: float = 4.0, compile: bool = True, device: str | None = None,
                 isolate: bool | None = None, gradcheck_seconds: float = 120.0,
                 known_failures: dict | None = None, stop_gradient: dict | None = None):
        self.op = op
        self.samples = list(samples)
        self.baseline = baseline
        self.dtypes = tuple(dtypes)
        self.leading = tuple(leading)
        self.mixed = mixed
        self.factor, self.ulps = factor, ulps
        self.compile = compile
        self.device = device or default_device()
        self.isolate = isolate
        self.gradcheck_seconds = gradcheck_seconds
        self.known_failures = dict(known_failures or {})
        self.stop_gradient = dict(stop_gradient or {})
        unknown = sorted(set(self.stop_gradient) - set(self._names()))
        if unknown:
            raise ValueError(f"OpSuite({op.label}): stop_gradient names {unknown}, not samples of the suite "
                             f"({self._names()})")
        bad = [n for n in self.leading if n not in op._names]
        if bad:
            raise ValueError(f"OpSuite({op.label}): leading={self.leading} names {bad}, not arguments of the op")
        if isolate and torch.device(self.device).type != "cpu":
            raise ValueError(f"OpSuite({op.label}): isolate=True runs each case in a forked child, which cannot "
                             f"use {self.device}; isolate needs device='cpu' (Triton's interpreter)")

    # ------------------------------------------------------------ cases
    @property
    def quick_cases(self) -> list[tuple[str, Callable[[], None]]]:
        """The cases of the quick tier (module docstring), in the order of :attr:`cases`."""
        return [(case_id, check) for case_id, check, quick in self._generate() if quick]

    def _names(self) -> list[str]:
        names = [getattr(s, "__name__", f"sample{i}") for i, s in enumerate(self.samples)]
        return [n if n != "<lambda>" else f"sample{i}" for i, n in enumerate(names)]

    @property
    def cases(self) -> list[tuple[str, Callable[[], None]]]:
        """``(id, check)`` pairs, every check on every sample; each raises AssertionError on failure."""
        return [(case_id, check) for case_id, check, _ in self._generate()]

    def _quick_dtypes(self, i: int) -> set:
        """The dtypes whose values are quick cases on sample ``i``: every dtype on the representative; on each
        other sample float32 (or the first dtype) and one other, the others in turn: every sample meets a second
        dtype's casts, and the dtypes meet the samples as they come round, without the whole product."""
        base = torch.float32 if torch.float32 in self.dtypes else self.dtypes[0]
        rest = [d for d in self.dtypes if d != base]
        if i == 0 or not rest:
            return set(self.dtypes)
        return {base, rest[(i - 1) % len(rest)]}

    def _generate(self) -> list[tuple[str, Callable[[], None], bool]]:
        """``(id, check, quick)``: a case is quick when it checks values in one of the sample's quick dtypes
        (:meth:`_quick_dtypes`), or when no earlier sample has its kind of check (the first sample has them
        all but the layouts that do not apply to it)."""
        out, kinds = [], set()

        def add(kind, name, fn, *args, quick=None, **kwargs):
            case_id = f"{kind}-{name}" if not kind.startswith("values-") else f"values-{name}-{kind[7:]}"
            check = _bind(fn, *args, _isolate=self._isolated(), _what=f"{self.op.label} {case_id}", **kwargs)
            out.append((case_id, check, kind not in kinds if quick is None else quick))
            kinds.add(kind)

        for i, (name, sample) in enumerate(zip(self._names(), self.samples)):
            first = i == 0
            quick_dtypes = self._quick_dtypes(i)
            for dtype in self.dtypes:
                add(f"values-{str(dtype)[6:]}", name, self.check_values, sample, dtype, quick=dtype in quick_dtypes)
            shapes = self._shapes(sample)
            for layout in LAYOUTS:
                if shapes is None or any(_applies(t, layout) for t in shapes):
                    add(f"layout-{layout}", name, self.check_values, sample, torch.float32, layout=layout)
            if self.leading:
                add("leading", name, self.check_values, sample, torch.float32, leading=True)
            if self.mixed:
                add("mixed", name, self.check_values, sample, torch.bfloat16, mixed=True)
            add("upstream-grads", name, self.check_upstream_grads, sample)
            add("needs_input_grad", name, self.check_needs_input_grad, sample)
            add("no_grad", name, self.check_no_grad, sample)
            if self.op.native is not None:
                add("native-memory", name, self.check_native_memory, sample)
            add("backward-reuse", name, self.check_backward_reuse, sample)
            if self.op.scaled_grads and torch.float16 in self.dtypes:
                add("loss-scale", name, self.check_loss_scale, sample)
            add("transforms", name, self.check_transforms, sample)
            if name not in self.stop_gradient:
                add("gradcheck", name, self.check_gradcheck, sample)
            # AOT dispatch with dynamic shapes once: compile-dynamic traces it on every sample.
            add("opcheck", name, self.check_opcheck, sample, aot=first)
            if self.compile:
                # Dynamic shapes on every sample (the launcher's shape logic traced symbolically); the static
                # trace runs the same code on concrete sizes, once, in the extended tier (opcheck and the
                # dynamic trace cover what it adds to eager in the quick one).
                if first:
                    add("compile", name, self.check_compile, sample, False, quick=False)
                add("compile-dynamic", name, self.check_compile, sample, True)
        return out

    def _isolated(self) -> bool:
        if self.isolate is not None:
            return bool(self.isolate)
        from . import _runtime as rt

        return (rt.INTERPRET and hasattr(os, "fork") and torch.device(self.device).type == "cpu"
                and os.environ.get("TRITONGRAD_KIT_FORK", "0") == "1")

    def _shapes(self, sample) -> list | None:
        """The sample's floating tensor arguments on the meta device (shapes only), or None where it cannot
        be made there."""
        try:
            made = sample(torch.float32, "meta")
            args = self.op.bind((), made) if isinstance(made, dict) else self.op.bind(tuple(made), {})
        except Exception:
            return None
        return [args[i] for i in self.op.tensor_positions if _floating(args[i])]

    def pytest(self):
        """A pytest test function parametrized over :attr:`cases`; assign it to a ``test_*`` name. Cases named
        in ``known_failures`` are marked ``xfail(strict=True)`` with their reason; cases outside
        :attr:`quick_cases` are marked ``extended``."""
        import pytest

        params = []
        quick = {case_id for case_id, _ in self.quick_cases}
        for case_id, check in self.cases:
            reason = next((r for k, r in self.known_failures.items() if case_id == k or case_id.startswith(k)),
                          None)
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            if case_id not in quick:
                marks.append(pytest.mark.extended)
            params.append(pytest.param(check, id=case_id, marks=marks))

        @pytest.mark.parametrize("check", params)
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

    def _run(self, fn, args, wanted, grads_out, guard=False) -> _Run:
        """``fn(*args)`` with gradients for positions ``wanted``; ``grads_out``: one upstream gradient per
        output (float64), or None for a forward only; ``guard``: each upstream gradient inside a NaN buffer."""
        args = list(args)
        for i in wanted:
            args[i] = args[i].detach().requires_grad_()
        outs = _tuple(fn(*args))
        grads = {}
        if grads_out is not None and wanted:
            pairs = [(o, g.to(o.dtype)) for o, g in zip(outs, grads_out) if o.requires_grad]
            if guard:
                pairs = [(o, relayout(g, "guarded")) for o, g in pairs]
            got = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wanted], [g for _, g in pairs],
                                      allow_unused=True)
            grads = dict(zip(wanted, got))
        return _Run(outs, grads)

    def _upcast(self, args) -> tuple:
        return tuple(a.detach().double() if _floating(a) else a for a in args)

    # ------------------------------------------------------------ checks
    def check_values(self, sample, dtype, *, layout=None, leading=False, mixed=False) -> None:
        """Outputs and gradients against the float64 reference, within the earned tolerance (for 16-bit
        results also element by element, relative to each element); output and gradient dtypes as the
        reference's; the op's own autograd node in the graph. With a ``layout`` the inputs and the upstream
        gradients sit in NaN-filled buffers (:func:`relayout`)."""
        op = self.op
        args = self._args(sample, dtype, layout=layout, leading=leading, mixed=mixed)
        wanted = self._diff(args)
        ref_low = _tuple(op.reference(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args]))
        # the upstream gradients as the op receives them, in its outputs' dtypes: the reference's exact gradient
        # is then that of the op's own inputs (a 16-bit rounding of them would swamp a cancelling sum)
        g = [torch.randn(o.shape, dtype=torch.float64, device=o.device).to(o.dtype).double()
             if o.is_floating_point() else None for o in ref_low]
        guard = layout is not None
        ref = self._run(op.reference, self._upcast(args), wanted, g)
        before = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
        got = self._run(op, args, wanted, g, guard=guard)
        self._assert_inputs_kept(args, before)
        base = self._run(self.baseline or op.reference, args, wanted, g)
        from . import _runtime as rt

        # an interpreter that rounds float32 -> bfloat16 by truncation (assert_close_earned): an intermediate
        # rounded to bfloat16 may then be one bfloat16 ulp off.
        trunc = rt.BF16_TRUNCATES and any(_floating(a) and a.dtype == torch.bfloat16 for a in args)
        label = f"{op.label}({dtype}{', ' + layout if layout else ''}{', leading dims' if leading else ''}" \
                f"{', mixed' if mixed else ''})"
        assert len(got.outs) == len(ref_low), f"{label}: {len(got.outs)} outputs, the reference returns {len(ref_low)}"
        for k, (o, r, b, lo) in enumerate(zip(got.outs, ref.outs, base.outs, ref_low)):
            self._assert_output(f"{label} output {k}", o, r, b, lo, args, bool(wanted), trunc)
        for i in wanted:
            self._assert_grad(f"{label} grad {op._names[i]}", got.grads[i], ref.grads[i], base.grads[i], args[i],
                              trunc)

    def _assert_inputs_kept(self, args, before) -> None:
        for i, (a, b) in enumerate(zip(args, before)):
            if b is not None:
                assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), (
                    f"{self.op.label}: the input {self.op._names[i]} was overwritten")

    def _assert_output(self, what, o, r, b, lo, args, wanted: bool, trunc) -> None:
        """One output ``o`` against the float64 reference's ``r``, the baseline's ``b`` and the reference's in
        the inputs' dtypes ``lo``: dtype, shape, the op's own autograd node, no memory shared with an input,
        the earned tolerance."""
        op = self.op
        assert o.dtype == lo.dtype, f"{what} is {o.dtype}, the reference's is {lo.dtype}"
        assert o.shape == lo.shape, f"{what} has shape {tuple(o.shape)}, the reference's {tuple(lo.shape)}"
        if wanted and o.requires_grad and torch.device(self.device).type in ("cuda", "cpu"):
            fn_name = type(o.grad_fn).__name__
            assert fn_name == op._function.__name__ + "Backward", (
                f"{what} has grad_fn {fn_name}, not the op's own; its kernels did not run")
        for i in op.tensor_positions:
            a = args[i]
            if isinstance(a, torch.Tensor) and a.numel() and o.numel() and _overlaps(o, a):
                raise AssertionError(f"{what} shares memory with the input {op._names[i]}")
        if o.is_floating_point():
            atol = ulp_atol(o.dtype, r, self.ulps) + (ulp_atol(torch.bfloat16, r, 1.0) if trunc else 0.0)
            assert_close_earned(what, o, r, b, self.factor, atol)
            self._assert_precise(what, o, r, b, trunc)
        else:
            assert torch.equal(o, r), f"{what} differs from the reference"

    def _assert_grad(self, what, gi, ri, bi, arg, trunc) -> None:
        """One input's gradient against the float64 reference's (zeros where the reference has none) and the
        baseline's, in the input's dtype and shape, within the earned tolerance."""
        assert gi is not None, f"{what}: no gradient"
        assert gi.dtype == arg.dtype and gi.shape == arg.shape, (
            f"{what} is {gi.dtype} {tuple(gi.shape)}, expected {arg.dtype} {tuple(arg.shape)}")
        if ri is None:
            ri = torch.zeros_like(gi, dtype=torch.float64)
            bi = torch.zeros_like(gi) if bi is None else bi
        atol = ulp_atol(gi.dtype, ri, self.ulps) + (ulp_atol(torch.bfloat16, ri, 1.0) if trunc else 0.0)
        assert_close_earned(what, gi, ri, bi, self.factor, atol)
        self._assert_precise(what, gi, ri, bi, trunc)

    def _assert_precise(self, what, got, ref, base, trunc) -> None:
        """16-bit results without the few ulps of slack the value check allows. At the largest magnitude
        (:func:`eps_err`): at most ``factor`` times the baseline's error plus one eps. Element by element
        (:func:`typical_eps_err`): the typical element's error in eps of itself at most ``factor`` times the
        baseline's plus a quarter. With an interpreter that truncates to bfloat16 (``rt.BF16_TRUNCATES``): two
        eps, twice the factor and three quarters. Math done in the 16-bit dtype instead of float32 fails
        here where the value check's slack lets it pass."""
        if got.dtype not in (torch.float16, torch.bfloat16) or not got.numel():
            return
        err, b = eps_err(got, ref), eps_err(base, ref)
        limit = self.factor * b + (2.0 if trunc else 1.0)
        assert err <= limit, (f"{what}: error {err:.2f} eps of the largest magnitude > {self.factor} x the "
                              f"baseline's {b:.2f} + {limit - self.factor * b:g} (16-bit math where float32 "
                              f"is due?)")
        # truncation's error is up to twice rounding's, and cancellation multiplies it alike: twice the factor
        err, b = typical_eps_err(got, ref), typical_eps_err(base, ref)
        factor = self.factor * (2.0 if trunc else 1.0)
        limit = factor * b + (0.75 if trunc else 0.25)
        assert err <= limit, (f"{what}: three elements in four within {err:.2f} eps of their own magnitudes > "
                              f"{factor:g} x the baseline's {b:.2f} + {limit - factor * b:g} (16-bit math where "
                              f"float32 is due?)")

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
            g = _odd_upstream(outs, kind)
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

    def check_native_memory(self, sample) -> None:
        """A call autograd records keeps no more bytes for the backward on the small-input path (the op's
        ``native``, where it takes the call) than on the kernels, in bfloat16 (where a float32 copy shows)."""
        from . import _pattern

        args = self._args(sample, torch.bfloat16 if torch.bfloat16 in self.dtypes else self.dtypes[0])
        wanted = self._diff(args)

        def call(threshold):
            prev = _pattern.set_small_input_threshold(threshold)
            try:
                with _pattern.SMALL.on_cpu():
                    return saved_bytes(lambda *a: self._run(self.op, a, wanted, None).outs, *args)
            finally:
                _pattern.set_small_input_threshold(prev)

        small, kernels = call(1 << 62), call(0)
        assert small <= kernels, (
            f"{self.op.label}: its small-input path keeps {small} bytes for the backward, its kernels {kernels}; "
            f"declare it native_grad=False (or make native keep less) for inputs "
            f"{[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]}")

    def check_loss_scale(self, sample) -> None:
        """float16: no gradient the forward makes for an upstream gradient of 1 (a ``scaled_grads`` residual)
        is float16; AMP's loss scale, the upstream gradient, must come before the float16 rounding it exists to
        protect, or a loss's small gradients underflow (docs/writing-an-op.md#gradients-computed-in-the-forward)."""
        op = self.op
        args = list(self._args(sample, torch.float16))
        for i in self._diff(args):
            args[i] = args[i].detach().requires_grad_()
        with torch.no_grad():  # the launcher as autograd's forward calls it
            made = dict(zip(op.residuals, _tuple(op.forward(*args))[op.n_outputs:]))
        for arg, k in op.scaled_grads:
            r = made.get(op.save[k])
            assert not (isinstance(r, torch.Tensor) and r.numel() and r.dtype == torch.float16), (
                f"{op.label}: the forward made {op.save[k]} for {op._names[arg]} in float16 "
                f"{tuple(r.shape)} for an upstream gradient of 1; under AMP's loss scale the backward multiplies "
                f"it in after the rounding, and small gradients underflow: make float16 gradients in the "
                f"backward, or the residual in float32")

    def check_backward_reuse(self, sample) -> None:
        """The caller owns what it gets: a backward through a retained graph three times (upstream gradient
        not 1) gives bitwise the same gradients; so does one after the caller overwrote a returned gradient;
        accumulated into existing ``.grad`` (zeroed, not None), two backwards give twice one."""
        op = self.op
        args = list(self._args(sample, torch.float32))
        wanted = self._diff(args)
        if not wanted:
            return
        for i in wanted:
            args[i] = args[i].detach().requires_grad_()
        inputs = [args[i] for i in wanted]
        outs = _tuple(op(*args))
        pairs = [(o, torch.randn(o.shape, dtype=o.dtype, device=o.device) * 1.5 + 0.25) for o in outs
                 if o.requires_grad]
        if not pairs:
            return
        names = [op._names[i] for i in wanted]

        def backward():
            return torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], retain_graph=True,
                                       allow_unused=True)

        def same(got, want, when):
            _assert_same_grads(op.label, names, got, want, when)

        first = [None if g is None else g.clone() for g in backward()]
        kept = backward()
        same(kept, first, "in backward 2 through the retained graph")
        again = backward()
        same(again, first, "in backward 3 through the retained graph")
        for n, a, b in zip(names, kept, again):
            assert a is None or b is None or not _overlaps(a, b), (
                f"{op.label}: two backwards returned the gradient of {n} in the same memory: the caller owns "
                "every gradient it receives")
        for g in again:
            if g is not None:
                g.fill_(float("nan"))  # the caller's to overwrite
        same(backward(), first, "after the caller overwrote the previous backward's result")
        self._check_accumulation(pairs, inputs, names)

    def _check_accumulation(self, pairs, inputs, names) -> None:
        """Two backwards into ``.grad`` zeroed in place (``zero_grad(set_to_none=False)``) give twice one."""
        for x in inputs:
            x.grad = None
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], retain_graph=True)
        one = [None if x.grad is None else x.grad.clone() for x in inputs]
        for x in inputs:
            if x.grad is not None:
                x.grad.zero_()
        for _ in range(2):
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], retain_graph=True)
        twice = [None if g is None else 2 * g for g in one]
        _assert_same_grads(self.op.label, names, [x.grad for x in inputs], twice,
                           "accumulated twice into a zeroed .grad (expected twice one backward's)")

    def check_transforms(self, sample) -> None:
        """torch.func ``jvp`` (forward-mode AD), ``vmap`` (a batch of 2 of the differentiable inputs) and
        ``grad``, in float64: the same values as the transform applied to the reference, or a RuntimeError
        from the op that names it (``"<op> does not support ..."``)."""
        op = self.op
        args = self._args(sample, torch.float64)
        diff = self._diff(args)
        if not diff:
            return

        def of(fn):
            def f(*xs):
                full = list(args)
                for i, x in zip(diff, xs):
                    full[i] = x
                return tuple(o for o in _tuple(fn(*full)) if o.is_floating_point())

            return f

        f, ref = of(op), of(op.reference)
        primals = tuple(args[i].detach() for i in diff)
        tangents = tuple(torch.randn_like(p) for p in primals)
        batch = tuple(torch.stack([p, torch.randn_like(p)]) for p in primals)
        weights = [torch.randn_like(o) for o in ref(*primals)]
        argnums = tuple(range(len(primals)))

        def loss(fn):
            return lambda *xs: sum((o * w).sum() for o, w in zip(fn(*xs), weights))

        transforms = {
            "torch.func.jvp": lambda fn: torch.func.jvp(fn, primals, tangents),
            "torch.func.vmap": lambda fn: torch.func.vmap(fn)(*batch),
            "torch.func.grad": lambda fn: torch.func.grad(loss(fn), argnums=argnums)(*primals),
        }
        refusal = f"{op.label} does not support"
        for what, apply in transforms.items():
            try:
                want = apply(ref)
            except Exception:
                want = None  # the reference cannot run under it: the op must refuse
            try:
                got = apply(f)
            except RuntimeError as e:
                if str(e).startswith(refusal):
                    continue
                raise AssertionError(f"{op.label} under {what}: {type(e).__name__}: {e}") from e
            assert want is not None, f"{op.label} under {what}: a result where the reference cannot run"
            got, want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
            assert len(got) == len(want), f"{op.label} under {what}: {len(got)} results, the reference's {len(want)}"
            for k, (a, b) in enumerate(zip(got, want)):
                assert a.shape == b.shape and a.dtype == b.dtype, (
                    f"{op.label} under {what}: result {k} is {a.dtype} {tuple(a.shape)}, the reference's "
                    f"{b.dtype} {tuple(b.shape)}")
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, equal_nan=True,
                                           msg=lambda m: f"{op.label} under {what}, result {k}: {m}")

    def check_gradcheck(self, sample) -> None:
        """``torch.autograd.gradcheck`` (fast mode) in float64 on a few elements of each differentiable input
        (spread over it, the last included), the others held, and two random projections of each output: a
        wrong gradient fails in seconds, as torch's slow-mode report on a failure costs two forward runs per
        element checked and two backwards per output. Capped at ``gradcheck_seconds``."""
        op = self.op
        args = list(self._args(sample, torch.float64))
        held, slices = [], []
        for i in self._diff(args):
            a = args[i].detach().contiguous()
            if a.numel():
                idx = torch.linspace(0, a.numel() - 1, min(a.numel(), 6), device=a.device).round().long().unique()
                held.append((i, a, idx))
                slices.append(a.flatten()[idx].clone().requires_grad_())
        if not slices:
            return

        # Each output seen through two fixed random projections: torch's slow-mode report on a failure then
        # runs two backwards per output, not one per output element.
        outs = [o for o in _tuple(op(*args)) if o.is_floating_point()]
        proj = [torch.randn((2, o.numel()), dtype=o.dtype, device=o.device) for o in outs]

        def f(*parts):
            full = list(args)
            for (i, a, idx), part in zip(held, parts):
                full[i] = a.flatten().index_put((idx,), part).view(a.shape)
            got = [o for o in _tuple(op(*full)) if o.is_floating_point()]
            return torch.cat([p @ o.reshape(-1) for p, o in zip(proj, got)])

        with _time_cap(self.gradcheck_seconds, f"{op.label} gradcheck"):
            assert torch.autograd.gradcheck(f, tuple(slices), eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=True)

    def check_opcheck(self, sample, aot: bool = True) -> None:
        """``torch.library.opcheck`` on the registered forward (schema, fake tensors, autograd registration,
        and with ``aot`` AOT dispatch) and on the registered backward (schema, fake tensors)."""
        op = self.op
        args = self._args(sample, torch.float32)
        diff = self._diff(args)
        req = [a.detach().requires_grad_() if i in diff else a for i, a in enumerate(args)]
        utils = ("test_schema", "test_autograd_registration", "test_faketensor") + (
            ("test_aot_dispatch_dynamic",) if aot else ())
        torch.library.opcheck(op.opoverload, tuple(req), test_utils=utils)
        outs = _tuple(op.opoverload(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args]))
        returned = dict(zip(op.outputs + op.residuals, outs))
        saved = [args[op._names.index(s)] if s in op._names else returned[s] for s in op.save]
        grads = [torch.randn_like(o) for o in outs[: op.n_outputs]]
        nontensor = [args[i] for i in op._nontensor]
        # Every input's gradient, then each one alone (the other subsets take the same code paths).
        combos = [[i in diff for i in op.tensor_positions]] + [[i == j for i in op.tensor_positions] for j in diff]
        for needs in combos[: 1 if len(diff) == 1 else None] if diff else []:
            torch.library.opcheck(op.backward_opoverload, (*grads, *saved, *nontensor, needs),
                                  test_utils=("test_schema", "test_faketensor"))

    def check_compile(self, sample, dynamic: bool) -> None:
        """``torch.compile(fullgraph=True)``: forward and gradients equal eager's, for a random upstream
        gradient, an expanded and a transposed one (Inductor on a GPU, the AOT tracer on CPU, where the
        interpreter's kernels run opaque)."""
        op = self.op
        args = self._args(sample, torch.float32)
        wanted = self._diff(args)
        outs = _tuple(op(*args))
        backend = "inductor" if torch.device(self.device).type == "cuda" else "aot_eager"
        torch._dynamo.reset()
        compiled = torch.compile(op, fullgraph=True, dynamic=dynamic, backend=backend)
        for kind in ("random", "expanded", "transposed"):
            g = _odd_upstream(outs, kind)
            want = self._run(op, args, wanted, g)
            with _mutation_analysis_failures() as failed:
                got = self._run(compiled, args, wanted, g)
            assert not failed, (
                f"{op.label} compiled: torch's mutation analysis could not compile a kernel, so it takes every "
                f"tensor argument as written (wrong where arguments alias): {failed[0]}")
            for o, w in zip(got.outs, want.outs):
                torch.testing.assert_close(o, w, atol=1e-5, rtol=1e-5)
            for i in wanted:
                torch.testing.assert_close(got.grads[i], want.grads[i], atol=1e-5, rtol=1e-5, msg=lambda m: (
                    f"{op.label} compiled, grad of {op._names[i]} ({kind} upstream gradient): {m}"))
            if not wanted:
                break


def saved_bytes(fn: Callable, *args) -> int:
    """Bytes that autograd keeps for the backward while ``fn(*args)`` runs: each storage a saved tensor uses,
    once, leaving out the argument tensors' own storages (the caller holds those anyway)."""
    given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    kept: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in given:
            kept[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return sum(kept.values())


@contextlib.contextmanager
def _mutation_analysis_failures():
    """The warnings torch logs while tracing when it cannot compile a Triton kernel to find which arguments
    it writes ("assuming every input is mutated"); collected into the yielded list."""
    failed: list = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "assuming every input is mutated" in record.getMessage():
                failed.append(record.getMessage().splitlines()[0] + (
                    f" ({record.exc_info[1]!r})" if record.exc_info and record.exc_info[1] else ""))

    log = logging.getLogger("torch._higher_order_ops.triton_kernel_wrap")
    handler = Catch(logging.WARNING)
    log.addHandler(handler)
    try:
        yield failed
    finally:
        log.removeHandler(handler)


def _assert_same_grads(label: str, names, got, want, when: str) -> None:
    """Each gradient in ``got`` bitwise equal to ``want``'s (both None, or the same dtype and values)."""
    for n, a, b in zip(names, got, want):
        assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b))), (
            f"{label}: the gradient of {n} {when} differs from the first backward's"
            + ("" if a is None or b is None else f" (max difference {max_err(a, b):.3e})"))


def _odd_upstream(outs, kind: str) -> list:
    """One upstream gradient per output: ``random``, ``expanded`` (one value, stride 0, as ``y.sum()`` gives)
    or ``transposed`` (a strided one for 1-D and 0-d outputs); None for non-floating outputs."""
    g = []
    for o in outs:
        if not o.is_floating_point():
            g.append(None)
        elif kind == "random":
            g.append(torch.randn(o.shape, dtype=torch.float64, device=o.device))
        elif kind == "expanded":
            g.append(torch.randn((), dtype=o.dtype, device=o.device).expand(o.shape))
        elif o.dim() >= 2:
            g.append(relayout(torch.randn(o.shape, dtype=o.dtype, device=o.device), "transposed"))
        else:  # every third element of a wider buffer
            g.append(torch.randn((*o.shape, 3), dtype=o.dtype, device=o.device)[..., 1])
    return g


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' storages share bytes (an output that aliases an input)."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa.nbytes() == 0 or sb.nbytes() == 0:
        return False
    pa, pb = sa.data_ptr(), sb.data_ptr()
    return pa < pb + sb.nbytes() and pb < pa + sa.nbytes()


class _time_cap:
    """Raise AssertionError in the main thread after ``seconds`` (SIGALRM; elsewhere no cap)."""

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what = seconds, what
        self.armed = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()

    def _expired(self, signum, frame):
        raise AssertionError(f"{self.what}: over its time cap of {self.seconds:g} s")

    def __enter__(self):
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._expired)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False


def _in_child(fn, what: str) -> None:
    """``fn()`` in a forked child process; its exception is raised here, and a child killed by a signal (an
    abort inside Triton's interpreter) is an AssertionError that says so."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: run, report through the pipe, exit without running the parent's cleanup
        code = 0
        try:
            os.close(read)
            import faulthandler

            faulthandler.disable()  # a crash is reported by the parent, without the child's thread dump
            try:
                fn()
                payload = pickle.dumps(None)
            except BaseException as e:
                code = 1
                tb = traceback.format_exc()
                try:
                    payload = pickle.dumps((e, tb))
                    pickle.loads(payload)
                except Exception:
                    payload = pickle.dumps((None, tb))
            with os.fdopen(write, "wb") as pipe:
                pipe.write(payload)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        raise AssertionError(f"{what}: the case crashed its process with {signal.Signals(sig).name} (an "
                             "out-of-bounds access in a kernel, say: an unmasked load or store)")
    result = pickle.loads(data) if data else (None, f"the child exited with status {os.WEXITSTATUS(status)} "
                                                    "and no report")
    if result is None:
        return
    error, tb = result
    if error is None:
        raise AssertionError(f"{what}: {tb}")
    error.add_note(f"(raised in the case's forked process)\n{tb}")
    raise error


class bounds_checked:
    """Under Triton's interpreter, while active: every load and store of every kernel launch must address
    elements inside the extent of a tensor argument of that launch (from its first element to its last, by
    its strides), where its mask is on. Anything else raises IndexError naming the kernel, instead of reading
    another allocation's memory or crashing the process (an unmasked store past a buffer corrupts the heap,
    and the interpreter aborts). A no-op without the interpreter. Every kit case runs under it."""

    def __enter__(self):
        from . import _runtime as rt

        self.active = rt.INTERPRET
        if not self.active:
            return self
        import numpy as np
        from triton.runtime import interpreter as ti

        extents: list = []  # (first byte, end byte) per tensor argument of the launch running now
        kernel = [""]
        init, builder = ti.GridExecutor._init_args_hst, ti.interpreter_builder
        load, store = builder.create_masked_load, builder.create_masked_store

        def add(arg):
            if isinstance(arg, tuple):
                for a in arg:
                    add(a)
            elif isinstance(arg, torch.Tensor) and arg.numel():
                span = 1 + sum((n - 1) * st for n, st in zip(arg.shape, arg.stride()))
                extents.append((arg.data_ptr(), arg.data_ptr() + span * arg.element_size()))

        def init_args(executor, args_dev, kwargs):
            args_hst, kwargs_hst = init(executor, args_dev, kwargs)
            extents.clear()
            kernel[0] = getattr(executor.fn, "__name__", "kernel")
            for a in (*args_hst, *kwargs_hst.values()):
                add(a)
            return args_hst, kwargs_hst

        def check(what, ptrs, mask):
            size = np.dtype(ti._get_np_dtype(ptrs.get_element_ty())).itemsize
            addr = np.broadcast_to(ptrs.data, np.broadcast_shapes(ptrs.data.shape, mask.data.shape))
            addr = addr[np.broadcast_to(mask.data, addr.shape)].astype(np.uint64)
            if not addr.size:
                return
            inside = np.zeros(addr.shape, dtype=bool)
            for lo, hi in extents:
                inside |= (addr >= lo) & (addr + size <= hi)
            if not inside.all():
                raise IndexError(f"{kernel[0]}: a {what} of {int((~inside).sum())} elements outside every tensor "
                                 "argument (a missing or wrong mask?)")

        def masked_load(ptrs, mask, other, *rest):
            check("load", ptrs, mask)
            return load(ptrs, mask, other, *rest)

        def masked_store(ptrs, value, mask, *rest):
            check("store", ptrs, mask)
            return store(ptrs, value, mask, *rest)

        self.restore = (ti, init, builder)
        ti.GridExecutor._init_args_hst = init_args
        builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
        return self

    def __exit__(self, *exc):
        if self.active:
            ti, init, builder = self.restore
            ti.GridExecutor._init_args_hst = init
            del builder.create_masked_load, builder.create_masked_store  # back to the class's methods
        return False


def _bind(fn, *args, _isolate: bool = False, _what: str = "", **kwargs):
    def run():
        from . import _pattern

        # Small CUDA inputs would run PyTorch's own ops (tritongrad.set_small_input_threshold): the kit tests
        # the kernels, so that path is off while a check runs.
        prev = _pattern.set_small_input_threshold(0)
        try:
            with bounds_checked():
                return fn(*args, **kwargs)
        finally:
            _pattern.set_small_input_threshold(prev)

    def check():
        if _isolate:
            return _in_child(run, _what or getattr(fn, "__name__", "check"))
        return run()

    check.__name__ = getattr(fn, "__name__", "check")
    return check

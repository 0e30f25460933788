"""The pattern every tritongrad operator follows, written once.

An operator supplies four things:

- ``forward(*args) -> (out, *residuals)``: the host launcher. It allocates its outputs and launches its
  Triton kernels; given fake/meta tensors it only allocates (``_runtime.is_fake``), which makes the same
  function the op's fake (shape) implementation for torch.compile and torch.export.
- ``backward(grad_out, args, residuals, needs) -> grads``: the backward launcher; ``needs`` has one bool
  per tensor input (``ctx.needs_input_grad``), and ``grads`` one tensor or None per tensor input.
- ``reference(*args) -> out``: plain, differentiable PyTorch that accumulates in float32 (float64 for
  float64). Tests compare against it in float64; CPU tensors use it when Triton's interpreter is off.
- ``validate(*args)``: shape checks that name the shapes involved. Dtype and device checks shared by all
  ops (floating dtypes only, every tensor on one device) are done here.
- optionally ``native(*args) -> out``: the same function in PyTorch's own CUDA ops (C++ autograd), or
  ``NotImplemented`` where those ops would be slow (e.g. very long rows). It serves small inputs (below).
  It runs before ``validate``, so it must return a result only for arguments ``validate`` accepts: it
  declines what its PyTorch ops would take but ``validate`` refuses (e.g. a 2-D w that ``torch.matmul``
  would broadcast), and may raise on the rest (PyTorch's own shape checks); on any exception the op runs
  ``validate``, which raises tritongrad's message where the arguments are at fault.

From that, :class:`Op` builds:

- the public callable. In eager mode it skips the dispatcher (a custom op's dispatch costs more than a
  small kernel) and runs a ``torch.autograd.Function`` that calls the launchers directly; under
  ``torch.no_grad()`` or when no input requires grad it calls the forward launcher alone, saving nothing.
- the ``torch.library`` registration ``tritongrad::<name>`` (forward, returns ``(out, *residuals)``) and
  ``tritongrad::<name>_backward``, with CPU/CUDA kernels, fake kernels and autograd. torch.compile and
  torch.export trace these ops (no graph break); ``torch.library.opcheck`` tests them.
- small CUDA inputs (at most :func:`set_small_input_threshold` elements in x, every tensor in x's dtype,
  x contiguous, autocast off): ``native`` serves them. There the host decides the time per call, and a Python
  autograd.Function plus Triton launches costs more host time than PyTorch's whole C++ forward+backward
  (benchmarks/NOTES.md). So that path is tried first, decided by a few attribute reads, and leaves the
  argument checks to PyTorch's ops (see ``native`` above). The choice depends on the inputs alone, so CUDA
  graph capture after a warm-up replays the ops the warm-up ran (no Triton kernel is loaded mid-capture).
  Tracers (torch.compile, export) always record the registered op.
- CPU behaviour: with ``TRITON_INTERPRET=1`` the Triton kernels run on CPU tensors in the interpreter;
  without it the reference serves CPU tensors, and its backward is the reference's autograd.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import _runtime as rt

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_FLOAT_SET = frozenset(FLOAT_DTYPES)
_PLAIN = (torch.Tensor, torch.nn.Parameter)

_LIB = torch.library.Library("tritongrad", "DEF")

# Inputs with at most this many elements in x go to the op's ``native`` PyTorch version (see above). Up to
# 2**22 elements the kernels save at most ~11 us of GPU time per forward+backward and cost hundreds of
# microseconds more host time per call than PyTorch's C++ autograd (benchmarks/NOTES.md, twelfth session).
SMALL_INPUT_THRESHOLD = 1 << 22
_small = [SMALL_INPUT_THRESHOLD]


# The small-input path serves CUDA tensors; tests set this to serve CPU tensors too, to check its handling of
# bad arguments without a GPU.
_serve_cpu = [False]
_is_compiling = torch.compiler.is_compiling
_dispatch_depth = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active


def set_small_input_threshold(numel: int) -> int:
    """Inputs x of at most ``numel`` elements (on CUDA, all tensors of x's dtype, x contiguous) run PyTorch's
    own ops instead of tritongrad's kernels, where host time, not the GPU, decides the time per call.
    0 turns that off. Returns the previous threshold."""
    if type(numel) is not int or numel < 0:
        raise ValueError(f"tritongrad.set_small_input_threshold: numel must be an int >= 0, got {numel!r}")
    prev, _small[0] = _small[0], numel
    return prev


def as_rows(t: torch.Tensor, feature_dims: int = 1) -> torch.Tensor:
    """View ``t`` as [N, D]: leading dims flattened into N, the last ``feature_dims`` dims into D.

    Kernels take both strides of the result, so sliced or transposed 2-D inputs are read in place; a copy
    happens only when the leading dims (or the feature dims) cannot be merged into a single stride.
    """
    if t.dim() == 2 and feature_dims == 1:
        return t
    n = 1
    for s in t.shape[: t.dim() - feature_dims]:
        n *= s
    d = 1
    for s in t.shape[t.dim() - feature_dims:]:
        d *= s
    try:
        return t.view(n, d)
    except RuntimeError:  # leading dims are not mergeable: e.g. a permuted 3-D tensor
        return t.reshape(n, d)


class _Function(torch.autograd.Function):
    """Eager autograd wiring shared by all ops: launchers are called directly, no dispatcher."""

    @staticmethod
    def forward(ctx, op: "Op", *args):
        outs = op.forward(*args)
        ctx.op = op
        op._save(ctx, args, outs[1:])
        return outs[0]

    @staticmethod
    def backward(ctx, grad_out):
        op: Op = ctx.op
        args, residuals = op._restore(ctx)
        if torch.is_grad_enabled() and (
            grad_out.requires_grad or any(t is not None and t.requires_grad for t in (*args, *residuals))
        ):
            # create_graph=True: the launchers are not differentiable, so a second-order gradient would
            # silently miss terms. Refuse instead.
            raise RuntimeError(f"tritongrad.{op.name}: double backward (create_graph=True) is not supported")
        needs = tuple(ctx.needs_input_grad[1 + i] for i in op.tensor_positions)
        grads = op.backward(grad_out, args, residuals, needs)
        return (None, *op._pad(grads))


class Op:
    """One differentiable Triton operator: public callable + torch.library registration.

    ``schema`` lists the forward inputs in torch.library syntax, e.g. ``"Tensor x, Tensor w"`` or
    ``"Tensor x, SymInt[] normalized_shape, Tensor? weight, float eps"``; ``n_residuals`` is the number of
    extra tensors ``forward`` returns for the backward (e.g. the inverse standard deviation of a norm).
    """

    def __init__(
        self,
        name: str,
        schema: str,
        forward: Callable,
        backward: Callable,
        reference: Callable,
        validate: Callable,
        n_residuals: int = 0,
        native: Callable | None = None,
    ):
        self.name = name
        self.forward = forward
        self.backward = backward
        self.reference = reference
        self._validate = validate
        self.n_residuals = n_residuals
        self.native = native
        self.arg_names, types = [], []
        for decl in (a.strip() for a in schema.split(",")):
            typ, arg_name = decl.split()
            types.append(typ)
            self.arg_names.append(arg_name)
        self.tensor_positions = tuple(i for i, t in enumerate(types) if t.startswith("Tensor"))
        self._optional = frozenset(i for i, t in enumerate(types) if t == "Tensor?")
        self._tensor_set = frozenset(self.tensor_positions)
        self._param_positions = self.tensor_positions[1:]
        self._n_args = len(types)
        # A subclass per op, so that y.grad_fn reads e.g. <WeightedSumBackward>.
        self._function = type("".join(p.title() for p in name.split("_")), (_Function,), {})
        # Function.apply minus its Python preamble (default-argument binding, functorch unwrapping), which
        # costs several microseconds per call and does nothing when no functorch transform is active.
        self._apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, self._function)
        self._register(schema)

    # ---------------------------------------------------------------- validation
    def validate(self, *args) -> None:
        device = None
        for i in self.tensor_positions:
            t = args[i]
            name = self.arg_names[i]
            if t is None and i in self._optional:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tritongrad.{self.name}: {name} must be a Tensor, got {type(t).__name__}")
            if t.dtype not in FLOAT_DTYPES:
                raise TypeError(
                    f"tritongrad.{self.name}: {name} has dtype {t.dtype}; supported dtypes are "
                    "float16, bfloat16, float32 and float64"
                )
            if device is None:
                device, first = t.device, name
            elif t.device != device:
                raise ValueError(
                    f"tritongrad.{self.name}: all tensors must be on one device, got {first} on {device} "
                    f"and {name} on {t.device}"
                )
        self._validate(*args)

    # ---------------------------------------------------------------- public entry point
    def __call__(self, *args):
        # Small inputs first (module docstring): a few attribute reads decide, and the argument checks are
        # left to PyTorch's ops and ``native``; whatever does not fit takes the checked path below.
        x = args[0]
        if (
            self.native is not None
            and type(x) in _PLAIN
            and not _is_compiling()  # before reading sizes: a traced size comparison would be a guard
            and 0 < x.numel() <= _small[0]
            and (x.is_cuda or _serve_cpu[0] and x.is_cpu)
        ):
            out = self._native_call(args, x)
            if out is not NotImplemented:
                return out
        self.validate(*args)
        tensors = [args[i] for i in self.tensor_positions if args[i] is not None]
        if _tracing(tensors):
            outs = self._fwd_op(*args)
            return outs[0] if self.n_residuals else outs
        x = tensors[0]
        if not rt.uses_triton(x.device):
            return self.reference(*args)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            if torch._C._are_functorch_transforms_active():
                return self._function.apply(self, *args)  # raises torch's own clear error for vmap/grad
            return self._apply(self, *args)
        return self.forward(*args)[0]

    def _native_call(self, args, x):
        """``native(*args)`` where it computes what tritongrad's kernels would return, else NotImplemented:
        x contiguous (the kernels return a contiguous y), every tensor plain (tracers, dispatch modes and
        torch.func transforms record or refuse tritongrad's op) and of x's floating dtype on x's kind of
        device (no mixed-precision semantics to match), autocast off (PyTorch's ops would change dtypes
        under it, tritongrad's kernels do not)."""
        dtype = x.dtype
        if dtype not in _FLOAT_SET or not x.is_contiguous():
            return NotImplemented
        for i in self._param_positions:
            t = args[i]
            if t is not None and (
                type(t) not in _PLAIN or t.dtype is not dtype or not (t.is_cuda or _serve_cpu[0] and t.is_cpu)
            ):
                return NotImplemented
        # torch.is_autocast_enabled() is CUDA's autocast, and half the host time of the device-type form.
        if _dispatch_depth() or _functorch_active() or torch.is_autocast_enabled():
            return NotImplemented
        try:
            return self.native(*args)
        except Exception as e:
            error = e
        # Outside the handler, so that tritongrad's message is not shown as raised while handling PyTorch's.
        self.validate(*args)
        raise error

    def _save(self, ctx, args, residuals) -> None:
        """Keep what the backward needs: tensor inputs and residuals as saved tensors, the rest on ctx."""
        ctx.nontensor_args = [None if i in self._tensor_set else a for i, a in enumerate(args)]
        ctx.save_for_backward(*[args[i] for i in self.tensor_positions], *residuals)

    def _restore(self, ctx) -> tuple[tuple, tuple]:
        """``(args, residuals)`` as they were given to :meth:`_save`."""
        saved = ctx.saved_tensors
        k = len(self.tensor_positions)
        args = list(ctx.nontensor_args)
        for i, t in zip(self.tensor_positions, saved[:k]):
            args[i] = t
        return tuple(args), saved[k:]

    def _pad(self, grads: Sequence) -> tuple:
        """Gradients of the tensor inputs -> one entry per input (None for non-tensor args)."""
        out = [None] * self._n_args
        for i, g in zip(self.tensor_positions, grads):
            out[i] = g
        return tuple(out)

    # ---------------------------------------------------------------- torch.library registration
    def _register(self, schema: str) -> None:
        name = self.name
        outs = ", ".join(["Tensor"] * (1 + self.n_residuals))
        ret = "Tensor" if self.n_residuals == 0 else f"({outs})"
        residual_decl = "".join(f", Tensor residual{i}" for i in range(self.n_residuals))
        _LIB.define(f"{name}({schema}) -> {ret}")
        _LIB.define(f"{name}_backward(Tensor grad_out, {schema}{residual_decl}, bool[] needs) -> Tensor[]")
        fwd_qual, bwd_qual = f"tritongrad::{name}", f"tritongrad::{name}_backward"

        def unwrap(outs):
            return outs if self.n_residuals else outs[0]

        def fwd_kernel(*args):
            self.validate(*args)
            tensors = [args[i] for i in self.tensor_positions if args[i] is not None]
            if rt.uses_triton(tensors[0].device):
                return unwrap(self.forward(*args))
            # PyTorch path: the output from the reference; residuals are shaped like the launcher's but
            # unused, since the backward of this path differentiates the reference.
            meta = self.forward(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
            out = self.reference(*args)
            return unwrap((out, *[torch.zeros(r.shape, dtype=r.dtype, device=out.device) for r in meta[1:]]))

        def fwd_fake(*args):
            self.validate(*args)
            return unwrap(self.forward(*args))

        def split_bwd_args(all_args):
            grad_out = all_args[0]
            args = all_args[1 : 1 + self._n_args]
            residuals = all_args[1 + self._n_args : 1 + self._n_args + self.n_residuals]
            needs = tuple(all_args[-1])
            return grad_out, args, residuals, needs

        def needed(grads, needs):
            return [g for g, n in zip(grads, needs) if n]

        def bwd_kernel(*all_args):
            grad_out, args, residuals, needs = split_bwd_args(all_args)
            if rt.uses_triton(grad_out.device):
                return needed(self.backward(grad_out, args, residuals, needs), needs)
            return needed(self._reference_backward(grad_out, args, needs), needs)

        def bwd_fake(*all_args):
            grad_out, args, residuals, needs = split_bwd_args(all_args)
            return needed(self.backward(grad_out, args, residuals, needs), needs)

        for key in ("CPU", "CUDA"):
            _LIB.impl(name, fwd_kernel, key)
            _LIB.impl(f"{name}_backward", bwd_kernel, key)
        torch.library.register_fake(fwd_qual, fwd_fake, lib=_LIB)
        torch.library.register_fake(bwd_qual, bwd_fake, lib=_LIB)

        def setup_context(ctx, inputs, output):
            self._save(ctx, inputs, output[1:] if self.n_residuals else ())

        def backward(ctx, grad_out, *_residual_grads):
            args, residuals = self._restore(ctx)
            needs = [ctx.needs_input_grad[i] for i in self.tensor_positions]
            grads = iter(self._bwd_op(grad_out, *args, *residuals, needs))
            return self._pad([next(grads) if n else None for n in needs])

        torch.library.register_autograd(fwd_qual, backward, setup_context=setup_context, lib=_LIB)

        def no_double_backward(ctx, *grads):
            raise RuntimeError(f"tritongrad.{name}: double backward (create_graph=True) is not supported")

        torch.library.register_autograd(bwd_qual, no_double_backward, lib=_LIB)
        self._fwd_op = getattr(torch.ops.tritongrad, name).default
        self._bwd_op = getattr(torch.ops.tritongrad, f"{name}_backward").default

    def _reference_backward(self, grad_out, args, needs):
        """Backward of the PyTorch path: the reference's vector-Jacobian product. torch.func.vjp works
        inside a dispatcher kernel, where the autograd keys are already handled."""
        wanted = [i for i, n in zip(self.tensor_positions, needs) if n]

        def f(*diff):
            full = list(args)
            for i, t in zip(wanted, diff):
                full[i] = t
            return self.reference(*full)

        _, vjp = torch.func.vjp(f, *[args[i] for i in wanted])
        got = iter(g.detach() for g in vjp(grad_out))
        return [next(got) if n else None for n in needs]


def _tracing(tensors: list[torch.Tensor]) -> bool:
    """True under torch.compile/export tracing, a dispatch mode (make_fx, FakeTensorMode) or for tensor
    subclasses: then the registered op must be used so the trace records it."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return True
    for t in tensors:
        if type(t) not in _PLAIN:
            return True
    return False

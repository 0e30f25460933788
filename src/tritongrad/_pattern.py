"""The pattern every tritongrad operator follows, written once and public: :func:`op` and :func:`kernel`.

An operator is three plain functions and a declaration::

    @tritongrad.op("mylib::softcap", reference=softcap_reference, save=("out",))
    def softcap(x: Tensor, cap: float = 30.0) -> Tensor:        # the forward launcher
        ...allocate, launch Triton kernels through tritongrad.kernel, return the output(s)...

    @softcap.backward
    def _(ctx, grad_out):                                        # the backward launcher
        ...ctx.out, ctx.cap, ctx.needs_input_grad...; return grad_x

- The forward launcher's annotated signature is the op's schema (as ``torch.library.custom_op`` infers it:
  keyword-only arguments and defaults allowed). It returns its outputs, then its ``residuals`` (extra tensors
  for the backward only, e.g. a norm's inverse standard deviation), as one tensor or a tuple.
- The backward launcher gets ``ctx`` (every argument of the forward by name, the saved tensors by name,
  ``ctx.needs_input_grad`` with one bool per forward argument) and one gradient per output. It returns one
  gradient per tensor input (or per argument, as ``torch.autograd.Function`` does); only those asked for
  are used.
- ``reference``: the same function in plain PyTorch, float64-capable. Tests compare against it; CPU tensors
  use it when Triton's interpreter is off.
- Launchers never check for fake tensors: the launch helper (:func:`kernel`) records a launch while
  torch.compile or torch.export trace the op, and skips it where only shapes exist.

From that the pattern builds:

- the public callable. In eager mode it skips the dispatcher and runs a ``torch.autograd.Function`` that
  calls the launchers directly (a dispatcher round trip costs more host time than a small kernel); under
  ``torch.no_grad()`` or when no input requires grad it calls the forward launcher alone, saving nothing;
- the ``torch.library`` ops ``ns::name`` (outputs and residuals) and ``ns::name_backward``, registered with
  ``torch.library.triton_op``: torch.compile and torch.export trace through them, so Inductor sees the Triton
  kernels and launches them itself (no Python launcher per call in compiled code). Under Triton's
  interpreter the kernels cannot be traced, and the ops are opaque custom ops instead; so are ops declared
  ``opaque=True``, whose launchers loop on the host (chunks written into slices of a buffer), which Inductor
  would unroll into copies. Autograd, fake tensors, vmap (a loop over the batch, for the registered op
  called directly) and, where declared, autocast are registered too;
- torch.func transforms (grad, vjp, jacrev, jvp, jacfwd, vmap, functionalize) and forward-mode AD
  (``torch.autograd.forward_ad`` dual tensors among the inputs): the launchers give no tangents and have no
  batching rule, so the op runs its ``reference`` there, which computes the same function and which PyTorch
  differentiates in both modes and batches. Eager and inside torch.compile alike. Where the reference cannot
  run under the transform (it reads tensor values, say), a RuntimeError names the op and the transform;
- checks every op shares: each tensor argument a Tensor (or None where optional), of a floating dtype (index
  arguments: an integer dtype), all on one device; then the op's own ``validate``. Messages name the op,
  the argument, its shape, dtype and device;
- small CUDA inputs (at most :func:`set_small_input_threshold` elements in the first tensor, every tensor in
  its dtype, contiguous, autocast off) go to the op's ``native`` PyTorch version where it has one: there the
  host decides the time per call, and PyTorch's C++ autograd costs less host time than a Python
  autograd.Function (docs/host-path.md). ``native`` may return ``NotImplemented`` to decline, and may raise
  (PyTorch's own shape checks); then the op's checks run and raise tritongrad's message. A call that autograd
  records (an input requires grad) goes there only for an op declared ``native_grad=True``, whose PyTorch ops
  keep no more for the backward than its kernels do; otherwise the kernels serve it, and ``native`` serves
  calls without gradients alone (a cast copy saved for PyTorch's backward would cost memory in every layer).

Re-declaring an op in the same process (a notebook cell run twice) replaces its launchers, reference and
checks in place; a new signature for the same name is refused with a message that says what to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import typing
from typing import Callable, Mapping, Sequence

import torch
import torch.autograd.forward_ad as _fwad

from . import _runtime as rt

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

_FLOAT_SET = frozenset(FLOAT_DTYPES)
_PLAIN = rt.PLAIN_TENSORS

# Inputs with at most this many elements go to the op's ``native`` PyTorch version (see above; measured in
# docs/host-path.md).
SMALL_INPUT_THRESHOLD = 1 << 22


@dataclasses.dataclass(slots=True)
class SmallInputs:
    """The small-input path's settings (module docstring); one instance, ``SMALL``."""

    threshold: int = SMALL_INPUT_THRESHOLD  # inputs of at most this many elements (set_small_input_threshold)
    serve_cpu: bool = False  # CPU tensors too, not only CUDA ones (tests: ``with SMALL.on_cpu():``)

    @contextlib.contextmanager
    def on_cpu(self):
        """Serve CPU tensors too inside the block: tests check the path's handling of bad arguments there."""
        prev, self.serve_cpu = self.serve_cpu, True
        try:
            yield self
        finally:
            self.serve_cpu = prev


SMALL = SmallInputs()
_is_compiling = torch.compiler.is_compiling
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_dispatch_depth = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled


def _tracing() -> bool:
    """Whether torch.compile or torch.export traces this code: Dynamo, or make_fx, which traces AOTAutograd's
    backward (where torch.compiler.is_compiling() answers False on some versions)."""
    return _is_compiling() or torch._C._get_dispatch_mode(_PROXY) is not None


def eager_autograd(t: torch.Tensor) -> bool:
    """Whether an op called now on ``t`` runs its eager torch.autograd.Function (:meth:`Op._checked_call`): a
    plain tensor that requires grad, with gradients on, on a device whose kernels run, outside tracing,
    dispatch modes, torch.func transforms and forward-mode AD on ``t``."""
    if _is_compiling() or type(t) not in _PLAIN or not t.requires_grad or not _grad_enabled():
        return False  # tracing first: nothing past it is traced
    return rt.uses_triton(t.device) and not (_dispatch_depth() or under_transform(t))


def under_transform(*tensors) -> bool:
    """Whether a torch.func transform is active, or forward-mode AD gives one of ``tensors`` a tangent: where
    an op runs its reference (module docstring)."""
    return _functorch_active() or (_fwad._current_level >= 0 and any(
        t is not None and _fwad.unpack_dual(t).tangent is not None for t in tensors))


# Every op declared in this process, by qualified name: a re-declaration updates the entry in place.
_OPS: dict[str, "Op"] = {}


def set_small_input_threshold(numel: int) -> int:
    """Inputs of at most ``numel`` elements (on CUDA, all tensors of one dtype, contiguous) run PyTorch's own
    ops instead of tritongrad's kernels, where host time, not the GPU, decides the time per call. 0 turns that
    off (e.g. before capturing CUDA graphs). Returns the previous threshold."""
    if type(numel) is not int or numel < 0:
        raise ValueError(f"tritongrad.set_small_input_threshold: numel must be an int >= 0, got {numel!r}")
    prev, SMALL.threshold = SMALL.threshold, numel
    return prev


kernel = rt.Kernel


def size_hint(n) -> int:
    """An int to choose a launch plan by (block sizes, warps): ``n`` itself, or a symbolic size's hint while
    torch.compile traces with dynamic shapes, without adding a guard. Plans may depend on it only for speed:
    grids and buffer sizes take the size itself, so that the traced launch is right for every value."""
    return rt.hint(n)


def op(
    name: str,
    *,
    reference: Callable,
    validate: Callable | None = None,
    residuals: Sequence[str] = (),
    outputs: Sequence[str] | None = None,
    save: Sequence[str] | None = None,
    index: Sequence[str] = (),
    nondiff: Sequence[str] = (),
    native: Callable | None = None,
    native_grad: bool = False,
    unsaved: Callable | None = None,
    autocast: torch.dtype | None = None,
    opaque: bool = False,
    scaled_grads: Mapping[str, str] | None = None,
    traced_backward: Callable | None = None,
) -> Callable[[Callable], "Op"]:
    """Declare a differentiable operator from its forward launcher (decorated) and a PyTorch reference.

    Args:
        name: ``"namespace::name"``, e.g. ``"mylib::softcap"``: the torch.library name
            (``torch.ops.mylib.softcap``; its backward is ``torch.ops.mylib.softcap_backward``).
        reference: plain PyTorch with the launcher's signature, returning the outputs (no residuals);
            differentiable and float64-capable. The tests' reference, the CPU path without Triton, and what
            the op runs under torch.func transforms (grad, vjp, jacrev, jvp, jacfwd, vmap) and forward-mode
            AD (dual tensors among the inputs): differentiable in both modes and batchable by vmap, it gives
            exact tangents and batches where the launchers would give none. A reference that cannot run there
            makes the op refuse the transform with a RuntimeError naming both.
        validate: optional checks with the launcher's signature; raise with a message that names the
            shapes. Type, dtype and device checks are done by the pattern.
        residuals: names of the tensors the forward returns after its outputs, for the backward only.
        outputs: names of the outputs (default ``out``, or ``out0``, ``out1``, ...), for ``save``.
        save: what the backward reads as saved tensors: names of tensor inputs, outputs or residuals.
            Default: every tensor input and every residual.
        index: tensor arguments that hold indices (int64/int32, no gradient), e.g. class targets.
        nondiff: floating tensor arguments the op gives no gradient for (e.g. rotary cos/sin tables); passing
            one that requires grad, with grad enabled, is an error rather than a silently missing gradient.
        native: optional, for small inputs: the op in PyTorch's own ops with C++ autograd (module docstring).
        native_grad: ``native`` also serves calls that autograd records. Declare it only where its ops keep no
            more for the backward than the kernels' saved tensors: the kit's ``native-memory`` case checks.
        unsaved: optional, with the launcher's signature: the names in ``save`` that the backward will not read
            for this call (an input whose gradients the forward computed, say); they are saved as None, so
            that autograd does not keep them alive. Called with fake tensors too: read shapes and flags only.
        autocast: under CUDA autocast, floating tensor inputs are cast to this dtype first, as PyTorch's
            autocast policy does for e.g. layer_norm (``torch.float32``). None: autocast leaves the op alone.
        opaque: torch.compile and torch.export call the op as one opaque custom op (its launchers run in
            Python) instead of tracing into them. For launchers that loop over chunks on the host and write
            each into a slice of a buffer: traced, Inductor unrolls the loop and turns every slice write into
            out-of-place copies (docs/writing-an-op.md#opaque-ops).
        scaled_grads: ``{input: residual}`` for an op with one output whose forward computes gradients for
            an upstream gradient of 1 (a loss): wherever ``residual`` is saved and not empty, the gradient of
            ``input`` is ``residual`` times the output's 0-d upstream gradient. The registered autograd (what
            torch.compile and torch.export trace) then computes it in PyTorch ops instead of calling the
            backward op, so that Inductor may write it over the residual, whose buffer the backward donates,
            rather than into a second one (docs/writing-an-op.md#gradients-computed-in-the-forward).
        traced_backward: optional, with the backward launcher's signature: the backward in PyTorch ops, which
            the registered autograd runs instead of the backward op where torch.compile or torch.export trace
            it (grad mode off). For elementwise ops: Inductor fuses it and writes the gradients over the saved
            inputs' buffers, which the backward donates, where the backward op must allocate them beside
            those inputs (docs/writing-an-op.md#a-backward-for-tracing).

    Returns a decorator; the decorated launcher becomes the :class:`Op`, whose ``.backward`` decorator
    attaches the backward launcher. Declaring a name again updates that op in place.
    """

    def declare(forward: Callable) -> Op:
        new = Op(name, forward, reference=reference, validate=validate, residuals=residuals, outputs=outputs,
                 save=save, index=index, nondiff=nondiff, native=native, native_grad=native_grad, unsaved=unsaved,
                 autocast=autocast, opaque=opaque, scaled_grads=scaled_grads, traced_backward=traced_backward)
        old = _OPS.get(name)
        if old is None:
            _OPS[name] = new
            return new
        old._take_launchers_of(new)
        return old

    return declare


def _tensor_kind(annotation) -> str | None:
    """'tensor', 'optional' or None for a resolved annotation."""
    if annotation is torch.Tensor:
        return "tensor"
    if typing.get_origin(annotation) is typing.Union and set(typing.get_args(annotation)) == {torch.Tensor, type(None)}:
        return "optional"
    return None


def _count_returns(annotation, label: str) -> int:
    if annotation is torch.Tensor:
        return 1
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple and args and all(a is torch.Tensor for a in args):
        return len(args)
    raise TypeError(
        f"{label}: annotate the forward launcher's return as Tensor or tuple[Tensor, ...] (outputs, then "
        f"residuals); got {annotation!r}"
    )


def _positional(fn: Callable | None, params: list) -> Callable | None:
    """``fn`` (with the launcher's signature ``params``) callable with every argument positionally, where the
    signature has keyword-only parameters: those are passed by name."""
    k = next((i for i, p in enumerate(params) if p.kind is p.KEYWORD_ONLY), None)
    if fn is None or k is None:
        return fn
    names = [p.name for p in params[k:]]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args[:k], **dict(zip(names, args[k:])), **kwargs)

    return call


def _as_tuple(outs) -> tuple:
    return outs if isinstance(outs, tuple) else tuple(outs) if isinstance(outs, list) else (outs,)


def _split_name(name) -> tuple[str, str]:
    if not isinstance(name, str) or name.count("::") != 1 or not all(name.split("::")):
        raise ValueError(f"tritongrad.op: name must be 'namespace::name', e.g. 'mylib::softcap', got {name!r}")
    namespace, short = name.split("::")
    return namespace, short


def _positions(label: str, what: str, names: Sequence[str], params: list, tensors: tuple) -> frozenset:
    """Positions of the tensor arguments ``names`` (``index=``, ``nondiff=``); a ValueError for others."""
    all_names = [p.name for p in params]
    unknown = [n for n in names if n not in all_names or all_names.index(n) not in tensors]
    if unknown:
        raise ValueError(f"{label}: {what}={tuple(names)} names {unknown}, which are not tensor arguments")
    return frozenset(all_names.index(n) for n in names)


class _Params(typing.NamedTuple):
    """The forward launcher's parameters, as the op binds and checks arguments (the Op's ``_<field>``
    attributes, and ``tensor_positions``)."""

    params: list
    names: list
    nargs: int
    tensor_positions: tuple  # tensor arguments (optional ones included)
    optional: frozenset  # tensor arguments that may be None
    index: frozenset  # class indices: integer dtypes, no gradient
    nondiff: frozenset  # floating, no gradient
    no_grad: frozenset
    diff_positions: tuple  # the tensors the op differentiates
    nontensor: tuple
    nontensor_names: tuple
    defaults: list
    first: int  # the first tensor argument: its device and size decide the path

    @classmethod
    def of(cls, label: str, signature: inspect.Signature, index: Sequence[str], nondiff: Sequence[str]) -> "_Params":
        params = list(signature.parameters.values())
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) for p in params):
            raise TypeError(f"{label}: the forward launcher takes named arguments only (no *args, **kwargs "
                            f"or positional-only ones): {signature}")
        names = [p.name for p in params]
        kinds = [_tensor_kind(p.annotation) for p in params]
        tensors = tuple(i for i, k in enumerate(kinds) if k is not None)
        if not tensors:
            raise TypeError(f"{label}: the forward launcher takes no Tensor argument: {signature}")
        index_pos = _positions(label, "index", index, params, tensors)
        nondiff_pos = _positions(label, "nondiff", nondiff, params, tensors)
        no_grad = index_pos | nondiff_pos
        nontensor = tuple(i for i in range(len(params)) if i not in tensors)
        return cls(params, names, len(params), tensors, frozenset(i for i, k in enumerate(kinds) if k == "optional"),
                   index_pos, nondiff_pos, no_grad, tuple(i for i in tensors if i not in no_grad), nontensor,
                   tuple(names[i] for i in nontensor), [p.default for p in params], tensors[0])


class Saved(typing.NamedTuple):
    """Where a saved tensor comes from: the argument at ``index``, or (``output``) the ``index``-th returned
    tensor (outputs, then residuals)."""

    name: str
    output: bool
    index: int


class _Returns(typing.NamedTuple):
    """What the forward launcher returns, and what the backward reads of it and of the arguments."""

    residuals: tuple
    n_outputs: int
    outputs: tuple
    save: tuple
    sources: tuple  # a Saved per name in ``save``

    @classmethod
    def of(cls, label: str, signature: inspect.Signature, names: list, tensors: tuple, residuals, outputs,
           save) -> "_Returns":
        total = _count_returns(signature.return_annotation, label)
        residuals = tuple(residuals)
        n_outputs = total - len(residuals)
        if n_outputs < 1:
            raise ValueError(f"{label}: {total} returned tensors leave no output after residuals {residuals}")
        outputs = tuple(outputs) if outputs is not None else (
            ("out",) if n_outputs == 1 else tuple(f"out{i}" for i in range(n_outputs)))
        if len(outputs) != n_outputs:
            raise ValueError(f"{label}: outputs={outputs} names {len(outputs)} outputs; the launcher "
                             f"returns {n_outputs} (and {len(residuals)} residuals)")
        returned = outputs + residuals
        tensor_names = [names[i] for i in tensors]
        save = tuple(save) if save is not None else (*tensor_names, *residuals)
        bad = [s for s in save if s not in tensor_names and s not in returned]
        if bad:
            raise ValueError(f"{label}: save={save} names {bad}: neither a tensor input "
                             f"({', '.join(tensor_names)}) nor an output or residual ({', '.join(returned)})")
        sources = tuple(Saved(s, False, names.index(s)) if s in tensor_names else Saved(s, True, returned.index(s))
                        for s in save)
        return cls(residuals, n_outputs, outputs, save, sources)


def _scaled_grads_positions(label: str, scaled_grads, names: list, diff: tuple, save: tuple, residuals: tuple,
                            n_outputs: int) -> tuple:
    """``scaled_grads`` as ``((argument position, index in save), ...)``; a ValueError names what does not fit."""
    if not scaled_grads:
        return ()
    if n_outputs != 1:
        raise ValueError(f"{label}: scaled_grads needs an op with one output; it has {n_outputs}")
    out = []
    for arg, res in dict(scaled_grads).items():
        if arg not in names or names.index(arg) not in diff:
            raise ValueError(f"{label}: scaled_grads names {arg!r}, which is not a differentiable tensor argument")
        if res not in residuals or res not in save:
            raise ValueError(f"{label}: scaled_grads maps {arg!r} to {res!r}, which is not a saved residual "
                             f"(residuals {residuals}, save {save})")
        out.append((names.index(arg), save.index(res)))
    return tuple(out)


def _scaled(op: "Op", saved: tuple, grad: torch.Tensor | None, needs: list) -> list | None:
    """The gradients of ``op.scaled_grads``' residuals times the 0-d upstream gradient, in PyTorch ops, one per
    tensor input (None where not needed); None where that does not serve this backward: an input needed that
    has no saved, non-empty residual, a non-scalar upstream gradient, or grad mode on (a graph of the backward
    asked for, which this product would leave without the op's second derivatives)."""
    if not op.scaled_grads or grad is None or grad.dim() != 0 or torch.is_grad_enabled():
        return None
    of = dict(op.scaled_grads)
    out = []
    for i, n in zip(op.tensor_positions, needs):
        if not n:
            out.append(None)
            continue
        res = saved[of[i]] if i in of else None
        if res is None or res.numel() == 0:
            return None
        acc = torch.promote_types(torch.promote_types(res.dtype, grad.dtype), torch.float32)
        v = res.to(acc) * grad.to(acc)
        if res.element_size() == 2:  # 16-bit through float32, as the kernels round (ops/_tl.round_to)
            v = v.to(torch.float32)
        out.append(v.to(res.dtype))
    return out


class _Function(torch.autograd.Function):
    """Eager autograd wiring shared by all ops: launchers are called directly, no dispatcher."""

    @staticmethod
    def forward(ctx, op: "Op", *args):
        outs = _as_tuple(op.forward(*args))
        ctx.op = op
        op._save(ctx, args, outs)
        if op.n_outputs == 1:
            return outs[0]
        return outs[: op.n_outputs]

    @staticmethod
    def backward(ctx, *grads):
        op: Op = ctx.op
        saved = ctx.saved_tensors  # once: each access unpacks every saved tensor again
        if torch.is_grad_enabled() and (
            any(g is not None and g.requires_grad for g in grads)
            or any(t is not None and t.requires_grad for t in saved)
        ):
            # create_graph=True: the launchers are not differentiable, so a second-order gradient would
            # silently miss terms. Refuse instead.
            raise RuntimeError(f"{op.label}: double backward (create_graph=True) is not supported")
        values = dict(zip(op._nontensor_names, ctx.nontensor_args))
        values.update(zip(op.save, saved))
        grads = op._grads(BackwardContext(op, values, ctx.needs_input_grad[1:], eager=True), grads)
        return (None, *op._pad(grads))


class Op:
    """A differentiable Triton operator declared with :func:`op`; call it with the launcher's signature.

    Attributes: ``qualname`` (``"mylib::softcap"``), ``signature``, ``outputs``, ``residuals``, ``save``,
    ``forward`` and ``reference`` (the functions given), ``opoverload`` and ``backward_opoverload`` (the
    registered torch.library ops).
    """

    def __init__(self, name, forward, *, reference, validate=None, residuals=(), outputs=None, save=None,
                 index=(), nondiff=(), native=None, native_grad=False, unsaved=None, autocast=None, opaque=False,
                 scaled_grads=None, traced_backward=None):
        # Declaration: the name, the forward launcher's parameters (the schema) and what it returns.
        self.qualname = name
        self.namespace, self.name = _split_name(name)
        self.label = f"{self.namespace}.{self.name}"
        self.signature = inspect.signature(forward, eval_str=True)
        params = _Params.of(self.label, self.signature, index, nondiff)
        self.tensor_positions = params.tensor_positions
        self.__dict__.update({f"_{k}": v for k, v in params._asdict().items() if k != "tensor_positions"})
        returns = _Returns.of(self.label, self.signature, self._names, self.tensor_positions, residuals, outputs, save)
        self.residuals, self.n_outputs, self.outputs, self.save = (
            returns.residuals, returns.n_outputs, returns.outputs, returns.save)
        self._save_src = returns.sources
        self.autocast = autocast
        self.opaque = bool(opaque)
        self.scaled_grads = _scaled_grads_positions(self.label, scaled_grads, self._names, self._diff_positions,
                                                    self.save, self.residuals, self.n_outputs)
        # Binding: the pattern passes every argument positionally; keyword-only parameters are then bound by name.
        self.forward, self.reference, self._validate, self.native = (
            _positional(f, self._params) for f in (forward, reference, validate, native))
        self.native_grad = bool(native_grad)
        self._unsaved = _positional(unsaved, self._params)
        self._backward_fn = None
        self.traced_backward = traced_backward
        self.declared_inputs: DeclaredInputs | None = None
        # Registration (torch.library) waits for the backward (``_register``); the autograd path is one
        # Function subclass per op, so that y.grad_fn reads e.g. <SoftcapBackward>.
        self._fwd_def = None
        self._function = type("".join(p.title() for p in self.name.split("_")), (_Function,), {})
        # Function.apply minus its Python preamble (default-argument binding, functorch unwrapping), which
        # costs several microseconds per call and does nothing when no functorch transform is active.
        self._apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, self._function)
        functools.update_wrapper(self, forward, updated=())

    def _layout(self) -> tuple:
        return (str(self.signature), self.outputs, self.residuals, self.save, self._index, self._nondiff,
                self.autocast, self.opaque, self.scaled_grads)

    def _take_launchers_of(self, new: "Op") -> None:
        """A re-declaration: keep this op's registration, run the new launchers, reference and checks."""
        if new._layout() != self._layout():
            raise RuntimeError(
                f"{self.label} is already declared in this process as {self.signature} (outputs {self.outputs}, "
                f"residuals {self.residuals}, save {self.save}); the new declaration differs, and torch.library "
                "cannot change a registered op. Keep the declaration, choose another name, or restart Python."
            )
        self.forward, self.reference, self._validate, self.native = new.forward, new.reference, new._validate, new.native
        self.native_grad = new.native_grad
        self._unsaved = new._unsaved
        self.traced_backward = new.traced_backward
        functools.update_wrapper(self, new.forward, updated=())

    def backward(self, fn: Callable) -> Callable:
        """Decorator: attach the backward launcher ``fn(ctx, *grad_outputs)`` and register the op."""
        self._backward_fn = fn
        self._register()
        return fn

    def inputs(self, *, fwd_bytes: Callable[[int, int, int], int], bwd_bytes: Callable[[int, int, int], int],
               shapes: Sequence[tuple[int, int]] | None = None) -> Callable[[Callable], Callable]:
        """Decorator: declare how to make the op's arguments for a size ``N x D``, and the bytes each pass must
        move there; the test kit (:meth:`sample`) and ``tritongrad bench --op`` both use it::

            @weighted_sum.inputs(fwd_bytes=lambda N, D, s: N * D * s + D * s + N * s,      # x, w, y
                                 bwd_bytes=lambda N, D, s: 2 * N * D * s + 2 * D * s + N * s)  # x, w, g, gx, gw
            def _(N, D, dtype, device):
                return torch.randn(N, D, dtype=dtype, device=device), torch.randn(D, dtype=dtype, device=device)

        The function returns the op's arguments (a tuple, or a dict by name) with fresh random values, tensors
        not requiring grad (the bench and the kit set that on the arguments the op differentiates).
        ``fwd_bytes(N, D, s)`` / ``bwd_bytes(N, D, s)``: the fewest bytes the forward / backward must read and
        write, every tensor at ``s`` bytes an element (the floor GB/s is measured against). ``shapes``: the
        ``(N, D)`` the bench sweeps on a GPU by default."""
        if not (callable(fwd_bytes) and callable(bwd_bytes)):
            raise TypeError(f"{self.label}.inputs: fwd_bytes and bwd_bytes are functions (N, D, itemsize) -> bytes")

        def declare(make: Callable) -> Callable:
            self.declared_inputs = DeclaredInputs(make, fwd_bytes, bwd_bytes,
                                                  tuple(tuple(s) for s in shapes) if shapes else None)
            return make

        return declare

    def make_inputs(self, N: int, D: int, dtype: torch.dtype, device) -> tuple:
        """The declared inputs (:meth:`inputs`) for ``N x D``: every argument, defaults filled in, the floating
        tensors the op differentiates requiring grad. Raises ValueError, saying what to declare, where the op
        declares none, and where the declared function fails or returns what the op does not take."""
        if self.declared_inputs is None:
            raise ValueError(
                f"{self.label} declares no inputs: add, after the op's declaration, "
                f"@{self.name}.inputs(fwd_bytes=lambda N, D, s: ..., bwd_bytes=lambda N, D, s: ...) on a function "
                f"(N, D, dtype, device) returning its arguments for a size N x D (docs/writing-an-op.md)")
        try:
            made = self.declared_inputs.make(N, D, dtype, device)
            args = self.bind((), made) if isinstance(made, dict) else self.bind(tuple(made), {})
            self.check(args)
        except Exception as e:
            raise ValueError(f"{self.label}: its declared inputs for {N}x{D} {dtype} cannot be built: "
                             f"{type(e).__name__}: {e}") from e
        return tuple(
            a.detach().requires_grad_() if i in self._diff_positions and isinstance(a, torch.Tensor)
            and a.is_floating_point() else a for i, a in enumerate(args))

    def sample(self, N: int, D: int) -> Callable:
        """A sample for the test kit (``OpSuite(op, [op.sample(5, 37), ...])``) made by the declared inputs at
        ``N x D``: ``make(dtype, device)`` returning the arguments, named ``"<N>x<D>"``."""
        if self.declared_inputs is None:
            self.make_inputs(N, D, torch.float32, "meta")  # raises: says what to declare
        make = self.declared_inputs.make

        def sample(dtype, device):
            return make(N, D, dtype, device)

        sample.__name__ = f"{N}x{D}"
        return sample

    # ---------------------------------------------------------------- checks
    def check(self, args: tuple) -> None:
        """The checks every op shares (types, dtypes, one device), then the op's own ``validate``."""
        device = None
        for i in self.tensor_positions:
            t = args[i]
            name = self._names[i]
            if t is None and i in self._optional:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.label}: {name} must be a Tensor, got {type(t).__name__}")
            if i in self._index:
                if t.dtype not in INDEX_DTYPES:
                    raise TypeError(f"{self.label}: {name} holds class indices and must be int64 or int32, got "
                                    f"{t.dtype} of shape {tuple(t.shape)}")
            elif t.dtype not in _FLOAT_SET:
                raise TypeError(
                    f"{self.label}: {name} has dtype {t.dtype} (shape {tuple(t.shape)}); supported dtypes are "
                    "float16, bfloat16, float32 and float64"
                )
            if i in self._nondiff and t.requires_grad and _grad_enabled():
                raise ValueError(f"{self.label}: {name} {tuple(t.shape)} requires grad, but the op gives no gradient "
                                 f"for it; pass {name}.detach(), or run under torch.no_grad()")
            if device is None:
                device, first = t.device, (name, tuple(t.shape))
            elif t.device != device:
                raise ValueError(
                    f"{self.label}: all tensors must be on one device, got {first[0]} {first[1]} on {device} "
                    f"and {name} {tuple(t.shape)} on {t.device}"
                )
        if self._validate is not None:
            self._validate(*args)

    # ---------------------------------------------------------------- public entry point
    def bind(self, args: tuple, kwargs: dict) -> tuple:
        """Positional and keyword arguments -> one value per parameter, defaults filled in."""
        n = len(args)
        if n > self._nargs:
            raise TypeError(f"{self.label}() takes {self._nargs} arguments but {n} were given")
        full = list(args) + self._defaults[n:]
        for k, v in kwargs.items():
            if k not in self._names:
                raise TypeError(f"{self.label}() got an unexpected keyword argument {k!r}")
            i = self._names.index(k)
            if i < n:
                raise TypeError(f"{self.label}() got multiple values for argument {k!r}")
            full[i] = v
        missing = [self._names[i] for i, v in enumerate(full) if v is inspect.Parameter.empty]
        if missing:
            raise TypeError(f"{self.label}() missing required argument(s): {', '.join(missing)}")
        return tuple(full)

    def __call__(self, *args, **kwargs):
        if kwargs or len(args) != self._nargs:
            args = self.bind(args, kwargs)
        x = args[self._first]
        # Small inputs first (module docstring): a few attribute reads decide, and the argument checks are
        # left to PyTorch's ops and ``native``; whatever does not fit takes the checked path below.
        if (
            self.native is not None
            and type(x) in _PLAIN
            and not _is_compiling()  # before reading sizes: a traced size comparison would be a guard
            and 0 < x.numel() <= SMALL.threshold
            and (x.is_cuda or SMALL.serve_cpu and x.is_cpu)
        ):
            out = self._native_call(args, x)
            if out is not NotImplemented:
                return out
        return self._checked_call(args)

    def _checked_call(self, args: tuple):
        """The op on bound arguments, checked: autocast, then the PyTorch path, transforms, tracing, the
        eager autograd.Function, or the forward launcher alone."""
        self.check(args)
        x = args[self._first]
        if self.autocast is not None and x.is_cuda and torch.is_autocast_enabled():
            with torch.autocast("cuda", enabled=False):
                return self(*self._autocast_args(args))
        if not rt.uses_triton(x.device):
            return self.reference(*args)
        if _functorch_active() or (_fwad._current_level >= 0 and self._dual(args)):
            # The launchers give no tangents and no batching rule: the reference computes the same function,
            # and PyTorch differentiates it in both modes and batches it.
            return self._under_transform(args)
        if _is_compiling() or _dispatch_depth() or self._subclassed(args):
            # Tracers, dispatch modes and tensor subclasses record or run the op.
            return self._user(self.opoverload(*args))
        if _grad_enabled() and any(args[i] is not None and args[i].requires_grad for i in self._diff_positions):
            return self._apply(self, *args)
        return self._user(self.forward(*args))

    def _dual(self, args) -> bool:
        """Whether a tensor argument carries a forward-mode AD tangent (torch.autograd.forward_ad)."""
        for i in self.tensor_positions:
            if args[i] is not None and _fwad.unpack_dual(args[i]).tangent is not None:
                return True
        return False

    def _under_transform(self, args):
        """The op under a torch.func transform or forward-mode AD: its reference, or a RuntimeError that
        names the op and the transform where the reference cannot run there."""
        try:
            return self.reference(*args)
        except Exception as e:
            error = e
        raise RuntimeError(
            f"{self.label} does not support {_transform_name()}: under it the op runs its PyTorch reference "
            f"(its kernels give no tangents and no batching rule), which raised {type(error).__name__}: {error}"
        ) from error

    def _subclassed(self, args) -> bool:
        for i in self.tensor_positions:
            if args[i] is not None and type(args[i]) not in _PLAIN:
                return True
        return False

    def _autocast_args(self, args) -> tuple:
        return tuple(
            a.to(self.autocast) if i in self.tensor_positions and i not in self._index and a is not None
            and a.dtype in _FLOAT_SET else a
            for i, a in enumerate(args)
        )

    def _user(self, outs):
        """The outputs a caller sees: residuals dropped, one tensor for one output."""
        if not isinstance(outs, (tuple, list)):
            return outs
        return outs[0] if self.n_outputs == 1 else tuple(outs[: self.n_outputs])

    def _native_call(self, args, x):
        """``native(*args)`` where it computes what tritongrad's kernels would return, else NotImplemented:
        x contiguous, every tensor plain (tracers, dispatch modes and torch.func transforms record or refuse
        tritongrad's op) and of x's floating dtype on x's kind of device (no mixed-precision semantics to
        match), autocast off (PyTorch's ops would change dtypes under it); a call that autograd records only
        where the op is declared ``native_grad``."""
        dtype = x.dtype
        if dtype not in _FLOAT_SET or not x.is_contiguous():
            return NotImplemented
        for i in self.tensor_positions:
            t = args[i]
            if t is not None and t is not x and (
                type(t) not in _PLAIN or (i not in self._index and t.dtype is not dtype)
                or not (t.is_cuda or SMALL.serve_cpu and t.is_cpu)
            ):
                return NotImplemented
        if not self.native_grad and _grad_enabled() and any(
                args[i] is not None and args[i].requires_grad for i in self._diff_positions):
            return NotImplemented
        # torch.is_autocast_enabled() is CUDA's autocast, and half the host time of the device-type form.
        if _dispatch_depth() or _functorch_active() or torch.is_autocast_enabled():
            return NotImplemented
        try:
            return self.native(*args)
        except Exception as e:
            error = e
        # Outside the handler, so that tritongrad's message is not shown as raised while handling PyTorch's.
        self.check(args)
        raise error

    # ---------------------------------------------------------------- autograd plumbing
    def _save(self, ctx, args, outs) -> None:
        """Keep what the backward needs: the saved tensors, and the non-tensor arguments on ctx."""
        ctx.nontensor_args = [args[i] for i in self._nontensor]
        # The reference's backward (no Triton on this device) reads every saved tensor.
        drop = self._unsaved(*args) if self._unsaved is not None and rt.uses_triton(args[self._first].device) else ()
        ctx.save_for_backward(*[None if s.name in drop else outs[s.index] if s.output else args[s.index]
                                for s in self._save_src])

    def _grads(self, bctx: "BackwardContext", grads, fn: Callable | None = None) -> list:
        """The backward launcher's result (or ``fn``'s) as one gradient (or None) per tensor input."""
        if self._backward_fn is None:
            raise RuntimeError(f"{self.label} has no backward: declare one with @{self.name}.backward")
        got = _as_tuple((fn or self._backward_fn)(bctx, *grads))
        k = len(self.tensor_positions)
        if len(got) == self._nargs and len(got) != k:
            got = [got[i] for i in self.tensor_positions]
        if len(got) != k:
            raise RuntimeError(
                f"{self.label}: the backward returned {len(got)} gradients; expected one per tensor input "
                f"({k}: {', '.join(self._names[i] for i in self.tensor_positions)}) or one per argument ({self._nargs})"
            )
        out = []
        for i, g in zip(self.tensor_positions, got):
            if not bctx.needs_input_grad[i] or i in self._no_grad:
                out.append(None)
            elif g is None:
                raise RuntimeError(f"{self.label}: the backward returned None for {self._names[i]}, whose gradient "
                                   "was asked for")
            else:
                out.append(g)
        return out

    def _pad(self, grads: Sequence) -> tuple:
        """Gradients of the tensor inputs -> one entry per argument (None for non-tensor args)."""
        out = [None] * self._nargs
        for i, g in zip(self.tensor_positions, grads):
            out[i] = g
        return tuple(out)

    # ---------------------------------------------------------------- torch.library registration
    @property
    def opoverload(self) -> torch._ops.OpOverload:
        """The registered forward, ``torch.ops.<namespace>.<name>.default``: outputs, then residuals."""
        self._register()
        return self._fwd_def._opoverload

    @property
    def backward_opoverload(self) -> torch._ops.OpOverload:
        """``torch.ops.<namespace>.<name>_backward.default``: (grad per output, saved tensors, non-tensor
        arguments, needs per tensor input) -> the gradients asked for."""
        self._register()
        return self._bwd_def._opoverload

    def _register(self) -> None:
        if self._fwd_def is not None:
            return
        self._fwd_def, self._bwd_def = _register(self)

    def _reference_backward(self, grads, bctx: "BackwardContext") -> list:
        """The backward of the PyTorch path (no Triton for these tensors): the reference's vector-Jacobian
        product. It needs the tensor inputs, so it works where the op saves them (the default)."""
        missing = [self._names[i] for i in self._diff_positions if self._names[i] not in self.save]
        if missing:
            raise RuntimeError(f"{self.label}: tensors on a device Triton does not serve need the reference's "
                               f"backward, which needs {missing} saved (save={self.save})")
        args = [bctx.__dict__.get(n) for n in self._names]
        wanted = [i for i in self._diff_positions if bctx.needs_input_grad[i]]
        if rt.is_fake(grads[0]):  # shapes only (torch.compile, export): torch.func cannot run on fake tensors
            return [torch.empty_like(args[i]) if i in wanted else None for i in self.tensor_positions]

        def f(*diff):
            full = list(args)
            for i, t in zip(wanted, diff):
                full[i] = t
            return _as_tuple(self.reference(*full))

        _, vjp = torch.func.vjp(f, *[args[i] for i in wanted])
        got = dict(zip(wanted, (g.detach() for g in vjp(tuple(grads)))))
        return [got.get(i) for i in self.tensor_positions]

    def __repr__(self) -> str:
        return f"<tritongrad op {self.qualname}{self.signature}>"


class DeclaredInputs(typing.NamedTuple):
    """What :meth:`Op.inputs` declared: ``make(N, D, dtype, device)`` -> the op's arguments; the bytes each
    pass must move, ``fwd_bytes(N, D, itemsize)`` and ``bwd_bytes(N, D, itemsize)``; the default sweep."""

    make: Callable
    fwd_bytes: Callable[[int, int, int], int]
    bwd_bytes: Callable[[int, int, int], int]
    shapes: tuple[tuple[int, int], ...] | None


class BackwardContext:
    """What a backward launcher receives as ``ctx``: the forward's non-tensor arguments and saved tensors as
    attributes, ``needs_input_grad`` (one bool per forward argument), ``op`` (the :class:`Op`) and ``eager``:
    True when eager autograd runs the backward through the op's own autograd.Function, False in the
    registered backward op (traced, compiled, exported, opcheck), where a launcher must not write into its
    saved tensors."""

    def __init__(self, op: Op, values: dict, needs_input_grad: tuple, eager: bool = False):
        self.__dict__.update(values)
        self.op = op
        self.needs_input_grad = needs_input_grad
        self.eager = eager

    def __getattr__(self, name: str):
        # Reached only for names not set in __init__: a tensor the declaration did not save.
        op = self.__dict__.get("op")
        if op is not None and (name in op._names or name in op.outputs or name in op.residuals):
            raise AttributeError(f"{op.label}: the backward reads ctx.{name}, which is not saved; add {name!r} to "
                                 f"the op's save=... (saved now: {', '.join(op.save) or 'nothing'})")
        raise AttributeError(name)


def _context(op: Op, nontensor: Sequence, saved: Sequence, needs: Sequence[bool]) -> BackwardContext:
    """The registered backward's ``ctx``: the non-tensor arguments and saved tensors by name, and ``needs`` (one
    per tensor input) spread over the forward's arguments."""
    values = dict(zip(op._nontensor_names, nontensor))
    values.update(zip(op.save, saved))
    full_needs = [False] * op._nargs
    for i, n in zip(op.tensor_positions, needs):
        full_needs[i] = bool(n)
    return BackwardContext(op, values, tuple(full_needs))


def _register(op: Op):
    """Register ``op`` and its backward with torch.library; returns their CustomOpDefs."""
    n_returned = op.n_outputs + len(op.residuals)
    ret = torch.Tensor if n_returned == 1 else tuple[(torch.Tensor,) * n_returned]
    # The registered schema takes every argument positionally, without defaults: the Op binds keywords and
    # defaults before it calls the registered op.
    params = [p.replace(default=inspect.Parameter.empty, kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
              for p in op._params]

    def fwd_impl(*args):
        op.check(args)
        rt.keep_source_tag()  # traced here before torch.compile keys its caches (rt.note_sources)
        device = args[op._first].device
        if rt.uses_triton(device):
            return _one(_as_tuple(op.forward(*args)))
        # The PyTorch path: outputs of the reference, and empty residuals (its backward is the reference's).
        out = _as_tuple(op.reference(*args))
        return _one((*out, *[torch.empty(0, device=device) for _ in op.residuals]))

    fwd_impl.__signature__ = inspect.Signature(params, return_annotation=ret)

    P = inspect.Parameter.POSITIONAL_OR_KEYWORD
    grad_params = [inspect.Parameter(f"grad_{n}", P, annotation=torch.Tensor) for n in op.outputs]
    saved_params = [inspect.Parameter(f"saved_{n}", P, annotation=typing.Optional[torch.Tensor]) for n in op.save]
    tail = [params[i] for i in op._nontensor] + [inspect.Parameter("needs", P, annotation=list[bool])]
    n_grads, n_saved = len(grad_params), len(saved_params)

    def bwd_impl(*all_args):
        grads = all_args[:n_grads]
        needs = all_args[-1]
        bctx = _context(op, all_args[n_grads + n_saved:-1], all_args[n_grads:n_grads + n_saved], needs)
        if rt.uses_triton(grads[0].device):
            got = op._grads(bctx, grads)
        else:
            got = op._reference_backward(grads, bctx)
        return [g for g, n in zip(got, needs) if n]

    bwd_impl.__signature__ = inspect.Signature([*grad_params, *saved_params, *tail],
                                               return_annotation=list[torch.Tensor])
    fwd_def = _define(op.qualname, fwd_impl, op.opaque)
    bwd_def = _define(op.qualname + "_backward", bwd_impl, op.opaque)

    def setup_context(ctx, inputs, output):
        outs = _as_tuple(output)
        op._save(ctx, inputs, outs)
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs[: op.n_outputs]]

    def backward(ctx, *grads):
        needs = [bool(ctx.needs_input_grad[i]) and i not in op._no_grad for i in op.tensor_positions]
        if not any(needs):
            return op._pad([None] * len(needs))
        # An output that did not reach the loss gets no gradient from autograd: zeros, as the launcher expects.
        g = [gr if gr is not None else torch.zeros(s, dtype=d, device=dv)
             for gr, (s, d, dv) in zip(grads[: op.n_outputs], ctx.out_meta)]
        scaled = _scaled(op, ctx.saved_tensors, g[0], needs)
        if scaled is not None:
            return op._pad(scaled)
        if op.traced_backward is not None and _tracing() and not torch.is_grad_enabled():
            bctx = _context(op, ctx.nontensor_args, ctx.saved_tensors, needs)
            return op._pad(op._grads(bctx, g, op.traced_backward))
        got = iter(bwd_def._opoverload(*g, *ctx.saved_tensors, *ctx.nontensor_args, needs))
        return op._pad([next(got) if n else None for n in needs])

    fwd_def.register_autograd(backward, setup_context=setup_context)

    def no_double_backward(ctx, *grads):
        raise RuntimeError(f"{op.label}: double backward (create_graph=True) is not supported")

    bwd_def.register_autograd(no_double_backward)
    fwd_def.register_vmap(functools.partial(_vmap_loop, fwd_def))
    if op.autocast is not None:
        fwd_def.register_autocast("cuda", op.autocast)
    rt.note_kernels(op.qualname, op.forward)
    rt.note_kernels(op.qualname + "_backward", op._backward_fn)
    rt.note_sources(*[f for f in (op.forward, op._backward_fn, op.traced_backward, op.reference) if f is not None])
    return fwd_def, bwd_def


def _transform_name() -> str:
    """The innermost active torch.func transform (``torch.func.vmap``, ...), else forward-mode AD."""
    interpreter = torch._C._functorch.peek_interpreter_stack()
    if interpreter is None:
        return "forward-mode AD (torch.autograd.forward_ad)"
    kind = str(interpreter.key()).rsplit(".", 1)[-1].lower()
    return {"grad": "torch.func.grad/vjp/jacrev", "jvp": "torch.func.jvp/jacfwd", "vmap": "torch.func.vmap"}.get(
        kind, f"the torch.func transform {kind}")


def _one(outs: tuple):
    return outs[0] if len(outs) == 1 else outs


def _define(qualname: str, impl: Callable, opaque: bool):
    """``torch.library.triton_op`` where the Triton kernels compile for a GPU: torch.compile and torch.export
    trace through ``impl`` and see its kernels. Otherwise (Triton's interpreter, no GPU, or ``opaque``) an
    opaque ``torch.library.custom_op`` whose fake implementation is ``impl`` itself, launches skipped on fake
    tensors (``rt.Kernel``): interpreted kernels cannot be traced."""
    if opaque or rt.INTERPRET or not torch.cuda.is_available():
        d = torch.library.custom_op(qualname, impl, mutates_args=())
        d.register_fake(impl)
        return d
    return torch.library.triton_op(qualname, impl, mutates_args=())


def _vmap_loop(op_def, info, in_dims, *args):
    """vmap without a batching rule of the op's own: one call per batch element, stacked."""
    n = info.batch_size
    outs = []
    for b in range(n):
        # A list argument (normalized_shape) comes with a list of in_dims: only tensors are sliced.
        sliced = [a.select(d, b) if d is not None and isinstance(a, torch.Tensor) else a
                  for a, d in zip(args, in_dims)]
        outs.append(op_def._opoverload(*sliced))
    if isinstance(outs[0], (tuple, list)):
        return tuple(torch.stack(o) for o in zip(*outs)), tuple(0 for _ in outs[0])
    return torch.stack(outs), 0

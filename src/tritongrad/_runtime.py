"""What every launcher needs to know about the machine, computed once, and the launch helper.

- whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1`` set before triton was imported);
- which devices the Triton kernels serve;
- :class:`Kernel` (public as ``tritongrad.kernel``): launches a ``@triton.jit`` function with little host
  time in eager mode, records it for torch.compile/export while they trace, and skips it on fake tensors;
- ``as_rows`` (a tensor as [N, D] without copying where strides allow) and ``hint`` (a size to plan with,
  symbolic or not);
- cached device properties (the SM count sizes persistent grids; shared memory bounds pipelining);
- the accumulation dtype of an input dtype, and its Triton spelling;
- launch heuristics shared by ops: the row split of a column reduction's first stage, the row tile of
  row-wise ops (norms), the longest row that small inputs hand to PyTorch's own ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import struct
import types
from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import driver as _driver
from torch._subclasses.fake_tensor import FakeTensor

from ._dtypes import acc_dtype, acc_of  # noqa: F401 (the launchers read them as rt.acc_dtype, rt.acc_of)


@triton.jit
def _probe_kernel():
    pass


# triton.jit returns an interpreter-backed function when TRITON_INTERPRET=1 was set at import time.
INTERPRET: bool = type(_probe_kernel).__name__ == "InterpretedFunction"


def _interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter reads a scalar as a loop bound with ``int(array)``, which numpy 2.4 refuses for
    its one-element arrays (every ``tl.range`` bound derived from ``tl.program_id``); later Triton squeezes
    the array first. Where the installed interpreter has the old conversion, its per-launch patch of
    ``tl.tensor`` gets the later one on top."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    try:
        old = "int(self.handle.data)" in inspect.getsource(patch_tensor)
    except (TypeError, OSError):
        return
    if not old:
        return

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = _patch_lang_tensor


def _interpreter_patches_once_a_launch() -> None:
    """Triton's interpreter patches ``triton.language`` for the interpreter when a kernel starts (and restores
    it when the kernel ends), and again at every call of a ``@triton.jit`` helper inside it, each time by
    walking every member of the language's modules: in kernels written with helpers that walk is most of the
    interpreter's time. A helper whose modules the running kernel has patched already skips it; one that sees
    a module the kernel does not is patched as before, and restored when the kernel ends (the interpreter
    drops a helper's patches unrestored, which left ``triton.language.core`` patched after any kernel that
    names only ``triton.language`` and calls ``tl.zeros``)."""
    from triton.runtime import interpreter

    patch_lang, scope_cls = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_cls is None or getattr(patch_lang, "_once_a_launch", False):
        return
    # while a kernel runs (the interpreter runs one at a time): the module ids it has patched, and the scopes
    # of its helpers' patches, restored with its own
    running: list = []
    seen: dict = {}  # a function's globals' language modules, by (function, size of its globals)

    def _patch_lang(fn):
        key = (fn, len(fn.__globals__))
        langs = seen.get(key)
        if langs is None:
            langs = seen[key] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if running and langs <= running[0]:
            return scope_cls()  # a helper inside the kernel: already patched; nothing to restore
        scope = patch_lang(fn)
        if running:  # a helper that sees another module: patched now, restored when the kernel ends
            running[0] |= langs
            running[1].append(scope)
            return scope
        running.extend((set(langs), []))  # a copy: the helpers add to it
        restore = scope.restore

        def restore_and_end():
            try:
                for helper in reversed(running[1]):
                    helper.restore()
                restore()
            finally:
                running.clear()

        scope.restore = restore_and_end
        return scope

    _patch_lang._once_a_launch = True
    interpreter._patch_lang = _patch_lang


def _interpreter_builtin_walk_once() -> None:
    """Each launch, the interpreter finds the builtins it wraps by listing every member of the language's
    modules and classes (``inspect.getmembers``: ``dir``, a ``getattr`` per name, sorted). The names of the
    callable members are kept, in the listing's order, per module or class and its size; each walk then wraps
    those of them that are builtins now, as the listing would (a member wrapped already is no builtin)."""
    from triton.runtime import interpreter

    walk = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if walk is None or patch_attr is None or getattr(walk, "_once", False):
        return
    names: dict = {}
    is_builtin = tl.core.is_builtin

    def _patch_builtin(pkg, builder, scope):
        key = (pkg, tuple(len(vars(c)) for c in (pkg.__mro__ if isinstance(pkg, type) else (pkg,))))
        kept = names.get(key)
        if kept is None:
            kept = names[key] = [n for n, m in inspect.getmembers(pkg) if callable(m)]
        for name in kept:
            member = getattr(pkg, name, None)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    _patch_builtin._once = True
    _patch_builtin._names = names
    _patch_builtin.__wrapped__ = walk
    interpreter._patch_builtin = _patch_builtin


def _type_key(t):
    """A hashable key that equal Triton types share (blocks and pointers define equality but no hash), or None
    for a type of another kind."""
    cls = type(t)
    if cls is tl.dtype:
        return t.name
    if cls is tl.pointer_type:
        element = _type_key(t.element_ty)
        return None if element is None else ("pointer", element, t.address_space, t.const)
    if cls is tl.block_type:
        element = _type_key(t.element_ty)
        return None if element is None else ("block", element, t.shape)
    return None


def _interpreter_dtype_table_once() -> None:
    """The interpreter maps a Triton dtype to its numpy storage dtype through a table it builds anew at every
    call, several times per operation of every program; the table is built once instead."""
    from triton.runtime import interpreter

    get = getattr(interpreter, "_get_np_dtype", None)
    if get is None or getattr(get, "_table_once", False):
        return
    table: dict = {}

    def _get_np_dtype(tt_dtype):
        key = _type_key(tt_dtype)
        np_dtype = table.get(key)
        if np_dtype is None:
            np_dtype = get(tt_dtype)
            if key is not None:
                table[key] = np_dtype
        return np_dtype

    _get_np_dtype._table_once = True
    interpreter._get_np_dtype = _get_np_dtype


def _interpreter_overflow_checks_follow_debug() -> None:
    """The interpreter's options ask to sanitize integer overflow but not to debug. Its front end then redoes
    every 32-bit integer add, sub and mul in 64 bits for the check, and drops the assertion, which only debug
    mode emits: a large share of its time, for nothing. Sanitizing follows debug instead, as in compiled
    kernels: the same results without the dead work."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not hasattr(options, "sanitize_overflow") or not hasattr(options, "debug"):
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=options.debug)


def _bfloat16_rounded(values):
    """float32 ``values`` (a numpy array) as bfloat16 bit patterns (uint16), rounded to nearest even as a
    GPU's conversion rounds; NaN stays a quiet NaN of the same sign."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    bits = np.where(nan, bits | 0x00400000, bits + (0x7FFF + ((bits >> 16) & 1)))
    return (bits >> 16).astype(np.uint16).reshape(np.shape(values))


def _interpreter_bfloat16_rounds_to_nearest() -> bool:
    """The interpreter converts float32 to bfloat16 by dropping the low 16 bits (truncation; its "rtne" mode
    adds the cut-off bit without carrying it into the exponent), where a GPU rounds to nearest even: an
    interpreted bfloat16 result would be up to a whole ulp off where a GPU's is half an ulp. Its conversion from
    float32 to bfloat16 rounds to nearest even instead, so CPU results are the GPU's. Returns whether it does
    (False: an interpreter this does not recognise, which the kit's tolerances then allow for)."""
    from triton.runtime import interpreter

    convert = getattr(interpreter, "_convert_float", None)
    if convert is None or getattr(convert, "_rounds", False):
        return convert is not None
    try:
        if list(inspect.signature(convert).parameters) != ["input", "input_dtype", "output_dtype", "rounding_mode"]:
            return False
    except (TypeError, ValueError):
        return False

    def _convert_float(input, input_dtype, output_dtype, rounding_mode):
        rtne = getattr(rounding_mode, "name", "RTNE") == "RTNE"  # None: a plain cast, rounded to nearest on a GPU too
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rtne:
            return _bfloat16_rounded(input)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    _convert_float._rounds = True
    _convert_float.__wrapped__ = convert
    interpreter._convert_float = _convert_float
    return True


def _interpreter_types_once() -> None:
    """The interpreter runs Triton's front end for every operation of every program: each result builds its
    block type (unwrapping and validating the shape, formatting its name) and its tensor (a tuple of
    constexprs for the shape), a large share of its time. What those constructors derive from their arguments
    is kept, by type, and copied onto the next instance built from equal arguments; the instances stay
    distinct, as before."""
    from triton.language import core

    original_block, original_tensor = core.block_type.__init__, core.tensor.__init__
    if getattr(original_block, "_types_once", False):
        return
    blocks: dict = {}
    tensors: dict = {}

    def block_type_init(self, element_ty, shape):
        dims = shape.values if type(shape) is core.tuple else shape
        if type(dims) is not list or not all(type(d) is int for d in dims):
            return original_block(self, element_ty, shape)  # constexprs and the like: as before
        key = _type_key(element_ty)
        if key is None:
            return original_block(self, element_ty, shape)
        key = (key, *dims)
        derived = blocks.get(key)
        if derived is None:
            original_block(self, element_ty, shape)
            blocks[key] = {k: v for k, v in vars(self).items() if k != "element_ty"}
        else:
            self.element_ty = element_ty
            self.__dict__.update(derived)

    def tensor_init(self, handle, type):
        key = _type_key(type)
        if key is None:
            return original_tensor(self, handle, type)
        derived = tensors.get(key)
        if derived is None:
            original_tensor(self, handle, type)
            tensors[key] = {k: v for k, v in vars(self).items() if k not in ("handle", "type")}
        else:
            self.handle, self.type = handle, type
            self.__dict__.update(derived)

    block_type_init._types_once = True
    block_type_init.__wrapped__, tensor_init.__wrapped__ = original_block, original_tensor
    core.block_type.__init__ = block_type_init
    core.tensor.__init__ = tensor_init


def _interpreter_tree_reduce() -> None:
    """``tl.reduce`` with a combine function of the kernel's own runs, in the interpreter, the combine once per
    element, the whole front end each time (layer_norm's backward; docs/measuring.md). It runs instead on whole
    halves of the reduced axis, pairwise, as a GPU's tree reduction does: the same combines in another order,
    which an associative combine (what ``tl.reduce`` asks for) allows; floating-point sums round as a tree's
    do, not as a sequence's."""
    import numpy as np
    from triton.runtime import interpreter

    ops = getattr(interpreter, "ReduceOps", None)
    original = getattr(ops, "generic_reduce", None)
    if original is None or getattr(original, "_tree", False):
        return

    def generic_reduce(self, input):
        original_axis = self.axis
        input, axis = self.unravel(input, self.axis)
        dtypes = [arg.dtype for arg in input]
        # every input flattened where the axis is None (unravel flattens the first alone)
        level = [arg.handle.data.reshape(-1) if original_axis is None else np.moveaxis(arg.handle.data, axis, 0)
                 for arg in input]
        if level[0].shape[0] == 0:
            return original(self, input)
        while level[0].shape[0] > 1:
            n = level[0].shape[0]
            half = n // 2
            args = [self.to_tensor(np.ascontiguousarray(d[:half]), t) for d, t in zip(level, dtypes)]
            args += [self.to_tensor(np.ascontiguousarray(d[half:2 * half]), t) for d, t in zip(level, dtypes)]
            got = self.combine_fn.fn(*args)
            got = got if isinstance(got, tuple) else (got,)
            pairs = [np.broadcast_to(np.asarray(g.handle.data if isinstance(g, tl.core.tensor) else g)
                                     .astype(d.dtype), d[:half].shape) for g, d in zip(got, level)]
            level = [np.concatenate([p, d[2 * half:]]) if n % 2 else p for p, d in zip(pairs, level)]
        ret = []
        for data, dtype in zip(level, dtypes):
            data = np.array(data[0])
            if self.keep_dims:
                if original_axis is not None:
                    data = np.expand_dims(data, axis)
                else:
                    for _ in range(len(input[0].handle.data.shape)):
                        data = np.expand_dims(data, 0)
            elif original_axis is None:
                data = data.item()
            ret.append(self.to_tensor(data, dtype))
        return ret

    generic_reduce._tree = True
    generic_reduce.__wrapped__ = original
    ops.generic_reduce = generic_reduce


if INTERPRET:
    _interpreter_scalar_index()
    _interpreter_tree_reduce()
    _interpreter_patches_once_a_launch()
    _interpreter_builtin_walk_once()
    _interpreter_dtype_table_once()
    _interpreter_types_once()
    _interpreter_overflow_checks_follow_debug()
# Whether interpreted kernels round float32 to bfloat16 by truncation (a GPU, and the patched interpreter,
# round to nearest even): the kit then allows one more bfloat16 ulp.
BF16_TRUNCATES: bool = INTERPRET and not _interpreter_bfloat16_rounds_to_nearest()


PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def uses_triton(device: torch.device) -> bool:
    """True when the Triton kernels serve tensors on ``device``; False means the PyTorch path does."""
    return device.type == "cuda" or INTERPRET


def backend(device=None) -> str:
    """Which path tritongrad's ops take for tensors on ``device`` (default: the GPU if there is one, else the
    CPU), in words: Triton kernels on the GPU, Triton kernels in Triton's interpreter, or the ops' PyTorch
    references (a CPU without ``TRITON_INTERPRET=1`` set before triton was imported). Public as
    ``tritongrad.backend``."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return f"Triton kernels on {torch.cuda.get_device_name(device)}"
    if INTERPRET:
        return f"Triton kernels in Triton's interpreter ({device.type})"
    return (f"the ops' PyTorch references ({device.type}; set TRITON_INTERPRET=1 before importing triton for the "
            "kernels in Triton's interpreter)")


def is_fake(t: torch.Tensor) -> bool:
    """Fake and meta tensors carry shapes only: launchers allocate outputs for them and launch nothing."""
    return t.is_meta or isinstance(t, FakeTensor)


def hint(n) -> int:
    """An int to choose a launch plan by: ``n`` itself, or a symbolic size's hint while torch.compile traces
    with dynamic shapes (no guard is added). Plans may depend on hints only for speed: grids and buffer
    sizes take the size itself, so the traced launch is right for every value."""
    if type(n) is int:
        return n
    h = getattr(getattr(n, "node", None), "hint", None)
    return int(h) if h is not None else int(n)


def _mergeable(t: torch.Tensor, start: int, stop: int) -> bool:
    """Whether dims ``start:stop`` of ``t`` collapse into one stride (dims of size 1 never matter)."""
    prev = None
    for i in range(start, stop):
        if t.shape[i] == 1:
            continue
        if prev is not None and t.stride(prev) != t.stride(i) * t.shape[i]:
            return False
        prev = i
    return True


def row_order(t: torch.Tensor, feature_dims: int = 1) -> tuple[int, ...] | None:
    """The order of ``t``'s leading dims in memory, where they merge into one stride taken in that order and do
    not as given: a transposed view of a dense tensor, such as ``[B, T, H, D]`` projections viewed as
    ``[B, H, T, D]``. Row-wise ops then read ``t.permute(*order, *feature dims)`` in place and write their
    outputs in ``t``'s layout. None where the leading dims merge as given, or in no order."""
    lead = t.dim() - feature_dims
    if lead < 2 or _mergeable(t, 0, lead):
        return None
    order = tuple(sorted(range(lead), key=lambda i: -t.stride(i) if t.shape[i] != 1 else 0))
    p = t.permute(*order, *range(lead, t.dim()))
    return order if _mergeable(p, 0, lead) else None


def inverse(order: Sequence[int]) -> tuple[int, ...]:
    """The permutation that undoes ``order``."""
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return tuple(inv)


def as_rows(t: torch.Tensor, feature_dims: int = 1) -> torch.Tensor:
    """View ``t`` as [N, D]: leading dims flattened into N, the last ``feature_dims`` dims into D.

    Kernels take both strides of the result, so sliced or transposed 2-D inputs are read in place; a copy
    happens only when the leading dims (or the feature dims) cannot be merged into a single stride, decided
    from the strides (never by a failing ``view``: a traced backward's fake tensors raise other errors).
    """
    if t.dim() == 2 and feature_dims == 1:
        return t
    lead = t.dim() - feature_dims
    n = 1
    for s in t.shape[:lead]:
        n *= s
    d = 1
    for s in t.shape[lead:]:
        d *= s
    if _mergeable(t, 0, lead) and _mergeable(t, lead, t.dim()):
        return t.view(n, d)
    return t.reshape(n, d)  # e.g. a permuted 3-D tensor: a copy


@dataclasses.dataclass(frozen=True)
class DeviceProps:
    """What launch plans read of a device: plans are pure functions of the shape, the dtypes, these and a
    family's tuning table."""

    sm_count: int  # streaming multiprocessors
    shared_mem_per_sm: int  # bytes of shared memory per SM (bounds pipelining depths)


# Off the GPU (interpreter, offline compiles): a small SM count, so that tests reach every launch path at small
# shapes, and an H100/H200's (sm_90) shared memory.
OFF_GPU = DeviceProps(sm_count=4, shared_mem_per_sm=228 * 1024)


@functools.lru_cache(maxsize=None)
def _cuda_props(index: int) -> DeviceProps:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0) or props.shared_memory_per_block
    return DeviceProps(props.multi_processor_count, smem)


class Scoped:
    """A setting read by the launchers, changed only for the extent of a ``with`` block (``using``)."""

    __slots__ = ("name", "value")

    def __init__(self, name: str, value):
        self.name, self.value = name, value

    @contextlib.contextmanager
    def using(self, value):
        prev, self.value = self.value, value
        try:
            yield value
        finally:
            self.value = prev

    def __repr__(self) -> str:
        return f"Scoped({self.name!r}, {self.value!r})"


# Device properties that every device is taken to have while set (None: each device's own), so that tests
# and offline compiles make the plans of another GPU: ``with assume_device(DeviceProps(4, 228 * 1024)): ...``.
_assumed = Scoped("assumed device properties", None)
assume_device = _assumed.using


def assumed_device() -> DeviceProps | None:
    """The properties ``assume_device`` sets now (None: each device's own): part of a kept launch's key."""
    return _assumed.value


def device_props(device: torch.device) -> DeviceProps:
    """The properties of ``device`` that plans read (``OFF_GPU`` off the GPU; ``assume_device`` overrides)."""
    if _assumed.value is not None:
        return _assumed.value
    if device.type != "cuda":
        return OFF_GPU
    return _cuda_props(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on ``device``; a small fixed number off the GPU (interpreter)."""
    return device_props(device).sm_count


def shared_mem_per_sm(device: torch.device) -> int:
    """Bytes of shared memory per SM on ``device`` (sm_90's off the GPU): bounds pipelining depths."""
    return device_props(device).shared_mem_per_sm


_TL_DTYPE = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


def tl_acc_dtype(dtype: torch.dtype):
    return _TL_DTYPE[acc_dtype(dtype)]


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def row_split(
    N: int, BLOCK_N: int, sms: int, programs_per_chunk: int = 1, programs_per_sm: int = 2
) -> tuple[int, int]:
    """Contiguous row chunks for the first stage of a column reduction: ``(chunks, rows_per_prog)``.

    Each chunk of rows is summed by one program (``programs_per_chunk`` programs when columns are split
    too) into one row of a partial buffer ``[chunks, D]``. At most ``programs_per_sm * sms`` programs in
    all, so that buffer is bounded by the SM count, not by N, and the second stage (``column_sum``) stays
    cheap. Chunk lengths are multiples of BLOCK_N, so only the last chunk is ragged; no chunk is empty.
    """
    chunks = min(cdiv(N, BLOCK_N), max(1, programs_per_sm * sms // programs_per_chunk))
    rows_per_prog = cdiv(cdiv(N, chunks), BLOCK_N) * BLOCK_N
    return cdiv(N, rows_per_prog), rows_per_prog


# Small inputs (``_pattern.set_small_input_threshold``) go to PyTorch's own ops only with rows up to this
# long: PyTorch's norms give a row to one block, and its matrix-vector product of a very long row is many times
# slower than tritongrad's kernels (docs/host-path.md).
NATIVE_MAX_D = 8192


class RowTile(NamedTuple):
    BLOCK_N: int  # rows per program step
    BLOCK_D: int  # columns per program step
    ONE_TILE: bool  # BLOCK_D covers the whole row: it is loaded once and stays in registers
    num_warps: int


def row_tile(N: int, D: int, max_block_d: int = 8192, chunk_d: int = 4096, tile: int = 4096) -> RowTile:
    """Tile of a row-wise op over [N, D] (each output row needs statistics of its whole input row).

    Rows up to ``max_block_d`` columns are held whole in registers (one read of the row); longer rows are
    walked in ``chunk_d``-column chunks (the op then reads the row twice). Short rows are stacked so that
    a program handles about ``tile`` elements per step; warps scale with the tile so that each thread keeps
    a few 16-byte vectors in flight without spilling.
    """
    BLOCK_D = next_pow2(max(D, 1))
    one_tile = BLOCK_D <= max_block_d
    if not one_tile:
        BLOCK_D = chunk_d
    BLOCK_N = min(max(1, tile // BLOCK_D), next_pow2(max(N, 1)))
    elems = BLOCK_N * BLOCK_D
    num_warps = 4 if elems <= 1024 else 8 if elems <= 4096 else 16
    return RowTile(BLOCK_N, BLOCK_D, one_tile, num_warps)


def align(*values: int) -> int:
    """The largest power of two, at most 16, that divides every value (0 is divisible by anything): the
    ``ALIGN`` hint of kernels whose row strides and row length may be aligned to 8 elements without being
    multiples of 16 (``ops/_tl.aligned``)."""
    g = math.gcd(*values)
    return 16 if g == 0 else min(16, g & -g)


@functools.lru_cache(maxsize=64)
def split_float(v: float) -> tuple[float, float]:
    """``(hi, lo)``: v rounded to float32, and the rest. Triton passes a Python float to a kernel as float32;
    a kernel that adds ``hi + lo`` in float64 gets v to about 48 bits instead of 24 (an eps of 1e-5 is 2.5e-8
    off in float32, which a float64 norm's constant rows, r = 1/sqrt(eps), would show)."""
    hi = struct.unpack("f", struct.pack("f", v))[0] if math.isfinite(v) and abs(v) < 3e38 else v
    return hi, v - hi if math.isfinite(v) else 0.0


_I32 = 2**31


# The current CUDA device and stream, straight from torch's C API where it has one (Triton's driver wraps the
# same calls in Python).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: _driver.active.get_current_device())
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: _driver.active.get_current_stream(device))


def _hooks_active() -> bool:
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and (not isinstance(hook, knobs.HookChain) or hook.calls):
            return True
    return False


class Launch(NamedTuple):
    """One kernel launch as an observer sees it (``observe_launches``)."""

    kernel: str  # the @triton.jit function's name
    grid: tuple
    args: tuple  # the kernel's non-constexpr arguments in its order, those passed by name included
    kw: dict  # constexprs and num_warps


_observers = Scoped("launch observers", ())


def observe_launches(fn):
    """``with observe_launches(fn):`` calls ``fn(Launch(...))`` before every launch through :class:`Kernel`
    in the block (the launch then runs as it would): tests see which kernel served a shape, on which grid,
    with which arguments, without replacing a launcher's kernel."""
    return _observers.using((*_observers.value, fn))


class Kernel:
    """``Kernel(jit_fn)[grid](*args, num_warps=..., **constexprs)`` launches like ``jit_fn[grid]``; public as
    ``tritongrad.kernel``. The first argument must be a tensor (it picks the device and the mode):

    - plain tensors (eager): Triton's launch path re-binds every argument and recomputes its cache key on each
      call (tens of microseconds of Python on a slow host, more than a small kernel runs). After the first
      launch of a specialization this keeps the compiled kernel under the same properties Triton specializes
      on (dtypes, 16-byte alignment of pointers, integers equal to 1 / divisible by 16 / beyond int32,
      constexpr values, device) and calls its launcher directly. The interpreter, and launches while a
      Triton launch hook is installed (profilers), take Triton's own path;
    - traced tensors (torch.compile's functionalization, AOTInductor): ``torch.library.wrap_triton``, so the
      graph holds the kernel and Inductor launches it;
    - fake or meta tensors (shape propagation): nothing runs.

    Float arguments: a Python float reaches the kernel as a float32 scalar in every mode. Triton's own launch
    passes it as float32; Inductor's generated code passes float64, so traced launches run
    :func:`float32_entry`'s copy of the kernel, which converts those parameters to float32 on entry. (Under
    the interpreter the value is rounded to float32 and stays a Python float.)
    """

    def __init__(self, fn):
        if isinstance(fn, Kernel):
            fn = fn.fn
        self.fn = fn
        self._cache: dict = {}
        self._float32_entry: dict = {}  # float parameters' names -> float32_entry(fn, names), for traced launches
        self._constexpr_names = [p.name for p in fn.params if p.is_constexpr] if not INTERPRET else []
        # A compiled launch takes every constexpr by name: those a launch leaves out take their defaults.
        self._constexpr_defaults = {p.name: p.default for p in fn.params
                                    if p.is_constexpr and getattr(p, "has_default", False)} if not INTERPRET else {}
        self._arg_names = _arg_names(fn)
        functools.update_wrapper(self, fn, updated=())

    def positional(self, args: tuple, kw: dict) -> tuple:
        """``args`` completed by the kernel's non-constexpr arguments passed by keyword (taken out of ``kw``):
        launchers pass long argument lists by name, a compiled launcher takes them by position."""
        if len(args) >= len(self._arg_names):
            return args
        more = []
        for n in self._arg_names[len(args):]:
            if n not in kw:  # the rest take their defaults
                break
            more.append(kw.pop(n))
        return (*args, *more)

    def __getitem__(self, grid):
        if _observers.value:
            return functools.partial(self._observed, grid)
        return functools.partial(self._launch, grid)

    def _observed(self, grid, *args, **kw):
        args = self.positional(args, kw)
        seen = Launch(self.fn.__name__, tuple(grid), args, dict(kw))
        for fn in _observers.value:
            fn(seen)
        return self._launch(grid, *args, **kw)

    def _launch(self, grid, *args, num_warps: int = 4, **constexprs):
        if len(args) < len(self._arg_names) and self._arg_names[len(args)] in constexprs:
            args = self.positional(args, constexprs)  # arguments passed by name, in the kernel's order
        a0 = args[0]
        if type(a0) not in PLAIN_TENSORS or a0.is_meta:
            return self._traced(grid, args, num_warps, constexprs)
        if INTERPRET:
            # A compiled kernel receives a Python float as float32; the interpreter would keep float64. Round
            # it here, so that CPU tests compute with the value a GPU gets (split_float).
            args = [split_float(a)[0] if type(a) is float else a for a in args]
            return self.fn[grid](*args, num_warps=num_warps, **constexprs)
        # Triton launches on the current device; a model spread over several GPUs must not launch its
        # kernels on the wrong one.
        device = a0.get_device()
        if device != _current_device():
            with torch.cuda.device(device):
                return self._launch(grid, *args, num_warps=num_warps, **constexprs)
        if _hooks_active():
            return self.fn[grid](*args, num_warps=num_warps, **constexprs)
        # The key holds the properties Triton specializes on: tensors by dtype and 16-byte alignment, ints by
        # width, equality to 1 and divisibility by 16, floats by type, bools and None by value; constexprs by
        # name and value (launchers pass them by keyword, in any order). Written inline rather than as a call
        # per argument: this line is most of a launch's Python.
        key = (device, num_warps, *constexprs.items(), *[
            (a.dtype, not a.data_ptr() & 15) if type(a) in PLAIN_TENSORS
            else (64 if not -_I32 <= a < _I32 else a == 1 or 16 * (not a & 15)) if type(a) is int
            else float if type(a) is float else a
            for a in args])
        compiled = self._cache.get(key)
        if compiled is None:  # first launch of this specialization: Triton compiles (or loads) and launches
            self._cache[key] = self.fn[grid](*args, num_warps=num_warps, **constexprs)
            return
        compiled.run(
            grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, _current_stream(device),
            compiled.function, compiled.packed_metadata, None, None, None,
            *args, *[constexprs[n] if n in constexprs else self._constexpr_defaults[n]
                     for n in self._constexpr_names],
        )

    def _key(self, device, num_warps, constexprs: dict, args) -> tuple:
        """_launch's cache key (written out there inline)."""
        return (device, num_warps, *constexprs.items(), *[
            (a.dtype, not a.data_ptr() & 15) if type(a) in PLAIN_TENSORS
            else (64 if not -_I32 <= a < _I32 else a == 1 or 16 * (not a & 15)) if type(a) is int
            else float if type(a) is float else a
            for a in args])

    def bind(self, grid, *args, num_warps: int = 4, **constexprs) -> "Bound":
        """This launch with its grid, scalars and constexprs fixed, launched by ``bound(*tensors)`` on the
        tensors (or None) in the places where ``args`` holds tensors (or None), in order. A launcher that keeps
        one per shape, strides, dtypes and flags (``Memo``) then spends a call's Python on that key and on
        the launch alone, not on rebuilding dozens of arguments. Nothing is launched here."""
        return Bound(self, tuple(grid), self.positional(args, constexprs), num_warps, constexprs)

    def _traced(self, grid, args, num_warps, constexprs) -> None:
        a0 = args[0]
        if INTERPRET or a0.is_meta or isinstance(a0, FakeTensor):
            return  # shapes only: the outputs were allocated, nothing to compute
        floats = tuple(p.name for p, a in zip(self.fn.params, args) if type(a) in (float, torch.SymFloat))
        fn = self.fn
        if floats:
            fn = self._float32_entry.get(floats)
            if fn is None:
                fn = self._float32_entry[floats] = float32_entry(self.fn, floats)
        torch.library.wrap_triton(fn)[tuple(grid)](*args, num_warps=num_warps, **constexprs)


class Bound:
    """A launch of a :class:`Kernel` with everything but its tensors fixed (``Kernel.bind``). A call
    ``bound(*tensors)`` launches like ``kernel[grid](*args, ...)`` with the tensors put in their places; on plain
    CUDA tensors it finds the compiled kernel under the tensors' dtypes and 16-byte alignment (all that the
    fixed arguments leave to specialize) and calls its launcher directly. The interpreter, tracers, fake and
    meta tensors, other devices, launch observers and Triton launch hooks take the kernel's full path
    (``kernel[grid]``)."""

    __slots__ = ("kernel", "grid", "_grid3", "args", "slots", "num_warps", "constexprs", "tail", "_compiled")

    def __init__(self, kernel: Kernel, grid: tuple, args: tuple, num_warps: int, constexprs: dict):
        self.kernel, self.num_warps, self.constexprs = kernel, num_warps, dict(constexprs)
        self.grid = grid
        self._grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.slots = tuple(i for i, a in enumerate(args) if a is None or isinstance(a, torch.Tensor))
        self.args = [None if i in self.slots else a for i, a in enumerate(args)]  # holds no tensor alive
        self.tail = tuple(self.constexprs[n] if n in self.constexprs else kernel._constexpr_defaults[n]
                          for n in kernel._constexpr_names) if not INTERPRET else ()
        self._compiled: dict = {}

    def _args(self, tensors) -> list:
        if len(tensors) != len(self.slots):
            raise TypeError(f"{self.kernel.fn.__name__}: this bound launch takes {len(self.slots)} tensors (or "
                            f"None), got {len(tensors)}")
        args = self.args.copy()
        for i, t in zip(self.slots, tensors):
            args[i] = t
        return args

    def __call__(self, *tensors) -> None:
        args = self._args(tensors)
        a0 = args[0]
        if INTERPRET or _observers.value or type(a0) not in PLAIN_TENSORS or not a0.is_cuda:
            return self.kernel[self.grid](*args, num_warps=self.num_warps, **self.constexprs)
        device = a0.get_device()
        key = (device, *[(t.dtype, not t.data_ptr() & 15) if t is not None else None for t in tensors])
        compiled = self._compiled.get(key)
        if compiled is None or device != _current_device() or _hooks_active():
            self.kernel._launch(self.grid, *args, num_warps=self.num_warps, **self.constexprs)
            if device == _current_device() and not _hooks_active():
                self._compiled[key] = self.kernel._cache.get(
                    self.kernel._key(device, self.num_warps, self.constexprs, args))
            return
        compiled.run(*self._grid3, _current_stream(device), compiled.function, compiled.packed_metadata, None, None,
                     None, *args, *self.tail)


def same_data(pairs) -> tuple:
    """For each ``(rows, tensor)`` pair, whether ``rows`` (a view of ``tensor`` made by ``as_rows`` or a copy)
    starts at the tensor's data (None pairs count as such): a bound launch may then take the tensor itself,
    reading its data alone. Plain tensors only."""
    return tuple(r is t or r is None or r.data_ptr() == t.data_ptr() for r, t in pairs)


class Memo(dict):
    """A launcher's bound launches (or any values it derives from a call's shapes, strides, dtypes and
    flags) by a key of those: the key must determine every argument but the tensors' data. Cleared when it
    holds ``maxsize``, so a long run of new shapes keeps it bounded."""

    def __init__(self, maxsize: int = 512):
        super().__init__()
        self.maxsize = maxsize

    def put(self, key, value):
        if len(self) >= self.maxsize:
            self.clear()
        self[key] = value
        return value


def float32_entry(jit_fn, names: tuple[str, ...]):
    """A copy of the ``@triton.jit`` function ``jit_fn`` whose body first converts the parameters ``names`` to
    float32 (``cap = tl.cast(cap, tl.float32)``), so that a float argument is a float32 scalar in the kernel
    whatever the launcher passes: Inductor's generated code passes a Python float as float64, Triton's launch
    as float32 (where the conversion is a no-op). ``tl.cast`` rather than ``.to``: torch's mutation analysis
    compiles the kernel with its scalars as constants (Python floats), and a kernel it cannot compile is taken
    to write every tensor argument, which breaks aliased arguments. ``jit_fn`` itself where it is not a plain
    JITFunction (an autotuner) or where its module binds ``tl`` to something other than ``triton.language``."""
    import ast
    import linecache

    from triton.runtime.jit import JITFunction

    if type(jit_fn) is not JITFunction:
        return jit_fn
    scope = dict(jit_fn.fn.__globals__)
    if scope.setdefault("tl", tl) is not tl:
        return jit_fn
    tree = ast.parse(jit_fn.src)
    fdef = tree.body[0]
    fdef.decorator_list = []
    body = fdef.body
    first = 1 if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
        and isinstance(body[0].value.value, str) else 0  # after the docstring
    casts = [ast.parse(f"{n} = tl.cast({n}, tl.float32)").body[0] for n in names]
    fdef.body = body[:first] + casts + body[first:]
    src = ast.unparse(ast.fix_missing_locations(tree)) + "\n"
    filename = f"<tritongrad float32 entry of {jit_fn.fn.__module__}.{jit_fn.fn.__qualname__}{names}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # inspect.getsource reads it
    exec(compile(src, filename, "exec"), scope)
    fn = scope[fdef.name]
    fn.__module__ = jit_fn.fn.__module__
    options = {k: getattr(jit_fn, k) for k in ("do_not_specialize", "do_not_specialize_on_alignment", "debug",
                                                "noinline") if getattr(jit_fn, k, None) is not None}
    return triton.jit(fn, **options)


def _arg_names(fn) -> list:
    """The names of a Triton kernel's non-constexpr parameters, in order."""
    if hasattr(fn, "params"):
        return [p.name for p in fn.params if not p.is_constexpr]
    sig = inspect.signature(getattr(fn, "fn", fn))  # the interpreter's function
    return [n for n, p in sig.parameters.items()
            if not (p.annotation is tl.constexpr or str(p.annotation).endswith("constexpr"))]


@dataclasses.dataclass
class _Sources:
    """What note_sources has hashed: each source file's name -> sha256 of its bytes, the paths read, and the
    tag's part it wrote last."""

    files: dict = dataclasses.field(default_factory=dict)
    paths: set = dataclasses.field(default_factory=set)
    tag: str = ""


_SOURCES = _Sources()
_SOURCE_TAG = "tritongrad:"


def note_sources(*fns) -> None:
    """Key torch.compile's caches on the Python that compiled code is traced through: tritongrad's own files
    and the files of every function ``fns`` (a declared op's launchers, backward, traced backward, reference)
    reach (:func:`_reachable`). The caches key on the graph that calls an op and on its Triton kernels'
    source, not on that Python (plans, grids, a traced backward), so after it changes (an upgrade, an edited
    op) they would serve the code compiled before. Sets ``torch.compiler.config.cache_key_tag`` to the user's
    own tag, then ``|tritongrad:`` and a digest of those files."""
    import hashlib
    import pathlib

    cfg = getattr(torch.compiler, "config", None)
    if cfg is None or not hasattr(cfg, "cache_key_tag"):
        return
    if not _SOURCES.files:  # the package's files by their names in it: a copy elsewhere keys alike
        root = pathlib.Path(__file__).parent
        for path in root.rglob("*.py"):
            _SOURCES.files["tritongrad/" + path.relative_to(root).as_posix()] = hashlib.sha256(
                path.read_bytes()).hexdigest()
            _SOURCES.paths.add(str(path))
    from triton.runtime.jit import JITFunction

    reached = [f for fn in fns for f in (_reachable(fn, lambda v: isinstance(v, (Kernel, JITFunction))) or [fn])]
    for fn in reached:
        try:
            fn = inspect.unwrap(fn)
            path = inspect.getsourcefile(fn) or ""
            if path in _SOURCES.paths or path and _library_file(path):
                continue
            text = pathlib.Path(path).read_bytes() if os.path.isfile(path) else inspect.getsource(fn).encode()
        except (TypeError, OSError):
            continue  # a builtin, or a function without source
        _SOURCES.paths.add(path)
        _SOURCES.files[path or f"{fn.__module__}.{fn.__qualname__}"] = hashlib.sha256(text).hexdigest()
    digest = hashlib.sha256("".join(f"{k}\0{v}\0" for k, v in sorted(_SOURCES.files.items())).encode()).hexdigest()
    _SOURCES.tag = _SOURCE_TAG + digest[:20]
    keep_source_tag()


def keep_source_tag() -> None:
    """Put note_sources's digest back at the end of ``torch.compiler.config.cache_key_tag`` if the tag has
    changed since (a user's own tag set after ops were declared): called where an op is traced, before
    torch.compile computes its cache keys."""
    mine = _SOURCES.tag
    cfg = torch.compiler.config
    tag = cfg.cache_key_tag
    if not mine or tag.endswith(mine):
        return
    cut = tag.find(_SOURCE_TAG)
    base = tag if cut < 0 else tag[: max(cut - 1, 0)]
    cfg.cache_key_tag = f"{base}|{mine}" if base else mine


@functools.cache
def _library_roots() -> tuple:
    import sysconfig

    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, triton)) + tuple(
        os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib"))


def _library_file(path: str) -> bool:
    """Whether ``path`` is torch's, Triton's or the standard library's: their versions key the caches already."""
    return os.path.abspath(path).startswith(_library_roots())


def _reachable(fn, take) -> list:
    """The Python functions ``fn`` reaches (itself, then what it names: globals, closure cells, attributes of
    modules it names; six calls deep; not into torch, Triton or the standard library), with ``take(value)``
    called on every value named along the way (True: not a function to follow)."""
    seen, order = set(), []

    def visit(f, depth: int) -> None:
        f = inspect.unwrap(f)
        code = getattr(f, "__code__", None)
        if code is None or depth > 6 or id(f) in seen or _library_file(code.co_filename):
            return
        seen.add(id(f))
        order.append(f)
        names, stack = set(), [code]
        while stack:
            c = stack.pop()
            names.update(c.co_names)
            names.update(c.co_freevars)
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        scope = dict(getattr(f, "__globals__", {}))
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            try:
                scope[name] = cell.cell_contents
            except ValueError:
                pass
        for name in names:
            v = scope.get(name)
            if v is None or take(v):
                continue
            if isinstance(v, types.ModuleType):
                for attr in names:
                    try:
                        a = getattr(v, attr, None)
                    except Exception:  # noqa: BLE001 - a module's lazy attribute that fails to import
                        continue
                    if a is not None and not take(a) and inspect.isfunction(a):
                        visit(a, depth + 1)
            elif inspect.isfunction(v) or isinstance(v, functools._lru_cache_wrapper):
                visit(v, depth + 1)

    visit(fn, 0)
    return order


def note_kernels(qualname: str, fn) -> None:
    """Tell torch.compile's caches which Triton kernels the launcher ``fn`` (and what it calls) launches, so
    that a changed kernel source changes their keys. ``torch.library.triton_op`` finds only kernels wrapped
    with ``wrap_triton`` in the function's own source; launchers here launch through :class:`Kernel`."""
    if fn is None or INTERPRET:
        return
    try:
        from torch._library import triton as lib_triton
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    found = []

    def take(v) -> bool:
        k = v.fn if isinstance(v, Kernel) else v
        if isinstance(k, JITFunction):
            if all(k is not f for f in found):
                found.append(k)
            return True
        return False

    _reachable(fn, take)
    lib_triton.triton_ops_to_kernels[qualname] = found

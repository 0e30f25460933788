"""Triton-side helpers for kernels written on tritongrad's pattern: call them from ``@triton.jit`` code.

    from tritongrad.language import store_partial, upcast

    x = upcast(tl.load(x_ptr + o, mask=m))      # float32 math (float64 for float64 inputs)
    store_partial(part_ptr, acc, o_d, D)        # this program's row of partial sums, for reduce_partials

Import them by name, as above: torch.compile's Inductor copies a kernel's source, and the ``@triton.jit``
functions it names, into its generated code; it does not follow module attributes (``tgl.upcast``).

The seed's weight gradient is a reduction over rows in two stages: each program sums its own chunk of rows into
one row of a partial buffer (:func:`store_partial`, into the buffer :func:`tritongrad.partial_rows` makes), and
:func:`tritongrad.reduce_partials` adds the rows in a fixed order.
"""

import triton
import triton.language as tl


@triton.jit
def upcast(x):
    """``x`` in the dtype to compute in: float32, or float64 for float64 ``x`` (16-bit inputs are widened)."""
    return x.to(tl.float64 if x.dtype == tl.float64 else tl.float32)


@triton.jit
def store_partial(part_ptr, acc, o_d, D):
    """Store this program's partial sums as row ``tl.program_id(0)`` of a ``[P, D]`` buffer of unit column
    stride and row stride ``D`` (what :func:`tritongrad.partial_rows` returns).

    ``acc``: ``[BLOCK_D]``, or ``[BLOCK_N, BLOCK_D]`` (summed over its rows first, in its own dtype); ``o_d``:
    the ``[BLOCK_D]`` column offsets it holds (columns at or past ``D`` are masked off). Rounded once to the
    buffer's dtype.
    """
    if len(acc.shape) == 2:
        acc = tl.sum(acc, axis=0)
    row = tl.program_id(0).to(tl.int64) * D
    tl.store(part_ptr + row + o_d, acc.to(part_ptr.dtype.element_ty), mask=o_d < D)

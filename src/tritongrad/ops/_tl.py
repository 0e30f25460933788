"""Triton helpers shared by the kernels."""

import triton
import triton.language as tl


@triton.jit
def float_arg(hi, lo, ACC: tl.constexpr):
    """A float argument passed as ``rt.split_float``'s ``(hi, lo)``, as an ACC scalar.

    Triton's own launch passes a Python float as float32, Inductor's generated code as float64; used as it
    comes, a float64 argument would turn every expression it touches into float64 (a whole tile in float64,
    and results that differ from eager mode's). hi + lo in float64, then ACC, is the same value either way.
    """
    return tl.cast(tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64), ACC)


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """``v`` (float32 or float64) rounded to ``dtype`` for a store.

    float64 reaches the 16-bit types through float32. Triton's interpreter converts float64 to bfloat16 as
    if the value were an integer (garbage); through float32 it is exact up to the final rounding, and on a
    GPU the two roundings differ from one only in rare ties. Mixed inputs such as bfloat16 x with a float64
    weight accumulate in float64 and hit this.
    """
    if dtype.primitive_bitwidth == 16:
        return v.to(tl.float32).to(dtype)
    return v.to(dtype)


@triton.jit
def aligned(v, ALIGN: tl.constexpr):
    """``v`` (an integer argument the host found divisible by ALIGN), with that divisibility known to the
    compiler.

    Triton specializes an integer argument only on divisibility by 16, and ``tl.multiple_of`` does not mark
    a kernel argument. A row of 13000 bfloat16 elements starts on a 16-byte boundary, but without this the
    row strides and the mask ``cols < D`` look unaligned and every load and store is split into 2-byte ones.
    ``v // ALIGN * ALIGN`` equals v and carries the divisibility. ALIGN 16 is Triton's own specialization.
    """
    if ALIGN > 1 and ALIGN < 16:
        v = v // ALIGN * ALIGN
    return v

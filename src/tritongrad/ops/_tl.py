"""Triton helpers shared by the kernels."""

import triton
import triton.language as tl


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

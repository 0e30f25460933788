"""What every launcher needs to know about the machine, computed once.

- whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1`` set before triton was imported);
- which devices the Triton kernels serve;
- cached device properties (the SM count sizes persistent grids);
- the accumulation dtype of an input dtype, and its Triton spelling.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensor


@triton.jit
def _probe_kernel():
    pass


# triton.jit returns an interpreter-backed function when TRITON_INTERPRET=1 was set at import time.
INTERPRET: bool = type(_probe_kernel).__name__ == "InterpretedFunction"


def uses_triton(device: torch.device) -> bool:
    """True when the Triton kernels serve tensors on ``device``; False means the PyTorch path does."""
    return device.type == "cuda" or INTERPRET


def is_fake(t: torch.Tensor) -> bool:
    """Fake and meta tensors carry shapes only: launchers allocate outputs for them and launch nothing."""
    return isinstance(t, FakeTensor) or t.device.type == "meta"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on ``device``; a small fixed number off the GPU (interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_TL_DTYPE = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_acc_dtype(dtype: torch.dtype):
    return _TL_DTYPE[acc_dtype(dtype)]


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()

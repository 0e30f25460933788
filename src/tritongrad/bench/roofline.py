"""The ceiling every result is compared with: the device's copy bandwidth, measured in the same run.

A memory-bound op cannot move its bytes faster than a plain device-to-device copy moves its own, so
``GB/s of the op / GB/s of the copy`` says how far from the floor an implementation is, on this device,
at this moment (clocks, driver), whatever the datasheet says.
"""

from __future__ import annotations

from typing import Callable

import torch

# Large enough that launch overhead and caches vanish: 1 GiB each way on a GPU (several times any L2).
_GPU_COPY_BYTES = 1 << 30
_CPU_COPY_BYTES = 64 << 20


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def copy_bandwidth(device: str, time_ms: Callable[[Callable[[], object]], tuple[float, float, float]]) -> dict:
    """Time ``dst.copy_(src)`` with ``time_ms`` (returns median, p20, p80 in ms); bytes = read + written."""
    nbytes = _GPU_COPY_BYTES if device == "cuda" else _CPU_COPY_BYTES
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms, p20, p80 = time_ms(lambda: dst.copy_(src))
    moved = 2 * nbytes
    return {"bytes": moved, "ms": ms, "ms_p20": p20, "ms_p80": p80, "GBps": gbps(moved, ms)}

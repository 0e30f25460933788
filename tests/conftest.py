"""Without a GPU, the Triton kernels run in Triton's interpreter: TRITON_INTERPRET=1 must be set before
triton is imported, so it is set here, before anything imports tritongrad."""

import os
import subprocess
import sys
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET could be set"
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Absolute slack on top of "2x eager PyTorch's error": a few ulps of each dtype at the magnitudes tested.
ATOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def _kernels_at_every_size():
    # Small CUDA inputs normally run PyTorch's own ops (tritongrad.set_small_input_threshold); the tests use
    # small shapes to test tritongrad's kernels, so that path is off unless a test turns it on.
    import tritongrad

    prev = tritongrad.set_small_input_threshold(0)
    yield
    tritongrad.set_small_input_threshold(prev)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Different data per test, reproducible per test id.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def run_without_interpreter(args: list, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python *args`` in a fresh process without TRITON_INTERPRET: there CPU tensors take the
    PyTorch path and triton.jit builds GPU kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)

"""Every kernel specialization the launchers request compiles for sm_90 (H100/H200), checked on a machine
without a GPU, where the rest of the CPU suite only runs the kernels in Triton's interpreter."""

import os

import pytest
import torch
from conftest import run_without_interpreter


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite compiles and runs the kernels itself")
def test_kernels_compile_for_sm90(sm90_cases):
    out = run_without_interpreter([os.path.join(os.path.dirname(__file__), "sm90_compile.py"), *sm90_cases],
                                  timeout=600)
    assert out.returncode == 0 and "0 failures" in out.stdout, (out.stdout + out.stderr)[-4000:]

"""``tritongrad`` command line: ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import os
import sys


def _ensure_backend() -> None:
    """Without a GPU the kernels need Triton's interpreter, which must be chosen before triton is
    imported; importing tritongrad imports triton, so re-run this command once with it set."""
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        from . import _runtime

        if not _runtime.INTERPRET:
            env = dict(os.environ, TRITON_INTERPRET="1")
            os.execve(sys.executable, [sys.executable, "-m", "tritongrad", *sys.argv[1:]], env)


def demo(args) -> int:
    import torch

    import tritongrad

    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU, Triton interpreter"
    torch.manual_seed(args.seed)
    x = torch.randn(4, 8, 512, device=device, requires_grad=True)
    w = torch.randn(512, device=device, requires_grad=True)
    y = tritongrad.weighted_sum(x, w)
    g = torch.randn_like(y)
    y.backward(g)

    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = (xr * wr).sum(-1)
    yr.backward(g)
    print(f"tritongrad {tritongrad.__version__} on {where}")
    print(f"x: {tuple(x.shape)} {x.dtype}, w: {tuple(w.shape)}")
    print(f"y = tritongrad.weighted_sum(x, w): {tuple(y.shape)}, y[0, :4] = {y[0, :4].tolist()}")
    print(f"y.grad_fn = {y.grad_fn}")
    print("max |tritongrad - PyTorch| (float32):")
    print(f"  y      {(y - yr).abs().max().item():.3e}")
    print(f"  grad_x {(x.grad - xr.grad).abs().max().item():.3e}")
    print(f"  grad_w {(w.grad - wr.grad).abs().max().item():.3e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritongrad", description="Differentiable Triton operators for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run weighted_sum forward and backward and compare with PyTorch")
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.set_defaults(func=demo)
    try:
        from .bench.cli import add_parser as add_bench_parser
    except ImportError:  # the bench package is optional at import time (e.g. a trimmed install)
        add_bench_parser = None
    if add_bench_parser is not None:
        add_bench_parser(sub)
    args = parser.parse_args(argv)
    _ensure_backend()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

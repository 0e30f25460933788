"""``tritongrad`` command line: ``demo``, ``bench`` and ``models``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys


def _ensure_backend(kernels: bool, argv: list[str] | None) -> None:
    """Off the GPU the ops run Triton's kernels in its interpreter, or with ``--no-kernels`` their PyTorch
    references. Which of the two is fixed when triton is imported (``TRITON_INTERPRET``), and importing tritongrad
    imports it: the command re-runs itself once with ``TRITON_INTERPRET=1`` set, or removed. Called from Python
    (``argv`` given) in a process that imported triton the other way, it stops and says so rather than replace
    the caller's process."""
    import torch

    if torch.cuda.is_available() or (kernels and os.environ.get("TRITON_INTERPRET") == "1"):
        return
    from . import _runtime

    if _runtime.INTERPRET == kernels:
        return
    if argv is not None:
        raise SystemExit("tritongrad: " + (
            "the kernels need Triton's interpreter, and this process imported triton without TRITON_INTERPRET=1"
            if kernels else "--no-kernels runs the ops' PyTorch references, and this process imported triton "
            "with TRITON_INTERPRET=1 (its kernels would run in the interpreter)") + ": run the command in a "
            "process of its own")
    env = dict(os.environ)
    if kernels:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    os.execve(sys.executable, [sys.executable, "-m", "tritongrad", *sys.argv[1:]], env)


def demo(args) -> int:
    import torch

    import tritongrad

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    x = torch.randn(4, 8, 512, device=device, requires_grad=True)
    w = torch.randn(512, device=device, requires_grad=True)
    y = tritongrad.weighted_sum(x, w)
    g = torch.randn_like(y)
    y.backward(g)

    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = (xr * wr).sum(-1)
    yr.backward(g)
    print(f"tritongrad {tritongrad.__version__}: {tritongrad.backend(device)}")
    print(f"x: {tuple(x.shape)} {x.dtype}, w: {tuple(w.shape)}")
    print(f"y = tritongrad.weighted_sum(x, w): {tuple(y.shape)}, y[0, :4] = {y[0, :4].tolist()}")
    print(f"y.grad_fn = {y.grad_fn}")
    print("max |tritongrad - PyTorch| (float32):")
    print(f"  y      {(y - yr).abs().max().item():.3e}")
    print(f"  grad_x {(x.grad - xr.grad).abs().max().item():.3e}")
    print(f"  grad_w {(w.grad - wr.grad).abs().max().item():.3e}")
    return 0


def models(args) -> int:
    """The family matrix (:mod:`tritongrad.zoo`): exit status 1 if any family is wrong."""
    import json

    from . import _runtime, zoo

    if not args.list:  # the path the verdicts are about
        print(f"tritongrad models: {_runtime.backend()}", file=sys.stderr, flush=True)
    names = args.family or zoo.families()
    unknown = sorted(set(names) - set(zoo.families()))
    if unknown:
        print(f"unknown famil{'y' if len(unknown) == 1 else 'ies'}: {', '.join(unknown)} (see "
              "`tritongrad models --list`)", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(zoo.families()))
        return 0
    modes = ("eager", "compiled") if args.mode == "both" else (args.mode,)

    def progress(v):
        if not args.json:
            name = f"{v.family} [{v.variant}]" if v.variant else v.family
            print(f"{name:28} {v.mode:9} {v.line()}", flush=True)

    # With --json, stdout holds the JSON alone: what the models print while they run goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        rows = zoo.run(names, modes, progress=progress if not args.markdown else None,
                       with_variants=args.variants)
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.markdown:
        print(zoo.markdown(rows, modes))
    else:
        counts = {}
        for r in rows:
            for m in modes:
                k = (m, r[m].split(":")[0])
                counts[k] = counts.get(k, 0) + 1
        for m in modes:
            print(f"{m}: " + ", ".join(f"{n} {s}" for (mm, s), n in sorted(counts.items()) if mm == m))
    return 1 if any(r[m].startswith("wrong") for r in rows for m in modes) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritongrad", description="Differentiable Triton operators for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run weighted_sum forward and backward and compare with PyTorch")
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.set_defaults(func=demo)
    p_models = sub.add_parser("models", help="check tritongrad.patch on a tiny model of every Hugging Face "
                              "causal-LM family (or those named): exact, refused, wrong or error")
    p_models.add_argument("family", nargs="*", help="model_type names (default: every causal-LM family)")
    p_models.add_argument("--mode", choices=("eager", "compiled", "both"), default="both")
    p_models.add_argument("--json", action="store_true", help="print a list of {family, eager, compiled, ops}")
    p_models.add_argument("--markdown", action="store_true", help="print the matrix as a Markdown table")
    p_models.add_argument("--list", action="store_true", help="list the families and exit")
    p_models.add_argument("--variants", action="store_true",
                          help="after each family, a row per config variant that applies to it (zoo.VARIANTS: "
                               "activation, biases, tied head, head width, eps, rotary width, logit scales and "
                               "caps), with a \"variant\" key in --json")
    p_models.add_argument("--no-kernels", action="store_true",
                          help="off the GPU, the ops on their PyTorch references instead of Triton's interpreter, "
                               "whatever TRITON_INTERPRET says: checks what patch substitutes, in seconds a "
                               "family")
    p_models.set_defaults(func=models)
    try:
        from .bench.cli import add_parser as add_bench_parser
    except ImportError:  # the bench package is optional at import time (e.g. a trimmed install)
        add_bench_parser = None
    if add_bench_parser is not None:
        add_bench_parser(sub)
    args = parser.parse_args(argv)
    _ensure_backend(not getattr(args, "no_kernels", False), argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""``tritongrad bench``: the subcommand's arguments and its run.

Only argparse is imported at module level: the parser is built before tritongrad decides whether Triton
must run in its interpreter, and triton may not be imported before that.
"""

from __future__ import annotations

import argparse
import sys
import time

_MODES = ("fwd", "bwd", "fwdbwd")
_DTYPES = ("bf16", "fp16", "fp32")


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(n) for n in item.lower().split("x")) for item in text.split(",") if item.strip()]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected NxD[,NxD...] such as 32768x4096,16x1048576; got {text!r}")
    return shapes


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmark tritongrad against eager PyTorch, torch.compile and other libraries",
        description=(
            "Time each op forward, backward and both, for every available provider, and report median and "
            "20/80 percentile times, GB/s from the op's bytes formula, % of the copy bandwidth measured in the "
            "same run, tritongrad's speedup, peak memory and host overhead. Without a GPU it runs a tiny smoke "
            "sweep through Triton's interpreter."
        ),
    )
    p.add_argument("ops", nargs="*", metavar="OP", help="ops to run (default: all built-in ones; see --list)")
    p.add_argument("--dtype", nargs="+", choices=_DTYPES, help="default: bf16 fp16 fp32 (bf16 with --quick, fp32 on CPU)")
    p.add_argument("--shapes", type=_shapes, help="NxD[,NxD...] rows x features, e.g. 32768x4096,16x1048576")
    p.add_argument("--mode", nargs="+", choices=_MODES, default=list(_MODES), help="default: all three")
    p.add_argument("--provider", nargs="+", metavar="NAME", help="providers to run (default: all; see --list)")
    p.add_argument(
        "--op", nargs="+", default=[], metavar="MODULE:NAME", dest="user_ops",
        help="also run a user's op: an op declared with tritongrad.op that declares its inputs (@op.inputs), "
             "or a tritongrad.bench OpSpec, e.g. examples.softcap:softcap (its reference is the eager and "
             "torch.compile baseline); an op without declared inputs is refused",
    )
    p.add_argument("--out", default="bench-out", help="folder for the JSON, CSV and PNGs (default: bench-out)")
    p.add_argument("--quick", action="store_true", help="a small sweep: three shapes, bf16")
    p.add_argument("--list", action="store_true", help="list ops and providers (and why any is skipped), then exit")
    p.add_argument("--warmup", type=float, default=10.0, help="warm-up per measurement, ms (default 10)")
    p.add_argument("--rep", type=float, default=50.0, help="timed runs per measurement, ms (default 50)")
    p.add_argument(
        "--time-limit", type=float, metavar="S", help="stop measuring after S seconds; the rest is reported as skipped"
    )
    p.set_defaults(func=run)
    return p


def _list(ops, probes) -> int:
    from .providers import PROVIDERS, Unavailable

    print("ops (default shapes on a GPU):")
    for op in ops.values():
        has, lacks = [], []
        for name, (version, why) in probes.items():
            if why is None:
                try:
                    PROVIDERS[name].build(op)
                    has.append(name)
                except Unavailable as e:
                    lacks.append(str(e))
        print(f"  {op.name:<13} {op.size}; {', '.join(f'{n}x{d}' for n, d in op.shapes)}")
        print(f"  {'':<13} run by: {', '.join(has)}" + "".join(f"; {why}" for why in lacks))
    print("providers:")
    for name, (version, why) in probes.items():
        print(f"  {name:<14} {version if why is None else 'skipped: ' + why}")
    return 0


def _user_ops(paths: list, device: str) -> list:
    """The ops of ``--op`` paths, loaded and checked (ValueError saying why one cannot be benched)."""
    from .ops import load, verify

    user = []
    for path in paths:
        try:
            spec = load(path)
            verify(spec, device)
        except ValueError as e:
            raise ValueError(f"tritongrad bench --op {path}: {e}") from e
        user.append(spec)
    return user


def _config(args, device: str, ops: dict, user: list, probes: dict):
    from . import harness

    default_dtypes = ["fp32"] if device != "cuda" else ["bf16"] if args.quick else list(_DTYPES)
    return harness.Config(
        ops=args.ops + [spec.name for spec in user] if args.ops or user else list(ops),
        dtypes=list(dict.fromkeys(args.dtype or default_dtypes)),
        modes=[m for m in _MODES if m in args.mode],
        providers=list(probes),
        shapes=args.shapes,
        quick=args.quick,
        warmup_ms=args.warmup,
        rep_ms=args.rep,
        time_limit_s=args.time_limit,
    )


def _print_header(meta: dict, device: str, probes: dict) -> None:
    print(f"tritongrad bench on {meta['gpu']}: torch {meta['torch']}, triton {meta['triton']}, "
          f"tritongrad {meta['tritongrad']} ({meta['git_sha']}), {meta['date']}")
    if device != "cuda":
        print("no GPU: a smoke sweep through Triton's interpreter; it exercises the harness, its times say nothing")
    for name, (version, why) in probes.items():
        print(f"  provider {name:<14} {version if why is None else 'skipped: ' + why}")


def _measure(cfg, device: str, timer, copy: dict, probes: dict, out, name: str, doc: dict) -> None:
    """The sweep's rows into ``doc``, printed as they come, checkpointed per op and dtype."""
    from . import harness, report

    print(report.LEGEND)
    print(report.HEADER)
    said, block = set(), None
    for row in harness.sweep(cfg, device, timer, copy["GBps"], probes):
        if block is not None and (row["dtype"], row["op"]) != block:
            report.write(out, name, doc)  # a checkpoint per op and dtype: a cut-short run keeps its results
        block = (row["dtype"], row["op"])
        doc["results"].append(row)
        # A skip is said once per provider, op and reason, not once per shape and mode.
        skip = (row["provider"], row["op"], row["reason"]) if row["status"] == "skipped" else None
        if skip is None or skip not in said:
            print(report.line(row), flush=True)
        said.add(skip)


def _finish(doc: dict, out, name: str, probes: dict, started: float) -> int:
    """Write the results and plots, print the summary; 1 where tritongrad's own measurements failed."""
    from . import plots, report

    doc["meta"]["elapsed_s"] = round(time.monotonic() - started, 1)
    written = report.write(out, name, doc)
    pictures = plots.plot(doc, out, name)
    if isinstance(pictures, str):
        print(pictures)
    else:
        written += pictures
    print("\n".join(report.summary(doc["results"], list(probes))))
    print(f"wrote {', '.join(str(p) for p in written)} in {doc['meta']['elapsed_s']:.0f} s")
    failed = sorted({r["op"] for r in doc["results"] if r["provider"] == "tritongrad" and r["status"] == "error"})
    if failed:
        print(f"tritongrad bench: tritongrad's measurements failed for {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def run(args) -> int:
    import dataclasses
    from pathlib import Path

    import torch

    from . import harness, report, roofline
    from .ops import ALIASES, OPS
    from .providers import PROVIDERS, probe_all

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        user = _user_ops(args.user_ops, device)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    OPS.update((spec.name, spec) for spec in user)
    args.ops = [ALIASES.get(o, o) for o in args.ops]
    unknown = [o for o in args.ops if o not in OPS] + [p for p in args.provider or () if p not in PROVIDERS]
    if unknown:
        print(f"tritongrad bench: unknown {', '.join(unknown)}; ops: {', '.join(OPS)}; "
              f"providers: {', '.join(PROVIDERS)}", file=sys.stderr)
        return 2
    wanted = set(args.provider or PROVIDERS)
    probes = probe_all([p for p in PROVIDERS if p in wanted])
    if args.list:
        return _list(OPS, probes)
    cfg = _config(args, device, OPS, user, probes)

    started = time.monotonic()
    meta = report.environment(device)
    _print_header(meta, device, probes)
    timer = harness.Timer(device, cfg.warmup_ms, cfg.rep_ms)
    copy = roofline.copy_bandwidth(device, timer)
    print(f"copy bandwidth: {copy['GBps']:.1f} GB/s ({copy['bytes'] / 2**20:.0f} MiB read + written "
          f"in {copy['ms']:.3f} ms)")

    out, name = Path(args.out), report.stem(meta)
    doc = {
        "meta": dict(meta, config=dataclasses.asdict(cfg)),
        "copy": copy,
        "providers": {p: {"version": v, "skipped": why} for p, (v, why) in probes.items()},
        "results": [],
    }
    _measure(cfg, device, timer, copy, probes, out, name, doc)
    return _finish(doc, out, name, probes, started)

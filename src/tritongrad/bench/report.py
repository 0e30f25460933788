"""What a run leaves behind: a line per measurement as it goes, JSON and CSV tagged with the machine and the
code that produced them, and a closing summary."""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path

import torch
import triton

import tritongrad

ROW_FIELDS = (
    "op", "dtype", "shape", "N", "D", "itemsize", "mode", "provider", "status", "reason",
    "ms", "ms_p20", "ms_p80", "bytes", "GBps", "pct_copy", "speedup", "peak_mem_bytes", "host_us",
    "dev_ms", "dev_ms_p20", "dev_ms_p80", "dev_pct_copy", "dev_speedup", "dev_reason",
)
# Repeated on every CSV row, so a row read on its own still says where it came from.
TAGS = ("gpu", "torch", "triton", "git_sha", "date")


def _git_sha() -> str:
    """``TRITONGRAD_GIT_SHA`` if set (a copy of the tree without .git), else the checkout's HEAD."""
    if os.environ.get("TRITONGRAD_GIT_SHA"):
        return os.environ["TRITONGRAD_GIT_SHA"]
    root = Path(__file__).resolve().parents[3]
    try:
        def git(*args):
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)

        head = git("rev-parse", "--short=12", "HEAD")
        if head.returncode == 0:
            dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def environment(device: str) -> dict:
    return {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)",
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tritongrad": tritongrad.__version__,
        "python": platform.python_version(),
        "git_sha": _git_sha(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def stem(meta: dict) -> str:
    machine = re.sub(r"[^a-z0-9]+", "-", meta["gpu"].lower()).strip("-")
    return f"bench-{machine}-{meta['date'].replace(':', '').replace('-', '')}"


def _num(value, fmt: str, width: int) -> str:
    return f"{value:{width}{fmt}}" if value is not None else f"{'-':>{width}}"


LEGEND = (
    "median/p20/p80: ms per call; GB/s: the op's bytes formula / median; %copy: of the copy bandwidth; "
    "tg x: this provider's time / tritongrad's; peak MiB (fwdbwd): above the inputs; host us (fwdbwd): "
    "wall time per call, back to back; dev ms, dev%: GPU time without the host (CUDA graph) and its %copy"
)
HEADER = (
    f"{'op':<13} {'dtype':<5} {'shape':<13} {'mode':<6} {'provider':<14} {'median ms':>10} {'p20':>9} {'p80':>9} "
    f"{'GB/s':>8} {'%copy':>6} {'tg x':>7} {'peak MiB':>9} {'host us':>9} {'dev ms':>9} {'dev%':>6}"
)


def line(row: dict) -> str:
    head = f"{row['op']:<13} {row['dtype']:<5} {row['shape']:<13} {row['mode']:<6} {row['provider']:<14}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row['reason']}"
    peak = row.get("peak_mem_bytes")
    return (
        f"{head} {_num(row['ms'], '.4f', 10)} {_num(row['ms_p20'], '.4f', 9)} {_num(row['ms_p80'], '.4f', 9)} "
        f"{_num(row['GBps'], '.1f', 8)} {_num(row['pct_copy'], '.1f', 6)} {_num(row.get('speedup'), '.3g', 7)} "
        f"{_num(peak / 2**20 if peak is not None else None, '.1f', 9)} {_num(row.get('host_us'), '.1f', 9)} "
        f"{_num(row.get('dev_ms'), '.4f', 9)} {_num(row.get('dev_pct_copy'), '.1f', 6)}"
    )


def write(out: Path, name: str, doc: dict) -> list[Path]:
    """``<name>.json`` (everything) and ``<name>.csv`` (one row per measurement, tagged)."""
    out.mkdir(parents=True, exist_ok=True)
    js, cs = out / f"{name}.json", out / f"{name}.csv"
    js.write_text(json.dumps(doc, indent=1) + "\n")
    tags = {k: doc["meta"][k] for k in TAGS}
    with cs.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=TAGS + ROW_FIELDS, extrasaction="ignore")
        w.writeheader()
        for row in doc["results"]:
            w.writerow({**tags, **row})
    return [js, cs]


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _speedup_cell(here: list[dict], provider: str) -> str:
    """Geometric-mean speedup over ``provider``, "call / device" when device times exist."""
    speedups = [r["speedup"] for r in here if r["provider"] == provider and r.get("speedup")]
    dev = [r["dev_speedup"] for r in here if r["provider"] == provider and r.get("dev_speedup")]
    if not speedups:
        return "-"
    return f"{_geomean(speedups):.3g}x" + (f" / {_geomean(dev):.3g}x" if dev else "")


def _share_cell(tg: list[dict]) -> str:
    """tritongrad's % of copy at its largest measured size, "per call / device"."""
    top = max(tg, key=lambda r: r["bytes"], default=None)
    if not top:
        return "-"
    dev = f" / {top['dev_pct_copy']:.1f}%" if top.get("dev_pct_copy") else ""
    return f"{top['pct_copy']:.1f}%{dev} at {top['shape']}"


def _bandwidth_lines(rows: list[dict], ok: list[dict], others: list[str]) -> list[str]:
    keys = list(dict.fromkeys((r["op"], r["dtype"], r["mode"]) for r in rows))
    lines = [
        "== summary: tritongrad's % of copy bandwidth at its largest size, per call / device time; its speedup "
        "over each provider (geometric mean over shapes, per call / device time; > 1: tritongrad faster)",
        f"{'op':<13} {'dtype':<5} {'mode':<6} {'tritongrad %copy':>30} " + " ".join(f"{p:>18}" for p in others),
    ]
    for op, dtype, mode in keys:
        here = [r for r in ok if (r["op"], r["dtype"], r["mode"]) == (op, dtype, mode)]
        share = _share_cell([r for r in here if r["provider"] == "tritongrad"])
        cells = [_speedup_cell(here, p) for p in others]
        lines.append(f"{op:<13} {dtype:<5} {mode:<6} {share:>30} " + " ".join(f"{c:>18}" for c in cells))
    return lines


def _latency_lines(ok: list[dict], providers: list[str]) -> list[str]:
    host = [r for r in ok if r.get("host_us") is not None]
    if not host:
        return []
    lines = ["== latency regime: host us per fwd+bwd call at the smallest shape",
             f"{'op':<13} {'dtype':<5} {'shape':<13} " + " ".join(f"{p:>14}" for p in providers)]
    for op, dtype in dict.fromkeys((r["op"], r["dtype"]) for r in host):
        mine = [r for r in host if (r["op"], r["dtype"]) == (op, dtype)]
        small = min(mine, key=lambda r: r["N"] * r["D"])["shape"]
        by = {r["provider"]: r["host_us"] for r in mine if r["shape"] == small}
        cells = [f"{by[p]:.1f}" if p in by else "-" for p in providers]
        lines.append(f"{op:<13} {dtype:<5} {small:<13} " + " ".join(f"{c:>14}" for c in cells))
    return lines


def _examples(rows: list[dict], title: str, reason: str) -> list[str]:
    """A title line, then up to five rows of distinct (provider, reason)."""
    if not rows:
        return []
    lines = [title.format(n=len(rows))]
    for r in list({(r["provider"], r[reason]): r for r in rows}.values())[:5]:
        lines.append(f"   {r['provider']} {r['op']} {r['dtype']} {r['shape']} {r['mode']}: {r[reason]}")
    return lines


def summary(rows: list[dict], providers: list[str]) -> list[str]:
    """Per op, dtype and mode: tritongrad's share of copy bandwidth at its largest measured size, and its
    speedup over each provider (geometric mean over the shapes both ran), per call and on the device;
    then the host time per fwd+bwd call at the smallest shape, the latency regime."""
    ok = [r for r in rows if r["status"] == "ok"]
    others = [p for p in providers if p != "tritongrad"]
    no_dev = [r for r in ok if r.get("dev_reason") and r["mode"] != "bwd"]  # bwd rows are never captured
    failed = [r for r in rows if r["status"] == "error"]
    return (_bandwidth_lines(rows, ok, others) + _latency_lines(ok, providers)
            + _examples(no_dev, "== {n} rows without a device time ('dev_reason' in the JSON/CSV), e.g.:", "dev_reason")
            + _examples(failed, "== {n} measurements failed (status 'error' in the JSON/CSV), e.g.:", "reason"))

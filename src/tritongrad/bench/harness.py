"""The measurements and the sweep.

Modes, for an op ``y = f(*inputs)`` and a fixed random upstream gradient ``g`` (one per floating output):

- ``fwd``   : ``f(*inputs)`` under ``torch.no_grad()`` (nothing saved for backward);
- ``bwd``   : ``y.backward(g, retain_graph=True)`` on one retained graph: the backward alone;
- ``fwdbwd``: ``f(*inputs).backward(g)``.

Gradients are set to None before every timed run, so no run pays for accumulating into the last one's.
Each (op, dtype, shape, provider, mode) gives one row: median and 20/80 percentiles of the time, GB/s from
the op's bytes formula, that as a share of the copy bandwidth, and tritongrad's speedup over the provider;
``fwdbwd`` rows add the peak memory of one fwd+bwd above the inputs, and the host's wall time per call over
many calls (in the latency regime, launch and Python overhead are what that measures).

Two times per row on a GPU. ``ms`` is ``triton.testing.do_bench``: each call issued from Python after an
L2 flush, so it includes whatever part of the host's work per call (Python, autograd, launches) the GPU
cannot hide; on a slow host that can exceed the kernels' time even at 256 MB. ``dev_ms`` takes the host
out (``fwd`` and ``fwdbwd`` rows): the same calls captured in a CUDA graph (each after an L2 flush) and
replayed, minus a graph of the flushes alone. ``ms`` is what one eager call costs; ``dev_ms`` is what the
GPU spends, the figure a kernel's distance from the copy bandwidth is judged by (``dev_pct_copy``).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from . import roofline
from .ops import OPS, QUICK_SHAPES, ROW_SWEEP, SMOKE_SHAPES, OpSpec, outputs
from .providers import PROVIDERS, Unavailable

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("fwd", "bwd", "fwdbwd")
QUANTILES = (0.5, 0.2, 0.8)
GRAPH_MS = 5.0  # GPU time each CUDA-graph replay of the device-time measurement aims at
GRAPH_REPLAYS = 5


@dataclass(frozen=True)
class Config:
    ops: Sequence[str]
    dtypes: Sequence[str]
    modes: Sequence[str]
    providers: Sequence[str]  # in PROVIDERS order: tritongrad's times exist before the others' speedups
    shapes: Sequence[tuple[int, int]] | None = None  # None: each op's sweep (GPU) or the smoke sweep (CPU)
    quick: bool = False
    warmup_ms: float = 10.0
    rep_ms: float = 50.0
    time_limit_s: float | None = None


def _clear_grads(leaves: Sequence) -> None:
    for t in leaves:
        if isinstance(t, torch.Tensor):
            t.grad = None


def _fwd(fn, inputs, g):
    def run():
        with torch.no_grad():
            fn(*inputs)

    return run


def _grads(g) -> tuple:
    return tuple(g) if isinstance(g, (tuple, list)) else (g,)


def _bwd(fn, inputs, g):
    y = outputs(fn(*inputs))  # kept alive by the closure, with its graph: each run is the backward alone
    g = _grads(g)

    def run():
        torch.autograd.backward(y, g, retain_graph=True)

    return run


def _fwdbwd(fn, inputs, g):
    g = _grads(g)

    def run():
        torch.autograd.backward(outputs(fn(*inputs)), g)

    return run


_RUNNERS = {"fwd": _fwd, "bwd": _bwd, "fwdbwd": _fwdbwd}


class Timer:
    """Times callables on ``device``: triton's ``do_bench`` on a GPU (CUDA events, L2 flushed before each
    run), the host clock on CPU, where ``do_bench`` has no device to ask for events."""

    def __init__(self, device: str, warmup_ms: float, rep_ms: float):
        self.device, self.warmup_ms, self.rep_ms = device, warmup_ms, rep_ms

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def __call__(self, run: Callable, leaves: Sequence[torch.Tensor] = ()) -> tuple[float, float, float]:
        """Median, 20th and 80th percentile of one run, in ms."""
        if self.device == "cuda":
            import triton.testing

            return tuple(
                triton.testing.do_bench(
                    run, warmup=self.warmup_ms, rep=self.rep_ms, grad_to_none=list(leaves), quantiles=list(QUANTILES)
                )
            )
        start = time.perf_counter()
        run()
        estimate_ms = max((time.perf_counter() - start) * 1e3, 1e-3)
        for _ in range(int(self.warmup_ms / estimate_ms)):
            run()
        times = []
        for _ in range(max(3, int(self.rep_ms / estimate_ms))):
            _clear_grads(leaves)
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e3)
        q = torch.quantile(torch.tensor(times, dtype=torch.float64), torch.tensor(QUANTILES, dtype=torch.float64))
        return tuple(q.tolist())

    def host_us(self, run: Callable, leaves: Sequence[torch.Tensor], median_ms: float, batches: int = 5) -> float:
        """Wall time per call over back-to-back calls, synchronized once at the end of a batch: where the
        device finishes faster than the host can issue work, this is the host's cost per call. The median
        of ``batches`` batches, so that one burst of other work on the host does not decide the figure."""
        calls = max(3, min(200, int(self.rep_ms / max(median_ms, 1e-3)) // batches))
        per_call = []
        for _ in range(batches):
            self.sync()
            start = time.perf_counter()
            for _ in range(calls):
                _clear_grads(leaves)
                run()
            self.sync()
            per_call.append((time.perf_counter() - start) / calls * 1e6)
        return statistics.median(per_call)

    def device_ms(self, run: Callable, leaves: Sequence[torch.Tensor], median_ms: float) -> tuple[float, float, float]:
        """Median, 20th and 80th percentile of the GPU time of one ``fwd`` or ``fwdbwd`` run, host overhead
        excluded: replays of a CUDA graph of n (flush L2, run) minus the mean replay of a graph of n
        flushes, over n. Not for ``bwd``: its forward ran before, outside the capture, and autograd runs a
        backward on its forward's stream; capturing it fails for every provider (torch 2.11)."""
        import triton

        n = max(3, min(100, int(GRAPH_MS / max(median_ms, 1e-3))))
        cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())

        def capture(body) -> torch.cuda.CUDAGraph:
            body()  # warm-up on the side stream, as torch.cuda.graph asks of code captured the first time
            graph = torch.cuda.CUDAGraph()
            # "thread_local": a backward runs on autograd's device thread, whose calls this capture, begun
            # on this thread, must not forbid.
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                for _ in range(n):
                    body()
            return graph

        def replay(graph) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            return start.elapsed_time(end)

        # A capture that fails leaves the CUDA generator marked as capturing, and every later random call
        # raises ("Offset increment outside graph capture"): a failed provider would fail the rest of the run.
        generator = torch.cuda.default_generators[torch.cuda.current_device()]
        fresh = generator.clone_state()
        try:
            with torch.cuda.stream(stream):

                def flush_and_run():
                    _clear_grads(leaves)
                    cache.zero_()
                    run()

                flushes = capture(cache.zero_)
                runs = capture(flush_and_run)
                replay(runs)
                replay(flushes)
                # each replay of the runs minus the replay of the flushes right after it: drift cancels
                times = [(replay(runs) - replay(flushes)) / n for _ in range(GRAPH_REPLAYS)]
        except BaseException:
            generator.graphsafe_set_state(fresh)
            raise
        finally:
            _clear_grads(leaves)  # they point into the graph's memory pool
            torch.cuda.current_stream().wait_stream(stream)
        q = torch.quantile(torch.tensor(times, dtype=torch.float64), torch.tensor(QUANTILES, dtype=torch.float64))
        return tuple(q.tolist())

    def peak_memory(self, run: Callable, leaves: Sequence[torch.Tensor]) -> int | None:
        """Bytes allocated at the peak of one run above what was allocated before it (inputs, g)."""
        if self.device != "cuda":
            return None
        _clear_grads(leaves)
        self.sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        self.sync()
        return torch.cuda.max_memory_allocated() - before


def shapes_for(op: OpSpec, cfg: Config, device: str) -> Sequence[tuple[int, int]]:
    if cfg.shapes:
        return cfg.shapes
    if device != "cuda":
        return SMOKE_SHAPES
    if cfg.quick:  # the row sweep's three, or the smallest row shape and the op's first two
        return QUICK_SHAPES if op.shapes == ROW_SWEEP else (QUICK_SHAPES[0], *op.shapes[:2])
    return op.shapes


def _no_room(N: int, D: int, itemsize: int, device: str) -> str | None:
    # Generous: inputs, g, output and gradients, plus eager PyTorch's float32 temporaries for 16-bit inputs.
    need = 8 * N * D * max(itemsize, 4)
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > free:
        return f"does not fit: needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


def _error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _measure(provider_name: str, fn: Callable, mode: str, inputs, g, timer: Timer) -> dict:
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    run = _RUNNERS[mode](fn, inputs, g)
    run()  # warm-up outside the guard: Triton's JIT, torch.compile's compilation
    _clear_grads(leaves)
    with PROVIDERS[provider_name].guard():
        ms, p20, p80 = timer(run, leaves)
        found = {"status": "ok", "ms": ms, "ms_p20": p20, "ms_p80": p80}
        if mode == "fwdbwd":
            found["peak_mem_bytes"] = timer.peak_memory(run, leaves)
            found["host_us"] = timer.host_us(run, leaves, ms)
        if timer.device == "cuda" and mode == "bwd":
            found["dev_reason"] = "not measured for bwd (see Timer.device_ms); fwdbwd minus fwd bounds it"
        elif timer.device == "cuda":
            try:
                dev = timer.device_ms(run, leaves, ms)
                if dev[1] > 0:  # the 20th percentile: every reported quantile is a time
                    found["dev_ms"], found["dev_ms_p20"], found["dev_ms_p80"] = dev
                else:
                    found["dev_reason"] = "below what the flush subtraction resolves"
            except Exception as e:  # e.g. a provider that synchronizes or reads back a value mid-call
                found["dev_reason"] = "not capturable in a CUDA graph: " + _error(e)
    _clear_grads(leaves)
    return found


def _provider_rows(name, op, inputs, g, base, why_not, cfg, timer, copy_gbps, reference) -> Iterator[dict]:
    """One row per mode for provider ``name``; ``reference`` collects tritongrad's medians per mode."""
    fn = None
    if why_not is None:
        try:
            fn = PROVIDERS[name].build(op)
        except Unavailable as e:
            why_not = str(e)
        except Exception as e:
            why_not = "error: " + _error(e)
    for mode in cfg.modes:
        row = dict(base, mode=mode, provider=name, bytes=op.bytes(mode, base["N"], base["D"], base["itemsize"]))
        if fn is None:
            status = "error" if why_not.startswith("error: ") else "skipped"
            yield dict(row, status=status, reason=why_not.removeprefix("error: "))
            continue
        try:
            row.update(_measure(name, fn, mode, inputs, g, timer))
        except Exception as e:
            row.update(status="error", reason=_error(e))
            _clear_grads(inputs)
        if row["status"] == "ok":
            row["GBps"] = roofline.gbps(row["bytes"], row["ms"])
            row["pct_copy"] = 100.0 * row["GBps"] / copy_gbps
            if row.get("dev_ms"):
                row["dev_pct_copy"] = 100.0 * roofline.gbps(row["bytes"], row["dev_ms"]) / copy_gbps
            if name == "tritongrad":
                reference[mode] = row["ms"]
                reference["dev", mode] = row.get("dev_ms")
            elif mode in reference:
                row["speedup"] = row["ms"] / reference[mode]
                if row.get("dev_ms") and reference.get(("dev", mode)):
                    row["dev_speedup"] = row["dev_ms"] / reference["dev", mode]
        yield row


def sweep(cfg: Config, device: str, timer: Timer, copy_gbps: float, probes: dict) -> Iterator[dict]:
    """Rows in the order dtype, op, shape, provider, mode (bf16 first: a run cut short loses fp32 first).
    ``probes`` is ``providers.probe_all``'s answer. Past ``cfg.time_limit_s`` no new shape is started and
    the remaining rows are yielded as skipped, so what was measured is kept."""
    start = time.monotonic()
    for dtype_name in cfg.dtypes:
        dtype = DTYPES[dtype_name]
        for op in (OPS[name] for name in cfg.ops):
            for N, D in shapes_for(op, cfg, device):
                base = dict(op=op.name, dtype=dtype_name, shape=f"{N}x{D}", N=N, D=D, itemsize=dtype.itemsize)
                past = cfg.time_limit_s is not None and time.monotonic() - start > cfg.time_limit_s
                why_not = f"time limit of {cfg.time_limit_s:g} s reached" if past else None
                why_not = why_not or _no_room(N, D, dtype.itemsize, device)
                inputs = g = None
                if why_not is None:
                    try:
                        inputs = op.inputs(N, D, dtype, device)
                        with torch.no_grad():
                            g = tuple(torch.randn_like(o) for o in outputs(op.bind(op.torch_fn)(*inputs)))
                    except Exception as e:  # the op's inputs cannot be made at this size: every row says so
                        why_not = "error: inputs: " + _error(e)
                reference: dict = {}
                for name in cfg.providers:
                    yield from _provider_rows(
                        name, op, inputs, g, base, why_not or probes[name][1], cfg, timer, copy_gbps, reference
                    )
                del inputs, g
                if device == "cuda":
                    torch.cuda.empty_cache()

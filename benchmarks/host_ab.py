"""Per-call time of a forward+backward, tritongrad against eager PyTorch, at sizes where the host decides it
(small inputs: tritongrad hands them to PyTorch's own ops behind its wrapper).

`tritongrad bench` times providers one after another, and this host's time per call drifts by 10-20% over
seconds, more than the difference measured here. So the two are interleaved: per round, a batch of calls of
each (in alternating order), synchronised at the end of the batch; per case, the medians over rounds of the
time per call and of the per-round ratio, with its 20th/80th percentiles.

    PYTHONPATH=src python3 benchmarks/host_ab.py LABEL OUT.json [NxD,NxD,...]     (on a GPU machine)
"""

import datetime
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import tritongrad as tg

EPS = 1e-5
# name -> (parameter tensors [D], eager, tritongrad); both take (x, params)
OPS = {
    "weighted_sum": (1, lambda x, p: (x * p[0]).sum(-1), lambda x, p: tg.weighted_sum(x, p[0])),
    "rms_norm": (1, lambda x, p: F.rms_norm(x, (x.shape[-1],), p[0], EPS),
                 lambda x, p: tg.rms_norm(x, (x.shape[-1],), p[0], EPS)),
    "layer_norm": (2, lambda x, p: F.layer_norm(x, (x.shape[-1],), p[0], p[1], EPS),
                   lambda x, p: tg.layer_norm(x, (x.shape[-1],), p[0], p[1], EPS)),
}
# hidden sizes <= 2048: a decode step, a small batch, and 2**20 elements
SHAPES = [(4, 64), (16, 2048), (512, 2048)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ROUNDS, CALLS = 21, 100


def measure(n, eager, ours, N, D, dtype, weighted_sum):
    x = torch.randn(N, D, device="cuda", dtype=dtype, requires_grad=True)
    params = [(1 + 0.5 * torch.randn(D, device="cuda")).to(dtype).requires_grad_() for _ in range(n)]
    g = torch.randn((N,) if weighted_sum else (N, D), device="cuda", dtype=dtype)
    leaves = [x, *params]

    def call(f):
        for t in leaves:
            t.grad = None
        f(x, params).backward(g)

    for f in (eager, ours):
        for _ in range(20):
            call(f)
    per = {"eager": [], "tritongrad": []}
    ratios = []
    for r in range(ROUNDS):
        order = [("eager", eager), ("tritongrad", ours)]
        got = {}
        for key, f in order if r % 2 == 0 else order[::-1]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(CALLS):
                call(f)
            torch.cuda.synchronize()
            got[key] = (time.perf_counter() - start) / CALLS * 1e6
            per[key].append(got[key])
        ratios.append(got["tritongrad"] / got["eager"])
    ratios.sort()
    return dict(eager_us=statistics.median(per["eager"]), tritongrad_us=statistics.median(per["tritongrad"]),
                ratio=statistics.median(ratios), ratio_p20=ratios[ROUNDS // 5], ratio_p80=ratios[-1 - ROUNDS // 5])


def main(label, out, shapes=None):
    shapes = [tuple(map(int, s.split("x"))) for s in shapes.split(",")] if shapes else SHAPES
    meta = dict(label=label, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    rows = []
    for name, (n, eager, ours) in OPS.items():
        for dtype in DTYPES:
            for N, D in shapes:
                row = dict(op=name, dtype=str(dtype).removeprefix("torch."), N=N, D=D,
                           **measure(n, eager, ours, N, D, dtype, name == "weighted_sum"))
                rows.append(row)
                print(f"{label} {name:12s} {row['dtype']:8s} {N}x{D:<5d} eager {row['eager_us']:6.1f} "
                      f"tritongrad {row['tritongrad_us']:6.1f} us  ratio {row['ratio']:.3f} "
                      f"[{row['ratio_p20']:.3f}, {row['ratio_p80']:.3f}]", flush=True)
    with open(out, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])

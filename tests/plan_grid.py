"""Every launch decision over a grid of shapes, dtypes and device properties, as canonical text.

The norm and weighted_sum launchers run on meta tensors (nothing is computed) and each ``tritongrad.kernel``
launch is recorded: kernel, grid, constexprs, warps and integer arguments. The other families' plan functions
are called directly. ``python tests/plan_grid.py`` prints one line per case; ``tests/test_plans.py`` checks
the digest, so that a changed plan is a deliberate change of that test.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import sys

import torch

from tritongrad import _runtime as rt

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# (N, D): short rows, rows between powers of two, parted rows, long rows of 3-6 chunks, few huge rows.
SHAPES = ((4, 64), (4096, 32), (4096, 1000), (16384, 1536), (2048, 4096), (8192, 5120), (4096, 8192),
          (512, 9216), (512, 13000), (4096, 16384), (512, 20480), (512, 24576), (16, 65536), (16, 1048576),
          (1 << 20, 128), (20000, 13000))
DEVICES = (rt.DeviceProps(4, 228 * 1024), rt.DeviceProps(132, 228 * 1024), rt.DeviceProps(78, 100 * 1024))


def _record(seen):
    def spy(launch: rt.Launch):
        ints = [a for a in launch.args if type(a) is int]
        consts = {k: (str(v) if not isinstance(v, (int, bool)) else v) for k, v in launch.kw.items()}
        if launch.kernel == "_column_sum_kernel":  # column_sum's own plan is not the family's: its shape only
            consts = {}
        seen.append(f"{launch.kernel} grid={launch.grid} ints={ints} {sorted(consts.items())}")

    return spy


def _meta(shape, dtype, grad=True):
    return torch.empty(shape, device="meta", dtype=dtype)


def norm_cases():
    from tritongrad.ops.norm import launch as L

    for (N, D), dt, wdt in itertools.product(SHAPES, DTYPES, ("same", torch.float32, None)):
        if N * D > (1 << 31):
            continue
        w_dtype = dt if wdt == "same" else wdt
        for kind in ("rms", "ln", "llama"):
            if kind == "llama" and w_dtype is None:
                continue
            x = _meta((N, D), dt)
            w = None if w_dtype is None else _meta((D,), w_dtype)
            b = w if kind == "ln" else None
            ln = kind == "ln"
            outs = L._forward(x, 1, w, b, 1e-5, layer_norm=ln, llama=kind == "llama")
            mean, rstd = (outs[1], outs[2]) if ln else (None, outs[1])
            dy = _meta((N, D), outs[0].dtype)
            for needs in ((True, w is not None, b is not None), (False, w is not None, False)):
                if any(needs):
                    yield f"norm {kind} {N}x{D} {dt} w={w_dtype} needs={needs}", lambda needs=needs: L._backward(
                        dy, x, 1, w, b, mean, rstd, needs, layer_norm=ln, llama=kind == "llama")
            yield f"norm {kind} fwd {N}x{D} {dt} w={w_dtype}", lambda: L._forward(
                x, 1, w, b, 1e-5, layer_norm=ln, llama=kind == "llama")


def weighted_sum_cases():
    from tritongrad.ops.weighted_sum import launch as L

    class Ctx:
        pass

    for (N, D), dt in itertools.product(SHAPES + ((32768, 4096), (131072, 1024), (64, 2097152)), DTYPES):
        if N * D > (1 << 31):
            continue
        x, w = _meta((N, D), dt), _meta((D,), dt)
        yield f"ws fwd {N}x{D} {dt}", lambda: L.weighted_sum.forward(x, w)
        for needs in ((True, True), (True, False), (False, True)):
            ctx = Ctx()
            ctx.x, ctx.w, ctx.needs_input_grad = x, w, needs
            yield f"ws bwd {N}x{D} {dt} {needs}", lambda ctx=ctx: L._weighted_sum_backward(ctx, _meta((N,), dt))


def plan_cases():
    from tritongrad.ops.cross_entropy import plans as CE
    from tritongrad.ops.norm import plans as NP
    from tritongrad.ops.rope import plans as RP
    from tritongrad.ops.swiglu import plans as SW

    for N, C, elem, narrow in itertools.product((1, 64, 16384), (1000, 4096, 32000, 128256, 256000), (2, 4, 8),
                                                (0, 1, 2)):
        yield f"ce row {N} {C} {elem} {narrow}", lambda: CE.row_plan(N, C, elem, rt.device_props(_DEV), narrow,
                                                                            CE.table())
    for N, V, H, elem in itertools.product((1, 1000, 16384, 65536), (32000, 128256, 256000), (1536, 4096), (2, 4)):
        yield f"ce lce {N} {V} {H} {elem}", lambda: CE.lce_chunk_rows(N, V, H, elem, CE.table())
    for N in (1, 100, 16384, 1 << 20):
        yield f"ce bwd {N}", lambda: CE.bwd_rows(N, rt.device_props(_DEV), CE.table())
    for T, HQ, HK, D, R, elem in itertools.product((1, 7, 4096), (32, 40, 28, 14, 8), (8, 4, 1, 0), (64, 128, 256),
                                                   (32, 64, 128), (2, 4)):
        if R <= D:
            yield f"rope {T} {HQ} {HK} {D} {R} {elem}", lambda: RP.plan(T, HQ, HK, D, R, elem, RP.table())
    for N, D, elem in itertools.product((1, 7, 16384), (64, 1000, 4096, 11008, 14336, 13824), (2, 4, 8)):
        yield f"swiglu {N} {D} {elem}", lambda: SW.tile(N, D, elem, SW.table())
    for (N, D), dt, wdt, cast_first in itertools.product(((1, 64), (7, 1000), (16384, 4096), (4096, 8192),
                                                          (512, 9216)), DTYPES, ("same", torch.float32),
                                                         (True, False)):
        w_dtype = dt if wdt == "same" else wdt
        yield f"add_norm {N}x{D} {dt} w={w_dtype} cast_first={cast_first}", lambda: NP.add_norm(
            N=N, D=D, x_dtype=dt, w_dtype=w_dtype, props=rt.device_props(_DEV), t=NP.table(),
            w_offset=0.0 if cast_first else 1.0, cast_first=cast_first)


_DEV = torch.device("meta")


def lines():
    out = []
    seen: list = []
    spy = _record(seen)
    for props in DEVICES:
        with contextlib.ExitStack() as stack:
            stack.enter_context(rt.assume_device(props))
            stack.enter_context(rt.observe_launches(spy))
            for name, fn in itertools.chain(norm_cases(), weighted_sum_cases(), plan_cases()):
                seen.clear()
                r = fn()
                got = " | ".join(seen) if seen else repr(r)
                out.append(f"{props.sm_count}/{props.shared_mem_per_sm} {name}: {got}")
    return out


def digest() -> str:
    return hashlib.sha256("\n".join(lines()).encode()).hexdigest()


if __name__ == "__main__":
    text = "\n".join(lines())
    sys.stdout.write(text + "\n")
    sys.stderr.write(hashlib.sha256(text.encode()).hexdigest() + f" {text.count(chr(10)) + 1} cases\n")

"""Shared by every test module. Without a GPU the Triton kernels run in Triton's interpreter, a choice Triton
reads once, when it is imported: ``use_interpreter()`` comes first, before anything imports tritongrad's ops."""

import os
import sys

# Bytecode, where the environment says not to write it (PYTHONDONTWRITEBYTECODE): every process the suite
# starts (the workers, the subprocesses of the model matrix and the examples) would compile torch's and
# transformers' modules from source again. They go to one cache in .pytest_cache instead, compiled once per
# checkout and never beside the sources (docs/measuring.md#the-test-suite). Before anything imports torch.
if sys.dont_write_bytecode:
    sys.pycache_prefix = sys.pycache_prefix or os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), ".pytest_cache", "pycache")
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from tritongrad.testing import default_device, use_interpreter  # noqa: E402

use_interpreter()

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import fnmatch  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tritongrad import _runtime as rt  # noqa: E402
from tritongrad.testing import OpSuite, assert_close_earned, ulp_atol  # noqa: E402

# One intra-op thread per test process, and for the subprocesses tests start: pytest-xdist already runs a
# process per core, and torch's thread pool on top of it oversubscribes the cores, which slows the suite's
# tiny ops tenfold (docs/measuring.md#the-test-suite).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

# The collector's thresholds after collection (Python's default: 700, 10, 10).
GC_THRESHOLDS = (10000, 50, 100)

DEVICE = default_device()
ROOT = Path(__file__).resolve().parents[1]

# Absolute slack on top of "2x eager PyTorch's error": a few ulps of each dtype at the magnitudes tested.
ATOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


# Modules whose tests share a long module-scoped fixture (test_bench.py's sweep): under pytest-xdist all their
# tests go to one worker, so that the fixture runs once; other tests go one by one to whichever worker is free.
# (pytest-xdist's own --dist loadgroup tags node ids, which pytest 9 no longer lets a plugin change.)
ONE_WORKER_MODULES = ("tests/test_bench.py",)

if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class Scheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                module = nodeid.split("::", 1)[0]
                return module if module in ONE_WORKER_MODULES else nodeid

        return Scheduling(config, log)


PARAMETER_SET = type(pytest.param(None))


@dataclasses.dataclass(frozen=True)
class OneAtATime:
    """Keeps, of a test's parameter product, the cases that differ from the first value of every parameter list
    in at most one list (``crossed``: argument names whose values are all kept with every other case, e.g. both
    norms): each value is tried once, with the others at the representative; the product is the extended tier's."""

    crossed: tuple = ()

    def keeps(self, item) -> bool:
        params, moved = item.callspec.params, 0
        for mark in item.iter_markers("parametrize"):
            names = mark.args[0]
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
            if names[0] in self.crossed:
                continue
            first = mark.args[1][0]
            if isinstance(first, PARAMETER_SET):  # pytest.param(...): its values, one a name
                first = tuple(first.values)
            else:
                first = tuple(first) if len(names) > 1 else (first,)
            moved += any(params[n] is not v and params[n] != v for n, v in zip(names, first))
        return moved <= 1


# The extended tier beyond the kit's (OpSuite marks its own cases): tests, or a test's parameters, that repeat
# what the quick tier checks on more specializations or shapes. `pytest -m extended` runs them, and the GPU
# script runs everything (docs/measuring.md#the-test-suite). Each entry says what the quick tier keeps: a
# reason, or (reason, the parameter ids kept in the quick tier, as fnmatch patterns, or a OneAtATime).
ONE_PARAMETER_AT_A_TIME = ("each parameter's values once, the others at their first (tests/conftest.py "
                           "OneAtATime): the product repeats the paths each value reaches")
NORMS = OneAtATime(crossed=("norm",))
EXTENDED = {
    "tests/test_patch_models.py::test_patch_transformers_first_call_compiled_establishes_each_instance": (
        "the fallback where dynamo cannot decide at the trace (a torch whose assume_constant_result takes no "
        "module), forced; the quick tier keeps the installed torch's path, established at the trace",
        {"established-at-trace"}),
    "tests/test_pattern.py::test_cpu_path_without_interpreter": (
        "the CPU path with the first op's reference lowered by Inductor (a C++ compile); the quick tier traces every "
        "op with aot_eager in the same fresh process", {"aot_eager"}),
    "tests/test_zoo.py::test_family_with_kernels": (
        "the kernel families beyond the two whose compiled paths crashed, and eager with the kernels: the quick "
        "tier runs Qwen3 (per-head q/k norms, transposed upstream gradients) and Gemma 3 (GeGLU, (1 + w) norms) "
        "compiled with the kernels in the interpreter, every family eager on the references "
        "(test_every_family_eager), and Llama eager with the kernels (test_patch_models)",
        {"qwen3-compiled", "gemma3_text-compiled"}),
    "tests/test_post_training.py::test_linear_distill_suite": (
        "the kit on the distillation op beyond its values; the quick tier checks its formulas against TRL's and "
        "its gradients, and keeps the kit's quick values (every dtype on the representative)", {"values-*"}),
    "tests/test_post_training.py::test_linear_grpo_suite": (
        "the kit on the fused GRPO op beyond its values; the quick tier checks it against TRL's formula and keeps "
        "the kit's quick values (the op called alone: its backward recomputes the gradients)",
        {"values-*"}),
    "tests/test_post_training.py::test_linear_dpo_suite": (
        "the kit on the fused DPO op beyond its values; the quick tier checks it against TRL's formula for every "
        "loss type, its chunks of one and two pairs and of rows against its float64 reference, and the op "
        "called alone (its backward recomputes the gradients)", {"values-*"}),
    "tests/test_bench.py::test_every_built_in_op_runs": (
        "the bench's rows of the ops past the sweep's: the quick tier sweeps layer_norm through every provider, "
        "shape and mode, and times the examples' ops (test_examples); each op's bytes formula is checked here"),
    "tests/test_train_llama.py::test_fsdp2_and_ddp_runs_match_one_process": (
        "the training benchmark's runs on two ranks and their report; the library on two ranks (every patched op, "
        "the sharded LM head, FSDP2 and DDP) is the quick tier's test_two_ranks_dtensor_weight_fsdp2_and_ddp"),
    "tests/test_patch_models.py::test_all_ops_match_hf": (
        "the families beyond Llama: the family matrix (test_zoo.py) checks every family, more closely", {"llama"}),
    **{f"tests/test_norms.py::{t}": (ONE_PARAMETER_AT_A_TIME, NORMS) for t in (
        "test_long_rows_path", "test_long_rows_split", "test_chunked_path", "test_forward_in_parts",
        "test_rows_aligned_below_16", "test_zero_variance_rows")},
    **{t: (ONE_PARAMETER_AT_A_TIME, OneAtATime()) for t in (
        "tests/test_rope.py::test_upstream_gradients_of_any_layout",
        "tests/test_cross_entropy.py::test_large_common_offset_costs_no_precision")},
}


def pytest_collection_finish(session):
    # What collection imported (torch, Triton, transformers, the tests' tables) lives to the end: frozen, the
    # collector's full passes no longer walk it, and with a larger first generation the interpreter's short-lived
    # objects are collected less often (docs/measuring.md#the-test-suite).
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def pytest_sessionfinish(session):
    gc.unfreeze()  # extension objects frozen above are freed at exit, as usual


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection, which reads the marks added here
def pytest_collection_modifyitems(config, items):
    files = {item.nodeid.split("::", 1)[0] for item in items}
    unused = {k for k in EXTENDED if k.split("::", 1)[0] in files}
    for item in items:
        for key, entry in EXTENDED.items():
            if item.nodeid == key or item.nodeid.startswith(key + "[") or item.nodeid.startswith(key + "::"):
                unused.discard(key)
                kept = entry[1] if isinstance(entry, tuple) else ()
                callspec = getattr(item, "callspec", None)
                if callspec is None:
                    keep = False
                elif isinstance(kept, OneAtATime):
                    keep = kept.keeps(item)
                else:
                    keep = any(fnmatch.fnmatchcase(callspec.id, k) for k in kept)
                if not keep:
                    item.add_marker(pytest.mark.extended)
    whole_files = not config.option.keyword and not any("::" in a for a in config.args)
    if unused and whole_files:  # a stale entry (a renamed test) would move that test into the quick tier
        raise pytest.UsageError(f"tests/conftest.py EXTENDED names tests that do not exist: {sorted(unused)}")
    # Slow tests first: under pytest-xdist each then starts at once on a worker of its own, beside the many
    # short tests, instead of finishing alone at the end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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
    # Different data per test, reproducible per test id (whichever worker runs it).
    # The CPU generator and, where there is one, the GPUs' (torch.manual_seed also visits every other backend's
    # seeding functions, a share of a short test's time).
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


Launch = rt.Launch  # kernel (name), grid, args (in the kernel's order), kw (constexprs and num_warps)


@pytest.fixture
def launches() -> list:
    """Every kernel launch through ``tritongrad.kernel`` while the test runs, in order: which kernel served a
    shape, on which grid, with which constexprs. The launches still run."""
    seen: list = []
    with rt.observe_launches(seen.append):
        yield seen


def kernel_names(seen: list) -> list:
    return [launch.kernel for launch in seen]


@pytest.fixture
def four_sms():
    """Plans made for 4 SMs on any device (the interpreter's count), so that a test's shapes take the
    launch path it names on a GPU too."""
    with rt.assume_device(dataclasses.replace(rt.device_props(torch.device(DEVICE)), sm_count=4)):
        yield


def check_values(op, *args, baseline=None) -> None:
    """The kit's value check on these arguments: outputs and gradients (for a random upstream gradient) against
    the float64 reference, within the earned tolerance, and the op's own autograd node in the graph. The ulps
    on top of the baseline's error grow with the square root of the rows that a parameter's gradient sums
    (where the baseline computes as the reference does, in float64 say, its error is 0)."""
    x = next(a for a in args if isinstance(a, torch.Tensor))
    rows = x.numel() // max(1, x.shape[-1]) if x.dim() else 1
    OpSuite(op, [], baseline=baseline, ulps=4.0 * max(1.0, rows**0.5)).check_values(lambda dtype, device: args,
                                                                                      x.dtype)


def check_forward(op, *args, baseline) -> tuple:
    """The outputs alone, without a graph, against the float64 reference within the kit's earned tolerance
    (``baseline``'s error in the same dtype, plus 4 ulps); returns all the registered op returns (outputs and
    residuals)."""
    args = op.bind(tuple(args), {})  # defaults filled: the registered op takes every argument
    with torch.no_grad():
        returned = op.opoverload(*args)
        got = returned[0] if isinstance(returned, tuple) else returned
        ref = op.reference(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
        base = baseline(*args)
    assert_close_earned(op.label, got, ref, base, atol=ulp_atol(got.dtype, ref, 4.0))
    return returned


def check_upstream_grad(op, args: tuple, grad: torch.Tensor) -> None:
    """Gradients of ``op(*args)`` for an upstream gradient of unusual strides (expanded by ``sum()``, sliced)
    against the float64 reference's for the same gradient: the backward must read it through its strides."""
    diff = [i for i in op.tensor_positions if isinstance(args[i], torch.Tensor) and args[i].is_floating_point()]
    ours = [a.detach().requires_grad_() if i in diff else a for i, a in enumerate(args)]
    ref = [a.detach().double().requires_grad_() if i in diff else a for i, a in enumerate(args)]
    got = torch.autograd.grad(op(*ours), [ours[i] for i in diff], grad)
    want = torch.autograd.grad(op.reference(*ref), [ref[i] for i in diff], grad.double())
    for i, g, w in zip(diff, got, want):
        torch.testing.assert_close(g.double(), w, atol=ATOL[g.dtype], rtol=ATOL[g.dtype],
                                   msg=lambda m: f"gradient of argument {i}: {m}")


def import_example(name: str):
    """``examples/<name>.py`` as the module ``name`` (once per process, so its op is declared once)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def clipped_mlp_class(module: str) -> type:
    """A gated-MLP class (16 -> 32 -> 16) of the transformers module ``module``, new on each call (the patch's
    probes are cached per class), with a class-level default (``limit = None``) that an instance overrides to
    clip gate and up, as BailingHybrid's shared experts do: a probe of the class alone passes, a clipping
    instance must not."""

    class ClippedMLP(torch.nn.Module):
        limit = None

        def __init__(self, limit=None):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(16, 32, bias=False)
            self.down_proj, self.act_fn = torch.nn.Linear(32, 16, bias=False), torch.nn.SiLU()
            if limit is not None:
                self.limit = limit

        def forward(self, x):
            gate, up = self.act_fn(self.gate_proj(x)), self.up_proj(x)
            if self.limit is not None:
                gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
            return self.down_proj(gate * up)

    ClippedMLP.__module__ = module
    return ClippedMLP


@pytest.fixture(params=[pytest.param("quick", marks=pytest.mark.extended),
                        pytest.param("all", marks=pytest.mark.extended)])
def sm90_cases(request) -> list:
    """Arguments of an offline sm_90 compile script (tests/sm90.py), in the extended tier (ptxas takes
    seconds a kernel): ``quick``, each kernel with each switch on and off (``--quick``; ``-m extended -k
    quick`` after a kernel change), ``all``, every specialization the launchers request."""
    return ["--quick"] if request.param == "quick" else []


def backward_graphs_backend() -> tuple:
    """``(backend, graphs)``: a torch.compile backend that runs AOTAutograd's graphs as traced (no compiler),
    and the list it appends each traced backward graph to, as text."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=keep), graphs


def run_without_interpreter(args: list, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python *args`` in a fresh process without TRITON_INTERPRET: there CPU tensors take the
    PyTorch path and triton.jit builds GPU kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


class KernelSpy:
    """Inside ``with KernelSpy(kern) as spy:`` (or from ``kernel_spy(kern)`` to the test's end), records the
    data_ptr of every tensor argument (in the kernel's order) of each launch of ``kern`` (``ptrs``); the
    launches run: what a test of "read in place, no copy" checks."""

    def __init__(self, kern):
        self.name, self.ptrs, self._observing = kern.fn.__name__, [], None

    def __call__(self, launch: rt.Launch) -> None:
        if launch.kernel == self.name:
            self.ptrs.append([a.data_ptr() if isinstance(a, torch.Tensor) else None for a in launch.args])

    def __enter__(self):
        self._observing = rt.observe_launches(self)
        self._observing.__enter__()
        return self

    def __exit__(self, *exc):
        return self._observing.__exit__(*exc)


# ---------------------------------------------------------------- kernel spies for a whole test
@pytest.fixture
def kernel_spy():
    """``kernel_spy(kern)``: a :class:`KernelSpy` of ``kern`` recording until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda kern: stack.enter_context(KernelSpy(kern))

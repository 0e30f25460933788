"""The training benchmark's spread runs, on CPU: one process unwrapped, then FSDP2 and DDP on two gloo ranks,
each with the report's comparison to the one-process run."""

import csv
import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fsdp2_and_ddp_runs_match_one_process(tmp_path):
    pytest.importorskip("torch.distributed.fsdp").fully_shard
    pytest.importorskip("transformers")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "train_llama.py"), "--size", "tiny", "--seq", "32",
           "--steps", "2", "--warmup", "1", "--providers", "tritongrad", "--modes", "eager",
           "--world-sizes", "1,fsdp2,ddp2", "--out", str(tmp_path), "--stem", "t"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "t.csv") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["tritongrad-eager", "tritongrad-eager-fsdp2", "tritongrad-eager-ddp2"], rows
    one = rows["tritongrad-eager"]
    assert one["status"] == "ok" and one["parallel"] == "" and one["world_size_1_run"] == "", one
    for name, spread in (("tritongrad-eager-fsdp2", "fsdp"), ("tritongrad-eager-ddp2", "ddp")):
        r = rows[name]
        assert (r["status"], r["parallel"], r["world_size"], r["steps"]) == ("ok", spread, "2", "2"), r
        assert r["world_size_1_run"] == "tritongrad-eager", r
        # the same global batch, split over the ranks: the same loss, to float32's rounding
        assert float(r["first_loss_rel_diff_vs_world_size_1"]) < 1e-5, r
        assert float(r["mean_rel_loss_diff_vs_world_size_1"]) < 1e-4, r
        assert float(r["tokens_per_s_per_gpu"]) == pytest.approx(float(r["tokens_per_s"]) / 2, rel=1e-4), r
        assert float(r["per_gpu_vs_world_size_1"]) == pytest.approx(
            float(r["tokens_per_s_per_gpu"]) / float(one["tokens_per_s"]), rel=1e-3), r
    assert sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "runs" / "*.json"))) == [
        "tritongrad-eager-ddp2.json", "tritongrad-eager-fsdp2.json", "tritongrad-eager.json"]


def _train_llama():
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_llama", os.path.join(ROOT, "benchmarks", "train_llama.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_listing_names_the_blocks_alive_at_the_steps_highest_allocation(tmp_path):
    """``--peak-step``'s listing from an allocator trace in torch's snapshot format: a block freed before the
    peak is not listed, one allocated after it is not, a free of a block older than the step lowers it, and
    frames outside Python files (C++ ones, when the trace has them) do not name a group."""
    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}

    model = [frame("??", 0, "torch::unwind::unwind()"), frame("/x/torch/nn/modules/module.py", 1, "_call_impl"),
             frame("/m/modeling_llama.py", 40, "forward"),
             frame("/m/train_llama.py", 470, "run")]
    generated = tmp_path / "cgen.py"  # Inductor's generated code: its line of code is listed with it
    generated.write_text("def call(args):\n    buf0 = empty_strided_cuda((8192, 4096), (4096, 1), torch.bfloat16)\n")
    kernel = [frame("/x/torch/autograd/function.py", 2, "apply"), frame(str(generated), 2, "call"),
              frame("/m/modeling_llama.py", 50, "forward")]
    mib = 2**20
    trace = [
        {"action": "free_completed", "addr": 1, "size": 8 * mib},       # a block from before the step
        {"action": "alloc", "addr": 2, "size": 4 * mib, "frames": model},
        {"action": "alloc", "addr": 3, "size": 2 * mib, "frames": kernel},
        {"action": "free_requested", "addr": 2, "size": 4 * mib},
        {"action": "free_completed", "addr": 2, "size": 4 * mib},
        {"action": "alloc", "addr": 4, "size": 6 * mib, "frames": model},
        {"action": "alloc", "addr": 5, "size": 3 * mib, "frames": kernel},  # the peak: 2 + 6 + 3 - 8 = 3 MiB
        {"action": "free_completed", "addr": 5, "size": 3 * mib},
        {"action": "alloc", "addr": 6, "size": 1 * mib, "frames": model},
    ]
    result = {"run": "tritongrad-compile"}
    path = tmp_path / "peak.txt"
    _train_llama()._write_peak({"device_traces": [trace]}, 100 * mib, str(path), result, 2)
    head, rows, title, last = path.read_text().split("\n\n")
    assert "step 2" in head and "+3.0 MiB" in head and "at event 6 of 9" in head, head
    assert f"{(100 + 3) / 1024:.3f} GiB (" in head, head
    model_at, kernel_at = ("modeling_llama.py:40 forward <- train_llama.py:470 run",
                           "cgen.py:2 call `buf0 = empty_strided_cuda((8192, 4096), (4096, 1), torch.bfloat16)` "
                           "<- modeling_llama.py:50 forward")
    assert rows.splitlines() == [f"       6.0 MiB      1 blocks  {model_at}",
                                 f"       5.0 MiB      2 blocks  {kernel_at}"], rows
    assert title == "the last allocations up to the peak:", title
    assert last.splitlines() == [f"       4.0 MiB  freed  {model_at}", f"       2.0 MiB  alive  {kernel_at}",
                                     f"       6.0 MiB  alive  {model_at}", f"       3.0 MiB  alive  {kernel_at}"], last
    assert result["peak_listings"] == ["peak.txt"]


def test_profile_splits_a_step_into_products_attention_optimizer_and_the_rest(tmp_path):
    """The profile's step by kind of work, on a CPU step of each: every kind takes time, the kinds and the rest
    add up to the step, and the rest is what no kind names (here the elementwise ops)."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(64, 128, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(128, 128))
    opt = torch.optim.AdamW([w], fused=True)

    def step():
        h = (x @ w).relu().exp2()
        q = h.view(1, 4, 16, 128)
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        opt.step()

    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
    tl = _train_llama()
    kinds = tl.step_kinds(prof.key_averages(), 2, "self_cpu_time_total")
    assert set(kinds) == {"products", "attention", "optimizer", "rest", "step"}, kinds
    # every operator of those kinds that spends time is named (forward and backward), none left to the rest
    named = {n for names in tl.STEP_KINDS.values() for n in names}
    unnamed = {e.key for e in prof.key_averages() if e.self_cpu_time_total > 0 and e.key not in named
               and re.search(r"aten::(mm|addmm|bmm)$|_attention_|_fused_adam|_foreach_", e.key)}
    assert not unnamed, unnamed
    for kind in ("products", "attention", "optimizer", "rest"):
        assert kinds[kind] > 0, kinds
    assert sum(v for k, v in kinds.items() if k != "step") == pytest.approx(kinds["step"]), kinds


def _families_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("families", os.path.join(ROOT, "benchmarks", "families.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _result(family, device, git, speeds):
    """A train_llama.py result as families.py reads it: tokens/s per run (None: the run did not finish)."""
    runs = [{"run": run, "status": "ok" if tps else "time limit", "tokens_per_s": tps,
             "peak_mem_gib": None if device == "cpu" else 6.0 + i, "first_loss_rel_diff_vs_hf_eager": 1e-5 * i,
             "mean_rel_loss_diff_vs_hf_eager": 2e-5 * i} for i, (run, tps) in enumerate(speeds.items())]
    settings = {"family": family, "size": "300m", "seq": 2048, "batch": 4, "steps": 12, "warmup": 4,
                "runs": ",".join(speeds), "time_limit": 150.0}
    return {"settings": settings, "device": device, "git": git, "versions": {}, "parameters": 1, "runs": runs}


def test_families_merge_a_later_run_replaces_and_rows_name_their_gpu(tmp_path):
    fam = _families_module()
    old = _result("llama", "NVIDIA H200", "aaaaaaa", {"hf-eager": 100e3, "tritongrad-compile": 150e3})
    new = _result("llama", "NVIDIA H100 80GB HBM3", "bbbbbbb",
                  {"hf-eager": 100e3, "tritongrad-eager": 130e3, "hf-compile": 120e3, "tritongrad-compile": 144e3})
    cpu = _result("qwen3", "cpu", "ccccccc", {"hf-eager": 10e3, "tritongrad-eager": None})
    paths = []
    for i, record in enumerate((old, cpu, new)):
        paths.append(str(tmp_path / f"{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(record, f)
    merged = fam.families(paths)
    assert list(merged) == ["llama", "qwen3"] and merged["llama"]["git"] == "bbbbbbb", merged
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in fam.table(merged).splitlines()[2:]}
    llama, qwen3 = rows["llama"], rows["qwen3"]
    assert llama[2] == "130.0k (1.30x), 7.0 GiB" and llama[3] == "-" and llama[6] == "1.20x", llama
    assert llama[-1] == "H100 |", llama
    assert qwen3[1] == "10.0k, - GiB" and qwen3[2] == "time limit" and qwen3[6] == "-", qwen3
    # the merged record is an input too: read back, it gives the same families
    out = tmp_path / "merged.json"
    with open(out, "w") as f:
        json.dump({"families": merged}, f)
    assert fam.families([str(out)]) == {k: {"git": None, "versions": None, "command": None, "device": None, **v}
                                        for k, v in merged.items()}

"""The training benchmark's spread runs, on CPU: one process unwrapped, then FSDP2 and DDP on two gloo ranks,
each with the report's comparison to the one-process run."""

import csv
import glob
import os
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

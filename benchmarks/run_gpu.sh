#!/usr/bin/env bash
# The full `tritongrad bench` sweep on a GPU machine, offline: every op, bf16/fp16/fp32, fwd/bwd/fwdbwd, all
# available providers. Writes one JSON, one CSV, one PNG per op and bench.log to $OUT, and ends with the
# summary table.
#
#   bash benchmarks/run_gpu.sh
#
# Nothing is installed from a network: tritongrad runs from src/ (PYTHONPATH), and optional providers come
# as wheels in the repository's .whl/ folder (ignored by git), installed with --no-deps into /tmp/site.
# liger-kernel is pure Python (needs only torch and triton); fetch its wheel on a machine with a network:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl liger-kernel
#
# Environment:
#   OUT                 results folder (default: bench-out)
#   TRITONGRAD_GIT_SHA  the commit measured, when the tree is a copy without .git (else read from git)
#   BENCH_TIME_LIMIT    seconds after which no new shape is started (default 300; the rest is reported as
#                       skipped), so the run ends in about 6 minutes whatever torch.compile costs there
#   BENCH_ARGS          more arguments for `tritongrad bench`, e.g. "--quick" or "rms_norm --dtype bf16"
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/bench.log" || true
# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
python3 -m tritongrad bench --out "$OUT" --time-limit "${BENCH_TIME_LIMIT:-300}" ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"

#!/usr/bin/env bash
# The training benchmark (benchmarks/train_llama.py) on a GPU machine, offline: a ~1.2B Llama (3.2-1B shape,
# vocab 128256) at seq 4096 trained from random init with Hugging Face eager, tritongrad-patched and
# Liger-patched kernels, each eager and under torch.compile, one process per run. Writes <stem>.json, .csv,
# -loss.png, -throughput.png, -memory.png, runs/ and train.log to $OUT, and ends with one line per run.
#
#   bash benchmarks/run_train.sh                                          # all 6 runs in TRAIN_BUDGET seconds
#   TRAIN_ARGS="--providers tritongrad --modes eager" bash benchmarks/run_train.sh       # one provider alone
#   TRAIN_ARGS="--world-sizes 1,2 --fsdp --modes eager" bash benchmarks/run_train.sh     # FSDP2, 1 and 2 GPUs
#   TRAIN_ARGS="--world-sizes 1,fsdp2,ddp2 --modes eager" bash benchmarks/run_train.sh   # 1 GPU, FSDP2, DDP
#   TRAIN_FAMILIES="qwen2 gemma2" TRAIN_ARGS="--size 300m --seq 2048 --steps 12 --warmup 4" bash benchmarks/run_train.sh
#       one family after another, each in $OUT/<family>/ with TRAIN_BUDGET seconds, then merged by
#       benchmarks/families.py into $OUT/families.json and .png and docs/models.md's table (families.md)
#
# Nothing is installed from a network: tritongrad runs from src/ (PYTHONPATH), and Liger comes as a wheel in
# the repository's .whl/ folder (ignored by git; see benchmarks/run_gpu.sh for how to fetch it), installed
# with --no-deps into /tmp/site. Without it the Liger runs are recorded as errors and the others run.
#
# Environment:
#   OUT                results folder (default bench-out)
#   TRAIN_BUDGET       seconds for all runs (default 660): runs not started by then are recorded as skipped
#   TRAIN_TIME_LIMIT   seconds per run, setup and compile included (default 150): no step starts after it
#   TRAIN_ARGS         more arguments for train_llama.py, e.g. "--size small --steps 20" (see --help)
#   TRAIN_FAMILIES     families to run one after another (train_llama.py --family), each with every run of TRAIN_ARGS
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/train.log" || true
if [ -z "${TRAIN_FAMILIES:-}" ]; then
  # shellcheck disable=SC2086  # TRAIN_ARGS is a list of arguments
  python3 benchmarks/train_llama.py --out "$OUT" --time-limit "${TRAIN_TIME_LIMIT:-150}" \
    --total-time-limit "${TRAIN_BUDGET:-660}" ${TRAIN_ARGS:-} 2>&1 | tee -a "$OUT/train.log"
  exit "${PIPESTATUS[0]}"
fi
for family in $TRAIN_FAMILIES; do
  mkdir -p "$OUT/$family"
  extra=""; [[ $family == *moe* ]] && extra="--experts 8 --top-k 2"  # the record's MoE shape, overridable
  # shellcheck disable=SC2086
  python3 benchmarks/train_llama.py --out "$OUT/$family" --family "$family" $extra \
    --time-limit "${TRAIN_TIME_LIMIT:-150}" --total-time-limit "${TRAIN_BUDGET:-660}" ${TRAIN_ARGS:-} 2>&1 \
    | tee -a "$OUT/train.log" "$OUT/$family/train.log" | grep -E "^(written|\S+-(eager|compile) )" || true
done
# shellcheck disable=SC2046
python3 benchmarks/families.py "$OUT/families.json" $(ls "$OUT"/*/train-*.json) | tee "$OUT/families.md"

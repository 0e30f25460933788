#!/usr/bin/env bash
# The whole test suite on a GPU machine (CUDA tensors, compiled kernels; the GPU-only tests and the extended
# tier run too), offline, from src/ without installing, on $WORKERS processes (6: eight
# processes' large-shape tests together can exhaust the H200's 140 GiB). Full log in $OUT/tests.log:
# one line per test as it ends (-v), so a run stopped by a time limit still names its failures; those lines are
# printed, then the summary.
#
#   bash benchmarks/gpu_tests.sh            (everything: about 7 minutes on an H200)
#   bash benchmarks/gpu_tests.sh tests/test_gpu_norms.py -k large      (a subset: paths and pytest options)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pytest -v -rfE -p no:cacheprovider -m "" -n "${WORKERS:-6}" --durations=5 "${@:-tests}" \
  >"$OUT/tests.log" 2>&1
rc=$?
grep -E "(FAILED|ERROR)( |$)" "$OUT/tests.log" | head -20
tail -12 "$OUT/tests.log"
exit $rc

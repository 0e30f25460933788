# Sourced by the GPU scripts (run_gpu.sh, run_train.sh): the repository root as working folder, $OUT made, the
# wheels in .whl/ (ignored by git; liger-kernel, cut-cross-entropy, ...) installed with --no-deps into
# /tmp/site, tritongrad from src/ on PYTHONPATH, unbuffered output, and TRITONGRAD_GIT_SHA for the results.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TRITONGRAD_GIT_SHA=${TRITONGRAD_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || true)}

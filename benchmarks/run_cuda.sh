#!/usr/bin/env bash
# The GPU checks in one run, on a machine whose python3 has a CUDA build of torch (and transformers for the
# BERT and Llama cases): the CUDA tests, the examples analysed on the GPU, then bench_cuda.py.
# Logs go to $OUT (default: ./cuda-logs). Wheels in .whl/ (junit-xml, where it is missing) are put on the path.
set -uo pipefail
OUT=${OUT:-cuda-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 QCORE_CACHE_DIR=/tmp/qcore-cache PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -p pytest_qreport.plugin -p no:cacheprovider -q -rfE --show-capture=no tests/gpu/test_cuda.py \
    2>&1 | tail -80 | tee "$OUT/test_cuda.log"
if [ -z "${SKIP_EXAMPLES:-}" ]; then
    timeout "${EXAMPLES_TIMEOUT:-120}" python3 -m pytest -p pytest_qreport.plugin -p no:cacheprovider --qreport \
        examples/ --qreport-device cuda --qreport-baseline-dir /tmp/no-baselines -q 2>&1 | tail -25 \
        | tee "$OUT/examples.log"
fi
timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/bench_cuda.py --json "$OUT/bench_cuda.json" \
    --deadline-s "${BENCH_DEADLINE:-200}" --profile-dir "$OUT" ${BENCH_CASES:+--cases "$BENCH_CASES"} 2>&1 | grep -v "^W[0-9]" \
    | tee "$OUT/bench_cuda.log"

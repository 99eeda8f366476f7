#!/usr/bin/env bash
# The mixture-of-experts GPU checks in one run, on a machine whose python3 has a CUDA build of torch: the CUDA
# tests (the MoE's items on the GPU against the CPU's, the captured experts against transformers' grouped_mm), then
# bench_moe.py --cost on the GPU (the MoE's analysis against the dense model's, each over its own forward).
# Logs go to $OUT (default: ./cuda-logs). Wheels in .whl/ (transformers and what it needs, where the machine's
# are older) are put on the path when they import; else the machine's own transformers is used, and said.
set -uo pipefail
OUT=${OUT:-cuda-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 QCORE_CACHE_DIR=/tmp/qcore-cache PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && PYTHONPATH=$PWD:/tmp/site python3 -c "import transformers, junit_xml; transformers.Qwen3MoeForCausalLM" \
        && export PYTHONPATH=$PWD:/tmp/site || echo "the carried wheels do not import: the machine's transformers"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
} 2>&1 | tee "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -p pytest_qreport.plugin -p no:cacheprovider -q -rfE \
    --show-capture=no tests/gpu/test_cuda.py 2>&1 | tail -60 | tee "$OUT/test_cuda.log"
timeout "${SMALL_TIMEOUT:-200}" python3 benchmarks/bench_moe.py --cost --device cuda --sizes tiny,small \
    --rounds "${ROUNDS:-5}" 2>&1 | grep -v "^W[0-9]\|Failed to load" | tee "$OUT/bench_moe_cost_tiny_small.txt"
timeout "${LARGE_TIMEOUT:-150}" python3 benchmarks/bench_moe.py --cost --device cuda --sizes 30b-a3b \
    2>&1 | grep -v "^W[0-9]\|Failed to load" | tee "$OUT/bench_moe_cost_30b_a3b.txt"

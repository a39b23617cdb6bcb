#!/usr/bin/env bash
# One device call for the attention work: GPU tests, then the benchmark (tuned configuration; pass
# SWEEP=1 to re-run the kernel-configuration sweep first and take its best). Writes logs and JSON/MD
# under ${OUT:-benchmarks/results}.
#   OUT=/tmp/out bash benchmarks/run_attention_gpu.sh
set -u
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
commit="$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
export XSTAGE_GIT_COMMIT="$commit"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -v --tb=short -p no:cacheprovider -o addopts="" \
    tests/test_ulysses_attention_gpu.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
if [ "${SWEEP:-0}" = 1 ]; then
    sweep_args=(--sweep --bench --sweep-shapes 16384x24,32760x40)
else
    sweep_args=(--config 128,128,4,2,1,1)
fi
timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_attention_a2a.py "${sweep_args[@]}" --skip-checks \
    --out-dir "$out" --commit "$commit" 2>&1 | tee "$out/bench.log" | grep -v '^{"gpu'

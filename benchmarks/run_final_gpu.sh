#!/usr/bin/env bash
# One device call that re-checks, on the GPU, the code paths changed since their last GPU run:
# the fused attention tests, the MoE two-process/EP-layer tests, and parallelize (tests + FLUX step
# benchmark). Logs and results go to $OUT (at most 8 files come back).
#   OUT=dir XSTAGE_COMMIT=sha bash benchmarks/run_final_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/device_env.sh
OUT="${OUT:-.gpu_out}"; mkdir -p "$OUT"
PT=(python3 -m pytest -v --tb=short -p no:cacheprovider -o addopts="")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== attention GPU tests"
timeout 90 "${PT[@]}" tests/test_ulysses_attention_gpu.py > "$OUT/attn_gpu_tests.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/attn_gpu_tests.log"
echo "== MoE GPU tests (EP layer vs diffusers, two processes vs one)"
timeout 45 "${PT[@]}" tests/test_moe_gpu.py -k "ep_layer or two_processes" > "$OUT/moe_gpu_tests.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/moe_gpu_tests.log"
echo "== parallelize GPU tests"
timeout 50 "${PT[@]}" tests/test_parallelize_gpu.py > "$OUT/par_gpu_tests.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/par_gpu_tests.log"
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
echo "== parallelize FLUX step benchmark"
timeout 80 python3 benchmarks/bench_parallelize_flux.py --out "$OUT" --commit "${XSTAGE_COMMIT:-unknown}" \
  --reps 3 --w2-timeout 40 > "$OUT/par_bench.log" 2>&1
tail -25 "$OUT/par_bench.log"

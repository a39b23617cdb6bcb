#!/usr/bin/env bash
# One device call: every GPU test file (attention, MoE, parallelize, calibration, server), then the
# attention benchmark at this commit. Everything lands in $OUT/recheck.tgz (at most 8 files come back
# from a device call); the summary lines print.
#   OUT=dir XSTAGE_GIT_COMMIT=sha bash benchmarks/run_recheck_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/device_env.sh
export XSTAGE_DIT_CACHE=/tmp/xstage-cache
OUT="${OUT:-.gpu_out}"; R="$OUT/recheck"; mkdir -p "$R"
PT=(python3 -m pytest -v --tb=short -p no:cacheprovider -o addopts="" -m gpu)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for t in ${TESTS:-ulysses_attention moe parallelize calibration}; do
  echo "== tests/test_${t}_gpu.py"
  timeout "${TEST_S:-150}" "${PT[@]}" "tests/test_${t}_gpu.py" > "$R/gpu-tests-$t.log" 2>&1
  echo "exit $?"; grep -E "FAILED|ERROR|passed|failed" "$R/gpu-tests-$t.log" | tail -12
done
if [ "${BENCH:-1}" = 1 ]; then
  echo "== attention benchmark"
  timeout "${BENCH_S:-300}" python3 benchmarks/bench_attention_a2a.py --config 128,128,4,2,1,1 --skip-checks \
    --out-dir "$R" --commit "${XSTAGE_GIT_COMMIT:-unknown}" > "$R/attention-bench.log" 2>&1
  echo "exit $?"; grep -A12 '"summary"' "$R/attention-a2a-h200.json" | head -14
fi
tar -czf "$OUT/recheck.tgz" -C "$OUT" recheck
rm -rf "$R"
